package fault

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestFullClusterRestart: all three allocators are killed with SIGKILL
// under load and restarted on the same data directories. The nodes take
// Raft snapshots every ~50 entries (cmd/allocator's -snapshot-interval and
// -snapshot-threshold), so the state comes back
// from a snapshot plus the bolt log. The rules, a lease, a drained bucket
// and the agent's idempotency record all survive; the gateways fail open
// during the outage (zero 5xx, within the fallback bound) and lease again
// after the restart.
func TestFullClusterRestart(t *testing.T) {
	checkLeaks(t)
	bins := testproc.Build(t)
	e := newEnv(t, envConfig{
		bin:       bins.Allocator,
		slowRules: true,
		// A long cold-key lease and agent TTL, so that the frozen agent's
		// lease outlives the outage.
		args: []string{"-max-lease-ttl", "60s", "-agent-ttl", "120s",
			"-snapshot-interval", "300ms", "-snapshot-threshold", "50"},
	})
	e.gateway("gw-a", e.c.GRPCAddrs())
	e.gateway("gw-b", e.c.GRPCAddrs())
	e.startLoad(200, 4)
	e.waitLeasing()

	// A frozen agent drains the slow key (6/minute, burst 100) to 10 and
	// stops calling: its lease, the bucket and its last answer must all
	// come back.
	lead := e.c.Leader(t, 10*time.Second)
	frozen := &allotv1.AcquireRequest{AgentId: "frozen", RequestId: 7, Keys: []*allotv1.KeyAcquire{{
		Domain: "slow", Entries: []*allotv1.Entry{{Key: "k", Value: "frozen"}}, Want: 90,
	}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	frozenResp, err := lead.Allocator(t).Acquire(ctx, frozen)
	if err != nil {
		t.Fatal(err)
	}
	if g := frozenResp.GetGrants()[0]; g.GetGranted() != 90 || g.GetRemaining() != 10 {
		t.Fatalf("frozen grant %v, want 90 granted, 10 remaining", g)
	}
	st, err := lead.Status(t)
	if err != nil {
		t.Fatal(err)
	}
	frozenIndex := st.GetCommitIndex()

	// Every node snapshots past the frozen grant.
	for _, n := range e.c.Nodes {
		testproc.Eventually(t, 60*time.Second, n.ID+" snapshotting past the frozen grant", func() bool {
			s, err := n.Status(t)
			return err == nil && s.GetLastSnapshotIndex() > frozenIndex
		})
	}
	before := captureState(t, e)
	e.runFor(time.Second)

	n := e.liveAgents()
	okBefore := e.sample(mCallsOK)
	killed := time.Now()
	for _, n := range e.c.Nodes {
		n.Proc.Kill()
	}
	t.Logf("all 3 nodes killed; %d live agents before", n)
	for _, g := range e.gws {
		testproc.Eventually(t, 10*time.Second, g.Name+" failing open", func() bool { return g.Metric(mFallback) == 1 })
	}
	e.runFor(3 * time.Second)

	restarted := time.Now()
	for _, n := range e.c.Nodes {
		n.Proc.Start(t)
	}
	e.c.WaitReady(t, 60*time.Second)
	rec := e.waitRecovered(allGateways(len(e.gws)), okBefore, restarted, recoveryBound)
	outage := time.Since(killed)
	t.Logf("restart → gateways leasing again: %v (kill → recovered %v)", rec, outage)

	// Each node came back through a snapshot.
	for _, n := range e.c.Nodes {
		out := n.Proc.Output()
		if i := strings.LastIndex(out, "==== start 2"); i < 0 || !strings.Contains(out[i:], "restored from snapshot") {
			t.Errorf("%s did not restore from a snapshot after the restart", n.ID)
		}
	}
	after := captureState(t, e)
	if after.rulesVersion != before.rulesVersion || after.rules != before.rules {
		t.Errorf("rules after the restart: version %d %q, want %d %q", after.rulesVersion, after.rules, before.rulesVersion, before.rules)
	}
	if after.frozenLease != before.frozenLease || before.frozenLease != 90 {
		t.Errorf("frozen lease holds %d after the restart, %d before; want 90", after.frozenLease, before.frozenLease)
	}
	// 6/minute refills 0.1 token/s: the drained bucket must not be full.
	maxTokens := before.frozenTokens + int64(time.Since(before.at).Seconds()/10) + 1
	if after.frozenTokens < before.frozenTokens || after.frozenTokens > maxTokens {
		t.Errorf("slow bucket holds %d after the restart (%d before): want [%d, %d], not a fresh bucket",
			after.frozenTokens, before.frozenTokens, before.frozenTokens, maxTokens)
	}
	// The idempotency record: a retry gets the recorded answer.
	rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer rcancel()
	again, err := e.c.Nodes[1].Allocator(t).Acquire(rctx, frozen)
	if err != nil {
		t.Fatalf("retry of the frozen agent's call: %v", err)
	}
	if again.GetNowUnixMs() != frozenResp.GetNowUnixMs() || !proto.Equal(again.GetGrants()[0], frozenResp.GetGrants()[0]) {
		t.Errorf("retry after the restart answered %v, want the recorded %v", again, frozenResp)
	}

	e.runFor(2 * time.Second)
	rep := &report{
		fault:    "full-cluster restart (3 × kill -9, restart on the same data dirs)",
		bound:    "B+R·T + B + per breaker opening ⌈B/N⌉ + R·T_open/N",
		recovery: rec,
	}
	e.checkLoad(rep, n)
	rep.log(t)
}

type clusterState struct {
	at           time.Time
	rulesVersion uint64
	rules        string
	frozenLease  int64
	frozenTokens int64
}

// captureState reads the rules, the frozen agent's lease and the slow
// key's bucket through the Admin API of the leader.
func captureState(t *testing.T, e *env) clusterState {
	t.Helper()
	n := e.c.Leader(t, 30*time.Second)
	ad := n.Admin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s := clusterState{at: time.Now()}
	rs, err := ad.GetRules(ctx, &allotv1.GetRulesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	s.rulesVersion = rs.GetVersion()
	var b strings.Builder
	for _, f := range rs.GetFiles() {
		fmt.Fprintf(&b, "%s:%s:%x;", f.GetName(), f.GetDomain(), f.GetYaml())
	}
	s.rules = b.String()
	ls, err := ad.ListLeases(ctx, &allotv1.ListLeasesRequest{AgentId: "frozen"})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls.GetLeases() {
		s.frozenLease += l.GetTokens()
	}
	ik, err := ad.InspectKey(ctx, &allotv1.InspectKeyRequest{Domain: "slow", Entries: []*allotv1.Entry{{Key: "k", Value: "frozen"}}})
	if err != nil {
		t.Fatal(err)
	}
	if !ik.GetTracked() {
		t.Errorf("the slow key is not tracked")
	}
	s.frozenTokens = ik.GetTokens()
	return s
}
