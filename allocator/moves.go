package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Slot moves. A move is recorded in the meta state (BeginMove) and driven
// by the meta group's leader (moveLoop), which proposes, in order:
//
//	source group  SlotFreeze           the source grants nothing more in the slots
//	meta          Froze(freeze index)  every node answers the slots KEY_STATUS_MOVED
//	target group  SlotDisown, then SlotImport of the source's export, taken
//	              from this node's replica of the source at or after the freeze
//	meta          Transferred(import index)
//	meta          Commit               the target owns the slots (slot map version+1)
//	source group  SlotDrop             the source frees the keys
//
// Every step is idempotent and the phase lives in the meta state, so a new
// meta leader resumes where the last one stopped. The meta steps are
// entries in the meta group's own log (a deposed leader cannot commit
// them, and Commit of a move that ended is a no-op); each entry in a data
// group carries the meta term of the leader that proposed it (its fence),
// and a data group refuses an entry of an older term than one it applied,
// so a deposed leader's entries still in flight cannot act on slots a
// newer leader has since moved. A move whose freeze or import is
// refused is aborted (before Transferred only): the target stops serving
// the slots if it does (an import that applied), then the source thaws
// them. A target that refuses the disown holds keys of the slots that are
// not known to be the source's export: it freezes them, they are
// dropped, and the step is retried.
//
// A data group's state machine serves every slot no slot entry has taken
// from it, so the driver also tells each group which slots are its own:
// a group that serves a slot that the slot map gives to another group,
// and that no move has transferred to it, freezes it (settleOwned). Slots
// a group holds frozen while no move in flight takes them from it are
// settled by the map: dropped when another group owns them, thawed when
// the group still does. A group therefore serves only its own slots in
// its state machine too (keys of others are answered KEY_STATUS_MOVED),
// and the target of a move holds none of the moving slots' keys but the
// import's.

// moveRetry is how long the move driver waits before retrying a step that
// failed (no leader in a group, an election, a lost proposal).
const moveRetry = 100 * time.Millisecond

// exportHeadroom is what the rest of an ApplySlotEntry call takes besides
// the export, at most.
const exportHeadroom = 64 << 10

// moveLoop is the meta group leader's move driver. It wakes on every
// topology change and every moveRetry, and drives the moves in flight
// while this node leads the meta group (after its Barrier); it stops when
// the Server does.
func (s *Server) moveLoop() {
	t := time.NewTicker(moveRetry)
	defer t.Stop()
	for {
		changed := s.topologyChanged()
		if s.IsLeader() && s.barrierTerm.Load() == s.node.raft.CurrentTerm() && s.metaBootstrapped() {
			if err := s.driveMoves(s.baseCtx); err != nil && s.IsLeader() {
				s.log.Warn("slot move step failed; retrying", "err", err)
			}
		}
		select {
		case <-s.done:
			return
		case <-changed:
		case <-t.C:
		}
	}
}

// driveMoves settles frozen slots no move takes, then advances each move
// in flight, oldest first, until it ends or a step fails.
func (s *Server) driveMoves(ctx context.Context) error {
	// The fence of every slot entry proposed: the meta term in which this
	// node leads and read the meta state.
	fence := s.barrierTerm.Load()
	if err := s.settleFrozen(ctx, fence); err != nil {
		return err
	}
	for {
		var moves []meta.Move
		s.grp.meta.view(func(st *meta.State) { moves = st.Moves() })
		if len(moves) == 0 || !s.IsLeader() {
			return nil
		}
		m := moves[0]
		if err := s.verifyMetaLeader(fence); err != nil {
			return err
		}
		if s.dataGroup(m.From) == nil || s.dataGroup(m.To) == nil {
			// The driver reads the source's replica and the target's.
			return s.handMoveDriver(ctx, m)
		}
		if err := s.moveStep(ctx, fence, m); err != nil {
			return fmt.Errorf("%s: %w", m, err)
		}
		if err := s.settleFrozen(ctx, fence); err != nil {
			return err
		}
	}
}

// moveStep advances move m by one phase, its slot entries fenced by the
// meta term fence.
func (s *Server) moveStep(ctx context.Context, fence uint64, m meta.Move) error {
	rs := []slots.Range{m.Range}
	switch m.Phase {
	case meta.PhaseFreezing:
		res, err := s.proposeSlot(ctx, fence, m.From, state.SlotFreeze, rs, nil)
		if err != nil {
			return err
		}
		if res.GetRefused() != "" {
			// A freeze proposed before a leader change applied already:
			// the slots are frozen as of this entry, which is later.
			frozen, err := s.slotsIn(ctx, m.From, res.GetIndex(), m.Range)
			if err != nil {
				return err
			}
			if frozen != slotsFrozen {
				return s.abortMove(m, "source refused the freeze: "+res.GetRefused())
			}
		}
		return s.metaCmd(&allotv1.MetaCommand{Op: allotv1.MetaOp_META_OP_FROZE, MoveId: m.ID, Index: res.GetIndex()})
	case meta.PhaseFrozen:
		src := s.dataGroup(m.From)
		if src == nil {
			return fmt.Errorf("group %d: this node hosts no replica of it", m.From)
		}
		if err := s.waitApplied(ctx, src.node, m.SrcIndex); err != nil {
			return err
		}
		export, err := src.st.Export(rs)
		if err != nil {
			return fmt.Errorf("export from group %d: %w", m.From, err)
		}
		// The export travels to the target's leader in one gRPC call.
		if limit := s.cfg.MaxRecvMsgSize - exportHeadroom; len(export) > limit {
			return s.abortFrozen(ctx, fence, m, fmt.Sprintf("the slots' export is %d bytes, over the %d a gRPC call between nodes may carry (4 MiB less headroom): move fewer slots at a time",
				len(export), limit))
		}
		// The target serves none of the slots (settleOwned froze and
		// dropped any it served), so the disown is a no-op, unless this
		// node's replica lagged. It is refused when the target holds keys
		// of the slots: an import that applied after all (proposed by a
		// deposed meta leader, or by this one before a lost answer), or
		// keys it served before it was told its slots. Neither is known
		// to be this export: the target freezes them, settleFrozen drops
		// them, and the step is retried.
		res, err := s.proposeSlot(ctx, fence, m.To, state.SlotDisown, rs, nil)
		if err != nil {
			return err
		}
		if res.GetRefused() != "" {
			if err := s.unserve(ctx, fence, m.To, m.Range); err != nil {
				return err
			}
			return fmt.Errorf("target group %d refused to disown the slots (%s): frozen there, to be dropped before the import",
				m.To, res.GetRefused())
		}
		var owned []slots.Range
		s.grp.meta.view(func(st *meta.State) { sm := st.SlotMap(); owned = sm.RangesOf(m.To) })
		owned = append(owned, m.Range)
		slices.SortFunc(owned, func(a, b slots.Range) int { return cmp.Compare(a.First, b.First) })
		// The import is the one the driver commits: an import proposed
		// earlier (before a leader change, or a retry) that applied since
		// makes this one refused, and the move is aborted rather than
		// committed on a copy the driver did not check.
		res, err = s.proposeSlot(ctx, fence, m.To, state.SlotImport, owned, export)
		if err != nil {
			return err
		}
		if res.GetRefused() != "" {
			return s.abortFrozen(ctx, fence, m, "target refused the import: "+res.GetRefused())
		}
		return s.metaCmd(&allotv1.MetaCommand{Op: allotv1.MetaOp_META_OP_TRANSFERRED, MoveId: m.ID, Index: res.GetIndex()})
	case meta.PhaseTransferred:
		return s.metaCmd(&allotv1.MetaCommand{Op: allotv1.MetaOp_META_OP_COMMIT, MoveId: m.ID})
	}
	return fmt.Errorf("unknown phase %v", m.Phase)
}

// moveHosts returns the nodes that host both groups of a move (the meta
// state's members), which may drive it.
func (s *Server) moveHosts(from, to slots.GroupID) []string {
	var a, b meta.Group
	s.grp.meta.view(func(st *meta.State) { a, _ = st.Group(from); b, _ = st.Group(to) })
	var out []string
	for _, m := range a.Members {
		if slices.Contains(b.Members, m) {
			out = append(out, m)
		}
	}
	return out
}

// handMoveDriver hands the meta group's leadership to a live node that
// hosts both groups of move m: the driver exports from its replica of the
// source and checks its replica of the target.
func (s *Server) handMoveDriver(ctx context.Context, m meta.Move) error {
	hosts := s.moveHosts(m.From, m.To)
	live := s.liveVoters()
	for _, h := range hosts {
		if h != s.cfg.NodeID && slices.Contains(live, h) {
			s.log.Info("meta group leadership handed to a node that hosts both groups of a move", "move", m.String(), "to", h)
			_, err := s.transferLeadership(ctx, s.node.raft, h)
			return err
		}
	}
	return fmt.Errorf("%s: no live node hosts both group %d and group %d (members: %v)", m, m.From, m.To, hosts)
}

// verifyMetaLeader confirms with a quorum that this node still leads the
// meta group, in term fence, so that the meta state it read is the latest
// committed one (a deposed leader whose replica lags would otherwise act
// on an old phase of a move). A leader deposed after this check may still
// have entries in flight: the fence in each slot entry makes the data
// group refuse them once a later meta leader's entry applied.
func (s *Server) verifyMetaLeader(fence uint64) error {
	if err := s.node.raft.VerifyLeader().Error(); err != nil {
		return fmt.Errorf("meta group leadership: %w", err)
	}
	if t := s.node.raft.CurrentTerm(); t != fence {
		return fmt.Errorf("meta group leadership: term %d, the moves were read in term %d", t, fence)
	}
	return nil
}

// abortFrozen aborts move m, past its freeze: the target first stops
// serving the slots (a Freeze; settleFrozen then drops them there), in
// case an import of them applied (proposed by an earlier driver, or by
// this one before a lost answer), so that the source never serves them
// again while the target does.
func (s *Server) abortFrozen(ctx context.Context, fence uint64, m meta.Move, reason string) error {
	if err := s.unserve(ctx, fence, m.To, m.Range); err != nil {
		return err
	}
	return s.abortMove(m, reason)
}

// unserve freezes slots r in group id, which does not own them, and
// returns once it serves none of them (they are frozen or gone there).
func (s *Server) unserve(ctx context.Context, fence uint64, id slots.GroupID, r slots.Range) error {
	res, err := s.proposeSlot(ctx, fence, id, state.SlotFreeze, []slots.Range{r}, nil)
	if err != nil {
		return err
	}
	if res.GetRefused() == "" {
		return nil
	}
	// Refused when a slot is gone there: the group must serve none.
	n, err := s.servedIn(ctx, id, res.GetIndex(), r)
	if err != nil {
		return err
	}
	if n > 0 {
		return fmt.Errorf("group %d serves %d of slots %s and refused to freeze them: %s", id, n, r, res.GetRefused())
	}
	return nil
}

func (s *Server) abortMove(m meta.Move, reason string) error {
	s.log.Warn("slot move aborted", "move", m.String(), "reason", reason)
	return s.metaCmd(&allotv1.MetaCommand{Op: allotv1.MetaOp_META_OP_ABORT, MoveId: m.ID, Reason: reason})
}

// metaCmd proposes a meta command in the meta group (this node leads it).
func (s *Server) metaCmd(c *allotv1.MetaCommand) error {
	_, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Meta{Meta: c}})
	return err
}

// settleFrozen drops or thaws the slots a data group holds frozen while
// no move in flight takes them from it: dropped when the slot map gives
// them to another group (the move committed), thawed when the group still
// owns them (the move was aborted). It reads this node's replicas, which
// may lag: both entries are harmless when they apply to slots already
// settled.
func (s *Server) settleFrozen(ctx context.Context, fence uint64) error {
	if err := s.verifyMetaLeader(fence); err != nil {
		return err
	}
	if err := s.settleOwned(ctx, fence); err != nil {
		return err
	}
	var moves []meta.Move
	var sm slots.Map
	s.grp.meta.view(func(st *meta.State) { moves, sm = st.Moves(), st.SlotMap() })
	for _, g := range s.dataGroups() {
		frozen, _ := g.st.SlotModes()
		var drop, thaw []slots.Range
		for _, r := range frozen {
			for sl := int(r.First); sl <= int(r.Last); sl++ {
				if slices.ContainsFunc(moves, func(m meta.Move) bool { return m.From == g.id && m.Range.Contains(slots.Slot(sl)) }) {
					continue
				}
				if sm.Owner(slots.Slot(sl)) == g.id {
					thaw = addSlot(thaw, slots.Slot(sl))
				} else {
					drop = addSlot(drop, slots.Slot(sl))
				}
			}
		}
		for _, p := range []struct {
			op state.SlotOp
			rs []slots.Range
		}{{state.SlotDrop, drop}, {state.SlotThaw, thaw}} {
			if len(p.rs) == 0 {
				continue
			}
			res, err := s.proposeSlot(ctx, fence, g.id, p.op, p.rs, nil)
			if err != nil {
				return err
			}
			if err := s.waitApplied(ctx, g.node, res.GetIndex()); err != nil {
				return err
			}
			s.log.Info("frozen slots settled", "group", g.id, "op", p.op.String(), "slots", slots.FormatRanges(p.rs),
				"keys", res.GetKeys(), "refused", res.GetRefused())
		}
	}
	return nil
}

// settleOwned freezes the slots a data group serves that are not its
// own: those the slot map gives to another group, unless a move in
// flight has transferred them to it (settleFrozen then drops them). A new
// group's state machine serves every slot, and so does one restored from
// a snapshot taken before its group was told its slots: this entry is how
// it learns them, replicated. It reads this node's replicas, which may
// lag: a freeze of slots already frozen is a no-op.
func (s *Server) settleOwned(ctx context.Context, fence uint64) error {
	var moves []meta.Move
	var sm slots.Map
	s.grp.meta.view(func(st *meta.State) { moves, sm = st.Moves(), st.SlotMap() })
	for _, g := range s.dataGroups() {
		frozen, gone := g.st.SlotModes()
		var stray []slots.Range
		for sl := range slots.Count {
			sl := slots.Slot(sl)
			if sm.Owner(sl) == g.id || inAny(frozen, sl) || inAny(gone, sl) ||
				slices.ContainsFunc(moves, func(m meta.Move) bool {
					return m.To == g.id && m.Phase == meta.PhaseTransferred && m.Range.Contains(sl)
				}) {
				continue
			}
			stray = addSlot(stray, sl)
		}
		if len(stray) == 0 {
			continue
		}
		// One group that cannot take the freeze now (no leader yet, no
		// quorum, a replica catching up) holds up neither the others nor
		// the moves: it is settled at a later tick, and until then the
		// nodes' routing keeps its stray slots' keys away from it.
		res, err := s.proposeSlot(ctx, fence, g.id, state.SlotFreeze, stray, nil)
		if err == nil {
			err = s.waitApplied(ctx, g.node, res.GetIndex())
		}
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			s.log.Warn("slots of other groups not frozen yet; retrying", "group", g.id, "slots", slots.FormatRanges(stray), "err", err)
			continue
		}
		s.log.Info("slots of other groups frozen", "group", g.id, "slots", slots.FormatRanges(stray), "refused", res.GetRefused())
	}
	return nil
}

// inAny reports whether slot sl is in one of rs.
func inAny(rs []slots.Range, sl slots.Slot) bool {
	return slices.ContainsFunc(rs, func(r slots.Range) bool { return r.Contains(sl) })
}

// addSlot appends slot sl to rs (in slot order), extending the last range
// when adjacent.
func addSlot(rs []slots.Range, sl slots.Slot) []slots.Range {
	if n := len(rs); n > 0 && rs[n-1].Last+1 == sl {
		rs[n-1].Last = sl
		return rs
	}
	return append(rs, slots.Range{First: sl, Last: sl})
}

// slotCover is how a group's replica holds a range.
type slotCover int

const (
	slotsMixed slotCover = iota
	slotsFrozen
	slotsServed
)

// slotsIn waits until this node's replica of group id has applied index,
// and says how it holds r: all frozen, all served, or otherwise.
func (s *Server) slotsIn(ctx context.Context, id slots.GroupID, index uint64, r slots.Range) (slotCover, error) {
	g := s.dataGroup(id)
	if g == nil {
		return slotsMixed, fmt.Errorf("group %d: this node hosts no replica of it", id)
	}
	if err := s.waitApplied(ctx, g.node, index); err != nil {
		return slotsMixed, err
	}
	frozen, gone := g.st.SlotModes()
	overlaps := func(rs []slots.Range) int {
		n := 0
		for _, x := range rs {
			lo, hi := max(x.First, r.First), min(x.Last, r.Last)
			if lo <= hi {
				n += int(hi-lo) + 1
			}
		}
		return n
	}
	size := int(r.Last-r.First) + 1
	switch nf, ng := overlaps(frozen), overlaps(gone); {
	case nf == size:
		return slotsFrozen, nil
	case nf == 0 && ng == 0:
		return slotsServed, nil
	}
	return slotsMixed, nil
}

// servedIn waits until this node's replica of group id has applied index,
// and returns how many slots of r it serves.
func (s *Server) servedIn(ctx context.Context, id slots.GroupID, index uint64, r slots.Range) (int, error) {
	g := s.dataGroup(id)
	if g == nil {
		return 0, fmt.Errorf("group %d: this node hosts no replica of it", id)
	}
	if err := s.waitApplied(ctx, g.node, index); err != nil {
		return 0, err
	}
	frozen, gone := g.st.SlotModes()
	n := 0
	for sl := int(r.First); sl <= int(r.Last); sl++ {
		if !inAny(frozen, slots.Slot(sl)) && !inAny(gone, slots.Slot(sl)) {
			n++
		}
	}
	return n, nil
}

// waitApplied waits until this node's replica of the Raft group n has
// applied index: its state machine has applied the entry (Raft's
// AppliedIndex moves when an entry is handed to the FSM goroutine, before
// it is applied, as for readiness), or holds a snapshot that covers it
// (restored, or taken after the FSM applied it; a restore does not move
// the FSM's applied index).
func (s *Server) waitApplied(ctx context.Context, n *node, index uint64) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ApplyTimeout)
	defer cancel()
	for !appliedThrough(n, index) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("applied index %d, waiting for %d: %w", n.fsm.applied.Load(), index, ctx.Err())
		case <-s.done:
			return errShutdown
		case <-time.After(2 * time.Millisecond):
		}
	}
	return nil
}

// appliedThrough reports whether n's state machine reflects every entry
// up to index (see waitApplied).
func appliedThrough(n *node, index uint64) bool {
	if n.fsm.applied.Load() >= index {
		return true
	}
	if n.raft.AppliedIndex() < index {
		return false // not even handed to the FSM, nor in a restored snapshot
	}
	snap, err := strconv.ParseUint(n.raft.Stats()["last_snapshot_index"], 10, 64)
	return err == nil && snap >= index
}

// proposeSlot proposes a slot entry in data group id, on its leader,
// fenced by the meta term fence: the group refuses it once it has applied
// an entry of a later meta leader (state.AppendFencedSlotEntry).
func (s *Server) proposeSlot(ctx context.Context, fence uint64, id slots.GroupID, op state.SlotOp, rs []slots.Range, payload []byte) (*allotv1.ApplySlotEntryResponse, error) {
	req := &allotv1.ApplySlotEntryRequest{Group: uint32(id), Entry: state.AppendFencedSlotEntry(nil, op, fence, s.stamp(), rs, payload)}
	ctx, cancel := context.WithTimeout(ctx, 2*s.cfg.ApplyTimeout)
	defer cancel()
	resp, err := s.applySlotEntry(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("group %d: %v: %w", id, op, err)
	}
	return resp, nil
}

// applySlotEntry appends req's entry to its group's log on the group's
// leader (this node, or the leader through Admin.ApplySlotEntry).
func (s *Server) applySlotEntry(ctx context.Context, req *allotv1.ApplySlotEntryRequest) (*allotv1.ApplySlotEntryResponse, error) {
	if req.GetGroup() == 0 {
		return nil, status.Error(codes.InvalidArgument, "allocator: slot entries go to data groups, not group 0")
	}
	if _, err := state.DecodeSlotEntry(req.GetEntry()); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "allocator: %v", err)
	}
	var resp *allotv1.ApplySlotEntryResponse
	err := s.onGroup(ctx, slots.GroupID(req.GetGroup()), false,
		func(_ context.Context, g *dataGroup) error {
			f := g.node.raft.Apply(req.GetEntry(), s.cfg.ApplyTimeout)
			if err := f.Error(); err != nil {
				return err
			}
			res, ok := f.Response().(state.SlotResult)
			if !ok {
				return fmt.Errorf("allocator: slot entry answered %T", f.Response())
			}
			resp = &allotv1.ApplySlotEntryResponse{Index: f.Index(), Keys: uint32(res.Keys)}
			if res.Err != nil {
				resp.Refused = res.Err.Error()
			}
			return nil
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			r, err := allotv1.NewAdminClient(cc).ApplySlotEntry(s.withJoinToken(ctx), req)
			resp = r
			return err
		})
	return resp, err
}

// ApplySlotEntry is the move driver's call to a data group's leader (only
// allocator nodes may make it: classPeer). The entry must carry a fence no
// higher than the meta group's term on this node: a fence above every
// meta leader's term would make the group refuse every later driver's
// entry (InvalidArgument, nothing applied).
func (a *adminService) ApplySlotEntry(ctx context.Context, req *allotv1.ApplySlotEntryRequest) (*allotv1.ApplySlotEntryResponse, error) {
	s := a.s
	if !s.multi() {
		return nil, status.Error(codes.FailedPrecondition, "allocator: this cluster has one group and no slots to move")
	}
	se, err := state.DecodeSlotEntry(req.GetEntry())
	if err == nil {
		err = se.Check()
	}
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "allocator: %v", err)
	}
	if term := s.node.raft.CurrentTerm(); se.Fence == 0 || se.Fence > term {
		return nil, status.Errorf(codes.InvalidArgument,
			"allocator: slot entry fenced by meta term %d: want a fence from 1 to the meta group's term here, %d", se.Fence, term)
	}
	resp, err := s.applySlotEntry(ctx, req)
	if err != nil {
		return nil, s.status(err)
	}
	return resp, nil
}

// MoveSlots records a move on the meta group's leader and answers once it
// has ended.
func (a *adminService) MoveSlots(ctx context.Context, req *allotv1.MoveSlotsRequest) (*allotv1.MoveSlotsResponse, error) {
	s := a.s
	if !s.multi() {
		return nil, status.Error(codes.FailedPrecondition, "allocator: this cluster has one group and no slots to move (start it with -groups N)")
	}
	r, err := slots.ParseRange(req.GetSlots())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "allocator: slots %q: %v", req.GetSlots(), err)
	}
	if req.GetTo() == 0 {
		return nil, status.Error(codes.InvalidArgument, "allocator: group 0 is the meta group: it owns no slots; name a data group")
	}
	var resp *allotv1.MoveSlotsResponse
	err = s.onRaftLeader(ctx, s.node.raft, false,
		func(ctx context.Context) error {
			mv, err := s.runMove(ctx, r, slots.GroupID(req.GetTo()))
			resp = &allotv1.MoveSlotsResponse{Move: mv}
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			r, err := allotv1.NewAdminClient(cc).MoveSlots(ctx, req)
			resp = r
			return err
		})
	if err != nil {
		return nil, moveStatus(s, err)
	}
	return resp, nil
}

// RebalanceSlots runs the moves that even the slots out over the data
// groups, one at a time, on the meta group's leader.
func (a *adminService) RebalanceSlots(ctx context.Context, req *allotv1.RebalanceSlotsRequest) (*allotv1.RebalanceSlotsResponse, error) {
	s := a.s
	if !s.multi() {
		return nil, status.Error(codes.FailedPrecondition, "allocator: this cluster has one group and no slots to move (start it with -groups N)")
	}
	resp := &allotv1.RebalanceSlotsResponse{}
	err := s.onRaftLeader(ctx, s.node.raft, false,
		func(ctx context.Context) error {
			for range slots.Count {
				var plan []slots.Move
				var err error
				s.grp.meta.view(func(st *meta.State) { plan, err = st.Rebalance() })
				if err != nil || len(plan) == 0 {
					return err
				}
				mv, err := s.runMove(ctx, plan[0].Range, plan[0].To)
				if mv != nil {
					resp.Moves = append(resp.Moves, mv)
				}
				if err != nil {
					return err
				}
				if !mv.GetCommitted() {
					return fmt.Errorf("%w: move of slots %s to group %d aborted: %s", meta.ErrBusy, mv.GetSlots(), mv.GetTo(), mv.GetReason())
				}
			}
			return nil
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			r, err := allotv1.NewAdminClient(cc).RebalanceSlots(ctx, req)
			resp = r
			return err
		})
	if err != nil {
		return nil, moveStatus(s, err)
	}
	return resp, nil
}

// runMove records a move of r to group to and waits until the driver has
// ended it.
func (s *Server) runMove(ctx context.Context, r slots.Range, to slots.GroupID) (*allotv1.SlotMove, error) {
	var from slots.GroupID
	exists := false
	s.grp.meta.view(func(st *meta.State) { sm := st.SlotMap(); from = sm.Owner(r.First); _, exists = st.Group(to) })
	if exists && from != to && len(s.moveHosts(from, to)) == 0 {
		return nil, fmt.Errorf("%w: move slots %s from group %d to group %d: no node hosts both groups, and the move is driven from a replica of each",
			meta.ErrBusy, r, from, to)
	}
	res, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Meta{Meta: &allotv1.MetaCommand{
		Op: allotv1.MetaOp_META_OP_BEGIN_MOVE, Slots: r.String(), Group: uint32(to),
	}}})
	if err != nil {
		return nil, err
	}
	mv, ok := res.(meta.Move)
	if !ok {
		return nil, fmt.Errorf("allocator: BeginMove answered %T", res)
	}
	s.log.Info("slot move begun", "move", mv.String())
	for {
		changed := s.topologyChanged()
		var done *meta.Finished
		var version uint64
		s.grp.meta.view(func(st *meta.State) {
			for _, f := range st.Finished() {
				if f.ID == mv.ID {
					done = &f
				}
			}
			sm := st.SlotMap()
			version = sm.Version()
		})
		if done != nil {
			s.log.Info("slot move ended", "move", done.String(), "committed", done.Committed, "reason", done.Reason,
				"took", time.Duration(done.Updated-done.Started)*time.Millisecond)
			return &allotv1.SlotMove{
				Id: done.ID, Slots: done.Range.String(), From: uint32(done.From), To: uint32(done.To),
				Committed: done.Committed, Reason: done.Reason, StartedUnixMs: done.Started, EndedUnixMs: done.Updated,
				SlotMapVersion: version,
			}, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("allocator: %s still in flight (it goes on): %w", mv, ctx.Err())
		case <-s.done:
			return nil, errShutdown
		case <-changed:
		case <-time.After(moveRetry):
		}
	}
}

// moveStatus maps the meta state's refusals to gRPC codes, and the rest
// as every call does.
func moveStatus(s *Server, err error) error {
	switch {
	case errors.Is(err, meta.ErrNoGroup), errors.Is(err, meta.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, meta.ErrOverlap), errors.Is(err, meta.ErrBusy), errors.Is(err, meta.ErrPhase):
		return status.Error(codes.FailedPrecondition, err.Error())
	}
	return s.status(err)
}
