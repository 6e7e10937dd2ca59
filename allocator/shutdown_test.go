package allocator

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestShutdownStopsLoopsBeforeRaft: Shutdown ends the server's loops before
// it shuts Raft down. hashicorp/raft can exit its FSM goroutine with a
// committed entry still queued and then never resolve that entry's
// ApplyFuture, so a loop waiting on one (the leader re-registering its
// addresses after a restart, as in TestMissingRaftDBRefused) would block
// Shutdown forever if Raft went first. Here the FSM holds the registration
// until Shutdown has begun: Raft must still be running when the entry is
// let through, and Shutdown must then return.
func TestShutdownStopsLoopsBeforeRaft(t *testing.T) {
	tc := newTestCluster(t, 1)
	last := tc.node(0).node.raft.LastIndex()
	tc.stop(0, true)

	held := make(chan struct{})
	release := make(chan struct{})
	var once sync.Once
	tc.cfgs[0].beforeApply = func(l *raft.Log) {
		if l.Index <= last || !isMemberEntry(l.Data) {
			return
		}
		once.Do(func() {
			close(held)
			<-release
		})
	}
	// A restart binds a new gRPC port: the new leader registers it.
	tc.restart(0)
	s := tc.node(0)
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("the leader's member registration never reached the FSM")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- s.Shutdown(ctx) }() // waited for below
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("Shutdown did not start")
	}
	// The expected outcome is the timeout: Raft still runs while the
	// registration is in the FSM.
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		if s.node.raft.State() == raft.Shutdown {
			t.Error("Raft shut down while the leader loop waited on its registration's future")
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	select {
	case err := <-stopped:
		if err != nil {
			t.Errorf("shutdown: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Shutdown hung")
	}
}

// isMemberEntry reports whether data is a MemberCommand.
func isMemberEntry(data []byte) bool {
	if state.IsSlotEntry(data) || state.IsUpstreamEntry(data) || state.IsCompactEntry(data) {
		return false
	}
	var cmd allotv1.Command
	return proto.Unmarshal(data, &cmd) == nil && cmd.GetMember() != nil
}
