package allocator

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestGroupsMoveProcesses runs a 3-node cluster with -groups 2 as real
// processes and moves a slot range between the data groups three times
// while lease takers acquire its keys through every node: no call fails,
// no key is granted beyond its budget in any window across the moves, the
// slot map version grows by one per move, and a quota key's bucket (not
// touched meanwhile) is carried over exactly. Bad moves are refused with
// InvalidArgument or FailedPrecondition. Then a rebalance evens the slots
// out, a third data group is added to the running cluster and given its
// share, and a node restarted afterwards hosts it again.
func TestGroupsMoveProcesses(t *testing.T) {
	c := startProcessCluster(t, "-groups", "2")
	procs := c.Nodes
	alloc, admin := dial(t, procs[1].GRPC)
	status1 := func() *allotv1.ClusterStatusResponse {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		if err != nil {
			return nil
		}
		return st
	}
	waitFor(t, 20*time.Second, "3 groups of 3 voters with leaders", func() bool {
		st := status1()
		if st == nil || len(st.GetGroups()) != 3 || st.GetTopologyVersion() != 1 {
			return false
		}
		for _, g := range st.GetGroups() {
			if len(g.GetMembers()) != 3 || g.GetLeaderId() == "" {
				return false
			}
		}
		return true
	})

	// The moved range: slots 0-127 (group 1's at bootstrap); four user
	// keys in it, and one quota key.
	moved := slots.Range{First: 0, Last: 127}
	var keys []string
	quota := ""
	for i := 0; len(keys) < 4 || quota == ""; i++ {
		k := fmt.Sprintf("k%d", i)
		if moved.Contains(slots.OfKey("test:user="+k)) && len(keys) < 4 {
			keys = append(keys, k)
		}
		if moved.Contains(slots.OfKey("test:quota="+k)) && quota == "" {
			quota = k
		}
	}
	ctx0, cancel0 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel0()
	qr, err := unthrottled(func() (*allotv1.AcquireResponse, error) {
		return alloc.Acquire(ctx0, &allotv1.AcquireRequest{AgentId: "quota", RequestId: 1,
			Keys: []*allotv1.KeyAcquire{key("quota", quota, 60)}})
	})
	if err != nil {
		t.Fatal(err)
	}
	if g := qr.GetGrants(); len(g) != 1 || g[0].GetGranted() != 60 {
		t.Fatalf("quota grant: %v", g)
	}
	inspect := func() *allotv1.InspectKeyResponse {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		r, err := admin.InspectKey(ctx, &allotv1.InspectKeyRequest{Domain: "test",
			Entries: []*allotv1.Entry{{Key: "quota", Value: quota}}})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	var before *allotv1.InspectKeyResponse
	waitFor(t, 5*time.Second, "the quota key in node n1's replica of group 1", func() bool {
		before = inspect()
		return before.GetTracked()
	})
	if before.GetGroup() != 1 || before.GetTokens() > 45 {
		t.Fatalf("quota key before the moves: %v", before)
	}

	// Bad moves are refused and change nothing.
	bctx, bcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer bcancel()
	for _, bad := range []struct {
		req  *allotv1.MoveSlotsRequest
		code codes.Code
	}{
		{&allotv1.MoveSlotsRequest{Slots: "0-127", To: 9}, codes.InvalidArgument},
		{&allotv1.MoveSlotsRequest{Slots: "0-127", To: 1}, codes.InvalidArgument},
		{&allotv1.MoveSlotsRequest{Slots: "500-600", To: 2}, codes.InvalidArgument},
		{&allotv1.MoveSlotsRequest{Slots: "7-3", To: 2}, codes.InvalidArgument},
		{&allotv1.MoveSlotsRequest{Slots: "0-127", To: 0}, codes.InvalidArgument},
	} {
		_, err := admin.MoveSlots(bctx, bad.req)
		if status.Code(err) != bad.code {
			t.Errorf("MoveSlots(%v) = %v, want %v", bad.req, err, bad.code)
		}
	}

	// Lease takers through every node, every call split by the node.
	addrs := []string{procs[0].GRPC, procs[1].GRPC, procs[2].GRPC}
	clients := make([]allotv1.AllocatorClient, len(addrs))
	for i, a := range addrs {
		clients[i], _ = dial(t, a)
	}
	log := &grantLog{}
	var calls, failed, movedKeys atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for a := range 3 {
		wg.Go(func() {
			agent := fmt.Sprintf("agent-%d", a)
			for id := uint64(1); ctx.Err() == nil; id++ {
				req := &allotv1.AcquireRequest{AgentId: agent, RequestId: id}
				for _, k := range keys {
					req.Keys = append(req.Keys, key("user", k, 10))
				}
				cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
				resp, err := clients[int(id)%len(clients)].Acquire(cctx, req)
				ccancel()
				if ctx.Err() != nil {
					return
				}
				calls.Add(1)
				if err != nil {
					failed.Add(1)
					t.Logf("%s call %d failed: %v", agent, id, err)
					continue
				}
				log.add(agent, id, resp)
				for _, g := range resp.GetGrants() {
					if g.GetStatus() == allotv1.KeyStatus_KEY_STATUS_MOVED {
						movedKeys.Add(1)
					}
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	count := func() int { log.mu.Lock(); defer log.mu.Unlock(); return len(log.grants) }
	waitFor(t, 20*time.Second, "grants before the moves", func() bool { return count() > 200 })

	var took []time.Duration
	for i, to := range []uint32{2, 1, 2} {
		mctx, mcancel := context.WithTimeout(context.Background(), 30*time.Second)
		start := time.Now()
		if i == 1 {
			// During the second move, the source group and the meta group
			// change leaders: the move still finishes.
			go func() {
				for _, g := range []uint32{1, 0} {
					if _, err := admin.TransferLeadership(mctx, &allotv1.TransferLeadershipRequest{Group: g}); err != nil {
						t.Logf("transfer the leadership of group %d during a move: %v", g, err)
					}
				}
			}()
		}
		resp, err := admin.MoveSlots(mctx, &allotv1.MoveSlotsRequest{Slots: moved.String(), To: to})
		mcancel()
		if err != nil {
			t.Fatalf("move %d of %s to group %d: %v", i+1, moved, to, err)
		}
		took = append(took, time.Since(start))
		mv := resp.GetMove()
		if !mv.GetCommitted() || mv.GetSlotMapVersion() != uint64(i+2) || mv.GetTo() != to {
			t.Fatalf("move %d: %v, want committed at slot map version %d", i+1, mv, i+2)
		}
		after := count()
		waitFor(t, 20*time.Second, "grants after the move", func() bool { return count() > after+100 })
	}
	// The source dropped the keys: group 1 tracks none (all the keys are in
	// the moved slots), group 2 all 5. Checked while the takers still
	// hold leases on the user keys: once they stop, a user key is dropped
	// as soon as its lease ends (TTL 1 s) and its bucket is full again
	// (0.5 s at 100/s), so a check that a loaded machine delays by a
	// second or two after the takers stop finds only the quota key.
	var st *allotv1.ClusterStatusResponse
	waitFor(t, 10*time.Second, "group 1 without keys, group 2 with the 5", func() bool {
		st = status1()
		n := map[uint32]uint64{}
		for _, g := range st.GetGroups() {
			n[g.GetId()] = g.GetKeys()
		}
		return n[1] == 0 && n[2] == 5
	})
	cancel()
	wg.Wait()
	t.Logf("moves of %s under load took %v; %d calls, %d failed, %d keys answered MOVED", moved, took, calls.Load(), failed.Load(), movedKeys.Load())
	if failed.Load() != 0 {
		t.Errorf("%d of %d calls failed across the moves, want 0", failed.Load(), calls.Load())
	}
	checkBudget(t, log.grants, 50, 100)
	for _, k := range keys {
		if !slices.ContainsFunc(log.grants, func(g grantRec) bool { return g.key == "test:user="+k }) {
			t.Errorf("no grant for key %s", k)
		}
	}

	// The quota key's bucket moved with it: what it held before, refilled
	// at 1 token/s since (±1 for the refill's fraction), not a new bucket.
	var after *allotv1.InspectKeyResponse
	waitFor(t, 5*time.Second, "the quota key in node n1's replica of group 2", func() bool {
		after = inspect()
		return after.GetGroup() == 2 && after.GetTracked()
	})
	want := min(before.GetTokens()+(after.GetNowUnixMs()-before.GetNowUnixMs())/1000, 100)
	if !after.GetTracked() || after.GetGroup() != 2 || after.GetTokens() < want-1 || after.GetTokens() > want+1 {
		t.Errorf("quota key after the moves: group %d, tokens %d (tracked %v); before: %d tokens at %d, want %d±1 at %d",
			after.GetGroup(), after.GetTokens(), after.GetTracked(), before.GetTokens(), before.GetNowUnixMs(), want, after.GetNowUnixMs())
	}
	if st.GetTopologyVersion() != 4 {
		t.Errorf("slot map version after 3 moves = %d, want 4", st.GetTopologyVersion())
	}
	for _, g := range st.GetGroups() {
		if g.GetId() == 2 && g.GetSlots() != "0-127,512-1023" {
			t.Errorf("group 2's slots = %q, want 0-127,512-1023", g.GetSlots())
		}
	}

	// Rebalance evens them out again: 512 slots each.
	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	rb, err := admin.RebalanceSlots(rctx, &allotv1.RebalanceSlotsRequest{})
	if err != nil || len(rb.GetMoves()) == 0 || !rb.GetMoves()[0].GetCommitted() {
		t.Fatalf("RebalanceSlots = %v, %v", rb, err)
	}
	waitFor(t, 5*time.Second, "512 slots in each data group", func() bool {
		st = status1()
		for _, g := range st.GetGroups() {
			if r, err := slots.ParseRanges(g.GetSlots()); g.GetId() != 0 && (err != nil || rangesLen(r) != 512) {
				return false
			}
		}
		return true
	})
	if rb, err := admin.RebalanceSlots(rctx, &allotv1.RebalanceSlotsRequest{}); err != nil || len(rb.GetMoves()) != 0 {
		t.Errorf("RebalanceSlots of even slots = %v, %v; want no move", rb, err)
	}

	// A third data group on the running cluster: every node hosts it, it
	// elects a leader, and a rebalance gives it a third of the slots, the
	// quota key's among them if its slot moves.
	ag, err := admin.AddGroup(rctx, &allotv1.AddGroupRequest{})
	if err != nil || ag.GetId() != 3 || len(ag.GetMembers()) != 3 || ag.GetLeaderId() == "" {
		t.Fatalf("AddGroup = %v, %v; want group 3 with 3 members and a leader", ag, err)
	}
	if _, err := admin.RebalanceSlots(rctx, &allotv1.RebalanceSlotsRequest{}); err != nil {
		t.Fatalf("RebalanceSlots with a new group: %v", err)
	}
	waitFor(t, 10*time.Second, "4 groups, 341 or 342 slots in each data group, every group led", func() bool {
		st = status1()
		if len(st.GetGroups()) != 4 {
			return false
		}
		for _, g := range st.GetGroups() {
			if g.GetLeaderId() == "" || len(g.GetMembers()) != 3 {
				return false
			}
			if r, err := slots.ParseRanges(g.GetSlots()); g.GetId() != 0 && (err != nil || rangesLen(r) < 341 || rangesLen(r) > 342) {
				return false
			}
		}
		return true
	})
	// A node restarted after the group was added opens it again from its
	// data dir (hosted.json names it).
	victim := procs[2]
	victim.Proc.Kill()
	victim.Proc.Start(t)
	testproc.Eventually(t, 30*time.Second, victim.ID+" /readyz", victim.Ready)
	_, vadmin := dial(t, victim.GRPC)
	waitFor(t, 10*time.Second, "the restarted node hosts the 4 groups", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		vs, err := vadmin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		if err != nil || len(vs.GetGroups()) != 4 {
			return false
		}
		for _, g := range vs.GetGroups() {
			if g.GetState() == "none" || g.GetLeaderId() == "" {
				return false
			}
		}
		return true
	})
	qctx, qcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer qcancel()
	qr, err = alloc.Acquire(qctx, &allotv1.AcquireRequest{AgentId: "quota", RequestId: 2,
		Keys: []*allotv1.KeyAcquire{key("quota", quota, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	// Its bucket, refilled at 1 token/s, minus the token just taken; a new
	// bucket would have 99 left.
	refill := (qr.GetNowUnixMs() - before.GetNowUnixMs()) / 1000
	if left := qr.GetGrants()[0].GetRemaining(); left > before.GetTokens()+refill+1 {
		t.Errorf("the quota key after the new group's rebalance: %d left; want ≤ %d (its bucket: %d, refilled %d s)",
			left, before.GetTokens()+refill+1, before.GetTokens(), refill)
	}
}

func rangesLen(rs []slots.Range) int {
	n := 0
	for _, r := range rs {
		n += r.Len()
	}
	return n
}

// TestGroupsMoveTokenCluster: in a cluster authenticated by admin tokens
// alone (no client certificates: without TLS, or with server certificates
// only), the nodes join, and the meta leader's move driver proves itself
// to the other nodes' ApplySlotEntry with the token every node's file
// holds, as a joining node does to AddVoter, and a move whose groups lead
// on other nodes commits. A caller without the token is refused.
func TestGroupsMoveTokenCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("multi-process cluster: skipped with -short")
	}
	// Server certificates for the address the processes listen on.
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "allot test CA")
	spec := tlstest.Role(tlsconfig.RoleAllocator, "")
	spec.IPs = []net.IP{net.ParseIP(testproc.ClusterHost())}
	alloc := tlstest.Files(t, dir, "allocator", ca, ca.Issue(t, spec))
	for _, tt := range []struct {
		name  string
		args  []string
		creds func(t *testing.T) credentials.TransportCredentials
	}{
		{"plaintext", nil, func(*testing.T) credentials.TransportCredentials { return insecure.NewCredentials() }},
		{"TLS without client certificates", []string{"-tls-cert", alloc.CertFile, "-tls-key", alloc.KeyFile,
			"-tls-ca", alloc.CAFile, "-tls-client-auth", "none"},
			func(t *testing.T) credentials.TransportCredentials {
				o := tlstest.Files(t, dir, "ca", ca, nil)
				o.ReloadInterval = -1
				l, err := tlsconfig.Load(o)
				if err != nil {
					t.Fatal(err)
				}
				return l.ClientCredentials("")
			}},
	} {
		t.Run(tt.name, func(t *testing.T) { testGroupsMoveTokenCluster(t, tt.args, tt.creds(t)) })
	}
}

func testGroupsMoveTokenCluster(t *testing.T, extra []string, creds credentials.TransportCredentials) {
	tokArgs, tok, err := testproc.AdminToken(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	args := append([]string{"-lease-ttl", "1s", "-max-lease-ttl", "2s", "-refresh-interval", "200ms",
		"-agent-ttl", "3s", "-expire-interval", "200ms", "-open-reads"}, tokArgs...)
	args = append(args, extra...)
	c := startProcessClusterConfig(t, testproc.ClusterConfig{Size: 3, Args: args, BootstrapArgs: []string{"-groups", "2"}, Creds: creds})
	dialNode := func(perRPC ...grpc.DialOption) allotv1.AdminClient {
		cc, err := grpc.NewClient(c.Nodes[1].GRPC, append([]grpc.DialOption{grpc.WithTransportCredentials(creds)}, perRPC...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return allotv1.NewAdminClient(cc)
	}
	admin := dialNode(grpc.WithPerRPCCredentials(testproc.Bearer(tok)))
	// The data groups' leaders spread over two nodes: whichever node leads
	// the meta group, the driver's entries for one of the groups go to
	// another node.
	waitFor(t, 30*time.Second, "3 groups of 3 voters, the data groups led by two nodes", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		if err != nil || len(st.GetGroups()) != 3 {
			return false
		}
		leaders := map[uint32]string{}
		for _, g := range st.GetGroups() {
			if len(g.GetMembers()) != 3 || g.GetLeaderId() == "" {
				return false
			}
			leaders[g.GetId()] = g.GetLeaderId()
		}
		return leaders[1] != leaders[2]
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	anon := dialNode()
	if _, err := anon.MoveSlots(ctx, &allotv1.MoveSlotsRequest{Slots: "0-127", To: 2}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("MoveSlots without the token: %v, want Unauthenticated", err)
	}
	if _, err := anon.ApplySlotEntry(ctx, &allotv1.ApplySlotEntryRequest{Group: 1}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("ApplySlotEntry without the token: %v, want Unauthenticated", err)
	}
	for _, to := range []uint32{2, 1} {
		resp, err := admin.MoveSlots(ctx, &allotv1.MoveSlotsRequest{Slots: "0-127", To: to})
		if err != nil {
			t.Fatalf("move of 0-127 to group %d: %v", to, err)
		}
		if mv := resp.GetMove(); !mv.GetCommitted() || mv.GetTo() != to {
			t.Fatalf("move to group %d: %v, want committed", to, mv)
		}
	}
}
