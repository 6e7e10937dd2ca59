package allocator

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestSingleNodeBootstrapRulesAcquire(t *testing.T) {
	tc := newTestCluster(t, 1)
	alloc, admin := tc.clients(0)
	ctx := ctxT(t)

	rs, err := admin.GetRules(ctx, &allotv1.GetRulesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if rs.GetVersion() == 0 || len(rs.GetFiles()) != 1 || rs.GetFiles()[0].GetDomain() != "test" {
		t.Fatalf("initial rules not applied: %v", rs)
	}

	resp, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{
		AgentId: "a1", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "alice", 20)},
	})
	if err != nil {
		t.Fatal(err)
	}
	g := resp.GetGrants()
	if len(g) != 1 || g[0].GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK || g[0].GetGranted() != 20 {
		t.Fatalf("Acquire = %v, want one OK grant of 20", resp)
	}
	if g[0].GetKey() != "test:user=alice" {
		t.Errorf("key = %q, want test:user=alice", g[0].GetKey())
	}
	if resp.GetLeaderId() != "n0" {
		t.Errorf("leader_id = %q, want n0", resp.GetLeaderId())
	}

	// The burst is 50: a greedy second agent gets at most what is left.
	resp, err = alloc.Acquire(ctx, &allotv1.AcquireRequest{
		AgentId: "a2", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "alice", 1000)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetGrants()[0].GetGranted(); got > 30+5 { // 30 left, plus refill during the test
		t.Errorf("second grant = %d, want ≤ 35 (burst 50, 20 granted)", got)
	}
}

func TestNoRuleKey(t *testing.T) {
	tc := newTestCluster(t, 1)
	alloc, _ := tc.clients(0)
	resp, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{
		AgentId: "a1", RequestId: 1,
		Keys: []*allotv1.KeyAcquire{key("nothing", "x", 5), {Domain: "other", Entries: []*allotv1.Entry{{Key: "user", Value: "a"}}, Want: 5}},
	})
	if err != nil {
		t.Fatal(err)
	}
	for i, g := range resp.GetGrants() {
		if g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_NO_RULE {
			t.Errorf("grant %d status = %v, want NO_RULE", i, g.GetStatus())
		}
	}
}

func TestBadInputInvalidArgumentChangesNothing(t *testing.T) {
	// No expiry ticks: no command at all may be applied.
	tc := newTestCluster(t, 3, func(_ int, c *Config) { c.ExpireInterval = time.Hour })
	f := tc.follower()
	alloc, admin := tc.clients(f)
	ctx := ctxT(t)
	l := tc.node(tc.leader())
	before := commandsApplied(l)

	many := make([]*allotv1.KeyAcquire, 1001)
	for i := range many {
		many[i] = key("user", "u", 1)
	}
	cases := map[string]*allotv1.AcquireRequest{
		"key over 4 KiB":  {AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", strings.Repeat("x", 5000), 1)}},
		"1001 keys":       {AgentId: "a", RequestId: 1, Keys: many},
		"negative want":   {AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "u", -1)}},
		"absurd want":     {AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "u", 1e13)}},
		"empty agent":     {AgentId: "", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "u", 1)}},
		"long agent":      {AgentId: strings.Repeat("a", 300), RequestId: 1},
		"zero request id": {AgentId: "a", RequestId: 0},
	}
	for name, req := range cases {
		_, err := alloc.Acquire(ctx, req)
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: Acquire error = %v, want InvalidArgument", name, err)
		}
	}
	_, err := admin.PutRules(ctx, &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{
		Name: "bad.yaml", Yaml: []byte("domain: test\ndescriptors:\n  - key: user\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n"),
	}}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "bad.yaml:") {
		t.Errorf("PutRules(bad) error = %v, want InvalidArgument naming bad.yaml:line", err)
	}
	_, err = admin.Check(ctx, &allotv1.CheckRequest{Domain: ""})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("Check(no domain) error = %v, want InvalidArgument", err)
	}
	if after := commandsApplied(l); after != before {
		t.Errorf("%v commands applied on rejected calls", after-before)
	}
	agents, err := admin.ListAgents(ctx, &allotv1.ListAgentsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(agents.GetAgents()) != 0 {
		t.Errorf("agents after rejected calls = %v, want none", agents.GetAgents())
	}
	rs, _ := admin.GetRules(ctx, &allotv1.GetRulesRequest{})
	if rs.GetVersion() != 1 {
		t.Errorf("rules version after rejected put = %d, want 1", rs.GetVersion())
	}
}

func TestAcquireThroughFollower(t *testing.T) {
	tc := newTestCluster(t, 3)
	f := tc.follower()
	alloc, _ := tc.clients(f)
	resp, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{
		AgentId: "a1", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "bob", 10)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if g := resp.GetGrants()[0]; g.GetGranted() != 10 || g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK {
		t.Fatalf("grant through follower = %v", g)
	}
	want := tc.cfgs[tc.leader()].NodeID
	if resp.GetLeaderId() != want {
		t.Errorf("leader_id = %q, want %q", resp.GetLeaderId(), want)
	}
	if n := tc.node(f).metrics; testutilCounter(n.forwarded) == 0 {
		t.Errorf("follower forwarded nothing")
	}
}

// TestAcquirePackedGrants: a caller that asks for packed grants gets them
// packed, through a follower too, and they read as the messages an
// unpacked call gets; a retry of the same call asking for messages gets
// the recorded answer as messages.
func TestAcquirePackedGrants(t *testing.T) {
	tc := newTestCluster(t, 3)
	alloc, _ := tc.clients(tc.follower())
	ctx := ctxT(t)
	req := &allotv1.AcquireRequest{AgentId: "packed", RequestId: 1, PackedGrants: true,
		Keys: []*allotv1.KeyAcquire{key("user", "ann", 10), key("user", "bo", 20), key("nosuch", "x", 1)}}
	resp, err := alloc.Acquire(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetGrants()) != 0 || len(resp.GetPackedGrants()) == 0 || len(resp.GetLimits()) != 1 {
		t.Fatalf("answer = %v; want packed grants with one limit, no messages", resp)
	}
	packed, err := allotv1.GrantsOf(resp)
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetLeaderId() != tc.cfgs[tc.leader()].NodeID {
		t.Errorf("leader_id = %q", resp.GetLeaderId())
	}
	plainReq := proto.Clone(req).(*allotv1.AcquireRequest)
	plainReq.PackedGrants = false
	plain, err := alloc.Acquire(ctx, plainReq)
	if err != nil {
		t.Fatal(err)
	}
	if len(plain.GetPackedGrants()) != 0 || len(plain.GetGrants()) != len(packed) {
		t.Fatalf("retry as messages = %v", plain)
	}
	for i, g := range plain.GetGrants() {
		if !proto.Equal(g, packed[i]) {
			t.Errorf("grant %d: packed %v, as messages %v", i, packed[i], g)
		}
	}
	if g := packed[0]; g.GetGranted() != 10 || g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK || g.GetLimit().GetBurst() == 0 {
		t.Errorf("first grant = %v; want 10 granted, OK, with its limit", g)
	}
	if g := packed[2]; g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_NO_RULE {
		t.Errorf("third grant = %v; want NO_RULE", g)
	}
}

// TestAcquirePackedKeys: a call whose keys come packed, through a follower
// too, is answered as the same call unpacked is (a retry with the keys
// unpacked gets the recorded answer), every answer says the node reads
// packed keys, and packed keys that do not decode or are not UTF-8 are
// InvalidArgument and change nothing.
func TestAcquirePackedKeys(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx := ctxT(t)
	keys := []*allotv1.KeyAcquire{key("user", "ann", 10), key("user", "bo", 20), key("nosuch", "x", 1)}
	packedReq := func(agent string, id uint64, p []byte) *allotv1.AcquireRequest {
		return &allotv1.AcquireRequest{AgentId: agent, RequestId: id, PackedGrants: true, PackedKeys: p}
	}
	for _, node := range []int{tc.leader(), tc.follower()} {
		alloc, _ := tc.clients(node)
		agent := "packed-keys-" + strconv.Itoa(node)
		resp, err := alloc.Acquire(ctx, packedReq(agent, 1, allotv1.AppendPackedKeys(nil, keys)))
		if err != nil {
			t.Fatal(err)
		}
		if !resp.GetReadsPackedKeys() {
			t.Errorf("node %d: reads_packed_keys unset", node)
		}
		got, err := allotv1.GrantsOf(resp)
		if err != nil || len(got) != len(keys) {
			t.Fatalf("node %d: %d grants, %v", node, len(got), err)
		}
		plain, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: agent, RequestId: 1, PackedGrants: true, Keys: keys})
		if err != nil {
			t.Fatal(err)
		}
		want, _ := allotv1.GrantsOf(plain)
		for i := range got {
			if !proto.Equal(got[i], want[i]) {
				t.Errorf("node %d grant %d: packed %v, unpacked %v", node, i, got[i], want[i])
			}
		}
		if g := got[0]; g.GetGranted() != 10 || g.GetKey() == "" {
			t.Errorf("node %d: first grant %v, want 10 granted", node, g)
		}
		for name, p := range map[string][]byte{
			"truncated": allotv1.AppendPackedKeys(nil, keys)[:5],
			"not utf-8": allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{key("user", "\xff", 1)}),
		} {
			_, err := alloc.Acquire(ctx, packedReq(agent, 2, p))
			if status.Code(err) != codes.InvalidArgument {
				t.Errorf("node %d, %s: err = %v, want InvalidArgument", node, name, err)
			}
		}
		// Nothing was applied: id 2 is still free.
		if r, err := alloc.Acquire(ctx, packedReq(agent, 2, allotv1.AppendPackedKeys(nil, keys[:1]))); err != nil {
			t.Fatal(err)
		} else if g, _ := allotv1.GrantsOf(r); len(g) != 1 || g[0].GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK {
			t.Errorf("node %d: call after the refused ones: %v", node, g)
		}
	}
}

func TestIdempotentRetryThroughBatcher(t *testing.T) {
	tc := newTestCluster(t, 3)
	alloc, _ := tc.clients(tc.follower())
	ctx := ctxT(t)
	req := &allotv1.AcquireRequest{AgentId: "retry", RequestId: 7, Keys: []*allotv1.KeyAcquire{key("quota", "carol", 30)}}

	// The same call twice at once lands in one batch or two; either way the
	// second gets the recorded answer.
	type res struct {
		r   *allotv1.AcquireResponse
		err error
	}
	ch := make(chan res, 2)
	for range 2 {
		go func() {
			r, err := alloc.Acquire(ctx, req)
			ch <- res{r, err}
		}()
	}
	a, b := <-ch, <-ch
	if a.err != nil || b.err != nil {
		t.Fatal(a.err, b.err)
	}
	ga, gb := a.r.GetGrants()[0], b.r.GetGrants()[0]
	if ga.GetGranted() != 30 || gb.GetGranted() != 30 || ga.GetRemaining() != gb.GetRemaining() ||
		a.r.GetNowUnixMs() != b.r.GetNowUnixMs() {
		t.Fatalf("answers differ: %v and %v; want the recorded answer twice", a.r, b.r)
	}
	// A later retry gets the same answer; nothing was taken twice.
	c, err := alloc.Acquire(ctx, req)
	if err != nil || c.GetGrants()[0].GetGranted() != 30 || c.GetNowUnixMs() != a.r.GetNowUnixMs() {
		t.Fatalf("late retry = %v, %v; want the recorded answer", c, err)
	}
	_, admin := tc.clients(tc.leader())
	ins, err := admin.InspectKey(ctx, &allotv1.InspectKeyRequest{Key: "test:quota=carol"})
	if err != nil {
		t.Fatal(err)
	}
	// 100 − 30 granted once, plus one token a second of refill.
	if got := ins.GetTokens(); got < 70 || got > 80 {
		t.Errorf("tokens left = %d, want ≈ 70 (100 − 30 granted once)", got)
	}
	// An older id is rejected.
	_, err = alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "retry", RequestId: 6, Keys: req.Keys})
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("older request id error = %v, want FailedPrecondition", err)
	}
}

// TestAcquireRetryAfterFailover: the answer a follower's state records
// for a call is the one its leader gave. The leader is killed after
// answering a call with packed grants; the agent's retry of the same
// request to the new leader, which applied the call as a follower, gets
// the same grants, time and counts, and nothing is taken twice. A
// replica that skipped recording answers for calls it did not propose
// would answer this retry from nothing.
func TestAcquireRetryAfterFailover(t *testing.T) {
	tc := newTestCluster(t, 3)
	old := tc.leader()
	alloc, _ := tc.clients(old)
	ctx := ctxT(t)
	keys := []*allotv1.KeyAcquire{key("quota", "dora", 30), key("user", "eve", 20), key("nosuch", "x", 1)}
	req := &allotv1.AcquireRequest{AgentId: "failover", RequestId: 3, PackedGrants: true,
		PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
	first, want := acquireGrants(ctx, t, alloc, req)
	if len(want) != 3 || want[0].GetGranted() != 30 || want[1].GetGranted() != 20 {
		t.Fatalf("first answer = %v; want 30 and 20 granted", want)
	}
	// Both followers have applied the call before the leader goes.
	waitApplied(t, tc, tc.node(old).node.raft.LastIndex(), -1)
	tc.stop(old, false)
	now := tc.leader()
	if now == old {
		t.Fatal("the killed node still leads")
	}
	alloc, admin := tc.clients(now)
	again, got := acquireGrants(ctx, t, alloc, req)
	if len(got) != len(want) {
		t.Fatalf("retry: %d grants, want %d", len(got), len(want))
	}
	for i := range want {
		if !proto.Equal(got[i], want[i]) {
			t.Errorf("retry: grant %d = %v, want the recorded %v", i, got[i], want[i])
		}
	}
	if again.GetNowUnixMs() != first.GetNowUnixMs() || again.GetLiveAgents() != first.GetLiveAgents() ||
		again.GetRulesVersion() != first.GetRulesVersion() {
		t.Errorf("retry: time %d, agents %d, rules %d; want the recorded %d, %d, %d", again.GetNowUnixMs(),
			again.GetLiveAgents(), again.GetRulesVersion(), first.GetNowUnixMs(), first.GetLiveAgents(), first.GetRulesVersion())
	}
	ins, err := admin.InspectKey(ctx, &allotv1.InspectKeyRequest{Key: "test:quota=dora"})
	if err != nil {
		t.Fatal(err)
	}
	// 100 − 30 granted once, plus one token a second of refill.
	if got := ins.GetTokens(); got < 70 || got > 80 {
		t.Errorf("tokens left = %d, want ≈ 70 (100 − 30 granted once)", got)
	}
}

// TestAcquireWaiterAcrossLeaderChange: a call whose entry the leader
// proposed, and the followers applied, while the leader's FSM was held
// does not hang when leadership moves before the leader applies it: the
// caller gets its answer (or an error to retry on) once the old leader's
// FSM goes on, and the new leader answers the retry with the same grants.
func TestAcquireWaiterAcrossLeaderChange(t *testing.T) {
	h := newApplyHold(t, func(l *raft.Log) bool { return state.IsCompactEntry(l.Data) })
	tc := newTestCluster(t, 3, func(i int, c *Config) { c.beforeApply = h.hook(i) })
	old := tc.leader()
	h.node.Store(int64(old))
	alloc, _ := tc.clients(old)
	ctx := ctxT(t)
	req := &allotv1.AcquireRequest{AgentId: "waiter", RequestId: 5, PackedGrants: true,
		PackedKeys: allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{key("quota", "finn", 30), key("user", "gus", 20)})}
	type res struct {
		r   *allotv1.AcquireResponse
		err error
	}
	done := make(chan res, 1)
	go func() {
		r, err := alloc.Acquire(ctx, req)
		done <- res{r, err}
	}()
	select {
	case <-h.held:
	case <-time.After(5 * time.Second):
		t.Fatal("the leader's FSM never reached the call's entry")
	}
	waitApplied(t, tc, tc.node(old).node.raft.LastIndex(), old)
	if err := tc.node(old).node.raft.LeadershipTransfer().Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "a new leader", func() bool { return !tc.node(old).IsLeader() && tc.leader() != old })
	h.open()
	var first res
	select {
	case first = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the call proposed by the old leader still waits after its FSM went on")
	}
	alloc, _ = tc.clients(tc.leader())
	again, got := acquireGrants(ctx, t, alloc, req)
	if len(got) != 2 || got[0].GetGranted() != 30 || got[1].GetGranted() != 20 {
		t.Fatalf("retry on the new leader = %v; want the recorded 30 and 20 granted", got)
	}
	if first.err != nil {
		t.Logf("the first call ended with %v (the retry got the answer)", first.err)
		return
	}
	want, err := allotv1.GrantsOf(first.r)
	if err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if !proto.Equal(got[i], want[i]) {
			t.Errorf("grant %d: retry %v, first answer %v", i, got[i], want[i])
		}
	}
	if again.GetNowUnixMs() != first.r.GetNowUnixMs() {
		t.Errorf("retry time %d, first answer's %d", again.GetNowUnixMs(), first.r.GetNowUnixMs())
	}
}

// acquireGrants makes the call and returns its answer and grants.
func acquireGrants(ctx context.Context, t *testing.T, alloc allotv1.AllocatorClient, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, []*allotv1.KeyGrant) {
	t.Helper()
	r, err := alloc.Acquire(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	g, err := allotv1.GrantsOf(r)
	if err != nil {
		t.Fatal(err)
	}
	return r, g
}

// waitApplied waits until every node but skip has applied index idx.
func waitApplied(t *testing.T, tc *testCluster, idx uint64, skip int) {
	t.Helper()
	for i := range tc.nodes {
		if i != skip {
			waitFor(t, 5*time.Second, fmt.Sprintf("node %d to apply %d", i, idx), func() bool {
				return tc.node(i).fsm.applied.Load() >= idx
			})
		}
	}
}

func TestPutRulesWatchRulesHotReload(t *testing.T) {
	tc := newTestCluster(t, 3)
	f := tc.follower()
	alloc, admin := tc.clients(f)
	ctx := ctxT(t)

	stream, err := alloc.WatchRules(ctx, &allotv1.WatchRulesRequest{AgentId: "w", KnownVersion: 0})
	if err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if first.GetVersion() != 1 {
		t.Fatalf("first rule set version = %d, want 1", first.GetVersion())
	}

	newRules := strings.Replace(testRules, "requests_per_unit: 100", "requests_per_unit: 200", 1)
	if v := putRulesOver(t, admin, 1, newRules); v != 2 {
		t.Errorf("PutRules version = %d, want 2", v)
	}
	next, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if next.GetVersion() != 2 || !strings.Contains(string(next.GetFiles()[0].GetYaml()), "200") {
		t.Fatalf("watched set = v%d %q, want v2 with the new rate", next.GetVersion(), next.GetFiles()[0].GetYaml())
	}
	// A conditional put against a stale version fails and changes nothing.
	_, err = admin.PutRules(ctx, &allotv1.PutRulesRequest{ExpectedVersion: 1, Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(testRules)}}})
	if status.Code(err) != codes.FailedPrecondition {
		t.Errorf("stale conditional put error = %v, want FailedPrecondition", err)
	}
	// A dry run reports and changes nothing.
	dry, err := admin.PutRules(ctx, &allotv1.PutRulesRequest{DryRun: true, Files: []*allotv1.RuleFile{{Name: "x.yaml", Yaml: []byte(strings.Replace(testRules, "domain: test", "domain: x", 1))}}})
	if err != nil || dry.GetVersion() != 2 || strings.Join(dry.GetDomains(), ",") != "test,x" {
		t.Errorf("dry run = %v, %v; want version 2, domains test,x", dry, err)
	}
	// A watcher that already knows v2 gets nothing until v3.
	s2, err := alloc.WatchRules(ctx, &allotv1.WatchRulesRequest{KnownVersion: 2})
	if err != nil {
		t.Fatal(err)
	}
	putRulesOver(t, admin, 2, testRules)
	got, err := s2.Recv()
	if err != nil || got.GetVersion() != 3 {
		t.Fatalf("watch from v2 got %v, %v; want v3", got, err)
	}
}

// putRulesOver puts test.yaml conditionally on version expected and
// returns the version it made. A put answered Unavailable (the leader lost
// its leadership while committing it) may or may not have committed: it
// is put again, and a conditional put that then fails its condition had
// committed.
func putRulesOver(t *testing.T, admin allotv1.AdminClient, expected uint64, yaml string) uint64 {
	t.Helper()
	req := &allotv1.PutRulesRequest{ExpectedVersion: expected, Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(yaml)}}}
	var version uint64
	unavailable := false
	waitFor(t, 20*time.Second, "a rules put", func() bool {
		put, err := admin.PutRules(ctxT(t), req)
		switch {
		case err == nil:
			version = put.GetVersion()
			return true
		case status.Code(err) == codes.Unavailable:
			t.Logf("PutRules: %v; again", err)
			unavailable = true
			return false
		case unavailable && status.Code(err) == codes.FailedPrecondition:
			version = expected + 1
			return true
		}
		t.Fatalf("PutRules over version %d: %v", expected, err)
		return false
	})
	return version
}

func TestWatchRulesEndsOnShutdown(t *testing.T) {
	tc := newTestCluster(t, 1)
	alloc, _ := tc.clients(0)
	stream, err := alloc.WatchRules(ctxT(t), &allotv1.WatchRulesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := stream.Recv()
		done <- err
	}()
	tc.stop(0, true)
	select {
	case err := <-done:
		if err == nil {
			t.Error("stream delivered another rule set instead of ending")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("watch stream did not end on shutdown")
	}
}

func TestMembershipAddRemoveTransfer(t *testing.T) {
	tc := newTestCluster(t, 3)
	_, admin := tc.clients(tc.follower())
	ctx := ctxT(t)

	st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.GetMembers()) != 3 {
		t.Fatalf("members = %v, want 3", st.GetMembers())
	}
	for _, m := range st.GetMembers() {
		if m.GetGrpcAddr() == "" {
			t.Errorf("member %s has no grpc address", m.GetId())
		}
	}

	old := tc.leader()
	target := tc.cfgs[(old+1)%3].NodeID
	tr, err := admin.TransferLeadership(ctx, &allotv1.TransferLeadershipRequest{Id: target})
	if err != nil {
		t.Fatal(err)
	}
	if tr.GetLeaderId() != target {
		t.Errorf("new leader = %q, want %q", tr.GetLeaderId(), target)
	}
	waitFor(t, 5*time.Second, "leader "+target, func() bool { return tc.node((old + 1) % 3).IsLeader() })

	// Remove the old leader (a follower now), through any node.
	victim := tc.cfgs[old].NodeID
	if _, err := admin.RemoveServer(ctx, &allotv1.RemoveServerRequest{Id: victim}); err != nil {
		t.Fatal(err)
	}
	tc.waitVoters(2)
	waitFor(t, 5*time.Second, "member record removed", func() bool {
		for _, m := range tc.node((old + 1) % 3).st.Members() {
			if m.GetId() == victim {
				return false
			}
		}
		return true
	})
	tc.stop(old, true)

	// Add it back (a fresh data dir): AddVoter is what Join calls.
	tc.cfgs[old].DataDir += "-again"
	tc.cfgs[old].Bootstrap = false
	tc.cfgs[old].InitialRules = nil
	tc.cfgs[old].Join = tc.node((old + 1) % 3).GRPCAddr()
	tc.restart(old)
	tc.waitVoters(3)
	tc.waitReady(old)
	// Acquire works through the re-added node.
	alloc, _ := tc.clients(old)
	if _, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "m", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "m", 1)}}); err != nil {
		t.Fatal(err)
	}
}

func TestSnapshotRestoreRestart(t *testing.T) {
	tc := newTestCluster(t, 3)
	alloc, admin := tc.clients(tc.leader())
	ctx := ctxT(t)
	for i := range 20 {
		if _, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "snap", RequestId: uint64(i + 1),
			Keys: []*allotv1.KeyAcquire{key("user", "dave", 1), key("slow", "s", 1)}}); err != nil {
			t.Fatal(err)
		}
	}
	newRules := strings.Replace(testRules, "burst: 50", "burst: 60", 1)
	if _, err := admin.PutRules(ctx, &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(newRules)}}}); err != nil {
		t.Fatal(err)
	}
	f := tc.follower()
	fs := tc.node(f)
	waitFor(t, 5*time.Second, "follower caught up", func() bool { return fs.rulesVersion() == 2 })
	for i := range tc.nodes {
		if err := tc.node(i).node.raft.Snapshot().Error(); err != nil {
			t.Fatalf("snapshot n%d: %v", i, err)
		}
	}
	tc.stop(f, false)
	tc.restart(f)
	tc.waitReady(f)
	rs := tc.node(f)
	if v := rs.rulesVersion(); v != 2 {
		t.Errorf("restarted follower rules version = %d, want 2", v)
	}
	_, fadmin := tc.clients(f)
	agents, err := fadmin.ListAgents(ctx, &allotv1.ListAgentsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(agents.GetAgents()) != 1 || agents.GetAgents()[0].GetLastRequestId() != 20 {
		t.Errorf("restored agents = %v, want snap with last request 20", agents.GetAgents())
	}
	// A retry of the last call is still answered from the restored record.
	falloc, _ := tc.clients(f)
	r, err := falloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "snap", RequestId: 20,
		Keys: []*allotv1.KeyAcquire{key("user", "dave", 1), key("slow", "s", 1)}})
	if err != nil || len(r.GetGrants()) != 2 {
		t.Fatalf("retry after restore = %v, %v", r, err)
	}

	// Restart the whole cluster from disk.
	for i := range tc.nodes {
		tc.stop(i, false)
	}
	for i := range tc.nodes {
		tc.cfgs[i].Join = ""
		tc.restart(i)
	}
	for i := range tc.nodes {
		tc.waitReady(i)
	}
	if v := tc.node(tc.leader()).rulesVersion(); v != 2 {
		t.Errorf("rules version after full restart = %d, want 2", v)
	}
}

func TestShutdownTwice(t *testing.T) {
	tc := newTestCluster(t, 1)
	s := tc.node(0)
	ctx := ctxT(t)
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Shutdown(ctx); err != nil {
		t.Fatalf("second Shutdown = %v", err)
	}
	if err := s.WaitReady(ctx); err == nil {
		t.Error("WaitReady after Shutdown succeeded")
	}
}

func TestCheckThroughRaft(t *testing.T) {
	tc := newTestCluster(t, 3)
	_, admin := tc.clients(tc.follower())
	ctx := ctxT(t)
	req := &allotv1.CheckRequest{Domain: "test", Hits: 3, Descriptors: []*allotv1.Descriptor{
		{Entries: []*allotv1.Entry{{Key: "slow", Value: "c"}}},
	}}
	var over bool
	for i := range 5 {
		resp, err := admin.Check(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetOverallCode() == allotv1.Code_CODE_OVER_LIMIT {
			over = true
			break
		}
		if i > 1 {
			t.Fatalf("check %d allowed: burst 5 admits at most one check of 3 hits (plus refill)", i)
		}
	}
	if !over {
		t.Error("checks never went over the limit")
	}
}

// commandsApplied counts the commands s has applied (Raft's own no-op and
// configuration entries are not commands).
func commandsApplied(s *Server) float64 {
	var n float64
	for _, typ := range []string{"acquire", "release", "put_rules", "expire", "member", "check"} {
		n += testutilCounter(s.metrics.commands.WithLabelValues(typ))
	}
	return n
}

// testutilCounter reads a counter's value.
func testutilCounter(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return 0
	}
	return m.GetCounter().GetValue()
}

// TestGetRulesLinearizable: a follower cut off from the leader's log
// answers a plain GetRules from its stale replica, and a linearizable one
// with the rules a PutRules through another node committed (it forwards
// the read to the leader): read-your-writes for allotctl.
func TestGetRulesLinearizable(t *testing.T) {
	tc := newTestCluster(t, 3)
	ld := tc.leader()
	var a, b int
	for i := range 3 {
		if i != ld {
			if a == b {
				b = i
			}
			a = i
		}
	}
	// b stops receiving the leader's appends; the leader and a still form
	// a quorum. b's gRPC server stays up.
	tc.mu.Lock()
	tc.trans[ld].Disconnect(raft.ServerAddress(tc.cfgs[b].NodeID))
	tc.mu.Unlock()
	_, adminA := tc.clients(a)
	_, adminB := tc.clients(b)
	ctx := ctxT(t)
	put, err := adminA.PutRules(ctx, &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "test.yaml",
		Yaml: []byte(strings.Replace(testRules, "requests_per_unit: 100", "requests_per_unit: 300", 1))}}})
	if err != nil {
		t.Fatal(err)
	}
	stale, err := adminB.GetRules(ctx, &allotv1.GetRulesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if stale.GetVersion() >= put.GetVersion() {
		t.Fatalf("the cut-off follower already has version %d: the test needs it stale", stale.GetVersion())
	}
	lin, err := adminB.GetRules(ctx, &allotv1.GetRulesRequest{Linearizable: true})
	if err != nil {
		t.Fatal(err)
	}
	if lin.GetVersion() != put.GetVersion() {
		t.Fatalf("linearizable GetRules on a lagging follower: version %d, want %d (the committed put)", lin.GetVersion(), put.GetVersion())
	}
}

// TestLegacyEntriesUpgrade is the documented upgrade from a version without
// compact entries: the cluster runs with LegacyAcquireEntries (Acquire
// batches as AcquireBatch Commands), then every node restarts without it,
// one at a time. The log then holds both kinds of entry; every node replays
// both from disk, answers a retry of a call committed in the old form, and
// ends with the same state.
func TestLegacyEntriesUpgrade(t *testing.T) {
	tc := newTestCluster(t, 3, func(_ int, c *Config) { c.LegacyAcquireEntries = true })
	ctx := ctxT(t)
	alloc, _ := tc.clients(tc.leader())
	var last *allotv1.AcquireResponse
	for id := uint64(1); id <= 3; id++ {
		r, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "up", RequestId: id,
			Keys: []*allotv1.KeyAcquire{key("user", "u"+strconv.FormatUint(id, 10), 2), key("slow", "s", 1)}})
		if err != nil {
			t.Fatalf("legacy acquire %d: %v", id, err)
		}
		last = r
	}
	for i := range tc.nodes {
		tc.stop(i, true)
		tc.cfgs[i].LegacyAcquireEntries = false
		tc.cfgs[i].Join = ""
		tc.restart(i)
		tc.waitReady(i)
	}
	alloc, _ = tc.clients(tc.leader())
	// The last call, committed as a Command, is answered from its record.
	r, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "up", RequestId: 3,
		Keys: []*allotv1.KeyAcquire{key("user", "u3", 2), key("slow", "s", 1)}})
	if err != nil {
		t.Fatalf("retry of the legacy call: %v", err)
	}
	r.LeaderId, last.LeaderId = "", ""
	if !proto.Equal(r, last) {
		t.Fatalf("retry of the legacy call = %v, want %v", r, last)
	}
	for id := uint64(4); id <= 6; id++ {
		if _, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "up", RequestId: id,
			Keys: []*allotv1.KeyAcquire{key("user", "u"+strconv.FormatUint(id, 10), 2), key("slow", "s", 1)}}); err != nil {
			t.Fatalf("compact acquire %d: %v", id, err)
		}
	}
	// Every replica replays the mixed log from disk to the same state.
	for i := range tc.nodes {
		tc.stop(i, false)
	}
	for i := range tc.nodes {
		tc.restart(i)
	}
	for i := range tc.nodes {
		tc.waitReady(i)
	}
	var want state.Stats
	waitFor(t, 10*time.Second, "replicas to agree", func() bool {
		want = tc.node(0).st.Stats()
		for i := 1; i < len(tc.nodes); i++ {
			got := tc.node(i).st.Stats()
			if got.Keys != want.Keys || got.Leases != want.Leases || got.LastApplied != want.LastApplied {
				return false
			}
		}
		return want.Leases > 0
	})
}

// TestLeaderHeartbeatTimeouts: the leader runs with the HeartbeatTimeout
// whose tenth is a fifth of the leader lease (its heartbeat interval) and
// an ElectionTimeout at least that long; followers keep the configured
// timeouts (their election timer is the failover); a leader that hands
// over leadership follows with the configured timeouts again, and the new
// leader raises its own.
func TestLeaderHeartbeatTimeouts(t *testing.T) {
	// The defaults' proportions (500/500/500 ms) at the harness's speed.
	tc := newTestCluster(t, 3, func(_ int, c *Config) { c.LeaderLeaseTimeout = c.HeartbeatTimeout })
	hb, el := tc.cfgs[0].HeartbeatTimeout, tc.cfgs[0].ElectionTimeout
	lead := 10 * tc.cfgs[0].LeaderLeaseTimeout / 5
	if lead <= hb {
		t.Fatalf("leader heartbeat timeout %v, want more than the configured %v", lead, hb)
	}
	// check waits for a leader whose timeouts are the leader's while the
	// others' are the configured ones, and returns it (leadership may
	// move on a loaded machine; whichever node leads is checked).
	check := func() int {
		t.Helper()
		leader := -1
		waitFor(t, 10*time.Second, "the leader's and the followers' timeouts", func() bool {
			leader = -1
			for i := range tc.nodes {
				if tc.node(i).IsLeader() {
					leader = i
				}
			}
			if leader < 0 {
				return false
			}
			for i := range tc.nodes {
				rc := tc.node(i).node.raft.ReloadableConfig()
				wantHB, wantEl := hb, el
				if i == leader {
					wantHB, wantEl = lead, max(el, lead)
				}
				if rc.HeartbeatTimeout != wantHB || rc.ElectionTimeout != wantEl {
					t.Logf("%s: heartbeat %v election %v, want %v %v", tc.cfgs[i].NodeID, rc.HeartbeatTimeout, rc.ElectionTimeout, wantHB, wantEl)
					return false
				}
			}
			return true
		})
		return leader
	}
	old := check()
	oldTerm := tc.node(old).node.raft.CurrentTerm()
	_, admin := tc.clients(old)
	// A transfer may time out on a loaded machine (raft waits one
	// election timeout for it); the old leader then keeps the configured
	// timeouts until it next gains leadership, so only a new leader is
	// checked.
	waitFor(t, 10*time.Second, "a transfer of the leadership", func() bool {
		_, err := admin.TransferLeadership(ctxT(t), &allotv1.TransferLeadershipRequest{})
		if err != nil {
			t.Logf("transfer: %v", err)
		}
		return err == nil
	})
	// A leader of a later term: on a loaded machine the old leader may
	// win the next election again, which also applies its leader's
	// timeouts afresh.
	waitFor(t, 10*time.Second, "a leader of a later term", func() bool {
		return tc.node(tc.leader()).node.raft.CurrentTerm() > oldTerm
	})
	check()
}

// TestAddVoterRefusesBadAddresses: AddVoter with an address that is not
// host:port with a port in 1..65535 is InvalidArgument and commits
// nothing: a voter nobody can reach would leave a one-node cluster
// without a quorum for good.
func TestAddVoterRefusesBadAddresses(t *testing.T) {
	tc := newTCPTestCluster(t, 1)
	_, admin := tc.clients(0)
	good := tc.node(0).self()
	for _, req := range []*allotv1.AddVoterRequest{
		{Id: "typo", RaftAddr: "not an address", GrpcAddr: good.GrpcAddr},
		{Id: "typo", RaftAddr: "127.0.0.1:0", GrpcAddr: good.GrpcAddr},
		{Id: "typo", RaftAddr: "127.0.0.1:70000", GrpcAddr: good.GrpcAddr},
		{Id: "typo", RaftAddr: ":7421", GrpcAddr: good.GrpcAddr},
		{Id: "typo", RaftAddr: "127.0.0.1:7421", GrpcAddr: "also bad"},
		{Id: "typo", RaftAddr: "127.0.0.1:7421", GrpcAddr: good.GrpcAddr, HttpAddr: "localhost"},
	} {
		_, err := admin.AddVoter(ctxT(t), req)
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("AddVoter(raft %q, grpc %q, http %q) = %v, want InvalidArgument", req.RaftAddr, req.GrpcAddr, req.HttpAddr, err)
		}
	}
	st, err := admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
	if err != nil || len(st.GetMembers()) != 1 {
		t.Fatalf("members after the refused calls: %v, %v; want n0 alone", st.GetMembers(), err)
	}
	put := &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "extra.yaml", Yaml: []byte(extraRules)}}}
	if _, err := admin.PutRules(ctxT(t), put); err != nil {
		t.Errorf("PutRules after the refused calls: %v", err)
	}
}
