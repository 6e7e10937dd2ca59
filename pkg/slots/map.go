package slots

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Map assigns every slot to one group, at a version. Owner is the lookup
// most callers want. A Map is a value (4 KiB): copies are independent. The
// zero value is version 0 with group 0 owning every slot.
type Map struct {
	version uint64
	owner   [Count]GroupID
}

// Assignment is a run of slots and their owner.
type Assignment struct {
	Range Range
	Group GroupID
}

func (a Assignment) String() string {
	return a.Range.String() + "=" + strconv.FormatUint(uint64(a.Group), 10)
}

// Even returns the map, at version, that gives each of groups (in the
// order given) one contiguous run of Count/len(groups) slots, the first
// Count%len(groups) groups one slot more.
func Even(version uint64, groups []GroupID) (Map, error) {
	if err := checkGroups(groups); err != nil {
		return Map{}, err
	}
	m := Map{version: version}
	n := len(groups)
	s := 0
	for i, g := range groups {
		size := Count / n
		if i < Count%n {
			size++
		}
		for range size {
			m.owner[s] = g
			s++
		}
	}
	return m, nil
}

// checkGroups refuses an empty or duplicated group list, or more groups
// than slots.
func checkGroups(groups []GroupID) error {
	if len(groups) == 0 {
		return fmt.Errorf("slots: no groups")
	}
	if len(groups) > Count {
		return fmt.Errorf("slots: %d groups for %d slots", len(groups), Count)
	}
	seen := make(map[GroupID]bool, len(groups))
	for _, g := range groups {
		if seen[g] {
			return fmt.Errorf("slots: group %d listed twice", g)
		}
		seen[g] = true
	}
	return nil
}

// Version is the map's version.
func (m *Map) Version() uint64 { return m.version }

// Owner is the group that owns slot s.
func (m *Map) Owner(s Slot) GroupID { return m.owner[s&(Count-1)] }

// OwnerOf is the group that owns the key whose hash is h (rules.KeyHash).
func (m *Map) OwnerOf(h uint64) GroupID { return m.owner[Of(h)] }

// Owns reports whether g owns every slot of r.
func (m *Map) Owns(g GroupID, r Range) bool {
	if !r.Valid() {
		return false
	}
	for s := int(r.First); s <= int(r.Last); s++ {
		if m.owner[s] != g {
			return false
		}
	}
	return true
}

// Assignments returns the map as maximal runs of one owner, in slot order.
func (m *Map) Assignments() []Assignment {
	var out []Assignment
	start := 0
	for s := 1; s <= Count; s++ {
		if s == Count || m.owner[s] != m.owner[start] {
			out = append(out, Assignment{Range{Slot(start), Slot(s - 1)}, m.owner[start]})
			start = s
		}
	}
	return out
}

// RangesOf returns the runs of slots g owns, in slot order.
func (m *Map) RangesOf(g GroupID) []Range {
	var out []Range
	for _, a := range m.Assignments() {
		if a.Group == g {
			out = append(out, a.Range)
		}
	}
	return out
}

// Counts returns how many slots each group owns.
func (m *Map) Counts() map[GroupID]int {
	out := map[GroupID]int{}
	for _, g := range m.owner {
		out[g]++
	}
	return out
}

// Groups returns the groups that own at least one slot, in id order.
func (m *Map) Groups() []GroupID {
	out := make([]GroupID, 0, 4)
	for g := range m.Counts() {
		out = append(out, g)
	}
	slices.Sort(out)
	return out
}

// Validate checks that every slot's owner is one of groups, naming the
// first run of slots that is not.
func (m *Map) Validate(groups []GroupID) error {
	for _, a := range m.Assignments() {
		if !slices.Contains(groups, a.Group) {
			return fmt.Errorf("slots: slots %s are owned by group %d, which does not exist", a.Range, a.Group)
		}
	}
	return nil
}

// Assign returns a copy of m with r owned by g, at version m.Version()+1.
func (m *Map) Assign(r Range, g GroupID) (Map, error) {
	if !r.Valid() {
		return Map{}, fmt.Errorf("slots: invalid range %d-%d", r.First, r.Last)
	}
	out := *m
	out.version++
	for s := int(r.First); s <= int(r.Last); s++ {
		out.owner[s] = g
	}
	return out, nil
}

// String writes the map's assignments, "A-B=G,...", in slot order (without
// the version): what ParseMap reads.
func (m *Map) String() string {
	as := m.Assignments()
	parts := make([]string, len(as))
	for i, a := range as {
		parts[i] = a.String()
	}
	return strings.Join(parts, ",")
}

// ParseMap reads a map written by Map.String: runs "A-B=G" (or "A=G")
// covering every slot exactly once, in any order.
func ParseMap(version uint64, s string) (Map, error) {
	m := Map{version: version}
	var covered [Count]bool
	n := 0
	for part := range strings.SplitSeq(s, ",") {
		rs, gs, ok := strings.Cut(part, "=")
		if !ok {
			return Map{}, fmt.Errorf("%w: %q: want A-B=GROUP", ErrSyntax, part)
		}
		r, err := ParseRange(rs)
		if err != nil {
			return Map{}, err
		}
		g, err := ParseGroup(gs)
		if err != nil {
			return Map{}, err
		}
		for s := int(r.First); s <= int(r.Last); s++ {
			if covered[s] {
				return Map{}, fmt.Errorf("slots: slot %d assigned twice", s)
			}
			covered[s] = true
			m.owner[s] = g
			n++
		}
	}
	if n != Count {
		for s, c := range covered {
			if !c {
				return Map{}, fmt.Errorf("slots: slot %d has no owner", s)
			}
		}
	}
	return m, nil
}

// ParseGroup reads a group id in canonical decimal.
func ParseGroup(s string) (GroupID, error) {
	if s == "" || (len(s) > 1 && s[0] == '0') || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%w: group %q: want a number", ErrSyntax, s)
	}
	g, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("%w: group %q: want a number below 2^32", ErrSyntax, s)
	}
	return GroupID(g), nil
}
