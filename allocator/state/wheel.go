package state

import "slices"

// The expiry wheel finds the leases an Expire must end without a node per
// lease: it holds, per unit, the links of the leased keys whose earliest
// lease expires in that unit, 4 bytes per entry in pooled pages. A unit is
// a second and one of 64 hash prefixes (the key hash's top 6 bits):
// unitOf(sec, hash) = sec·64 + prefix, so units are ordered by second,
// then prefix.
//
// Invariant: every leased key has a current wheel entry, whose link is the
// key's link, whose unit has the key's hash prefix and whose second S
// matches the queued byte of the key's entry; for a key in a served slot
// S ≤ the second of its earliest lease expiry. So an Expire at now, which
// takes every unit up to now's second, meets every served key with a lease
// due. (A frozen key's leases do not end: a taken entry re-queues it in
// the next second, and thawing its slot queues it at its earliest expiry
// again.) Entries are queued lazily:
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
// link, its key's hash prefix is not the unit's, or its queued byte
// differs. Were a stale entry to pass those checks, taking it would only
// end leases of its unit that are due anyway. The wheel is derived state:
// Restore rebuilds it and compaction re-queues what it moves, so which
// leases an Expire ends must not depend on its order or its stale
// entries: a budgeted Expire takes whole units only (core.expireBudgeted).
type wheel struct {
	buckets map[int64]*wbucket // by unit
	units   unitHeap           // the units that have a bucket
	pool    []*[wheelPage]uint32
	free    []*wbucket // emptied buckets, for reuse
	due     []int64    // takeDue's scratch
	n       int        // entries
}

// wbucket holds a unit's entries: full pages, then last entries in the
// last page.
type wbucket struct {
	pages []*[wheelPage]uint32
	last  int
}

// len returns the bucket's entries.
func (b *wbucket) len() int {
	if len(b.pages) == 0 {
		return 0
	}
	return (len(b.pages)-1)*wheelPage + b.last
}

// each calls f with b's entries, in order, at most k at a time.
func (b *wbucket) each(k int, f func(links []uint32)) {
	for i := range b.pages {
		pg := b.page(i)
		for j := 0; j < len(pg); j += k {
			f(pg[j:min(j+k, len(pg))])
		}
	}
}

// page returns the entries of b's page i.
func (b *wbucket) page(i int) []uint32 {
	if i == len(b.pages)-1 {
		return b.pages[i][:b.last]
	}
	return b.pages[i][:]
}

const (
	wheelPage = 256 // entries per page
	unitBits  = 6   // hash prefix bits of a unit
)

// unitOf returns the wheel unit of second sec for the key hashed h.
func unitOf(sec int64, h uint64) int64 {
	return sec<<unitBits | int64(h>>(64-unitBits))
}

// unitSec returns the second of unit u.
func unitSec(u int64) int64 { return u >> unitBits }

// unitPrefix returns the hash prefix of unit u.
func unitPrefix(u int64) uint64 { return uint64(u) & (1<<unitBits - 1) }

func (w *wheel) init() {
	*w = wheel{buckets: make(map[int64]*wbucket)}
}

// push queues link, the entry of the key hashed h, in second sec.
func (w *wheel) push(sec int64, h uint64, link uint32) {
	u := unitOf(sec, h)
	b := w.buckets[u]
	if b == nil {
		if k := len(w.free); k > 0 {
			b = w.free[k-1]
			w.free[k-1] = nil
			w.free = w.free[:k-1]
		} else {
			b = &wbucket{}
		}
		w.buckets[u] = b
		w.units.push(u)
	}
	if len(b.pages) == 0 || b.last == wheelPage {
		var pg *[wheelPage]uint32
		if p := len(w.pool); p > 0 {
			pg = w.pool[p-1]
			w.pool[p-1] = nil
			w.pool = w.pool[:p-1]
		} else {
			pg = new([wheelPage]uint32)
		}
		b.pages = append(b.pages, pg)
		b.last = 0
	}
	b.pages[len(b.pages)-1][b.last] = link
	b.last++
	w.n++
}

// minSec returns the earliest second that has a bucket.
func (w *wheel) minSec() (int64, bool) {
	if len(w.units) == 0 {
		return 0, false
	}
	return unitSec(w.units[0]), true
}

// due reports whether unit u is due by second sec and, when last is not
// 0, not after unit last.
func due(u, sec, last int64) bool {
	return unitSec(u) <= sec && (last == 0 || u <= last)
}

// popDue removes and returns the bucket of the earliest unit, if it is due
// by second sec and last (due). Its entries no longer count in w.n;
// entries queued in the unit from now on go to a new bucket.
func (w *wheel) popDue(sec, last int64) (int64, *wbucket, bool) {
	if len(w.units) == 0 || !due(w.units[0], sec, last) {
		return 0, nil, false
	}
	u := w.units.pop()
	b := w.buckets[u]
	delete(w.buckets, u)
	w.n -= b.len()
	return u, b, true
}

// recycle returns b, popped and taken, and its pages to the pools.
func (w *wheel) recycle(b *wbucket) {
	w.pool = append(w.pool, b.pages...)
	clear(b.pages)
	b.pages, b.last = b.pages[:0], 0
	w.free = append(w.free, b)
}

// trimPool keeps at most a few idle pages and buckets.
func (w *wheel) trimPool() {
	if len(w.pool) > 256 {
		clear(w.pool[256:])
		w.pool = w.pool[:256]
	}
	if len(w.free) > 256 {
		clear(w.free[256:])
		w.free = w.free[:256]
	}
}

// takeDue takes every entry of every unit of a second ≤ sec, earliest
// unit first, and calls f for them, a few of a unit at a time. Entries f
// queues go to new buckets and are not taken by this call, even in a unit
// it takes. (A budgeted Expire takes entries with core.expireBudgeted
// instead.)
func (w *wheel) takeDue(sec int64, f func(u int64, links []uint32)) {
	units := w.due[:0]
	for len(w.units) > 0 && unitSec(w.units[0]) <= sec {
		units = append(units, w.units.pop())
	}
	w.due = units
	for _, u := range units {
		b := w.buckets[u]
		delete(w.buckets, u)
		w.n -= b.len()
		b.each(touchAhead, func(links []uint32) { f(u, links) })
		w.recycle(b)
	}
	w.trimPool()
}

// dueCount returns how many entries are queued in seconds ≤ sec.
func (w *wheel) dueCount(sec int64) int {
	n := 0
	for _, u := range w.units {
		if unitSec(u) <= sec {
			n += w.buckets[u].len()
		}
	}
	return n
}

// lastUnit returns the earliest unit of a second ≤ sec at which the
// entries of that unit and the earlier ones reach n, or 0 if all those
// units together hold fewer. (It runs under the read lock: it does not
// use w.due.)
func (w *wheel) lastUnit(sec int64, n int) int64 {
	var units []int64
	for _, u := range w.units {
		if unitSec(u) <= sec {
			units = append(units, u)
		}
	}
	slices.Sort(units)
	for _, u := range units {
		if n -= w.buckets[u].len(); n <= 0 {
			return u
		}
	}
	return 0
}

// each calls f for every entry (for tests).
func (w *wheel) each(f func(u int64, link uint32)) {
	for u, b := range w.buckets {
		for i := range b.pages {
			for _, l := range b.page(i) {
				f(u, l)
			}
		}
	}
}

// unitHeap is a binary min-heap of units.
type unitHeap []int64

func (h *unitHeap) push(u int64) {
	*h = append(*h, u)
	a := *h
	for i := len(a) - 1; i > 0; {
		p := (i - 1) / 2
		if a[p] <= a[i] {
			break
		}
		a[p], a[i] = a[i], a[p]
		i = p
	}
}

func (h *unitHeap) pop() int64 {
	a := *h
	u := a[0]
	n := len(a) - 1
	a[0] = a[n]
	a = a[:n]
	for i := 0; ; {
		m, l, r := i, 2*i+1, 2*i+2
		if l < n && a[l] < a[m] {
			m = l
		}
		if r < n && a[r] < a[m] {
			m = r
		}
		if m == i {
			break
		}
		a[i], a[m] = a[m], a[i]
		i = m
	}
	*h = a
	return u
}
