package state

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// decodeEntry decodes the entry at link of key h from ps into e (its
// leases slice is reused). It reports false if link does not name a
// well-formed entry.
func decodeEntry(ps *pageSets, lc *leaseCodec, link uint32, h uint64, e *entry) bool {
	b, ok := ps.head(link)
	if !ok {
		return false
	}
	n, at, size, ok := parseHeader(b, e)
	if !ok {
		return false
	}
	e.link, e.size = link, blockSize(size)
	e.leases = lc.decodeLeases(e.leases[:0], b, at, n, h, e.base)
	e.src, e.srcBase, e.srcN = b, e.base, n
	return true
}

// pageSets returns the live arenas' pages, by tag.
func (c *core) pageSets() pageSets {
	var ps pageSets
	ps[c.ar.tag] = c.ar.pages
	if c.old != nil {
		ps[c.old.tag] = c.old.pages
	}
	return ps
}

// arenaOf returns the arena link is in.
func (c *core) arenaOf(link uint32) *arena {
	if linkTag(link) == c.ar.tag {
		return &c.ar
	}
	return c.old
}

// loadEntry decodes the live entry at link of key h into e.
func (c *core) loadEntry(e *entry, h uint64, link uint32) {
	ps := c.pageSets()
	if !decodeEntry(&ps, &c.codec, link, h, e) {
		panic(fmt.Sprintf("state: key %016x: corrupt lease entry at %#x", h, link))
	}
}

// keyOf appends e's canonical key to dst.
func (c *core) keyOf(dst []byte, e *entry) []byte {
	return joinKey(dst, c.tpls.strs[e.tpl], e.value)
}

// splitNew splits key (canonical) into c.scr.tpl and c.scr.val, for
// newEntry, and returns the id its template has or will get and the
// values' length.
func (c *core) splitNew(key []byte) (tpl uint32, vlen int) {
	var ok bool
	c.scr.tpl, c.scr.val, ok = splitKey(key, c.scr.tpl[:0], c.scr.val[:0])
	if !ok {
		// AppendKey's output always splits; keep the whole key as the
		// template rather than fail.
		c.scr.tpl, c.scr.val = append(c.scr.tpl[:0], key...), c.scr.val[:0]
	}
	return c.tpls.peek(c.scr.tpl), len(c.scr.val)
}

// newEntry prepares e as a new entry, with no lease, for the key split by
// splitNew, interning its template. The caller stores it (storeEntry).
func (c *core) newEntry(e *entry) {
	*e = entry{leases: e.leases[:0], tpl: c.tpls.ref(c.scr.tpl), value: c.scr.val}
}

// addLease inserts l at position i of e (key h's entry) and counts it.
func (c *core) addLease(e *entry, i int, l lease) {
	ag := c.mutAgent(c.byNum[l.agent])
	ag.keysHeld++
	ag.tokensHeld += l.held
	c.leases++
	e.leases = slices.Insert(e.leases, i, l)
}

// dropLease ends lease i of e (key h's entry). Its tokens are not credited
// back: the agent may have spent them (docs/architecture.md, invariant
// (c)).
func (c *core) dropLease(e *entry, i int, h uint64) {
	l := e.leases[i]
	if ag := c.byNum[l.agent]; ag != nil {
		ag = c.mutAgent(ag)
		ag.keysHeld--
		ag.tokensHeld -= l.held
	}
	if l.ext {
		delete(c.codec.ext, extKey{h, l.agent})
	}
	if len(c.shares) > 0 {
		delete(c.shares, extKey{h, l.agent})
	}
	e.leases = slices.Delete(e.leases, i, i+1)
	c.leases--
}

// storeEntry writes e, key h's entry (slot idx), back to the arena:
// freeing it when it has no lease left, allocating or moving it when its
// size changed (a shrinking entry moves only into a free block of its new
// size, else shrinks in place), and queueing it on the expiry wheel when
// its earliest expiry moved earlier than oldMin (a second), when it moved
// to another block, or when consumed (its wheel entry was just taken).
func (c *core) storeEntry(h uint64, idx int, e *entry, oldMin int64, consumed bool) {
	if len(e.leases) == 0 {
		if e.link != 0 {
			c.arenaOf(e.link).release(c, e.link, e.size)
			c.tab.mut(c, idx).link = 0
		}
		c.tpls.unref(e.tpl)
		e.link, e.size = 0, 0
		return
	}
	size := blockSize(entrySize(len(e.leases), e.tpl, len(e.value)))
	push, shrink, kept := consumed, false, e.link != 0
	var old uint32
	oldSize := e.size
	in := &c.ar
	if e.link != 0 {
		in = c.arenaOf(e.link)
	}
	switch {
	case e.link == 0:
		e.link, e.size, push = c.ar.alloc(c, size), size, true
		kept = false
		c.tab.mut(c, idx).link = e.link
	case size == e.size:
	case size < e.size && e.size <= arenaLarge && c.ar.free[size/2] == 0:
		// Shrunk, with no free block of the new size: in place, its tail
		// freed. With one, the entry moves into it (default), which frees
		// its whole block for an entry of that size: a tail (a lease or
		// two, 22 or 44 bytes) is shorter than any entry, so under lease
		// churn tails would pile up until a compaction took them back.
		shrink = true
	case size < e.size && !c.ar.canAlloc(size):
		// A large block (its own page) shrinking with no room for the
		// smaller one: only leases ended or released shrink an entry, and
		// an Expire or Release must not fail for want of room, so the
		// entry is encoded aside, its page freed, and the block allocated
		// again, in the arena that has room (during a compaction, the old
		// one the entry is in: its key is not past the cursor, which moves
		// it later).
		c.storeShrunk(h, idx, e, size, in)
		return
	default:
		old = e.link
		e.link, e.size, push, kept = c.ar.alloc(c, size), size, true, false
		c.tab.mut(c, idx).link = e.link
	}
	b := c.arenaOf(e.link).mut(c, e.link, size)
	me := c.codec.encode(b, e, h, kept) // e.value and e.src may alias the old block: release it after
	if shrink {
		in.split(c, e.link, e.size, size) // after encode: the tail may hold leases it copies
		e.size = size
	}
	m := floorDiv(me, 1e9) // e.minSec(), from encode's pass over the leases (e has one at least)
	if push || m < oldMin {
		e.queued = uint8(m)
		setQueued(b, e.queued)
		c.wheel.push(m, h, e.link)
	}
	if old != 0 {
		in.release(c, old, oldSize)
	}
}

// storeShrunk writes e, key h's entry (slot idx) in the large block of
// arena in, back to a new block of size bytes when the arena has no room
// for it beside the old one: encoded into scratch, the old block released,
// then allocated (releasing a large block frees its page, so one fits).
// The entry is queued on the expiry wheel at its new link.
func (c *core) storeShrunk(h uint64, idx int, e *entry, size int, in *arena) {
	c.scr.shrunk = slices.Grow(c.scr.shrunk[:0], size)[:size]
	me := c.codec.encode(c.scr.shrunk, e, h, false) // e.value and e.src alias the old block
	in.release(c, e.link, e.size)
	to := &c.ar
	if !to.canAlloc(size) {
		to = in
	}
	e.link, e.size = to.alloc(c, size), size
	c.tab.mut(c, idx).link = e.link
	b := to.mut(c, e.link, size)
	copy(b, c.scr.shrunk)
	m := floorDiv(me, 1e9)
	e.queued = uint8(m)
	setQueued(b, e.queued)
	c.wheel.push(m, h, e.link)
	c.loadEntry(e, h, e.link) // e.value and e.src named the released block and scratch
}

// setQueued writes the queued byte of the entry b.
func setQueued(b []byte, q uint8) {
	w := binary.LittleEndian.Uint64(b)
	w = w&^(0xff<<baseBits) | uint64(q)<<baseBits
	binary.LittleEndian.PutUint64(b, w)
}

// expireEntry takes the wheel entry (u, link) of unit u at now: it ends
// the key's due leases and re-queues the key, or ignores the entry if it
// is stale. With budgeted (an Expire with MaxEntries, which takes whole
// units of past seconds only), an entry queued before the second of its
// key's earliest expiry (a renewal queues nothing) is re-queued in that
// second and ends nothing yet, so that the key is met there
// (expireBudgeted). It reports whether it ended leases.
func (c *core) expireEntry(u int64, link uint32, now int64, budgeted bool) bool {
	h, idx, ok := c.entryHash(u, link)
	if !ok {
		return false
	}
	return c.expireLoaded(unitSec(u), h, idx, link, now, budgeted)
}

// entryHash returns the hash and table index of the key of the wheel entry
// (u, link), or ok false if the entry is stale.
func (c *core) entryHash(u int64, link uint32) (h uint64, idx int, ok bool) {
	e := &c.scr.e
	ps := c.pageSets()
	b, ok := ps.head(link)
	if !ok {
		return 0, 0, false
	}
	if _, _, _, ok := parseHeader(b, e); !ok || e.queued != uint8(unitSec(u)) || int(e.tpl) >= len(c.tpls.strs) {
		return 0, 0, false
	}
	c.scr.key = c.keyOf(c.scr.key[:0], e)
	h = xxhash.Sum64(c.scr.key)
	if h>>(64-unitBits) != unitPrefix(u) {
		return 0, 0, false // a block reused by a key of another unit
	}
	idx = c.tab.find(h)
	if idx < 0 || c.tab.at(idx).link != link {
		return 0, 0, false
	}
	return h, idx, true
}

// expireLoaded is expireEntry for a live entry of second s, the key's hash
// h and table index idx found.
func (c *core) expireLoaded(s int64, h uint64, idx int, link uint32, now int64, budgeted bool) bool {
	e := &c.scr.e
	c.loadEntry(e, h, link)
	if c.frozen(h) {
		// Frozen (slots.go): its leases move as they are; look again
		// next second (thaw queues it at its earliest expiry again).
		c.queueKey(e, h, link, floorDiv(now, 1e9)+1)
		return false
	}
	oldMin := e.minSec()
	if budgeted && oldMin > s {
		c.queueKey(e, h, link, oldMin)
		return false
	}
	due := false
	for i := 0; i < len(e.leases); {
		if e.leases[i].expiry <= now {
			c.dropLease(e, i, h)
			due = true
			continue
		}
		i++
	}
	if due {
		c.storeEntry(h, idx, e, oldMin, true)
		return true
	}
	// Nothing due yet: re-queue at the earliest expiry.
	c.queueKey(e, h, link, oldMin)
	return false
}

// expireBudgeted takes the wheel's units of the seconds ≤ sec (and, if
// last is not 0, none after unit last), earliest unit first, each whole,
// until the leases of budget keys or more have been ended. It stops only
// between units: past the budget by less than a unit's due keys.
//
// Which keys those are is a function of the replicated state and the
// command only, not of the wheel, which differs between a replica that
// applied the log (entries in push order, stale entries, keys queued early
// by a lazy renewal or a frozen slot) and one that restored a snapshot
// (every leased key queued afresh): only an entry that ends leases counts,
// and an entry queued before its key's earliest expiry second is re-queued
// in that second and ends nothing yet. When the earliest unit U is taken,
// every served key whose earliest expiry is in U has its entry there (the
// invariant, and no unit before U is left), and every key whose leases
// the entries of U end is one of them. So taking U ends the leases due
// of exactly those keys, in whatever order its entries are, and the
// units an Expire takes, and the keys it ends, are the same on every
// replica. (last names a unit, not a count of entries, for the same
// reason.)
func (c *core) expireBudgeted(sec, last int64, budget int, now int64) {
	w := &c.wheel
	for ended := 0; ended < budget; {
		u, b, ok := w.popDue(sec, last)
		if !ok {
			break
		}
		// Entries queued meanwhile go to other units: a key re-queued
		// early goes to its earliest expiry's second (> u's), a frozen
		// or renewed one past sec.
		b.each(touchAhead, func(links []uint32) {
			c.touchEntries(links)
			for _, l := range links {
				if c.expireEntry(u, l, now, true) {
					ended++
				}
			}
		})
		w.recycle(b)
	}
	w.trimPool()
}

// touchEntries reads the blocks the wheel entries links name
// (touchEntry), as touchKeys does for a call's keys: a unit's entries lie
// about 64 blocks apart in the arena (its keys are 1/64 of the keys
// queued in the second, mostly in the order they were allocated), so each
// misses the cache; these reads are independent, and their misses
// overlap. It changes nothing.
func (c *core) touchEntries(links []uint32) {
	ps := c.pageSets()
	var x byte
	for _, l := range links {
		x += touchEntry(ps[linkTag(l)], l)
	}
	c.tab.sink += uint32(x)
}

// queueKey queues the key hashed h whose entry e is at link in second sec of the
// expiry wheel, and sets its queued byte, which retires the key's earlier
// wheel entries.
func (c *core) queueKey(e *entry, h uint64, link uint32, sec int64) {
	e.queued = uint8(sec)
	setQueued(c.arenaOf(link).mut(c, link, e.size), e.queued)
	c.wheel.push(sec, h, link)
}

// rebuildWheel queues every leased key afresh (after Restore or
// compaction, when no old entry may remain).
func (c *core) rebuildWheel() {
	c.wheel.init()
	e := &c.scr.e
	t := &c.tab
	for i := 0; i < t.size; i++ {
		s := t.at(i)
		if s.link == 0 {
			continue
		}
		c.loadEntry(e, s.hash, s.link)
		c.queueKey(e, s.hash, s.link, e.minSec())
	}
}

// compactBudget is the most entries an Expire moves while the arena is
// compacted. A step moves compactRate entries a second since the last one
// (by the commands' time), at least compactMinStep, so that Expires that
// follow each other closely under load take short steps (each one holds
// every Acquire entry behind it; an entry moved costs ~0.5–1 µs) and a
// compaction moves about compactRate entries a second while Expires come
// 16 ms to 0.5 s apart (the default -expire-interval is 100 ms; closer
// ones move compactMinStep each, sparser ones compactBudget): 100,000
// leased keys in ~6 s, a million in ~1 min.
const (
	compactBudget  = 8192
	compactRate    = 16384
	compactMinStep = 256
)

// compactQuota returns the entries the compaction step of an Expire at now
// moves, and records now as the last step's time.
func (c *core) compactQuota(now int64) int {
	n := c.compactBudget
	if d := now - c.compactAt; d >= 0 && d < int64(c.compactBudget)*1e9/compactRate {
		n = max(int(d*compactRate/1e9), compactMinStep)
	}
	c.compactAt = now
	return min(n, c.compactBudget)
}

// maybeCompact starts a compaction when more than a third of the arena is
// free (and it is more than a few pages, and no snapshot shares it), and
// advances a running one by one step.
func (c *core) maybeCompact() {
	a := &c.ar
	if c.old == nil && (c.compactAlways || (!c.cow && a.idle*2 > a.live && len(a.pages) > 8)) {
		c.startCompaction()
	}
	if c.old != nil {
		c.compactStep(c.compactQuota(c.now))
	}
}

// startCompaction makes the arena the old one and allocates from now on in
// a new arena with the other tag; its first step, at c.now, takes
// compactMinStep entries.
func (c *core) startCompaction() {
	old := c.ar
	c.old = &old
	c.ar.init(1 - old.tag)
	c.ar.maxPages = old.maxPages
	c.compactFrom = 0
	c.compactAt = c.now
}

// compactStep moves up to budget entries (looking at up to 16 keys per
// entry of c.compactBudget) from the old arena into the new one, resuming
// at the hash cursor;
// keys inserted, moved or reallocated meanwhile are in the new arena
// already. Once the cursor has passed every key, the old arena is dropped.
// A moved entry is queued on the wheel at its new link; its old entries
// there are stale.
//
// New leases are checked against the new arena only, so leases granted
// while a compaction runs can fill it before the old arena's entries are
// moved: a step that meets an entry the new arena has no room for stops
// there, and reports false (the compaction resumes at that key once
// expiries free room; meanwhile no new lease is granted, as with any full
// arena). Moving never allocates without room.
func (c *core) compactStep(budget int) bool {
	t := &c.tab
	e := &c.scr.e
	// The scan is not paced with the moves: in a table of mostly
	// unleased keys (charges, static shares) the cursor would otherwise
	// crawl, and while a compaction runs the leader commits an Expire
	// every ExpireInterval.
	scan := c.compactBudget * 16
	i := t.lowerBound(c.compactFrom)
	ahead := i
	for ; i < t.size && budget > 0 && scan > 0; i++ {
		if i >= ahead {
			ahead = c.touchOld(i, min(budget, touchAhead))
		}
		s := t.at(i)
		if s.lim == 0 {
			continue
		}
		move := s.link != 0 && linkTag(s.link) != c.ar.tag
		if move {
			c.loadEntry(e, s.hash, s.link)
			if !c.ar.canAlloc(e.size) {
				return false
			}
		}
		scan--
		if s.hash == math.MaxUint64 {
			c.compactFrom = s.hash
		} else {
			c.compactFrom = s.hash + 1
		}
		if !move {
			continue
		}
		l := c.ar.alloc(c, e.size)
		b := c.ar.mut(c, l, e.size)
		copy(b, c.old.bytes(s.link, e.size))
		c.old.live -= int64(e.size) // the old arena is dropped whole
		m := e.minSec()
		setQueued(b, uint8(m))
		c.wheel.push(m, s.hash, l)
		t.mut(c, i).link = l
		budget--
	}
	switch {
	case i >= t.size || c.compactFrom == math.MaxUint64:
		c.old = nil
	case i > 0 && t.at(i-1).lim == 0:
		// No key homed before i lies at or after it (slots from a key's
		// home to it are full): the cursor may skip to i's first hash.
		if i >= t.capa {
			c.old = nil // the rest is empty tail slack
			return true
		}
		q, r := bits.Div64(uint64(i), 0, uint64(t.capa))
		if r != 0 {
			q++
		}
		c.compactFrom = max(c.compactFrom, q)
	}
	return true
}

// touchOld reads ahead, as touchKeys does, the entries in the old arena
// of the keys from slot i on, the next n of them or those of the next
// 16·n slots, and returns the slot after the last one it looked at. The
// compaction moves them in table order, each from a block far from the
// last, so each would miss the cache in turn. It changes nothing.
func (c *core) touchOld(i, n int) int {
	t := &c.tab
	end := min(i+16*n, t.size)
	if c.old == nil {
		return end
	}
	var x byte
	for ; i < end && n > 0; i++ {
		if l := t.at(i).link; l != 0 && t.at(i).lim != 0 && linkTag(l) == c.old.tag {
			x += touchEntry(c.old.pages, l)
			n--
		}
	}
	c.tab.sink += uint32(x)
	return i
}

// compact runs a whole compaction (for tests and tools), as far as the
// arena has room.
func (c *core) compact() {
	if c.old == nil {
		c.startCompaction()
	}
	for c.old != nil && c.compactStep(compactBudget) {
	}
}
