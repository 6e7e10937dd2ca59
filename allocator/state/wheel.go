package state

import (
	"container/heap"
)

// The expiry wheel finds the leases an Expire must end without a node per
// lease: it holds, per second, the links of the leased keys whose earliest
// lease expires in that second, 4 bytes per entry in pooled pages.
//
// Invariant: every leased key has a current wheel entry, whose link is the
// key's link and whose second S matches the queued byte of the key's
// entry; for a key in a served slot S ≤ the second of its earliest lease
// expiry. So an Expire at now, which takes every bucket up to now's
// second, meets every served key with a lease due. (A frozen key's leases
// do not end: a taken entry re-queues it in the next second, and thawing
// its slot queues it at its earliest expiry again.) Entries are queued
// lazily:
//
//   - a renewal that makes the earliest expiry later queues nothing (the
//     current entry is early, and is re-queued when it is taken);
//   - a change that makes it earlier, or moves the entry to another block,
//     queues a new entry and sets queued, which retires the old one;
//   - a taken entry ends the key's due leases and re-queues the key at its
//     new earliest expiry.
//
// A stale entry (retired, or naming a block since freed or reused) is
// recognised when taken: the block is free, its key's slot has another
// link, or its queued byte differs. Were a stale entry to pass those checks,
// taking it would only end leases that are due anyway. The wheel is derived
// state: Restore and compaction rebuild it.
type wheel struct {
	buckets map[int64]*wbucket
	secs    secHeap // the seconds that have a bucket
	pool    [][]uint32
	n       int // entries
}

type wbucket struct {
	pages [][]uint32
}

const wheelPage = 1024 // entries per page

func (w *wheel) init() {
	*w = wheel{buckets: make(map[int64]*wbucket)}
}

// push queues link in second sec.
func (w *wheel) push(sec int64, link uint32) {
	b := w.buckets[sec]
	if b == nil {
		b = &wbucket{}
		w.buckets[sec] = b
		heap.Push(&w.secs, sec)
	}
	k := len(b.pages)
	if k == 0 || len(b.pages[k-1]) == wheelPage {
		var pg []uint32
		if p := len(w.pool); p > 0 {
			pg = w.pool[p-1][:0]
			w.pool = w.pool[:p-1]
		} else {
			pg = make([]uint32, 0, wheelPage)
		}
		b.pages = append(b.pages, pg)
		k++
	}
	b.pages[k-1] = append(b.pages[k-1], link)
	w.n++
}

// takeDue takes the entries of every bucket of a second ≤ sec, earliest
// second first, and calls f for each; with max > 0 it stops after max
// entries and leaves the rest queued (they are due at the next call). It
// returns how many it took. Entries f queues go to new buckets and are not
// taken by this call, even in a second ≤ sec.
//
// Within a bucket, entries are taken from its last page backwards, so what
// a budget leaves is a prefix of the bucket; the order is a function of the
// applied commands only, as replicas need.
func (w *wheel) takeDue(sec int64, max int, f func(s int64, link uint32)) int {
	var due []int64
	for len(w.secs) > 0 && w.secs[0] <= sec {
		due = append(due, heap.Pop(&w.secs).(int64))
	}
	taken := 0
	for _, s := range due {
		if max > 0 && taken >= max {
			heap.Push(&w.secs, s) // untouched: its bucket is still in the map
			continue
		}
		b := w.buckets[s]
		delete(w.buckets, s)
		for len(b.pages) > 0 && (max <= 0 || taken < max) {
			k := len(b.pages) - 1
			pg := b.pages[k]
			n := len(pg)
			if max > 0 {
				n = min(n, max-taken)
			}
			part := pg[len(pg)-n:]
			for _, l := range part {
				f(s, l)
			}
			taken += n
			w.n -= n
			if n == len(pg) {
				w.pool = append(w.pool, pg)
				b.pages[k] = nil
				b.pages = b.pages[:k]
			} else {
				b.pages[k] = pg[:len(pg)-n]
			}
		}
		if len(b.pages) > 0 {
			// Budget spent mid-bucket: the rest stays due, together with
			// whatever f queued in the same second.
			if nb := w.buckets[s]; nb != nil {
				nb.pages = append(nb.pages, b.pages...)
			} else {
				w.buckets[s] = b
				heap.Push(&w.secs, s)
			}
		}
	}
	// Keep at most a few idle pages.
	if len(w.pool) > 64 {
		clear(w.pool[64:])
		w.pool = w.pool[:64]
	}
	return taken
}

// dueCount returns how many entries are queued in seconds ≤ sec.
func (w *wheel) dueCount(sec int64) int {
	n := 0
	for _, s := range w.secs {
		if s <= sec {
			for _, pg := range w.buckets[s].pages {
				n += len(pg)
			}
		}
	}
	return n
}

// each calls f for every entry (for tests).
func (w *wheel) each(f func(s int64, link uint32)) {
	for s, b := range w.buckets {
		for _, pg := range b.pages {
			for _, l := range pg {
				f(s, l)
			}
		}
	}
}

type secHeap []int64

func (h secHeap) Len() int           { return len(h) }
func (h secHeap) Less(i, j int) bool { return h[i] < h[j] }
func (h secHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *secHeap) Push(x any)        { *h = append(*h, x.(int64)) }
func (h *secHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
