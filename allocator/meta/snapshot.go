package meta

import (
	"encoding/json"
	"fmt"
	"slices"

	"github.com/allot/allot/pkg/slots"
)

// snapshotFormat is the version of the snapshot encoding.
const snapshotFormat = 1

type snapshot struct {
	Format         int           `json:"format"`
	ClusterID      string        `json:"cluster_id"`
	Groups         []Group       `json:"groups"`
	NextGroup      slots.GroupID `json:"next_group"`
	SlotMapVersion uint64        `json:"slot_map_version"`
	SlotMap        string        `json:"slot_map"`
	Moves          []Move        `json:"moves"`
	NextMove       uint64        `json:"next_move"`
	Finished       []Finished    `json:"finished"`
	Replicas       int           `json:"replicas,omitempty"`
}

// Snapshot encodes the State. The encoding is deterministic: equal States
// give equal bytes.
func (s *State) Snapshot() ([]byte, error) {
	snap := snapshot{
		Format:         snapshotFormat,
		ClusterID:      s.clusterID,
		Groups:         s.Groups(),
		NextGroup:      s.nextGroup,
		SlotMapVersion: s.slotMap.Version(),
		SlotMap:        s.slotMap.String(),
		Moves:          s.Moves(),
		NextMove:       s.nextMove,
		Finished:       s.Finished(),
		Replicas:       s.replicas,
	}
	if !s.Bootstrapped() {
		snap.SlotMapVersion, snap.SlotMap = 0, ""
	}
	b, err := json.Marshal(snap)
	if err != nil {
		return nil, fmt.Errorf("meta: snapshot: %w", err)
	}
	return b, nil
}

// Restore replaces the State with a Snapshot's. A snapshot that does not
// decode, is of another format or breaks an invariant is refused, and
// the State is unchanged.
func (s *State) Restore(b []byte) error {
	var snap snapshot
	if err := json.Unmarshal(b, &snap); err != nil {
		return fmt.Errorf("meta: restore: %w", err)
	}
	if snap.Format != snapshotFormat {
		return fmt.Errorf("meta: restore: snapshot format %d, want %d", snap.Format, snapshotFormat)
	}
	var next State
	if snap.ClusterID != "" {
		m, err := slots.ParseMap(snap.SlotMapVersion, snap.SlotMap)
		if err != nil {
			return fmt.Errorf("meta: restore: %w", err)
		}
		next = State{
			clusterID: snap.ClusterID,
			groups:    make(map[slots.GroupID]*Group, len(snap.Groups)),
			nextGroup: snap.NextGroup,
			slotMap:   m,
			moves:     make(map[uint64]*Move, len(snap.Moves)),
			nextMove:  snap.NextMove,
			finished:  snap.Finished,
			replicas:  snap.Replicas,
		}
		for _, g := range snap.Groups {
			if _, dup := next.groups[g.ID]; dup {
				return fmt.Errorf("meta: restore: group %d twice", g.ID)
			}
			next.groups[g.ID] = &Group{ID: g.ID, Members: g.Members, Founders: g.Founders}
		}
		for _, m := range snap.Moves {
			if _, dup := next.moves[m.ID]; dup {
				return fmt.Errorf("meta: restore: move %d twice", m.ID)
			}
			next.moves[m.ID] = &m
		}
	} else if len(snap.Groups) > 0 || len(snap.Moves) > 0 || snap.SlotMap != "" {
		return fmt.Errorf("meta: restore: %w: state without a cluster id", ErrInvalid)
	}
	if err := next.Validate(); err != nil {
		return fmt.Errorf("meta: restore: %w", err)
	}
	*s = next
	return nil
}

// Equal reports whether two States hold the same state.
func (s *State) Equal(o *State) bool {
	if s.clusterID != o.clusterID || s.nextGroup != o.nextGroup || s.nextMove != o.nextMove || s.replicas != o.replicas ||
		s.slotMap != o.slotMap || len(s.groups) != len(o.groups) || len(s.moves) != len(o.moves) {
		return false
	}
	for id, g := range s.groups {
		h, ok := o.groups[id]
		if !ok || !slices.Equal(g.Members, h.Members) || !slices.Equal(g.Founders, h.Founders) {
			return false
		}
	}
	for id, m := range s.moves {
		if n, ok := o.moves[id]; !ok || *m != *n {
			return false
		}
	}
	return slices.Equal(s.finished, o.finished)
}
