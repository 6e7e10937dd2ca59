package allocator

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestGroupsProcesses runs a 3-node cluster with -groups 4 as real
// processes: Acquire is served for keys of every data group through every
// node, a call addressed to the wrong group is answered KEY_STATUS_MOVED
// with the topology, the watch stream carries the topology, the leaders
// are spread, kill -9 of a node leaves every group with a leader within
// 2 s, the restarted node leads again, and no key is granted beyond its
// budget in any window (invariants (a) and (d), per group: each key lives
// in one group).
func TestGroupsProcesses(t *testing.T) {
	c := startProcessCluster(t, "-groups", "4")
	procs := c.Nodes
	_, admin := dial(t, procs[0].GRPC)
	status := func(ad allotv1.AdminClient) *allotv1.ClusterStatusResponse {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		st, err := ad.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		if err != nil {
			return nil
		}
		return st
	}
	// led counts the data groups each node leads (nil: a group has no
	// leader, or one not in live).
	led := func(st *allotv1.ClusterStatusResponse, live map[string]bool) map[string]int {
		if st == nil || len(st.GetGroups()) != 5 {
			return nil
		}
		n := map[string]int{}
		for _, g := range st.GetGroups() {
			if !live[g.GetLeaderId()] {
				return nil
			}
			if g.GetId() != 0 {
				n[g.GetLeaderId()]++
			}
		}
		return n
	}
	all := map[string]bool{"n0": true, "n1": true, "n2": true}
	spread := func(st *allotv1.ClusterStatusResponse) bool {
		n := led(st, all)
		if n == nil || len(n) != 3 {
			return false
		}
		for _, c := range n {
			if c < 1 || c > 2 {
				return false
			}
		}
		return true
	}
	waitFor(t, 20*time.Second, "5 groups of 3 voters, leaders spread over the nodes", func() bool {
		st := status(admin)
		if !spread(st) {
			return false
		}
		for _, g := range st.GetGroups() {
			if len(g.GetMembers()) != 3 {
				return false
			}
		}
		return st.GetTopologyVersion() == 1 && st.GetClusterId() != ""
	})

	// Two keys of every data group (groups 1..4 own the slots evenly).
	even, err := slots.Even(1, []slots.GroupID{1, 2, 3, 4})
	if err != nil {
		t.Fatal(err)
	}
	byGroup := map[slots.GroupID][]string{}
	var keys []string
	for i := 0; len(keys) < 8; i++ {
		k := fmt.Sprintf("k%d", i)
		g := even.Owner(slots.OfKey("test:user=" + k))
		if len(byGroup[g]) < 2 {
			byGroup[g] = append(byGroup[g], k)
			keys = append(keys, k)
		}
	}

	// A call addressed to group 1 with a key of group 2: MOVED, with the
	// topology; group 1's key is served.
	alloc, _ := dial(t, procs[1].GRPC)
	resp, err := unthrottled(func() (*allotv1.AcquireResponse, error) {
		return alloc.Acquire(context.Background(), &allotv1.AcquireRequest{
			AgentId: "probe", RequestId: 1, Group: 1,
			Keys: []*allotv1.KeyAcquire{key("user", byGroup[1][0], 5), key("user", byGroup[2][0], 5)},
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	if gs := resp.GetGrants(); len(gs) != 2 || gs[0].GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK ||
		gs[1].GetStatus() != allotv1.KeyStatus_KEY_STATUS_MOVED || gs[1].GetKey() != "test:user="+byGroup[2][0] {
		t.Fatalf("grants of a call to group 1 = %v, want OK then MOVED", gs)
	}
	if topo := resp.GetTopology(); topo.GetVersion() != 1 || len(topo.GetGroups()) != 4 {
		t.Fatalf("topology in a MOVED answer = %v", topo)
	}

	// The watch stream names every data group's leader, slots and rules
	// version. A follower's replicas learn the commit index of a burst's
	// last entries up to a second later (the Raft commit timeout), so a
	// stream opened while the groups settle may start without them: the
	// first message of a stream opened within 10 s must have them all.
	var rs *allotv1.RuleSet
	complete := func(rs *allotv1.RuleSet) bool {
		if rs.GetVersion() != 1 || len(rs.GetTopology().GetGroups()) != 4 {
			return false
		}
		for _, g := range rs.GetTopology().GetGroups() {
			if g.GetLeaderAddr() == "" || g.GetSlots() == "" || g.GetRulesVersion() != 1 {
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
		ws, err := alloc.WatchRules(wctx, &allotv1.WatchRulesRequest{AgentId: "watcher"})
		if err != nil {
			wcancel()
			t.Fatal(err)
		}
		rs, err = ws.Recv()
		wcancel()
		if err != nil {
			t.Fatal(err)
		}
		if complete(rs) || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if rs.GetVersion() != 1 || len(rs.GetTopology().GetGroups()) != 4 {
		t.Fatalf("first watch message: version %d, topology %v", rs.GetVersion(), rs.GetTopology())
	}
	for _, g := range rs.GetTopology().GetGroups() {
		if g.GetLeaderAddr() == "" || g.GetSlots() == "" || g.GetRulesVersion() != 1 {
			t.Errorf("group route %v: want a leader address, slots and rules version 1", g)
		}
	}

	// Lease takers through every node, as agents send them: one call per
	// group (each answer then carries its group's commit time, which the
	// budget check needs), and one taker whose calls the nodes split.
	addrs := []string{procs[0].GRPC, procs[1].GRPC, procs[2].GRPC}
	log := &grantLog{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for a := range 2 {
		for g, ks := range byGroup {
			wg.Go(func() { takerLastIn(ctx, t, fmt.Sprintf("agent-%d-g%d", a, g), uint32(g), addrs, ks, log) })
		}
	}
	split := &grantLog{}
	wg.Go(func() { takerLast(ctx, t, "agent-split", addrs, keys, split) })
	count := func() int { log.mu.Lock(); defer log.mu.Unlock(); return len(log.grants) }
	waitFor(t, 20*time.Second, "grants before the kill", func() bool { return count() > 400 })
	granted := map[string]bool{}
	log.mu.Lock()
	for _, g := range log.grants {
		granted[g.key] = true
	}
	log.mu.Unlock()
	for _, k := range keys {
		if !granted["test:user="+k] {
			t.Errorf("no grant for key %s", k)
		}
	}

	// kill -9 the node that leads the most data groups: every group has a
	// leader among the others within 2 s.
	n := led(status(admin), all)
	victim := procs[0]
	for _, p := range procs {
		if n[p.ID] > n[victim.ID] {
			victim = p
		}
	}
	survivor := procs[(indexOf(procs, victim)+1)%3]
	_, sadmin := dial(t, survivor.GRPC)
	live := map[string]bool{}
	for _, p := range procs {
		live[p.ID] = p != victim
	}
	victim.Proc.Kill()
	killed := time.Now()
	waitFor(t, 10*time.Second, "every group led by a live node", func() bool { return led(status(sadmin), live) != nil })
	took := time.Since(killed)
	t.Logf("kill -9 of %s (leading %d data groups): every group had a live leader after %v", victim.ID, n[victim.ID], took)
	if took > 2*time.Second {
		t.Errorf("every group had a leader %v after the kill, want ≤ 2s", took)
	}
	after := count()
	waitFor(t, 20*time.Second, "grants after the kill", func() bool { return count() > after+300 })

	// The restarted node leads data groups again.
	victim.Proc.Start(t)
	testproc.Eventually(t, 30*time.Second, victim.ID+" /readyz", victim.Ready)
	waitFor(t, 20*time.Second, "leaders spread again after the restart", func() bool { return spread(status(sadmin)) })
	after = count()
	waitFor(t, 20*time.Second, "grants after the restart", func() bool { return count() > after+300 })
	cancel()
	wg.Wait()
	checkBudget(t, log.grants, 50, 100)
	if len(split.grants) == 0 {
		t.Errorf("no grant to the calls split over the groups")
	}

	// Removing a node removes it from every group.
	rctx, rcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer rcancel()
	if _, err := sadmin.RemoveServer(rctx, &allotv1.RemoveServerRequest{Id: victim.ID}); err != nil {
		t.Fatalf("remove %s: %v", victim.ID, err)
	}
	victim.Proc.Kill()
	waitFor(t, 20*time.Second, "every group without the removed node, with a leader", func() bool {
		st := status(sadmin)
		if led(st, live) == nil {
			return false
		}
		for _, g := range st.GetGroups() {
			if len(g.GetMembers()) != 2 {
				return false
			}
		}
		return true
	})
}
