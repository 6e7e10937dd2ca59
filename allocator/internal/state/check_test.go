package state

import (
	"fmt"
)

// consistency checks every internal invariant of the state and returns the
// first violation. Tests call it after each step.
func (s *State) consistency() error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	t := &c.tab

	// Table: sorted, every slot at or after its home with no gap between,
	// counts and limit references right, flags match infos.
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
		h := t.home(sl.hash)
		if h > i {
			return fmt.Errorf("table: slot %d before its home %d", i, h)
		}
		for j := h; j < i; j++ {
			if t.at(j).lim == 0 {
				return fmt.Errorf("table: gap at %d between home %d and slot %d", j, h, i)
			}
		}
		if t.find(sl.hash) != i {
			return fmt.Errorf("table: find(%016x) != %d", sl.hash, i)
		}
		refs[sl.lim]++
		if (sl.flags&flagInfo != 0) != (c.infos[sl.hash] != nil) {
			return fmt.Errorf("table: slot %d flag %d but info %v", i, sl.flags, c.infos[sl.hash] != nil)
		}
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

	// Leases: counters, sums, agents, expiry heap.
	keys := make(map[uint32]uint32)
	tokens := make(map[uint32]int64)
	live := make(map[[2]uint64]lease)
	var leases uint64
	for h, k := range c.infos {
		if len(k.leases) == 0 {
			return fmt.Errorf("info %016x without leases", h)
		}
		if t.find(h) < 0 {
			return fmt.Errorf("info %016x for an untracked key", h)
		}
		var need int64
		for i, l := range k.leases {
			if i > 0 && l.agent <= k.leases[i-1].agent {
				return fmt.Errorf("info %016x: leases out of order", h)
			}
			if l.held < 0 || l.need < 0 {
				return fmt.Errorf("info %016x: negative lease %+v", h, l)
			}
			if c.byNum[l.agent] == nil {
				return fmt.Errorf("info %016x: lease of unknown agent %d", h, l.agent)
			}
			need += l.need
			keys[l.agent]++
			tokens[l.agent] += l.held
			live[[2]uint64{h, uint64(l.agent)}] = l
			leases++
		}
		if need != k.sumNeed {
			return fmt.Errorf("info %016x: sumNeed %d, Σ %d", h, k.sumNeed, need)
		}
	}
	if leases != c.leases {
		return fmt.Errorf("leases: counted %d, counter %d", leases, c.leases)
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
	queued := make(map[[2]uint64]bool)
	for _, e := range c.exp {
		k := [2]uint64{e.hash, uint64(e.agent)}
		if l, ok := live[k]; ok && l.seq == e.seq {
			if e.expiry > l.expiry {
				return fmt.Errorf("expiry heap: entry %d after lease expiry %d", e.expiry, l.expiry)
			}
			queued[k] = true
		}
	}
	if len(queued) != len(live) {
		return fmt.Errorf("expiry heap: %d of %d leases queued", len(queued), len(live))
	}
	return nil
}
