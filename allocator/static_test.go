package allocator

import (
	"testing"
	"time"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestStaticSettingsCommitted: the leader commits its static shares flags
// when the replicated settings differ, and answers carry the slots; a
// restart with other flags changes them (after a revocation).
func TestStaticSettingsCommitted(t *testing.T) {
	tc := newTestCluster(t, 1, func(_ int, c *Config) { c.StaticSlots, c.StaticTTL = 3, time.Second })
	want := state.StaticSettings{Slots: 3, TTL: time.Second}
	waitStatic := func(want state.StaticSettings) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for tc.node(0).st.StaticSettings() != want {
			if time.Now().After(deadline) {
				t.Fatalf("static settings %+v, want %+v", tc.node(0).st.StaticSettings(), want)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	waitStatic(want)
	alloc, _ := tc.clients(0)
	resp, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, StaticShares: true,
		Keys: []*allotv1.KeyAcquire{key("user", "alice", 1)}})
	if err != nil {
		t.Fatal(err)
	}
	if st := resp.GetStatic(); st.GetSlots() != 3 || st.GetValidMs() != 1000 || !st.GetHotReset() {
		t.Fatalf("static answer %v", st)
	}
	// The admin API shows the slot held (ClusterStatus, ListAgents).
	_, admin := tc.clients(0)
	cs, err := admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st := cs.GetStatic(); st.GetSlots() != 3 || st.GetTtlMs() != 1000 || st.GetSlotsHeld() != 1 || st.GetPaused() {
		t.Fatalf("ClusterStatus static %v", st)
	}
	ags, err := admin.ListAgents(ctxT(t), &allotv1.ListAgentsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(ags.GetAgents()) != 1 || !ags.GetAgents()[0].GetStaticSlot() {
		t.Fatalf("ListAgents %v", ags.GetAgents())
	}
	tc.stop(0, true)
	tc.cfgs[0].StaticSlots = 0
	tc.restart(0)
	tc.waitReady(0)
	waitStatic(state.StaticSettings{})
	_, admin = tc.clients(0)
	// Turning off revokes the slots first: the status says so.
	if cs, err := admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{}); err != nil ||
		!cs.GetStatic().GetPaused() || cs.GetStatic().GetNextSlots() != 0 {
		t.Fatalf("ClusterStatus while static shares turn off: %v, %v", cs.GetStatic(), err)
	}
}
