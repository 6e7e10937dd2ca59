package allocator

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// readiness describes whether the node can serve reads and rule watches,
// and answers /readyz:
//   - a leader is known;
//   - as leader, it has completed a Barrier in its current term, so its
//     FSM has applied every entry of its log;
//   - as follower, its FSM has applied (not just been handed) every entry
//     up to the commit index it first learned from the leader after it
//     started (latched: later it must only stay within ReadyMaxLag), it
//     can append to its log, it heard from the leader at most ReadyMaxLag
//     ago, and it has not stayed behind the leader's commit index for
//     longer than ReadyMaxLag (see followerLag);
//   - if this node carries InitialRules, the rule set is not empty.
type readiness struct {
	Ready        bool   `json:"ready"`
	NodeID       string `json:"node_id"`
	State        string `json:"state"`
	LeaderID     string `json:"leader_id"`
	LeaderAddr   string `json:"leader_addr,omitempty"`
	CommitIndex  uint64 `json:"commit_index"`
	AppliedIndex uint64 `json:"applied_index"`
	// FSMIndex is the last entry the state machine has applied (raft's
	// AppliedIndex moves when an entry is handed to it).
	FSMIndex     uint64 `json:"fsm_index"`
	RulesVersion uint64 `json:"rules_version"`
	// LagMillis is how long this follower's state machine has been behind
	// the commit index the leader sent it (0: caught up; -1: leader or
	// unknown; see followerLag).
	LagMillis int64  `json:"lag_ms"`
	Reason    string `json:"reason,omitempty"`
}

func (s *Server) readiness() readiness {
	r := s.node.raft
	h := s.leaderHint()
	rd := readiness{
		NodeID:       s.cfg.NodeID,
		State:        r.State().String(),
		LeaderID:     h.id,
		LeaderAddr:   h.addr,
		CommitIndex:  r.CommitIndex(),
		AppliedIndex: r.AppliedIndex(),
		FSMIndex:     s.fsm.applied.Load(),
		RulesVersion: s.rulesVersion(),
		LagMillis:    -1,
	}
	select {
	case <-s.done:
		rd.Reason = "shutting down"
		return rd
	default:
	}
	if h.id == "" {
		rd.Reason = "no leader known"
		return rd
	}
	if h.id == s.cfg.NodeID {
		if s.barrierTerm.Load() != r.CurrentTerm() {
			rd.Reason = "new leader: applying its log (barrier)"
			return rd
		}
		s.caughtUp.Store(true)
	} else if reason := s.followerLag(&rd); reason != "" {
		rd.Reason = reason
		return rd
	}
	if reason := s.groupsNotReady(); reason != "" {
		rd.Reason = reason
		return rd
	}
	if len(s.cfg.InitialRules) > 0 && rd.RulesVersion == 0 {
		rd.Reason = "initial rules not applied yet"
		return rd
	}
	rd.Ready = true
	return rd
}

// followerLag returns why a follower is not ready ("" when it is), and
// fills rd.LagMillis.
//
// The lag needs no traffic: the leader sends every follower its commit
// index at least every raft commit timeout (commitTimeout), with or
// without entries, and a heartbeat more often. A follower whose state machine has applied up to
// that commit index is caught up (lag 0) however old its newest entry is.
// One that is behind has been so since the first readiness check that saw
// it behind (s.behindSince, cleared by a check that sees it caught up), and
// at most since the leader appended the newest entry it applied: its lag
// is the shorter of the two, so an entry that arrives after a quiet hour
// is not an hour of lag, and a follower that stays behind under steady
// traffic reports the age of what it applied. A follower that has not heard
// from the leader for longer than the bound, or whose log append has been
// running for that long, is lagging too.
func (s *Server) followerLag(rd *readiness) string {
	if e := s.node.appendErr.Load(); e != nil {
		return fmt.Sprintf("cannot append to the raft log since %s: %v", e.since.UTC().Format(time.RFC3339), e.err)
	}
	now := time.Now()
	rd.LagMillis = 0
	if rd.FSMIndex < s.fsmTarget(rd.FSMIndex, rd.CommitIndex) {
		s.behindSince.CompareAndSwap(0, now.UnixNano())
		from := max(s.behindSince.Load(), s.fsm.appliedAt.Load())
		rd.LagMillis = max(0, now.Sub(time.Unix(0, from)).Milliseconds())
	} else {
		s.behindSince.Store(0)
	}
	if !s.caughtUp.Load() {
		target := s.catchUpTarget.Load()
		if target == 0 {
			// A restarted follower's commit index is 0 until the leader's
			// first AppendEntries; what it learns then is what it must
			// apply before it serves.
			if target = rd.CommitIndex; target == 0 {
				return "waiting for the leader's commit index"
			}
			s.catchUpTarget.CompareAndSwap(0, target)
			target = s.catchUpTarget.Load()
		}
		if rd.FSMIndex < s.fsmTarget(rd.FSMIndex, target) {
			return fmt.Sprintf("catching up with the log: applied %d of %d", rd.FSMIndex, target)
		}
	}
	if maxLag := s.maxLag(); maxLag > 0 {
		// A follower stuck in an append (a stalled disk) still answers
		// heartbeats, which bypass its log, and learns no new commit
		// index: its hung append is the sign.
		if at := s.node.appendStart.Load(); at != 0 && now.Sub(time.Unix(0, at)) > maxLag {
			return fmt.Sprintf("lagging: a raft log append has been running for %v (-ready-max-lag %v)",
				now.Sub(time.Unix(0, at)).Round(time.Millisecond), maxLag)
		}
		if last := s.node.raft.LastContact(); !last.IsZero() && now.Sub(last) > maxLag {
			return fmt.Sprintf("lagging: no contact with the leader for %v (-ready-max-lag %v)",
				now.Sub(last).Round(time.Millisecond), maxLag)
		}
		if lag := time.Duration(rd.LagMillis) * time.Millisecond; lag > maxLag {
			return fmt.Sprintf("lagging: behind the leader's commit index (applied %d of %d) for %v (-ready-max-lag %v)",
				rd.FSMIndex, rd.CommitIndex, lag, maxLag)
		}
	}
	s.caughtUp.Store(true)
	return ""
}

// fsmScan bounds how many entries fsmTarget reads back.
const fsmScan = 64

// fsmTarget returns the newest entry at or below index that reaches the
// state machine, given that it has applied fsmIndex. Raft commits a no-op
// at the start of every term and a barrier entry for each Barrier (a new
// leader's, among others) without handing either to the FSM, so a replica
// whose newest committed entries are of those kinds has applied all there
// is when its FSM index is below them: an idle cluster appends nothing
// after them that would move it. Entries it cannot read (compacted into a
// snapshot) count as reaching the FSM; with more than fsmScan entries to
// read it returns one below the newest it read, which is still ahead.
func (s *Server) fsmTarget(fsmIndex, index uint64) uint64 {
	if index <= fsmIndex || s.node.logs == nil {
		return index
	}
	lo := fsmIndex
	if index-lo > fsmScan {
		lo = index - fsmScan
	}
	for i := index; i > lo; i-- {
		var l raft.Log
		if err := s.node.logs.GetLog(i, &l); err != nil {
			return i
		}
		if l.Type != raft.LogNoop && l.Type != raft.LogBarrier {
			return i
		}
	}
	return lo
}

// maxLag is the lag bound in effect: ReadyMaxLag, at least three
// ExpireIntervals (0: none).
func (s *Server) maxLag() time.Duration { return s.cfg.readyLag() }

// readyLag is the lag past which a follower reports not ready:
// ReadyMaxLag, at least three ExpireIntervals (0: none).
func (c Config) readyLag() time.Duration {
	if c.ReadyMaxLag < 0 {
		return 0
	}
	return max(c.ReadyMaxLag, 3*c.ExpireInterval)
}

// followerApplyLag is the lag of a follower's applies past which they run
// at the process's priority (lowApplier): half of readyLag, or of the
// default ReadyMaxLag when readiness ignores the lag.
func (c Config) followerApplyLag() time.Duration {
	if l := c.readyLag(); l > 0 {
		return l / 2
	}
	return DefaultConfig().ReadyMaxLag / 2
}

// WaitReady blocks until the node is ready (see /readyz), ctx ends, or the
// Server shuts down.
func (s *Server) WaitReady(ctx context.Context) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		rd := s.readiness()
		if rd.Ready {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("allocator: not ready (%s): %w", rd.Reason, ctx.Err())
		case <-s.done:
			return errShutdown
		case <-t.C:
		}
	}
}

// waitServable blocks a read or a rule watch until the replica has caught
// up with what was committed when it started (and, on a leader, until its
// Barrier), for at most ForwardWait or ctx; then Unavailable.
func (s *Server) waitServable(ctx context.Context) error {
	servable := func() bool {
		if !s.caughtUp.Load() {
			return false
		}
		if s.IsLeader() {
			return s.barrierTerm.Load() == s.node.raft.CurrentTerm()
		}
		return true
	}
	if servable() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ForwardWait)
	defer cancel()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		rd := s.readiness() // advances the latch
		if rd.Ready || servable() {
			return nil
		}
		select {
		case <-ctx.Done():
			return status.Errorf(codes.Unavailable, "allocator: node %s not serving yet: %s", s.cfg.NodeID, rd.Reason)
		case <-s.done:
			return s.status(errShutdown)
		case <-t.C:
		}
	}
}

// appendFailure is the first error of a run of failed log appends.
type appendFailure struct {
	err   error
	since time.Time
}

// watchedLog is the node's log store with its append failures recorded: a
// follower that cannot append (a full disk) is not ready, nor is one whose
// append has hung (a stalled disk) for longer than the lag bound.
type watchedLog struct {
	raft.LogStore
	failed  *atomic.Pointer[appendFailure]
	running *atomic.Int64 // Unix nanos when the running append started (0: none)
}

func (w *watchedLog) StoreLog(l *raft.Log) error { return w.StoreLogs([]*raft.Log{l}) }

// IsMonotonic passes on the store's raft.MonotonicLogStore answer (raft's
// LogCache passes it on from here): a store that refuses a gap in its log
// (raft-wal) needs Raft to clear the old log when it installs a snapshot.
func (w *watchedLog) IsMonotonic() bool {
	m, ok := w.LogStore.(raft.MonotonicLogStore)
	return ok && m.IsMonotonic()
}

func (w *watchedLog) StoreLogs(logs []*raft.Log) error {
	if w.running != nil {
		w.running.Store(time.Now().UnixNano())
		defer w.running.Store(0)
	}
	err := w.LogStore.StoreLogs(logs)
	if err != nil {
		if w.failed.Load() == nil {
			w.failed.Store(&appendFailure{err: err, since: time.Now()})
		}
		return err
	}
	if w.failed.Load() != nil {
		w.failed.Store(nil)
	}
	return nil
}
