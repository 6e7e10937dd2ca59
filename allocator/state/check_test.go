package state

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// consistency checks every internal invariant of the state and returns the
// first violation. Tests call it after each step.
func (s *State) consistency() error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	t := &c.tab

	// Table: sorted, every slot at or after its home with no gap between,
	// counts and limit references right.
	refs := make(map[uint32]uint32)
	n := 0
	var prev uint64
	for i := 0; i < t.size; i++ {
		sl := t.at(i)
		if sl.lim == 0 {
			continue
		}
		if n > 0 && sl.hash <= prev {
			return fmt.Errorf("table: slot %d hash %016x not above %016x", i, sl.hash, prev)
		}
		prev = sl.hash
		n++
		if err := placedErr(t, i); err != nil {
			return fmt.Errorf("table: %w", err)
		}
		if t.find(sl.hash) != i {
			return fmt.Errorf("table: find(%016x) != %d", sl.hash, i)
		}
		refs[sl.lim]++
	}
	if n != t.n {
		return fmt.Errorf("table: %d occupied slots, n = %d", n, t.n)
	}
	for i := 1; i < len(c.lims.ents); i++ {
		e := c.lims.ents[i]
		if e.refs != refs[uint32(i)] {
			return fmt.Errorf("limits: entry %d refs %d, slots %d", i, e.refs, refs[uint32(i)])
		}
		if e.refs > 0 && c.lims.idx[e.key] != uint32(i) {
			return fmt.Errorf("limits: entry %d not indexed", i)
		}
	}
	if len(c.lims.idx) != len(refs) {
		return fmt.Errorf("limits: %d indexed, %d used", len(c.lims.idx), len(refs))
	}

	// Leased keys: entries, leases, counters, agents.
	keys := make(map[uint32]uint32)
	tokens := make(map[uint32]int64)
	type want struct {
		minSec int64
		queued uint8
		hash   uint64
	}
	wheelWant := make(map[uint32]want) // by link
	tplRefs := make(map[uint32]uint32)
	var blocks []block
	var leases uint64
	var live [2]int64
	exts, shares := 0, 0
	for i := 0; i < t.size; i++ {
		sl := t.at(i)
		if sl.link == 0 {
			continue
		}
		if sl.lim == 0 {
			return fmt.Errorf("entry %#x in an empty slot %d", sl.link, i)
		}
		var e entry
		ps := c.pageSets()
		if c.old == nil && linkTag(sl.link) != c.ar.tag {
			return fmt.Errorf("key %016x: entry %#x in no arena", sl.hash, sl.link)
		}
		if c.old != nil && linkTag(sl.link) == c.old.tag && sl.hash < c.compactFrom {
			return fmt.Errorf("key %016x: entry %#x left in the old arena behind the cursor %016x", sl.hash, sl.link, c.compactFrom)
		}
		if !decodeEntry(&ps, &c.codec, sl.link, sl.hash, &e) {
			return fmt.Errorf("key %016x: bad entry at %#x", sl.hash, sl.link)
		}
		if _, dup := wheelWant[sl.link]; dup {
			return fmt.Errorf("key %016x: entry %#x shared", sl.hash, sl.link)
		}
		if int(e.tpl) >= len(c.tpls.strs) || c.tpls.refs[e.tpl] == 0 {
			return fmt.Errorf("key %016x: bad template %d", sl.hash, e.tpl)
		}
		if key := c.keyOf(nil, &e); xxhash.Sum64(key) != sl.hash {
			return fmt.Errorf("key %016x: stored key %q hashes differently", sl.hash, key)
		}
		if size := blockSize(entrySize(len(e.leases), e.tpl, len(e.value))); size != e.size {
			return fmt.Errorf("key %016x: entry size %d, want %d", sl.hash, e.size, size)
		}
		tplRefs[e.tpl]++
		live[linkTag(sl.link)] += int64(e.size)
		blocks = append(blocks, block{sl.link, e.size, true})
		wheelWant[sl.link] = want{e.minSec(), e.queued, sl.hash}
		for j, l := range e.leases {
			if j > 0 && l.agent <= e.leases[j-1].agent {
				return fmt.Errorf("key %016x: leases out of order", sl.hash)
			}
			if l.held < 0 || l.need < 0 {
				return fmt.Errorf("key %016x: negative lease %+v", sl.hash, l)
			}
			if c.byNum[l.agent] == nil {
				return fmt.Errorf("key %016x: lease of unknown agent %d", sl.hash, l.agent)
			}
			if _, ok := c.codec.ext[extKey{sl.hash, l.agent}]; ok != l.ext {
				return fmt.Errorf("key %016x: lease of agent %d escaped %v, in map %v", sl.hash, l.agent, l.ext, ok)
			}
			if l.ext {
				exts++
			}
			if sh, ok := c.shares[extKey{sl.hash, l.agent}]; ok {
				if sh < shareUnknown {
					return fmt.Errorf("key %016x: lease of agent %d issued share %d", sl.hash, l.agent, sh)
				}
				shares++
			}
			keys[l.agent]++
			tokens[l.agent] += l.held
			leases++
		}
	}
	if leases != c.leases {
		return fmt.Errorf("leases: counted %d, counter %d", leases, c.leases)
	}
	if exts != len(c.codec.ext) {
		return fmt.Errorf("escaped leases: %d, map %d", exts, len(c.codec.ext))
	}
	if shares != len(c.shares) {
		return fmt.Errorf("issued shares: %d of live leases, map %d", shares, len(c.shares))
	}
	if len(c.agents) != len(c.byNum) {
		return fmt.Errorf("agents: %d by id, %d by number", len(c.agents), len(c.byNum))
	}
	for id, a := range c.agents {
		if a.id != id || c.byNum[a.num] != a {
			return fmt.Errorf("agent %q: index mismatch", id)
		}
		if a.keysHeld != keys[a.num] || a.tokensHeld != tokens[a.num] {
			return fmt.Errorf("agent %q: keysHeld %d tokensHeld %d, leases say %d %d", id, a.keysHeld, a.tokensHeld, keys[a.num], tokens[a.num])
		}
	}

	// Templates: references are the entries using them.
	for id, s := range c.tpls.strs {
		if c.tpls.refs[id] != tplRefs[uint32(id)] {
			return fmt.Errorf("template %d %q: refs %d, entries %d", id, s, c.tpls.refs[id], tplRefs[uint32(id)])
		}
		if c.tpls.refs[id] > 0 && c.tpls.idx[s] != uint32(id) {
			return fmt.Errorf("template %d %q not indexed", id, s)
		}
	}

	// Arenas: live bytes, free lists, no two blocks overlapping.
	arenas := []*arena{&c.ar}
	if c.old != nil {
		arenas = append(arenas, c.old)
		if c.old.tag == c.ar.tag {
			return fmt.Errorf("arenas: both tagged %d", c.ar.tag)
		}
	}
	for _, a := range arenas {
		if live[a.tag] != a.live {
			return fmt.Errorf("arena %d: live %d, entries %d", a.tag, a.live, live[a.tag])
		}
		var free int64
		for s2, l := range a.free {
			if (a.nonEmpty[s2/64]>>(s2%64)&1 != 0) != (l != 0) {
				return fmt.Errorf("arena %d: free list %d and its bit disagree", a.tag, s2*2)
			}
			for ; l != 0; l = binary.LittleEndian.Uint32(a.bytes(l, minBlock)[8:]) {
				b := a.bytes(l, minBlock)
				if linkTag(l) != a.tag || binary.LittleEndian.Uint64(b) != 0 || int(binary.LittleEndian.Uint32(b[12:])) != s2*2 {
					return fmt.Errorf("arena %d: free block %#x of list %d is not marked free", a.tag, l, s2*2)
				}
				free += int64(s2 * 2)
				blocks = append(blocks, block{l, s2 * 2, false})
			}
		}
		if free > a.idle {
			return fmt.Errorf("arena %d: free lists hold %d bytes, idle %d", a.tag, free, a.idle)
		}
	}
	slices.SortFunc(blocks, func(a, b block) int { return cmp.Compare(a.link, b.link) })
	for i := 1; i < len(blocks); i++ {
		a, b := blocks[i-1], blocks[i]
		if linkTag(a.link) == linkTag(b.link) && linkPage(a.link) == linkPage(b.link) && linkOff(a.link)+a.size > linkOff(b.link) {
			return fmt.Errorf("arena: blocks %#x+%d and %#x overlap", a.link, a.size, b.link)
		}
	}

	// Expiry wheel: every leased key has its current entry.
	found := make(map[uint32]bool)
	n = 0
	c.wheel.each(func(u int64, l uint32) {
		n++
		if w, ok := wheelWant[l]; ok && w.queued == uint8(unitSec(u)) && unitSec(u) <= w.minSec && u == unitOf(unitSec(u), w.hash) {
			found[l] = true
		}
	})
	if n != c.wheel.n {
		return fmt.Errorf("wheel: %d entries, counter %d", n, c.wheel.n)
	}
	if len(found) != len(wheelWant) {
		return fmt.Errorf("expiry wheel: %d of %d leased keys queued", len(found), len(wheelWant))
	}
	return nil
}

type block struct {
	link uint32
	size int
	live bool
}
