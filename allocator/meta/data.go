package meta

import (
	"fmt"

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
