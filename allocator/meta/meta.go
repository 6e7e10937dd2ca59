package meta

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/allot/allot/pkg/slots"
)

// Sentinels that refused commands wrap.
var (
	// ErrNoGroup: the command names a group that does not exist.
	ErrNoGroup = errors.New("meta: no such group")
	// ErrOverlap: the slots are in another move in flight.
	ErrOverlap = errors.New("meta: slots already moving")
	// ErrNoMove: the command names a move that is not in flight.
	ErrNoMove = errors.New("meta: no such move")
	// ErrPhase: the move is not in a phase that allows the command.
	ErrPhase = errors.New("meta: wrong move phase")
	// ErrBusy: the group owns slots or takes part in a move.
	ErrBusy = errors.New("meta: group in use")
	// ErrInvalid: the command's arguments are malformed, or the State is
	// not bootstrapped (or is, for Bootstrap).
	ErrInvalid = errors.New("meta: invalid command")
)

// Phase is a move's progress.
type Phase uint8

// The phases of a move in flight, in order.
const (
	PhaseFreezing Phase = iota + 1
	PhaseFrozen
	PhaseTransferred
)

func (p Phase) String() string {
	switch p {
	case PhaseFreezing:
		return "freezing"
	case PhaseFrozen:
		return "frozen"
	case PhaseTransferred:
		return "transferred"
	}
	return fmt.Sprintf("Phase(%d)", uint8(p))
}

// Group is a Raft group of the cluster.
type Group struct {
	ID slots.GroupID `json:"id"`
	// Members are the node ids that host a replica, sorted.
	Members []string `json:"members"`
	// Founders are the members the group was created with (sorted), until
	// its members first change (SetMembers clears them): while the group
	// is new, each founder bootstraps the group's Raft configuration with
	// them as its voters (Bootstraps). A member added later, and a founder
	// that comes back with an empty data dir once the group has run,
	// joins the running group instead: bootstrapping again, it could elect
	// itself leader of an empty copy of the group.
	Founders []string `json:"founders,omitempty"`
}

// Bootstraps reports whether node bootstraps the group's Raft
// configuration when it opens its replica without one: the group is new
// (its members are still its founders) and node is a founder. Every other
// member opens the group without a configuration and waits for the
// group's leader to add it as a voter.
func (g Group) Bootstraps(node string) bool {
	return len(g.Founders) > 0 && slices.Equal(g.Founders, g.Members) && slices.Contains(g.Founders, node)
}

// Move is a move of slots in flight.
type Move struct {
	ID       uint64        `json:"id"`
	Range    slots.Range   `json:"range"`
	From     slots.GroupID `json:"from"`
	To       slots.GroupID `json:"to"`
	Phase    Phase         `json:"phase"`
	Started  int64         `json:"started_unix_ms"` // the leader's time at BeginMove
	Updated  int64         `json:"updated_unix_ms"` // the leader's time at the last phase
	SrcIndex uint64        `json:"source_index,omitempty"`
	DstIndex uint64        `json:"target_index,omitempty"`
}

func (m Move) String() string {
	return fmt.Sprintf("move %d (slots %s, group %d → %d, %s)", m.ID, m.Range, m.From, m.To, m.Phase)
}

// Finished records a move that ended (committed or aborted), kept for
// status: the last MaxFinished of them.
type Finished struct {
	Move
	Committed bool   `json:"committed"`
	Reason    string `json:"reason,omitempty"` // why it was aborted
}

// MaxFinished is how many ended moves a State keeps.
const MaxFinished = 16

// State is the meta group's state. The zero value is an empty cluster,
// which Bootstrap initializes.
type State struct {
	clusterID string
	groups    map[slots.GroupID]*Group
	nextGroup slots.GroupID
	slotMap   slots.Map
	moves     map[uint64]*Move
	nextMove  uint64
	finished  []Finished
	// replicas is how many members a data group has at most (0: every
	// voter of the meta group).
	replicas int
}

// Replicas is how many members each data group has at most: a node that
// joins becomes a member of the data groups that have fewer, and a new
// group gets that many. 0 means every node hosts every group.
func (s *State) Replicas() int { return s.replicas }

// CheckReplicas refuses a Replicas value out of range.
func CheckReplicas(n int) error {
	if n < 0 || n > maxReplicas {
		return fmt.Errorf("%w: %d replicas: want 0 (every node) to %d", ErrInvalid, n, maxReplicas)
	}
	return nil
}

// SetReplicas sets Replicas (a bootstrap option, CheckReplicas).
func (s *State) SetReplicas(n int) error {
	if err := s.ready(); err != nil {
		return err
	}
	if err := CheckReplicas(n); err != nil {
		return err
	}
	s.replicas = n
	return nil
}

// maxReplicas bounds Replicas: a Raft group of more voters than this
// commits slowly and gains nothing.
const maxReplicas = 15

// ClusterID is the id given at Bootstrap ("" before).
func (s *State) ClusterID() string { return s.clusterID }

// Bootstrapped reports whether Bootstrap was applied.
func (s *State) Bootstrapped() bool { return s.clusterID != "" }

// SlotMap is the current slot map (a copy).
func (s *State) SlotMap() slots.Map { return s.slotMap }

// Groups returns the groups, in id order (copies).
func (s *State) Groups() []Group {
	ids := slices.Sorted(maps.Keys(s.groups))
	out := make([]Group, len(ids))
	for i, id := range ids {
		out[i] = s.groups[id].clone()
	}
	return out
}

// Group returns group id (a copy).
func (s *State) Group(id slots.GroupID) (Group, bool) {
	g, ok := s.groups[id]
	if !ok {
		return Group{}, false
	}
	return g.clone(), true
}

func (g *Group) clone() Group {
	return Group{ID: g.ID, Members: slices.Clone(g.Members), Founders: slices.Clone(g.Founders)}
}

// Moves returns the moves in flight, in id order (copies).
func (s *State) Moves() []Move {
	ids := slices.Sorted(maps.Keys(s.moves))
	out := make([]Move, len(ids))
	for i, id := range ids {
		out[i] = *s.moves[id]
	}
	return out
}

// Finished returns the last moves that ended, oldest first.
func (s *State) Finished() []Finished { return slices.Clone(s.finished) }

// Route returns the owner of slot sl and, when the slot is in a move in
// flight, that move: from PhaseFrozen on, the owner no longer serves it.
func (s *State) Route(sl slots.Slot) (slots.GroupID, *Move) {
	owner := s.slotMap.Owner(sl)
	for _, m := range s.moves {
		if m.Range.Contains(sl) {
			mv := *m
			return owner, &mv
		}
	}
	return owner, nil
}

// checkMembers refuses an empty, duplicated or blank member list and
// returns it sorted.
func checkMembers(members []string) ([]string, error) {
	if len(members) == 0 {
		return nil, fmt.Errorf("%w: a group needs at least one member", ErrInvalid)
	}
	out := slices.Clone(members)
	slices.Sort(out)
	for i, m := range out {
		if m == "" {
			return nil, fmt.Errorf("%w: empty member id", ErrInvalid)
		}
		if i > 0 && out[i-1] == m {
			return nil, fmt.Errorf("%w: member %q listed twice", ErrInvalid, m)
		}
	}
	return out, nil
}

// Bootstrap initializes an empty State: groups 0..n-1, each with members,
// and the slots spread evenly over them (slots.Even) at slot map version 1.
func (s *State) Bootstrap(clusterID string, n int, members []string) error {
	if s.Bootstrapped() {
		return fmt.Errorf("%w: already bootstrapped (cluster %s)", ErrInvalid, s.clusterID)
	}
	if clusterID == "" {
		return fmt.Errorf("%w: empty cluster id", ErrInvalid)
	}
	if n < 1 || n > slots.Count {
		return fmt.Errorf("%w: %d groups: want 1 to %d", ErrInvalid, n, slots.Count)
	}
	return s.bootstrap(clusterID, n, 0, members)
}

// bootstrap initializes groups 0..n-1 with members, the slots spread
// evenly over groups first..n-1.
func (s *State) bootstrap(clusterID string, n, first int, members []string) error {
	ms, err := checkMembers(members)
	if err != nil {
		return err
	}
	ids := make([]slots.GroupID, n)
	groups := make(map[slots.GroupID]*Group, n)
	for i := range ids {
		ids[i] = slots.GroupID(i)
		groups[ids[i]] = &Group{ID: ids[i], Members: slices.Clone(ms), Founders: slices.Clone(ms)}
	}
	m, err := slots.Even(1, ids[first:])
	if err != nil {
		return err
	}
	*s = State{
		clusterID: clusterID,
		groups:    groups,
		nextGroup: slots.GroupID(n),
		slotMap:   m,
		moves:     map[uint64]*Move{},
		nextMove:  1,
	}
	return nil
}

func (s *State) ready() error {
	if !s.Bootstrapped() {
		return fmt.Errorf("%w: the cluster is not bootstrapped", ErrInvalid)
	}
	return nil
}

// AddGroup adds a group with members and no slots, and returns its id:
// the next unused one (ids are never reused).
func (s *State) AddGroup(members []string) (slots.GroupID, error) {
	if err := s.ready(); err != nil {
		return 0, err
	}
	ms, err := checkMembers(members)
	if err != nil {
		return 0, err
	}
	if s.nextGroup == 0 && len(s.groups) > 0 {
		return 0, fmt.Errorf("%w: group ids exhausted", ErrInvalid)
	}
	id := s.nextGroup
	s.groups[id] = &Group{ID: id, Members: ms, Founders: slices.Clone(ms)}
	s.nextGroup++
	return id, nil
}

// SetMembers replaces group id's member list. The group's founders are
// cleared: its members change through its running Raft group (the
// leader adds or removes the voter), so no node bootstraps it again.
func (s *State) SetMembers(id slots.GroupID, members []string) error {
	if err := s.ready(); err != nil {
		return err
	}
	g, ok := s.groups[id]
	if !ok {
		return fmt.Errorf("%w: group %d", ErrNoGroup, id)
	}
	ms, err := checkMembers(members)
	if err != nil {
		return err
	}
	g.Members, g.Founders = ms, nil
	return nil
}

// RemoveGroup removes group id, which must own no slot and take part in
// no move; group 0 (the meta group) is never removed.
func (s *State) RemoveGroup(id slots.GroupID) error {
	if err := s.ready(); err != nil {
		return err
	}
	if _, ok := s.groups[id]; !ok {
		return fmt.Errorf("%w: group %d", ErrNoGroup, id)
	}
	if id == 0 {
		return fmt.Errorf("%w: group 0 is the meta group and cannot be removed", ErrBusy)
	}
	if rs := s.slotMap.RangesOf(id); len(rs) > 0 {
		return fmt.Errorf("%w: group %d owns slots %s: move them first (groups rebalance without it)", ErrBusy, id, slots.FormatRanges(rs))
	}
	for _, m := range s.moves {
		if m.From == id || m.To == id {
			return fmt.Errorf("%w: group %d takes part in %s", ErrBusy, id, m)
		}
	}
	delete(s.groups, id)
	return nil
}

// BeginMove records a move of r to group to, at the leader's time now
// (Unix ms), and returns it. The slots must all be owned by one group
// other than to, and none may be in another move.
func (s *State) BeginMove(now int64, r slots.Range, to slots.GroupID) (Move, error) {
	if err := s.ready(); err != nil {
		return Move{}, err
	}
	if !r.Valid() {
		return Move{}, fmt.Errorf("%w: slot range %d-%d", ErrInvalid, r.First, r.Last)
	}
	if _, ok := s.groups[to]; !ok {
		return Move{}, fmt.Errorf("%w: move slots %s to group %d: group %d does not exist", ErrNoGroup, r, to, to)
	}
	from := s.slotMap.Owner(r.First)
	if !s.slotMap.Owns(from, r) {
		var owners []string
		for _, a := range s.slotMap.Assignments() {
			if a.Range.Overlaps(r) {
				a.Range = slots.Range{First: max(a.Range.First, r.First), Last: min(a.Range.Last, r.Last)}
				owners = append(owners, a.String())
			}
		}
		return Move{}, fmt.Errorf("%w: slots %s have several owners (%s): move each group's slots separately",
			ErrInvalid, r, strings.Join(owners, ", "))
	}
	if from == to {
		return Move{}, fmt.Errorf("%w: group %d already owns slots %s", ErrInvalid, to, r)
	}
	for _, id := range slices.Sorted(maps.Keys(s.moves)) {
		if m := s.moves[id]; m.Range.Overlaps(r) {
			return Move{}, fmt.Errorf("%w: slots %s overlap %s", ErrOverlap, r, m)
		}
	}
	m := &Move{ID: s.nextMove, Range: r, From: from, To: to, Phase: PhaseFreezing, Started: now, Updated: now}
	s.moves[m.ID] = m
	s.nextMove++
	return *m, nil
}

// advance moves move id from phase want to next, recording the
// reporting group's log index; a move already in next is left as is.
func (s *State) advance(now int64, id uint64, want, next Phase, index uint64) error {
	if err := s.ready(); err != nil {
		return err
	}
	m, ok := s.moves[id]
	if !ok {
		return fmt.Errorf("%w: move %d", ErrNoMove, id)
	}
	switch {
	case m.Phase == next:
		return nil
	case m.Phase != want:
		return fmt.Errorf("%w: %s is %s, want %s", ErrPhase, m, m.Phase, want)
	case index == 0:
		return fmt.Errorf("%w: %s: %s at log index 0", ErrInvalid, m, next)
	}
	m.Phase, m.Updated = next, now
	if next == PhaseFrozen {
		m.SrcIndex = index
	} else {
		m.DstIndex = index
	}
	return nil
}

// Froze records that the source committed its freeze of move id's slots
// at its log index index.
func (s *State) Froze(now int64, id, index uint64) error {
	return s.advance(now, id, PhaseFreezing, PhaseFrozen, index)
}

// Transferred records that the target committed move id's slots' state
// at its log index index.
func (s *State) Transferred(now int64, id, index uint64) error {
	return s.advance(now, id, PhaseFrozen, PhaseTransferred, index)
}

// Commit ends move id: the target owns its slots, at the next slot map
// version. Committing a move that ended committed, among the last
// MaxFinished, is a no-op.
func (s *State) Commit(now int64, id uint64) error {
	if err := s.ready(); err != nil {
		return err
	}
	m, ok := s.moves[id]
	if !ok {
		if f := s.finishedMove(id); f != nil && f.Committed {
			return nil
		}
		return fmt.Errorf("%w: move %d", ErrNoMove, id)
	}
	if m.Phase != PhaseTransferred {
		return fmt.Errorf("%w: %s is %s, want %s", ErrPhase, m, m.Phase, PhaseTransferred)
	}
	next, err := s.slotMap.Apply([]slots.Move{{Range: m.Range, From: m.From, To: m.To}})
	if err != nil {
		// Validate rules this out: a move's source owns its range.
		return fmt.Errorf("meta: %s: %w", m, err)
	}
	s.slotMap = next
	m.Updated = now
	s.finish(m, true, "")
	return nil
}

// Abort ends move id before PhaseTransferred; the source serves the
// slots again. Aborting a move that ended aborted, among the last
// MaxFinished, is a no-op.
func (s *State) Abort(now int64, id uint64, reason string) error {
	if err := s.ready(); err != nil {
		return err
	}
	m, ok := s.moves[id]
	if !ok {
		if f := s.finishedMove(id); f != nil && !f.Committed {
			return nil
		}
		return fmt.Errorf("%w: move %d", ErrNoMove, id)
	}
	if m.Phase >= PhaseTransferred {
		return fmt.Errorf("%w: %s: the target holds the slots' state, so the move can only be committed", ErrPhase, m)
	}
	m.Updated = now
	s.finish(m, false, reason)
	return nil
}

func (s *State) finish(m *Move, committed bool, reason string) {
	delete(s.moves, m.ID)
	s.finished = append(s.finished, Finished{Move: *m, Committed: committed, Reason: reason})
	if n := len(s.finished); n > MaxFinished {
		s.finished = slices.Delete(s.finished, 0, n-MaxFinished)
	}
}

func (s *State) finishedMove(id uint64) *Finished {
	for i := range s.finished {
		if s.finished[i].ID == id {
			return &s.finished[i]
		}
	}
	return nil
}

// Rebalance plans the moves that even out the slots over the data groups
// (DataGroups: never the meta group of a cluster whose meta group serves
// no keys; slots.Rebalance); it refuses while moves are in flight.
func (s *State) Rebalance() ([]slots.Move, error) {
	if err := s.ready(); err != nil {
		return nil, err
	}
	if len(s.moves) > 0 {
		return nil, fmt.Errorf("%w: %d moves in flight (first: %s): rebalance after they end", ErrOverlap, len(s.moves), s.Moves()[0])
	}
	return slots.Rebalance(&s.slotMap, s.DataGroups())
}

// Validate checks the invariants (see the package doc).
func (s *State) Validate() error {
	if !s.Bootstrapped() {
		if len(s.groups) > 0 || len(s.moves) > 0 {
			return fmt.Errorf("%w: groups or moves without a cluster id", ErrInvalid)
		}
		return nil
	}
	if _, ok := s.groups[0]; !ok {
		return fmt.Errorf("%w: no group 0", ErrInvalid)
	}
	ids := make([]slots.GroupID, 0, len(s.groups))
	for id, g := range s.groups {
		if g.ID != id {
			return fmt.Errorf("%w: group %d recorded as %d", ErrInvalid, g.ID, id)
		}
		if id >= s.nextGroup {
			return fmt.Errorf("%w: group %d at or past the next id %d", ErrInvalid, id, s.nextGroup)
		}
		if ms, err := checkMembers(g.Members); err != nil {
			return fmt.Errorf("group %d: %w", id, err)
		} else if !slices.Equal(ms, g.Members) {
			return fmt.Errorf("%w: group %d's members are not sorted", ErrInvalid, id)
		}
		ids = append(ids, id)
	}
	if err := s.slotMap.Validate(ids); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	moves := s.Moves()
	for i, m := range moves {
		if s.moves[m.ID].ID != m.ID || m.ID >= s.nextMove || m.ID == 0 {
			return fmt.Errorf("%w: %s: bad id", ErrInvalid, m)
		}
		if m.Phase < PhaseFreezing || m.Phase > PhaseTransferred {
			return fmt.Errorf("%w: %s: bad phase", ErrInvalid, m)
		}
		if !m.Range.Valid() || m.From == m.To || !s.slotMap.Owns(m.From, m.Range) {
			return fmt.Errorf("%w: %s: its source does not own its slots", ErrInvalid, m)
		}
		if _, ok := s.groups[m.To]; !ok {
			return fmt.Errorf("%w: %s: no group %d", ErrInvalid, m, m.To)
		}
		for _, o := range moves[:i] {
			if o.Range.Overlaps(m.Range) {
				return fmt.Errorf("%w: %s overlaps %s", ErrInvalid, m, o)
			}
		}
	}
	if len(s.finished) > MaxFinished {
		return fmt.Errorf("%w: %d finished moves", ErrInvalid, len(s.finished))
	}
	if err := CheckReplicas(s.replicas); err != nil {
		return err
	}
	return nil
}
