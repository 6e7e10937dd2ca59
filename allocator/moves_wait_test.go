package allocator

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// waitApplied returns only once this node's state machine has applied the
// entry: Raft's AppliedIndex moves when the entry is handed to the FSM
// goroutine, before it is applied, so a move step that read the state then
// (an Export after the freeze) could read it without the entry. The FSM
// is held by a gate before the entry, so the race is deterministic.
func TestWaitAppliedWaitsForTheFSM(t *testing.T) {
	var hold atomic.Bool
	var heldIdx atomic.Uint64
	held := make(chan struct{})
	var once sync.Once
	g := newGate(t)
	tc := newTestCluster(t, 1, func(i int, c *Config) {
		c.beforeApply = func(l *raft.Log) {
			if hold.Load() && l.Type == raft.LogCommand {
				heldIdx.Store(l.Index)
				once.Do(func() { close(held) })
				g.wait(l)
			}
		}
	})
	t.Cleanup(g.open) // before the cluster stops (cleanups run last first)
	s := tc.node(0)
	hold.Store(true)
	done := make(chan error, 1)
	go func() {
		_, err := s.propose(&allotv1.Command{Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{SkipSweep: true}}})
		done <- err
	}()
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the entry never reached the FSM")
	}
	idx := heldIdx.Load()
	// Raft's main goroutine moves AppliedIndex after handing the batch to
	// the FSM goroutine, which may reach the gate first: wait for it, so
	// that AppliedIndex says the entry is applied while it is not.
	for deadline := time.Now().Add(10 * time.Second); s.node.raft.AppliedIndex() < idx; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("raft AppliedIndex %d never reached the held entry %d", s.node.raft.AppliedIndex(), idx)
		}
	}
	ctx, cancel := context.WithTimeout(ctxT(t), 100*time.Millisecond)
	defer cancel()
	if err := s.waitApplied(ctx, s.node, idx); err == nil {
		t.Fatalf("waitApplied(%d) returned while the FSM was held before the entry (fsm applied %d)", idx, s.node.fsm.applied.Load())
	}
	g.open()
	if err := s.waitApplied(ctxT(t), s.node, idx); err != nil {
		t.Fatalf("waitApplied(%d) after the FSM applied it: %v", idx, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
