package meta

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/allot/allot/pkg/slots"
)

// BootstrapData initializes an empty State for a cluster whose meta group
// serves no keys: group 0 (the meta group) and data groups 1..data, each
// with members, and the slots spread evenly over the data groups
// (slots.Even) at slot map version 1.
func (s *State) BootstrapData(clusterID string, data int, members []string) error {
	if s.Bootstrapped() {
		return fmt.Errorf("%w: already bootstrapped (cluster %s)", ErrInvalid, s.clusterID)
	}
	if clusterID == "" {
		return fmt.Errorf("%w: empty cluster id", ErrInvalid)
	}
	if data < 1 || data > slots.Count {
		return fmt.Errorf("%w: %d data groups: want 1 to %d", ErrInvalid, data, slots.Count)
	}
	return s.bootstrap(clusterID, data+1, 1, members)
}

// DataGroups returns the ids of the groups that own at least one slot or
// may (every group but the meta group 0, when the meta group owns no
// slot), in id order.
func (s *State) DataGroups() []slots.GroupID {
	var out []slots.GroupID
	for _, g := range s.Groups() {
		if g.ID != 0 || len(s.slotMap.RangesOf(0)) > 0 {
			out = append(out, g.ID)
		}
	}
	return out
}

// GroupsToJoin returns the data groups a node that joins the cluster
// becomes a member of: every one it is not a member of that has fewer
// than Replicas members (every one with Replicas 0), in id order.
func (s *State) GroupsToJoin(node string) []slots.GroupID {
	var out []slots.GroupID
	for _, id := range s.DataGroups() {
		g := s.groups[id]
		if id == 0 || slices.Contains(g.Members, node) || (s.replicas > 0 && len(g.Members) >= s.replicas) {
			continue
		}
		out = append(out, id)
	}
	return out
}

// PlaceGroup returns the members of a new data group among nodes: all of
// them with Replicas 0, else the Replicas nodes that are members of the
// fewest data groups (ties to the lower id), sorted.
func (s *State) PlaceGroup(nodes []string) []string {
	nodes = slices.Clone(nodes)
	if s.replicas == 0 || len(nodes) <= s.replicas {
		slices.Sort(nodes)
		return nodes
	}
	load := make(map[string]int, len(nodes))
	for _, id := range s.DataGroups() {
		for _, m := range s.groups[id].Members {
			load[m]++
		}
	}
	slices.SortFunc(nodes, func(a, b string) int {
		if c := cmp.Compare(load[a], load[b]); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
	out := nodes[:s.replicas]
	slices.Sort(out)
	return out
}
