package allocator

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// raftFSM is the raft.FSM that Raft drives for f: f itself, or the FSM
// that wraps it.
func (f *fsm) raftFSM() raft.FSM {
	if f.outer != nil {
		return f.outer
	}
	return f
}

// metaFSM is the meta group's raft.FSM in a cluster with several groups:
// the group-0 state machine (rules, member records) plus the meta state
// (allocator/meta: groups, members, slot map, moves), which MetaCommand
// entries change. Its snapshots hold both: a header, the meta state's
// encoding, then the state machine's snapshot.
type metaFSM struct {
	inner *fsm
	// onChange is called after a meta command or a restore changed the
	// meta state. It must not block.
	onChange func()

	mu sync.RWMutex // guards st
	st meta.State
}

var (
	_ raft.FSM                = (*metaFSM)(nil)
	_ raft.ConfigurationStore = (*metaFSM)(nil)
)

// metaSnapshotMagic starts a meta group's snapshot.
var metaSnapshotMagic = [4]byte{'A', 'M', 'T', '1'}

// view runs f with the meta state, read-locked.
func (m *metaFSM) view(f func(st *meta.State)) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	f(&m.st)
}

// Apply applies a MetaCommand entry to the meta state and hands every
// other entry to the group-0 state machine.
func (m *metaFSM) Apply(l *raft.Log) any {
	if l.Type != raft.LogCommand || state.IsCompactEntry(l.Data) {
		return m.inner.Apply(l)
	}
	var cmd allotv1.Command
	if err := proto.Unmarshal(l.Data, &cmd); err != nil {
		return m.inner.Apply(l) // panics, naming the entry
	}
	mc, ok := cmd.Cmd.(*allotv1.Command_Meta)
	if !ok {
		return m.inner.Apply(l)
	}
	defer m.inner.advance(l.Index, l.AppendedAt)
	m.mu.Lock()
	res := applyMeta(&m.st, mc.Meta, cmd.NowUnixNanos/1e6)
	m.mu.Unlock()
	if m.onChange != nil {
		m.onChange()
	}
	return res
}

// applyMeta applies one meta command at the leader's time nowMs. A
// refused command returns its error (the state is unchanged); a command
// of an unknown op panics, as an unknown command type does.
func applyMeta(st *meta.State, c *allotv1.MetaCommand, nowMs int64) any {
	switch c.GetOp() {
	case allotv1.MetaOp_META_OP_BOOTSTRAP:
		if err := meta.CheckReplicas(int(c.GetReplicas())); err != nil {
			return err
		}
		if err := st.BootstrapData(c.GetClusterId(), int(c.GetDataGroups()), c.GetMembers()); err != nil {
			return err
		}
		return st.SetReplicas(int(c.GetReplicas()))
	case allotv1.MetaOp_META_OP_ADD_GROUP:
		id, err := st.AddGroup(c.GetMembers())
		if err != nil {
			return err
		}
		return id
	case allotv1.MetaOp_META_OP_SET_MEMBERS:
		return st.SetMembers(slots.GroupID(c.GetGroup()), c.GetMembers())
	case allotv1.MetaOp_META_OP_BEGIN_MOVE:
		r, err := slots.ParseRange(c.GetSlots())
		if err != nil {
			return fmt.Errorf("%w: %w", meta.ErrInvalid, err)
		}
		mv, err := st.BeginMove(nowMs, r, slots.GroupID(c.GetGroup()))
		if err != nil {
			return err
		}
		return mv
	case allotv1.MetaOp_META_OP_FROZE:
		return st.Froze(nowMs, c.GetMoveId(), c.GetIndex())
	case allotv1.MetaOp_META_OP_TRANSFERRED:
		return st.Transferred(nowMs, c.GetMoveId(), c.GetIndex())
	case allotv1.MetaOp_META_OP_COMMIT:
		return st.Commit(nowMs, c.GetMoveId())
	case allotv1.MetaOp_META_OP_ABORT:
		return st.Abort(nowMs, c.GetMoveId(), c.GetReason())
	}
	panic(fmt.Sprintf("allocator: meta command of unknown op %v; upgrade this node", c.GetOp()))
}

// StoreConfiguration implements raft.ConfigurationStore.
func (m *metaFSM) StoreConfiguration(index uint64, c raft.Configuration) {
	m.inner.StoreConfiguration(index, c)
}

// Snapshot captures the meta state and the state machine's.
func (m *metaFSM) Snapshot() (raft.FSMSnapshot, error) {
	m.mu.RLock()
	b, err := m.st.Snapshot()
	m.mu.RUnlock()
	if err != nil {
		return nil, fmt.Errorf("allocator: snapshot: %w", err)
	}
	inner, err := m.inner.Snapshot()
	if err != nil {
		return nil, err
	}
	return &metaSnapshot{meta: b, inner: inner}, nil
}

// Restore replaces both states with a snapshot's.
func (m *metaFSM) Restore(rc io.ReadCloser) error {
	var hdr [8]byte
	if _, err := io.ReadFull(rc, hdr[:]); err != nil {
		rc.Close()
		return m.restoreFailed(fmt.Errorf("allocator: restore: meta group snapshot header: %w", err))
	}
	if !bytes.Equal(hdr[:4], metaSnapshotMagic[:]) {
		rc.Close()
		return m.restoreFailed(errors.New("allocator: restore: not a meta group snapshot (a single-group node's data dir?)"))
	}
	b := make([]byte, binary.BigEndian.Uint32(hdr[4:]))
	if _, err := io.ReadFull(rc, b); err != nil {
		rc.Close()
		return m.restoreFailed(fmt.Errorf("allocator: restore: meta state: %w", err))
	}
	var st meta.State
	if err := st.Restore(b); err != nil {
		rc.Close()
		return m.restoreFailed(fmt.Errorf("allocator: restore: %w", err))
	}
	if err := m.inner.Restore(rc); err != nil {
		return err
	}
	m.mu.Lock()
	m.st = st
	m.mu.Unlock()
	if m.onChange != nil {
		m.onChange()
	}
	return nil
}

// restoreFailed records err as the inner fsm records its own failures
// (openNode turns it into a startup error).
func (m *metaFSM) restoreFailed(err error) error {
	m.inner.mu.Lock()
	if m.inner.restoreErr == nil {
		m.inner.restoreErr = err
	}
	m.inner.mu.Unlock()
	return err
}

// metaSnapshot is a metaFSM's capture.
type metaSnapshot struct {
	meta  []byte
	inner raft.FSMSnapshot
}

func (s *metaSnapshot) Persist(sink raft.SnapshotSink) error {
	var hdr [8]byte
	copy(hdr[:4], metaSnapshotMagic[:])
	binary.BigEndian.PutUint32(hdr[4:], uint32(len(s.meta)))
	if _, err := sink.Write(append(hdr[:], s.meta...)); err != nil {
		_ = sink.Cancel()
		return fmt.Errorf("allocator: persist snapshot: %w", err)
	}
	return s.inner.Persist(sink)
}

func (s *metaSnapshot) Release() { s.inner.Release() }
