package allocator

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestGroupsForwardProcesses runs four allocator processes bootstrapped
// with -groups 6 -group-replicas 3: the first three nodes host every data
// group, each leading 2 of the 6, again after one of them is killed and
// restarted; the node that joined last hosts the meta group only. That
// node answers Acquire (addressed to a group, and split), Check, Release,
// InspectKey, ListLeases, TopKeys and ListAgents for every group, each
// through a forward to the group's leader (its per-group forward counter
// grows, and it has no replica to answer from). A group added to the
// grown cluster is placed on the three nodes that host the fewest groups.
//
// Leases last up to 30 s here (the other process tests: 2 s): the lease
// carried by the move under a meta leader's kill must outlive the MOVED
// answers, the election and the move's commit on a loaded machine, or it
// ends by expiry at the target before the test can see it carried.
func TestGroupsForwardProcesses(t *testing.T) {
	c := startProcessClusterArgs(t, 4, []string{"-lease-ttl", "5s", "-max-lease-ttl", "30s", "-refresh-interval", "200ms",
		"-agent-ttl", "1m", "-expire-interval", "200ms"}, "-groups", "6", "-group-replicas", "3")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	status := func(n *testproc.Node) *allotv1.ClusterStatusResponse {
		sctx, scancel := context.WithTimeout(ctx, time.Second)
		defer scancel()
		st, err := n.Admin(t).ClusterStatus(sctx, &allotv1.ClusterStatusRequest{})
		if err != nil {
			return nil
		}
		return st
	}
	hosted := func(st *allotv1.ClusterStatusResponse) int {
		n := 0
		for _, g := range st.GetGroups() {
			if g.GetId() != 0 && g.GetState() != "none" {
				n++
			}
		}
		return n
	}
	// The outsider is the node that hosts no data group; the others host
	// all 6 (nodes join concurrently: any of n1..n3 may be last).
	var outsider *testproc.Node
	var members []*testproc.Node
	waitFor(t, 30*time.Second, "three nodes hosting the 6 data groups, one hosting none", func() bool {
		outsider, members = nil, nil
		for _, n := range c.Nodes {
			st := status(n)
			if st == nil || len(st.GetGroups()) != 7 {
				return false
			}
			switch hosted(st) {
			case 0:
				outsider = n
			case 6:
				members = append(members, n)
			default:
				return false
			}
		}
		return outsider != nil && len(members) == 3
	})
	t.Logf("%s hosts no data group", outsider.ID)
	memberIDs := map[string]bool{}
	for _, m := range members {
		memberIDs[m.ID] = true
	}
	// spread: each member leads 2 of the 6 data groups (the outsider, a
	// member of none, leads none).
	spread := func(from *testproc.Node) bool {
		st := status(from)
		if st == nil {
			return false
		}
		led := map[string]int{}
		for _, g := range st.GetGroups() {
			if g.GetId() == 0 {
				continue
			}
			if !memberIDs[g.GetLeaderId()] || len(g.GetMembers()) != 3 || slices.Contains(g.GetMembers(), outsider.ID) {
				return false
			}
			led[g.GetLeaderId()]++
		}
		return len(led) == 3 && led[members[0].ID] == 2 && led[members[1].ID] == 2 && led[members[2].ID] == 2
	}
	waitFor(t, 30*time.Second, "each of the 3 members leading 2 of the 6 data groups", func() bool { return spread(members[0]) })

	// A key of every data group.
	even, err := slots.Even(1, []slots.GroupID{1, 2, 3, 4, 5, 6})
	if err != nil {
		t.Fatal(err)
	}
	byGroup := map[slots.GroupID]string{}
	for i := 0; len(byGroup) < 6; i++ {
		k := fmt.Sprintf("f%d", i)
		if g := even.Owner(slots.OfKey("test:user=" + k)); byGroup[g] == "" {
			byGroup[g] = k
		}
	}
	alloc, admin := outsider.Allocator(t), outsider.Admin(t)
	forwards := func() map[slots.GroupID]float64 {
		m, err := testproc.Scrape("http://" + outsider.HTTP + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		out := map[slots.GroupID]float64{}
		for g := range byGroup {
			out[g] = m.Get(fmt.Sprintf(`allot_allocator_group_forwards_total{group="%d"}`, g))
		}
		return out
	}
	before := forwards()

	// Acquire addressed to each group, then split by the node.
	for g, k := range byGroup {
		resp, err := unthrottled(func() (*allotv1.AcquireResponse, error) {
			return alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "fwd", RequestId: uint64(g), Group: uint32(g),
				Keys: []*allotv1.KeyAcquire{key("user", k, 5)}})
		})
		if err != nil {
			t.Fatalf("Acquire to group %d through %s: %v", g, outsider.ID, err)
		}
		if gs := resp.GetGrants(); len(gs) != 1 || gs[0].GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK || gs[0].GetGranted() != 5 {
			t.Fatalf("Acquire to group %d through %s: grants %v, want 5 granted", g, outsider.ID, gs)
		}
	}
	var all []*allotv1.KeyAcquire
	for g := range slots.GroupID(6) {
		all = append(all, key("user", byGroup[g+1], 1))
	}
	resp, err := unthrottled(func() (*allotv1.AcquireResponse, error) {
		return alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "fwd", RequestId: 10, Keys: all})
	})
	if err != nil {
		t.Fatalf("split Acquire through %s: %v", outsider.ID, err)
	}
	for i, g := range resp.GetGrants() {
		if g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK || g.GetGranted() != 1 {
			t.Errorf("split Acquire, key %d: %v, want 1 granted", i, g)
		}
	}

	// Check: a check-and-take on the group's leader.
	k1 := byGroup[1]
	chk, err := admin.Check(ctx, &allotv1.CheckRequest{Domain: "test", Hits: 3,
		Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "user", Value: k1}}}}})
	if err != nil || chk.GetOverallCode() != allotv1.Code_CODE_OK {
		t.Fatalf("Check through %s: %v, %v; want allowed", outsider.ID, chk, err)
	}

	// Reads: the same answers as the group's members give.
	ins, err := admin.InspectKey(ctx, &allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: "user", Value: k1}}})
	if err != nil {
		t.Fatalf("InspectKey through %s: %v", outsider.ID, err)
	}
	if ins.GetGroup() != 1 || len(ins.GetLeases()) != 1 || ins.GetLeases()[0].GetAgentId() != "fwd" {
		t.Errorf("InspectKey through %s: group %d, leases %v; want group 1 and a lease of agent fwd", outsider.ID, ins.GetGroup(), ins.GetLeases())
	}
	ls, err := admin.ListLeases(ctx, &allotv1.ListLeasesRequest{AgentId: "fwd"})
	if err != nil || len(ls.GetLeases()) != 6 {
		t.Errorf("ListLeases through %s: %d leases, %v; want 6 (one per group)", outsider.ID, len(ls.GetLeases()), err)
	}
	var paged int
	for tok := ""; ; {
		p, err := admin.ListLeases(ctx, &allotv1.ListLeasesRequest{AgentId: "fwd", PageSize: 4, PageToken: tok})
		if err != nil {
			t.Fatalf("ListLeases page %q through %s: %v", tok, outsider.ID, err)
		}
		paged += len(p.GetLeases())
		if tok = p.GetNextPageToken(); tok == "" {
			break
		}
	}
	if paged != 6 {
		t.Errorf("ListLeases in pages of 4 through %s: %d leases, want 6", outsider.ID, paged)
	}
	top, err := admin.TopKeys(ctx, &allotv1.TopKeysRequest{Limit: 20})
	if err != nil || len(top.GetKeys()) < 6 {
		t.Errorf("TopKeys through %s: %v, %v; want the 6 keys", outsider.ID, top.GetKeys(), err)
	}
	ags, err := admin.ListAgents(ctx, &allotv1.ListAgentsRequest{})
	if err != nil || !slices.ContainsFunc(ags.GetAgents(), func(a *allotv1.AgentInfo) bool { return a.GetAgentId() == "fwd" }) {
		t.Errorf("ListAgents through %s: %v, %v; want agent fwd", outsider.ID, ags.GetAgents(), err)
	}

	// Release all: every group ends the agent's lease.
	rel, err := alloc.Release(ctx, &allotv1.ReleaseRequest{AgentId: "fwd", RequestId: 11, All: true})
	if err != nil || rel.GetLeasesEnded() != 6 {
		t.Fatalf("Release through %s: %v, %v; want 6 leases ended", outsider.ID, rel, err)
	}
	// A member reads its own replicas, which apply the Release shortly.
	waitFor(t, 5*time.Second, "no lease of agent fwd left, read on a member", func() bool {
		ls, err := members[0].Admin(t).ListLeases(ctx, &allotv1.ListLeasesRequest{AgentId: "fwd"})
		return err == nil && len(ls.GetLeases()) == 0
	})

	// Every group's calls went through forwards: the node has no replica.
	after := forwards()
	for g := range byGroup {
		if after[g] <= before[g] {
			t.Errorf("group %d: %s forwarded %v calls, want more than %v", g, outsider.ID, after[g], before[g])
		}
	}
	if st := status(outsider); hosted(st) != 0 {
		t.Errorf("%s hosts %d data groups, want 0", outsider.ID, hosted(st))
	}

	// kill -9 a member and restart it: each member leads 2 again.
	victim := members[1]
	victim.Proc.Kill()
	waitFor(t, 20*time.Second, "every group led by a live member", func() bool {
		st := status(members[0])
		if st == nil {
			return false
		}
		for _, g := range st.GetGroups() {
			if l := g.GetLeaderId(); l == victim.ID || l == "" {
				return false
			}
		}
		return true
	})
	victim.Proc.Start(t)
	testproc.Eventually(t, 30*time.Second, victim.ID+" /readyz", victim.Ready)
	waitFor(t, 30*time.Second, "each member leading 2 data groups after the restart", func() bool { return spread(members[0]) })

	// A move during elections of the meta group and of the source group:
	// the meta leader is killed once every node answers the moving key
	// MOVED (the source froze it, the target does not serve it yet); the
	// new meta leader finishes the move, with the key's lease carried.
	moveDuringElection(ctx, t, c, byGroup[1])

	// A group added to the grown cluster goes to the outsider and the two
	// members of lowest id (each hosts 6 groups; the outsider none).
	ag, err := admin.AddGroup(ctx, &allotv1.AddGroupRequest{})
	if err != nil {
		t.Fatalf("AddGroup through %s: %v", outsider.ID, err)
	}
	ids := memberIDsOf(members)
	slices.Sort(ids)
	want := []string{ids[0], ids[1], outsider.ID}
	slices.Sort(want)
	if ag.GetId() != 7 || !slices.Equal(ag.GetMembers(), want) || ag.GetLeaderId() == "" {
		t.Errorf("AddGroup = %v, want group 7 on %v with a leader", ag, want)
	}
}

func memberIDsOf(ns []*testproc.Node) []string {
	out := make([]string, len(ns))
	for i, n := range ns {
		out[i] = n.ID
	}
	return out
}

// moveDuringElection moves the slot of key user=k from group 1 to group 2
// and kills -9 the meta group's leader mid-move (after the freeze, before
// the commit); then restarts it. The move commits under the next leader,
// and the key keeps its lease in group 2.
func moveDuringElection(ctx context.Context, t *testing.T, c *testproc.Cluster, k string) {
	t.Helper()
	sl := slots.OfKey("test:user=" + k)
	leader := c.Leader(t, 10*time.Second)
	var probe *testproc.Node
	for _, n := range c.Nodes {
		if n != leader {
			probe = n
			break
		}
	}
	alloc := probe.Allocator(t)
	r, err := unthrottled(func() (*allotv1.AcquireResponse, error) {
		return alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "mover", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", k, 7)}})
	})
	if err != nil || r.GetGrants()[0].GetGranted() != 7 {
		t.Fatalf("Acquire before the move: %v, %v", r, err)
	}
	version := r.GetTopology().GetVersion()
	if version == 0 {
		st, err := probe.Status(t)
		if err != nil {
			t.Fatal(err)
		}
		version = st.GetTopologyVersion()
	}
	moveErr := make(chan error, 1)
	go func() {
		_, err := leader.Admin(t).MoveSlots(ctx, &allotv1.MoveSlotsRequest{Slots: slots.Range{First: sl, Last: sl}.String(), To: 2})
		moveErr <- err
	}()
	// Every node answers the key MOVED from the meta group's Froze on.
	id := uint64(2)
	waitFor(t, 20*time.Second, "the moving key answered MOVED", func() bool {
		select {
		case err := <-moveErr:
			t.Fatalf("the move ended before the probe saw it in flight: %v", err)
		default:
		}
		id++
		r, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "probe", RequestId: id, Keys: []*allotv1.KeyAcquire{key("user", k, 1)}})
		return err == nil && r.GetGrants()[0].GetStatus() == allotv1.KeyStatus_KEY_STATUS_MOVED
	})
	leader.Proc.Kill()
	t.Logf("killed the meta leader %s mid-move (MoveSlots answered %v)", leader.ID, <-moveErr)
	waitFor(t, 30*time.Second, "the move committed by the next meta leader", func() bool {
		st, err := probe.Status(t)
		if err != nil || st.GetTopologyVersion() <= version {
			return false
		}
		for _, g := range st.GetGroups() {
			if g.GetId() == 2 && slotIn(g.GetSlots(), sl) {
				return true
			}
		}
		return false
	})
	// The probe reads its own replica of group 2, which applies the import
	// once the group's leader (maybe the killed node) is replaced.
	var last string
	defer func() {
		if t.Failed() {
			t.Logf("the last InspectKey of the moved key through %s: %s", probe.ID, last)
		}
	}()
	waitFor(t, 10*time.Second, "the moved key in group 2 with agent mover's lease", func() bool {
		ins, err := probe.Admin(t).InspectKey(ctx, &allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: "user", Value: k}}})
		last = fmt.Sprintf("%v, %v", ins, err)
		return err == nil && ins.GetGroup() == 2 && slices.ContainsFunc(ins.GetLeases(), func(l *allotv1.Lease) bool { return l.GetAgentId() == "mover" })
	})

	waitFor(t, 10*time.Second, "the moved key served by group 2", func() bool {
		id++
		r, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "mover", RequestId: id, Keys: []*allotv1.KeyAcquire{key("user", k, 1)}})
		return err == nil && r.GetGrants()[0].GetStatus() == allotv1.KeyStatus_KEY_STATUS_OK
	})
	leader.Proc.Start(t)
	testproc.Eventually(t, 30*time.Second, leader.ID+" /readyz", leader.Ready)
}

// slotIn reports whether slot sl is in the ranges "A-B,C,..." rs.
func slotIn(rs string, sl slots.Slot) bool {
	ranges, err := slots.ParseRanges(rs)
	if err != nil {
		return false
	}
	return slices.ContainsFunc(ranges, func(r slots.Range) bool { return r.Contains(sl) })
}
