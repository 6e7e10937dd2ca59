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
// state: Restore rebuilds it and compaction re-queues what it moves, so
// which leases an Expire ends must not depend on its order or its stale
// entries (core.expireBudgeted, which keeps what a budget leaves of a
// second in the bucket's cut, sorted by key hash).
type wheel struct {
	buckets map[int64]*wbucket
	secs    secHeap // the seconds that have a bucket
	pool    [][]uint32
	n       int // entries
}

type wbucket struct {
	pages [][]uint32
	// cut holds, sorted by key hash, the entries a budgeted Expire left
	// in this second (core.expireBudgeted); entries queued in the second
	// since are in pages.
	cut []cutEntry
}

// cutEntry is a wheel entry of a second a budget cut, with its key's hash.
type cutEntry struct {
	hash uint64
	link uint32
}

// len returns the bucket's entries.
func (b *wbucket) len() int {
	n := len(b.cut)
	for _, pg := range b.pages {
		n += len(pg)
	}
	return n
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

// popDue removes and returns the bucket of the earliest second, if that
// second is ≤ sec. Its entries no longer count in w.n.
func (w *wheel) popDue(sec int64) (int64, *wbucket, bool) {
	if len(w.secs) == 0 || w.secs[0] > sec {
		return 0, nil, false
	}
	s := heap.Pop(&w.secs).(int64)
	b := w.buckets[s]
	delete(w.buckets, s)
	w.n -= b.len()
	return s, b, true
}

// putBack queues the entries of b (popped by popDue) in second s again,
// together with whatever was queued in s since.
func (w *wheel) putBack(s int64, b *wbucket) {
	w.n += b.len()
	if nb := w.buckets[s]; nb != nil {
		b.pages = append(b.pages, nb.pages...)
		b.cut = append(b.cut, nb.cut...) // empty: nb is new
		w.buckets[s] = b
		return
	}
	w.buckets[s] = b
	heap.Push(&w.secs, s)
}

// recycle returns page pg to the pool.
func (w *wheel) recycle(pg []uint32) {
	w.pool = append(w.pool, pg)
}

// trimPool keeps at most a few idle pages.
func (w *wheel) trimPool() {
	if len(w.pool) > 64 {
		clear(w.pool[64:])
		w.pool = w.pool[:64]
	}
}

// takeDue takes every entry of every bucket of a second ≤ sec, earliest
// second first, and calls f for each. Entries f queues go to new buckets
// and are not taken by this call, even in a second ≤ sec. (A budgeted
// Expire takes entries with core.expireBudgeted instead.)
func (w *wheel) takeDue(sec int64, f func(s int64, link uint32)) {
	var due []int64
	for len(w.secs) > 0 && w.secs[0] <= sec {
		due = append(due, heap.Pop(&w.secs).(int64))
	}
	for _, s := range due {
		b := w.buckets[s]
		delete(w.buckets, s)
		w.n -= b.len()
		for _, ce := range b.cut {
			f(s, ce.link)
		}
		for _, pg := range b.pages {
			for _, l := range pg {
				f(s, l)
			}
			w.recycle(pg)
		}
	}
	w.trimPool()
}

// dueCount returns how many entries are queued in seconds ≤ sec.
func (w *wheel) dueCount(sec int64) int {
	n := 0
	for _, s := range w.secs {
		if s <= sec {
			n += w.buckets[s].len()
		}
	}
	return n
}

// each calls f for every entry (for tests).
func (w *wheel) each(f func(s int64, link uint32)) {
	for s, b := range w.buckets {
		for _, ce := range b.cut {
			f(s, ce.link)
		}
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
