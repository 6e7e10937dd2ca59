package meta

import (
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
	ms, err := checkMembers(members)
	if err != nil {
		return err
	}
	groups := make(map[slots.GroupID]*Group, data+1)
	ids := make([]slots.GroupID, data)
	for i := range data + 1 {
		id := slots.GroupID(i)
		groups[id] = &Group{ID: id, Members: slices.Clone(ms)}
		if i > 0 {
			ids[i-1] = id
		}
	}
	m, err := slots.Even(1, ids)
	if err != nil {
		return err
	}
	*s = State{
		clusterID: clusterID,
		groups:    groups,
		nextGroup: slots.GroupID(data + 1),
		slotMap:   m,
		moves:     map[uint64]*Move{},
		nextMove:  1,
	}
	return nil
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
