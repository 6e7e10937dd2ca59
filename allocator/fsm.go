package allocator

import (
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/internal/state"
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
	// onExpired, when set, is told how many leases an Expire command ended.
	onExpired func(n uint64)

	mu sync.Mutex // guards restoreErr
	// restoreErr is the first Restore failure. Raft would fall back to an
	// older snapshot; openNode turns it into a startup error instead.
	restoreErr error
}

var _ raft.FSM = (*fsm)(nil)

// Apply decodes a committed command and applies it. An entry that does not
// decode, or carries a command this binary does not know without the
// ignore_if_unknown flag, panics: a replica that skips what the others
// apply drifts silently, which is worse than stopping.
func (f *fsm) Apply(l *raft.Log) any {
	if l.Type != raft.LogCommand {
		return nil
	}
	cmd := new(allotv1.Command)
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

// Snapshot captures the state under its lock; Persist does the I/O.
func (f *fsm) Snapshot() (raft.FSMSnapshot, error) {
	snap, err := f.st.Snapshot()
	if err != nil {
		return nil, fmt.Errorf("allocator: snapshot: %w", err)
	}
	return &fsmSnapshot{snap: snap}, nil
}

// Restore replaces the state with a snapshot's.
func (f *fsm) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	if err := f.st.Restore(rc); err != nil {
		err = fmt.Errorf("allocator: restore: %w", err)
		f.mu.Lock()
		if f.restoreErr == nil {
			f.restoreErr = err
		}
		f.mu.Unlock()
		return err
	}
	if f.onRules != nil {
		f.onRules()
	}
	return nil
}

func (f *fsm) restoreError() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.restoreErr
}

// fsmSnapshot adapts state.Snapshot to raft.FSMSnapshot.
type fsmSnapshot struct {
	snap state.Snapshot
}

// Persist streams the captured state to the sink, then closes it, or
// cancels it on error.
func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	if err := s.snap.Persist(sink); err != nil {
		_ = sink.Cancel()
		return fmt.Errorf("allocator: persist snapshot: %w", err)
	}
	if err := sink.Close(); err != nil {
		return fmt.Errorf("allocator: close snapshot: %w", err)
	}
	return nil
}

func (s *fsmSnapshot) Release() { s.snap.Release() }
