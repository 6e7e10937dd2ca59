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
	rows  map[int64]*wrow // by second
	units unitHeap        // the units that have a bucket
	pool  []*[wheelPage]uint32
	free  []*wbucket // taken buckets, emptied, for reuse
	spare []*wrow    // emptied rows, for reuse
	due   []int64    // takeDue's scratch
	n     int        // entries
}

// wrow holds the buckets of one second's units in place, by hash prefix.
// A push reads the row (from a map of the seconds queued, a few dozen,
// which stays cached), the bucket in it and the bucket's current page:
// with a map of buckets by unit and a page list to index, it read a map
// slot, the bucket, the list and the page, each likely a cache miss. A
// row is 2.5 KiB, one for each second that holds entries: with leases of
// at most MaxLeaseTTL (60 s by default) about 150 KiB in all.
type wrow struct {
	b    [1 << unitBits]wbucket
	used int // buckets holding entries
}

// wbucket holds a unit's entries: full pages, then last entries in the
// last page, cur.
type wbucket struct {
	pages []*[wheelPage]uint32
	cur   *[wheelPage]uint32 // pages' last; nil when empty
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
	*w = wheel{rows: make(map[int64]*wrow)}
}

// push queues link, the entry of the key hashed h, in second sec.
func (w *wheel) push(sec int64, h uint64, link uint32) {
	r := w.rows[sec]
	if r == nil {
		if k := len(w.spare); k > 0 {
			r = w.spare[k-1]
			w.spare[k-1] = nil
			w.spare = w.spare[:k-1]
		} else {
			r = new(wrow)
		}
		w.rows[sec] = r
	}
	b := &r.b[h>>(64-unitBits)]
	if b.cur == nil || b.last == wheelPage {
		if b.cur == nil {
			r.used++
			w.units.push(unitOf(sec, h))
		}
		var pg *[wheelPage]uint32
		if p := len(w.pool); p > 0 {
			pg = w.pool[p-1]
			w.pool[p-1] = nil
			w.pool = w.pool[:p-1]
		} else {
			pg = new([wheelPage]uint32)
		}
		b.pages = append(b.pages, pg)
		b.cur, b.last = pg, 0
	}
	b.cur[b.last] = link
	b.last++
	w.n++
}

// bucket returns unit u's bucket, which must hold entries.
func (w *wheel) bucket(u int64) *wbucket {
	return &w.rows[unitSec(u)].b[unitPrefix(u)]
}

// take removes unit u's bucket, which must hold entries, from its row and
// returns it; pushes to u from now on go to a new bucket. A row left
// without entries is put aside for reuse.
func (w *wheel) take(u int64) *wbucket {
	sec := unitSec(u)
	r := w.rows[sec]
	var t *wbucket
	if k := len(w.free); k > 0 {
		t = w.free[k-1]
		w.free[k-1] = nil
		w.free = w.free[:k-1]
	} else {
		t = &wbucket{}
	}
	b := &r.b[unitPrefix(u)]
	*t, *b = *b, *t // b gets t's empty page list, to reuse
	if r.used--; r.used == 0 {
		delete(w.rows, sec)
		w.spare = append(w.spare, r)
	}
	w.n -= t.len()
	return t
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
	return u, w.take(u), true
}

// recycle returns b, popped and taken, and its pages to the pools.
func (w *wheel) recycle(b *wbucket) {
	w.pool = append(w.pool, b.pages...)
	clear(b.pages)
	b.pages, b.cur, b.last = b.pages[:0], nil, 0
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
	if len(w.spare) > 16 {
		clear(w.spare[16:])
		w.spare = w.spare[:16]
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
		b := w.take(u)
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
			n += w.bucket(u).len()
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
		if n -= w.bucket(u).len(); n <= 0 {
			return u
		}
	}
	return 0
}

// each calls f for every entry (for tests).
func (w *wheel) each(f func(u int64, link uint32)) {
	for sec, r := range w.rows {
		for p := range r.b {
			b := &r.b[p]
			for i := range b.pages {
				for _, l := range b.page(i) {
					f(sec<<unitBits|int64(p), l)
				}
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
