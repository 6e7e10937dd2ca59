package fault

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestFullClusterRestart: all three allocators are killed with SIGKILL
// under load and restarted on the same data directories. The nodes take
// Raft snapshots every ~50 entries (cmd/allocator's -snapshot-interval and
// -snapshot-threshold), so the state comes back
// from a snapshot plus the Raft log. The rules, a lease, a drained bucket
// and the agent's idempotency record all survive; the gateways fail open
// during the outage (zero 5xx, within the fallback bound) and lease again
// after the restart.
func TestFullClusterRestart(t *testing.T) { runFullRestart(t, 1) }

// runFullRestart restarts a cluster of groups data groups (the
// allocators run with the extra flags args); with groups, the frozen
// agent holds a slow key in every data group, and every group's state
// must come back from its own snapshot.
func runFullRestart(t *testing.T, groups int, args ...string) {
	checkLeaks(t)
	bins := testproc.Build(t)
	e := newEnv(t, envConfig{
		bin:       bins.Allocator,
		slowRules: true,
		groups:    groups,
		// A long cold-key lease and agent TTL, so that the frozen agent's
		// lease outlives the outage.
		args: append([]string{"-max-lease-ttl", "60s", "-agent-ttl", "120s",
			"-snapshot-interval", "300ms", "-snapshot-threshold", "50"}, args...),
	})
	e.gateway("gw-a", e.c.GRPCAddrs())
	e.gateway("gw-b", e.c.GRPCAddrs())
	e.startLoad(200, 4)
	e.waitLeasing()

	// A frozen agent drains the slow key (6/minute, burst 100) to 10 and
	// stops calling: its lease, the bucket and its last answer must all
	// come back. With groups, it drains a slow key of every data group in
	// one call, which the node splits over the groups.
	frozenKeys := []string{"frozen"}
	if groups > 1 {
		frozenKeys = e.keysPerGroup("slow:k=", "frozen-", 1)
	}
	lead := e.c.Leader(t, 10*time.Second)
	frozen := &allotv1.AcquireRequest{AgentId: "frozen", RequestId: 7}
	for _, k := range frozenKeys {
		frozen.Keys = append(frozen.Keys, &allotv1.KeyAcquire{
			Domain: "slow", Entries: []*allotv1.Entry{{Key: "k", Value: k}}, Want: 90,
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	frozenResp, err := lead.Allocator(t).Acquire(ctx, frozen)
	if err != nil {
		t.Fatal(err)
	}
	for i, g := range frozenResp.GetGrants() {
		if g.GetGranted() != 90 || g.GetRemaining() != 10 {
			t.Fatalf("frozen grant %d: %v, want 90 granted, 10 remaining", i, g)
		}
	}

	// Every node snapshots past the frozen grant (with groups: every
	// group of every node, in its own groups/<id>/snapshots/).
	if groups > 1 {
		frozenIndex := map[int]uint64{}
		for _, n := range e.c.Nodes {
			v, err := e.groupsOf(n)
			if err != nil {
				t.Fatal(err)
			}
			for g, c := range v.commit {
				frozenIndex[g] = max(frozenIndex[g], c)
			}
		}
		for _, n := range e.c.Nodes {
			for g := 1; g <= groups; g++ {
				testproc.Eventually(t, 60*time.Second, fmt.Sprintf("%s snapshotting group %d past the frozen grant", n.ID, g), func() bool {
					return lastSnapshot(t, filepath.Join(n.DataDir, "groups", strconv.Itoa(g), "snapshots")) > frozenIndex[g]
				})
			}
		}
	} else {
		st, err := lead.Status(t)
		if err != nil {
			t.Fatal(err)
		}
		frozenIndex := st.GetCommitIndex()
		for _, n := range e.c.Nodes {
			testproc.Eventually(t, 60*time.Second, n.ID+" snapshotting past the frozen grant", func() bool {
				s, err := n.Status(t)
				return err == nil && s.GetLastSnapshotIndex() > frozenIndex
			})
		}
	}
	before := captureState(t, e, frozenKeys)
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
	if groups > 1 {
		e.waitGroupLeaders(60 * time.Second)
	}
	rec := e.waitRecovered(allGateways(len(e.gws)), okBefore, restarted, recoveryBound)
	outage := time.Since(killed)
	t.Logf("restart → gateways leasing again: %v (kill → recovered %v)", rec, outage)

	// Each node came back through a snapshot (with groups: of every data
	// group; each group logs with its id).
	for _, n := range e.c.Nodes {
		out := n.Proc.Output()
		i := strings.LastIndex(out, "==== start 2")
		if i < 0 {
			t.Fatalf("%s: no second start in its log", n.ID)
		}
		if groups <= 1 {
			if !strings.Contains(out[i:], "restored from snapshot") {
				t.Errorf("%s did not restore from a snapshot after the restart", n.ID)
			}
			continue
		}
		for g := 1; g <= groups; g++ {
			if !restoredGroup(out[i:], g) {
				t.Errorf("%s did not restore data group %d from a snapshot after the restart", n.ID, g)
			}
		}
	}
	after := captureState(t, e, frozenKeys)
	if after.rulesVersion != before.rulesVersion || after.rules != before.rules {
		t.Errorf("rules after the restart: version %d %q, want %d %q", after.rulesVersion, after.rules, before.rulesVersion, before.rules)
	}
	for _, k := range frozenKeys {
		label := k
		if groups > 1 {
			label = fmt.Sprintf("%s (group %d)", k, e.groupOfKey("slow:k="+k))
		}
		if after.frozenLease[k] != before.frozenLease[k] || before.frozenLease[k] != 90 {
			t.Errorf("%s: frozen lease holds %d after the restart, %d before; want 90", label, after.frozenLease[k], before.frozenLease[k])
		}
		// 6/minute refills 0.1 token/s: the drained bucket must not be full.
		maxTokens := before.frozenTokens[k] + int64(time.Since(before.at).Seconds()/10) + 1
		if after.frozenTokens[k] < before.frozenTokens[k] || after.frozenTokens[k] > maxTokens {
			t.Errorf("%s: slow bucket holds %d after the restart (%d before): want [%d, %d], not a fresh bucket",
				label, after.frozenTokens[k], before.frozenTokens[k], before.frozenTokens[k], maxTokens)
		}
	}
	// The idempotency record: a retry gets the recorded answer (with
	// groups: every group answers its keys from its own record).
	rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer rcancel()
	again, err := e.c.Nodes[1].Allocator(t).Acquire(rctx, frozen)
	if err != nil {
		t.Fatalf("retry of the frozen agent's call: %v", err)
	}
	if again.GetNowUnixMs() != frozenResp.GetNowUnixMs() || len(again.GetGrants()) != len(frozenResp.GetGrants()) {
		t.Errorf("retry after the restart answered %v, want the recorded %v", again, frozenResp)
	} else {
		for i, g := range frozenResp.GetGrants() {
			if !proto.Equal(again.GetGrants()[i], g) {
				t.Errorf("retry after the restart answered %v for key %d, want the recorded %v", again.GetGrants()[i], i, g)
			}
		}
	}

	e.runFor(2 * time.Second)
	rep := &report{
		fault:    "full-cluster restart (3 × kill -9, restart on the same data dirs)" + groupsNote(groups),
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
	frozenLease  map[string]int64 // by the slow key's value
	frozenTokens map[string]int64
}

// captureState reads the rules, the frozen agent's leases and the slow
// keys' buckets (values keys) through the Admin API of the leader.
func captureState(t *testing.T, e *env, keys []string) clusterState {
	t.Helper()
	n := e.c.Leader(t, 30*time.Second)
	ad := n.Admin(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s := clusterState{at: time.Now(), frozenLease: map[string]int64{}, frozenTokens: map[string]int64{}}
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
	// Raw keys: the cluster has no authentication, so any caller that asks
	// is an admin (allocator.ShowKeysMetadata).
	lctx := metadata.AppendToOutgoingContext(ctx, "x-allot-show-keys", "1")
	ls, err := ad.ListLeases(lctx, &allotv1.ListLeasesRequest{AgentId: "frozen"})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls.GetLeases() {
		k, ok := strings.CutPrefix(l.GetKey(), "slow:k=")
		if !ok {
			t.Errorf("the frozen agent holds a lease of %q", l.GetKey())
		}
		s.frozenLease[k] += l.GetTokens()
	}
	for _, k := range keys {
		ik, err := ad.InspectKey(ctx, &allotv1.InspectKeyRequest{Domain: "slow", Entries: []*allotv1.Entry{{Key: "k", Value: k}}})
		if err != nil {
			t.Fatal(err)
		}
		if !ik.GetTracked() {
			t.Errorf("the slow key %s is not tracked", k)
		}
		s.frozenTokens[k] = ik.GetTokens()
	}
	return s
}

// lastSnapshot is the highest index of the complete snapshots in dir (a
// raft.FileSnapshotStore: directories named term-index-ms), 0 when none.
func lastSnapshot(t *testing.T, dir string) uint64 {
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var last uint64
	for _, d := range ents {
		parts := strings.Split(d.Name(), "-")
		if !d.IsDir() || len(parts) != 3 || strings.HasSuffix(d.Name(), ".tmp") {
			continue
		}
		if i, err := strconv.ParseUint(parts[1], 10, 64); err == nil {
			last = max(last, i)
		}
	}
	return last
}

// restoredGroup reports whether an allocator's log (text format) says data
// group g restored its state from a snapshot: hashicorp/raft's "restored
// from snapshot", logged with the group's id.
func restoredGroup(log string, g int) bool {
	for line := range strings.Lines(log) {
		if strings.Contains(line, "restored from snapshot") && strings.Contains(line, fmt.Sprintf(" group=%d ", g)) {
			return true
		}
	}
	return false
}
