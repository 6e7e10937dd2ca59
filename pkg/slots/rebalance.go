package slots

import (
	"fmt"
	"slices"
)

// Move hands a range of slots from one group to another.
type Move struct {
	Range    Range
	From, To GroupID
}

func (mv Move) String() string { return fmt.Sprintf("%s: %d→%d", mv.Range, mv.From, mv.To) }

// Apply returns m with moves carried out in order, at version
// m.Version()+1. A move whose source does not own its whole range, or
// whose source is its target, is refused and nothing changes.
func (m *Map) Apply(moves []Move) (Map, error) {
	out := *m
	for _, mv := range moves {
		if !mv.Range.Valid() {
			return Map{}, fmt.Errorf("slots: move %s: invalid range", mv)
		}
		if mv.From == mv.To {
			return Map{}, fmt.Errorf("slots: move %s: group %d already owns the slots", mv, mv.To)
		}
		if !out.Owns(mv.From, mv.Range) {
			return Map{}, fmt.Errorf("slots: move %s: group %d does not own every slot of %s", mv, mv.From, mv.Range)
		}
		for s := int(mv.Range.First); s <= int(mv.Range.Last); s++ {
			out.owner[s] = mv.To
		}
	}
	out.version = m.version + 1
	return out, nil
}

// Targets returns how many slots each of groups should own in an even
// map reached from m with the fewest slots moved: Count/len(groups) each,
// and one more for the Count%len(groups) groups that own the most now
// (ties to the lower id). Any other choice moves at least as many slots.
func Targets(m *Map, groups []GroupID) (map[GroupID]int, error) {
	if err := checkGroups(groups); err != nil {
		return nil, err
	}
	have := m.Counts()
	order := slices.Clone(groups)
	slices.SortFunc(order, func(a, b GroupID) int {
		if have[a] != have[b] {
			return have[b] - have[a]
		}
		return cmpGroup(a, b)
	})
	n := len(groups)
	out := make(map[GroupID]int, n)
	for i, g := range order {
		out[g] = Count / n
		if i < Count%n {
			out[g]++
		}
	}
	return out, nil
}

func cmpGroup(a, b GroupID) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Rebalance plans the moves that leave each of groups owning Count/n or
// Count/n+1 slots (n = len(groups)) and groups not listed owning none (a
// group being drained), moving the fewest slots possible: only a
// group's slots beyond its target (Targets) move, each at most once, and
// no group both gives and receives. A group gives its highest slots; the
// receivers, in id order, take the given slots in slot order. Moves come in
// slot order, each a maximal run with one source and one target. An even
// map gets no moves.
func Rebalance(m *Map, groups []GroupID) ([]Move, error) {
	target, err := Targets(m, groups)
	if err != nil {
		return nil, err
	}
	// Mark the slots each group gives: its highest ones beyond its target;
	// every slot of a group that is not listed.
	give := make(map[GroupID]int)
	for g, n := range m.Counts() {
		if t, listed := target[g]; !listed {
			give[g] = n
		} else if n > t {
			give[g] = n - t
		}
	}
	var given []Slot
	for s := Count - 1; s >= 0; s-- {
		if g := m.owner[s]; give[g] > 0 {
			give[g]--
			given = append(given, Slot(s))
		}
	}
	slices.Reverse(given)

	have := m.Counts()
	receivers := slices.Clone(groups)
	slices.Sort(receivers)
	var moves []Move
	ri := 0
	for _, s := range given {
		for have[receivers[ri]] >= target[receivers[ri]] {
			ri++
		}
		to, from := receivers[ri], m.owner[s]
		have[to]++
		if k := len(moves) - 1; k >= 0 && moves[k].From == from && moves[k].To == to && moves[k].Range.Last+1 == s {
			moves[k].Range.Last = s
			continue
		}
		moves = append(moves, Move{Range{s, s}, from, to})
	}
	return moves, nil
}
