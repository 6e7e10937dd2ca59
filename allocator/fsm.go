package allocator

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// fsm is the raft.FSM over the deterministic state machine. It is
// unexported so that Apply, Snapshot and Restore stay out of the public API.
type fsm struct {
	st *state.State
	// onRules is called after a put_rules entry is applied and after a
	// restore: the rule set may have changed. It must not block.
	onRules func()
	// onApply, when set, observes every applied command and its result
	// (metrics). It must not block.
	onApply func(cmd *allotv1.Command, result any)
	// onEntry, when set, is told, for every applied command entry (and
	// the command, decoded by then unless the entry did not decode), how long
	// after the leader appended it the FSM started applying it (-1 when
	// the entry carries no append time) and how long the apply took. The
	// clock is read for these metrics only; the state never sees it.
	onEntry func(cmd *allotv1.Command, commit, apply time.Duration)
	// onExpired, when set, is told how many leases an Expire command ended.
	onExpired func(n uint64)
	// onSnapshot, when set, observes every snapshot capture, persist and
	// restore (metrics). It must not block.
	onSnapshot func(ev snapshotEvent)
	// snaps and snapsDir locate the snapshot store, to report the newest
	// snapshot after a persist or a restore (nil: not reported). Set before
	// Raft starts.
	snaps    *raft.FileSnapshotStore
	snapsDir string

	// applied is the index of the last entry the FSM has applied (a
	// command, or a configuration through StoreConfiguration), and
	// appliedAt the leader's append time of that entry in Unix
	// nanoseconds (0: unknown). Raft's own AppliedIndex moves when an
	// entry is handed to the FSM goroutine, before it is applied;
	// readiness needs these instead.
	applied   atomic.Uint64
	appliedAt atomic.Int64
	// beforeApply, when set (tests), runs before each command entry is
	// applied: a test delays the FSM with it.
	beforeApply func(l *raft.Log)

	// outer, when set, is the raft.FSM Raft drives instead of this one: it
	// wraps this fsm (the meta group's, meta_fsm.go).
	outer raft.FSM

	// low, when set, runs the applies while this node does not lead on a
	// thread of lower priority (applythread.go); raft, once Raft has
	// started, says whether it leads.
	low  *lowApplier
	raft atomic.Pointer[raft.Raft]

	mu sync.Mutex // guards restoreErr
	// restoreErr is the first Restore failure. Raft would fall back to an
	// older snapshot; openNode turns it into a startup error instead.
	restoreErr error
}

var (
	_ raft.FSM                = (*fsm)(nil)
	_ raft.ConfigurationStore = (*fsm)(nil)
)

// Apply decodes a committed command and applies it. An entry that does not
// decode, or carries a command this binary does not know without the
// ignore_if_unknown flag, panics: a replica that skips what the others
// apply drifts silently, which is worse than stopping.
//
// While the node does not lead and is caught up, an entry of lowMinEntry
// bytes or more is applied on f.low's thread (when set); the call still
// returns only once it is applied, so entries are applied one at a time
// and in order either way.
func (f *fsm) Apply(l *raft.Log) any {
	if l.Type != raft.LogCommand {
		return nil
	}
	if f.low != nil && len(l.Data) >= lowMinEntry {
		switch r := f.raft.Load(); {
		case r == nil:
		case r.State() == raft.Leader:
			f.low.stop() // its priority cannot be raised again
		case f.low.caughtUp(l.AppendedAt, time.Now()):
			var res any
			if f.low.run(func() { res = f.apply(l) }) {
				return res
			}
		}
	}
	return f.apply(l)
}

func (f *fsm) apply(l *raft.Log) any {
	if f.beforeApply != nil {
		f.beforeApply(l)
	}
	defer f.advance(l.Index, l.AppendedAt)
	if state.IsSlotEntry(l.Data) {
		return f.applySlots(l)
	}
	if state.IsUpstreamEntry(l.Data) {
		return f.applyUpstream(l)
	}
	compact := state.IsCompactEntry(l.Data)
	cmd := compactAcquire
	if !compact {
		cmd = new(allotv1.Command)
	}
	if f.onEntry != nil {
		start := time.Now()
		commit := time.Duration(-1)
		if !l.AppendedAt.IsZero() {
			commit = start.Sub(l.AppendedAt)
		}
		defer func() { f.onEntry(cmd, commit, time.Since(start)) }()
	}
	if compact {
		return f.applyCompact(l)
	}
	if err := proto.Unmarshal(l.Data, cmd); err != nil {
		panic(fmt.Sprintf("allocator: raft log entry %d (term %d) does not decode as an allot.v1.Command: %v", l.Index, l.Term, err))
	}
	if cmd.Cmd == nil {
		if cmd.IgnoreIfUnknown {
			return nil
		}
		panic(fmt.Sprintf("allocator: raft log entry %d (term %d) holds an unknown command type; upgrade this node", l.Index, l.Term))
	}
	_, isExpire := cmd.Cmd.(*allotv1.Command_Expire)
	var leasesBefore uint64
	if isExpire && f.onExpired != nil {
		leasesBefore = f.st.Stats().Leases
	}
	result := f.st.Apply(cmd)
	if isExpire && f.onExpired != nil {
		// Expire only ends leases, so the drop is what it ended.
		if after := f.st.Stats().Leases; after < leasesBefore {
			f.onExpired(leasesBefore - after)
		}
	}
	if err, ok := result.(error); ok && errors.Is(err, state.ErrUnknownCommand) {
		panic(fmt.Sprintf("allocator: raft log entry %d (term %d): %v; upgrade this node", l.Index, l.Term, err))
	}
	if _, ok := cmd.Cmd.(*allotv1.Command_PutRules); ok && f.onRules != nil {
		f.onRules()
	}
	if f.onApply != nil {
		f.onApply(cmd, result)
	}
	return result
}

// StoreConfiguration implements raft.ConfigurationStore: a configuration
// entry changes no state here, but counts as applied.
func (f *fsm) StoreConfiguration(index uint64, _ raft.Configuration) {
	f.advance(index, time.Time{})
}

// advance records that the entry at index (appended by the leader at at;
// zero: unknown) has been applied.
func (f *fsm) advance(index uint64, at time.Time) {
	f.applied.Store(index)
	if at.IsZero() {
		f.appliedAt.Store(0)
	} else {
		f.appliedAt.Store(at.UnixNano())
	}
}

// compactAcquire stands for a compact Acquire entry in the metrics hooks,
// which see it as an Acquire command.
var compactAcquire = &allotv1.Command{Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{}}}

// applyCompact applies a compact Acquire entry. One that does not decode,
// or is of a version this binary does not know, panics, as an undecodable
// Command does.
func (f *fsm) applyCompact(l *raft.Log) any {
	res, err := f.st.ApplyCompact(l.Data)
	if err != nil {
		stop(l, err)
	}
	if f.onApply != nil {
		f.onApply(compactAcquire, res)
	}
	return res
}

// applySlots applies a slot entry (freeze, thaw, import, drop, disown of
// slot ranges: allocator/state's Slots) and returns its state.SlotResult,
// whose Err says whether the operation was refused. An entry that does not
// decode, or of an operation this binary does not know, panics, as an
// undecodable Command does.
func (f *fsm) applySlots(l *raft.Log) any {
	res, err := f.st.ApplySlotEntry(l.Data)
	if err != nil {
		stop(l, err)
	}
	return res
}

// stop panics on entry l, which the state could not apply (err): a
// replica that skips what the others apply drifts.
func stop(l *raft.Log, err error) {
	hint := ""
	if errors.Is(err, state.ErrUnknownCommand) {
		hint = "; upgrade this node"
	}
	panic(fmt.Sprintf("allocator: raft log entry %d (term %d): %v%s", l.Index, l.Term, err, hint))
}

// Snapshot captures the state under its lock; Persist does the I/O. The
// clock is read only to time the capture for the metrics; the state never
// sees it.
func (f *fsm) Snapshot() (raft.FSMSnapshot, error) {
	start := time.Now()
	snap, err := f.st.Snapshot()
	f.observe(snapshotEvent{stage: stageCapture, took: time.Since(start), err: err})
	if err != nil {
		return nil, fmt.Errorf("allocator: snapshot: %w", err)
	}
	return &fsmSnapshot{snap: snap, f: f}, nil
}

// Restore replaces the state with a snapshot's.
func (f *fsm) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	start := time.Now()
	cr := &countingReader{r: rc}
	if err := f.st.Restore(cr); err != nil {
		err = fmt.Errorf("allocator: restore: %w", err)
		f.observe(snapshotEvent{stage: stageRestore, took: time.Since(start), bytes: cr.n, err: err})
		f.mu.Lock()
		if f.restoreErr == nil {
			f.restoreErr = err
		}
		f.mu.Unlock()
		return err
	}
	f.observe(snapshotEvent{stage: stageRestore, took: time.Since(start), bytes: cr.n})
	if f.onRules != nil {
		f.onRules()
	}
	return nil
}

// Snapshot stages, the values of snapshotEvent.stage.
const (
	stageCapture = "capture" // FSM.Snapshot: the state captured under its lock
	stagePersist = "persist" // FSMSnapshot.Persist: the capture streamed to the store
	stageRestore = "restore" // FSM.Restore: at start, or a snapshot installed by the leader
)

// snapshotEvent is one snapshot stage's outcome. After a successful
// persist or restore, newest describes the newest snapshot in the store
// (nil when unknown).
type snapshotEvent struct {
	stage  string
	took   time.Duration
	bytes  int64 // persist: written; restore: read
	err    error
	newest *snapshotInfo
}

// snapshotInfo is a snapshot in the store: its last included Raft index
// and when it was written (its meta.json's modification time).
type snapshotInfo struct {
	index uint64
	at    time.Time
}

// observe reports ev, with the newest snapshot after a successful persist
// or restore.
func (f *fsm) observe(ev snapshotEvent) {
	if f.onSnapshot == nil {
		return
	}
	if ev.err == nil && ev.stage != stageCapture {
		ev.newest = f.newestSnapshot()
	}
	f.onSnapshot(ev)
}

// newestSnapshot reads the store's newest snapshot (nil without a store,
// or on error: it is for the metrics only).
func (f *fsm) newestSnapshot() *snapshotInfo {
	if f.snaps == nil {
		return nil
	}
	metas, err := f.snaps.List()
	if err != nil || len(metas) == 0 {
		return nil
	}
	fi, err := os.Stat(filepath.Join(f.snapsDir, metas[0].ID, "meta.json"))
	if err != nil {
		return nil
	}
	return &snapshotInfo{index: metas[0].Index, at: fi.ModTime()}
}

func (f *fsm) restoreError() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.restoreErr
}

// fsmSnapshot adapts state.Snapshot to raft.FSMSnapshot.
type fsmSnapshot struct {
	snap state.Snapshot
	f    *fsm // observes the persist
}

// Persist streams the captured state to the sink, then closes it, or
// cancels it on error. It is timed, and its bytes counted, for the
// metrics.
func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	start := time.Now()
	cw := &countingWriter{w: sink}
	err := s.persist(sink, cw)
	s.f.observe(snapshotEvent{stage: stagePersist, took: time.Since(start), bytes: cw.n, err: err})
	return err
}

func (s *fsmSnapshot) persist(sink raft.SnapshotSink, w io.Writer) error {
	if err := s.snap.Persist(w); err != nil {
		_ = sink.Cancel()
		return fmt.Errorf("allocator: persist snapshot: %w", err)
	}
	if err := sink.Close(); err != nil {
		return fmt.Errorf("allocator: close snapshot: %w", err)
	}
	return nil
}

func (s *fsmSnapshot) Release() { s.snap.Release() }

// countingWriter counts the bytes written through it.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}
