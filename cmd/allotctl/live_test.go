package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/allocator"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// liveRules is the rule file of the live tests. Its limits refill so
// slowly (10 a day) that the token counts in the goldens cannot drift
// while a test runs.
const liveRules = "testdata/live/live.yaml"

// logSink sends slog output to t.Log until the test ends.
type logSink struct {
	mu      sync.Mutex // guards stopped; serialises t.Log
	t       testing.TB
	stopped bool
}

func (w *logSink) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.stopped {
		w.t.Log(string(bytes.TrimRight(p, "\n")))
	}
	return len(p), nil
}

func (w *logSink) stop() {
	w.mu.Lock()
	w.stopped = true
	w.mu.Unlock()
}

// startCluster starts an in-process allocator cluster of n nodes over real
// loopback TCP: n1 bootstraps with no rules, the others join through it.
// It returns once every node is ready and all n are voters.
func startCluster(t *testing.T, n int) []*allocator.Server {
	t.Helper()
	sink := &logSink{t: t}
	t.Cleanup(sink.stop)
	logger := slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelWarn}))
	base := t.TempDir()
	var nodes []*allocator.Server
	t.Cleanup(func() {
		for i := len(nodes) - 1; i >= 0; i-- {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			if err := nodes[i].Shutdown(ctx); err != nil {
				t.Logf("shutdown n%d: %v", i+1, err)
			}
			cancel()
		}
	})
	for i := range n {
		cfg := allocator.DefaultConfig()
		cfg.NodeID = fmt.Sprintf("n%d", i+1)
		cfg.DataDir = filepath.Join(base, cfg.NodeID)
		cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0", ""
		// Leases outlive the test: the goldens show them.
		cfg.LeaseTTL, cfg.MaxLeaseTTL, cfg.AgentTTL = 10*time.Minute, 10*time.Minute, 20*time.Minute
		cfg.Logger = logger.With("node", cfg.NodeID)
		if i == 0 {
			cfg.Bootstrap = true
		} else {
			cfg.Join = nodes[0].GRPCAddr()
		}
		s, err := allocator.New(cfg)
		if err != nil {
			t.Fatalf("allocator.New(%s): %v", cfg.NodeID, err)
		}
		nodes = append(nodes, s)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = s.WaitReady(ctx)
		cancel()
		if err != nil {
			t.Fatalf("%s not ready: %v", cfg.NodeID, err)
		}
	}
	waitFor(t, 30*time.Second, fmt.Sprintf("%d voters", n), func() bool {
		st, err := clusterStatus(nodes[0].GRPCAddr())
		if err != nil {
			return false
		}
		voters := 0
		for _, m := range st.Members {
			if m.Suffrage == "voter" && m.GrpcAddr != "" {
				voters++
			}
		}
		return voters == n && st.LeaderId != ""
	})
	return nodes
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func clusterStatus(addr string) (*allotv1.ClusterStatusResponse, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return allotv1.NewAdminClient(conn).ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
}

// acquire takes want tokens of one key for agent, as an agent's refill
// would, and returns the grant.
func acquire(t testing.TB, addr, agent string, reqID uint64, domain string, entries []*allotv1.Entry, want int64, demand float64, denied int64) *allotv1.KeyGrant {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := allotv1.NewAllocatorClient(conn).Acquire(ctx, &allotv1.AcquireRequest{
		AgentId: agent, RequestId: reqID,
		Keys: []*allotv1.KeyAcquire{{Domain: domain, Entries: entries, Want: want, Demand: demand, Denied: denied}},
	})
	if err != nil {
		t.Fatalf("Acquire(%s, %d): %v", agent, reqID, err)
	}
	return resp.Grants[0]
}

func entries(kvs ...string) []*allotv1.Entry {
	var es []*allotv1.Entry
	for _, kv := range kvs {
		k, v, _ := strings.Cut(kv, "=")
		es = append(es, &allotv1.Entry{Key: k, Value: v})
	}
	return es
}

var (
	reAddr    = regexp.MustCompile(`127\.0\.0\.1:\d+`)
	reTime    = regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z`)
	reDur     = regexp.MustCompile(`\b\d+(\.\d+)?(ms|s|m|h|d)(\d+(ms|s|m|h))?\b`)
	reRate    = regexp.MustCompile(`\b\d+\.\d+\b`)
	reJSONVar = regexp.MustCompile(`"(now_unix_ms|granted_unix_ms|expires_in_ms|full_in_ms|last_contact_unix_ms|grant_rate|deny_rate|updated_unix_ms|demand)": "?[-0-9.e+]+"?`)
	reSpaces  = regexp.MustCompile(` {2,}`)
)

// normalize removes what differs between runs: ports, times, durations
// and decaying rates. With tables, runs of spaces inside lines become two
// spaces so that column widths changed by the replacements do not matter.
func normalize(s string, tables bool) string {
	s = reAddr.ReplaceAllString(s, "127.0.0.1:PORT")
	s = reJSONVar.ReplaceAllString(s, `"$1": X`)
	s = reTime.ReplaceAllString(s, "TIME")
	s = reDur.ReplaceAllString(s, "DUR")
	s = reRate.ReplaceAllString(s, "RATE")
	if !tables {
		return s
	}
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		if !strings.HasPrefix(strings.TrimSpace(l), `"`) { // keep JSON indentation
			lead := len(l) - len(strings.TrimLeft(l, " "))
			lines[i] = l[:lead] + reSpaces.ReplaceAllString(l[lead:], "  ")
		}
	}
	return strings.Join(lines, "\n")
}

// TestLiveCluster runs the CLI against an in-process 3-node allocator
// cluster: rules applied through the CLI, leases created by raw Acquire
// calls, then every read command's output compared with goldens.
func TestLiveCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-node allocator cluster")
	}
	nodes := startCluster(t, 3)
	addr := nodes[1].GRPCAddr() // a follower (or not): any node answers
	cliCode := func(code int, args ...string) result {
		t.Helper()
		r := runCLI(t, append([]string{"--addr", addr, "--timeout", "10s"}, args...)...)
		if r.code != code {
			t.Fatalf("allotctl %s: exit %d, want %d, stderr %q", strings.Join(args, " "), r.code, code, r.stderr)
		}
		return r
	}
	cli := func(args ...string) result { t.Helper(); return cliCode(exitOK, args...) }
	golden := func(name string, r result) {
		t.Helper()
		checkGolden(t, "live_"+name, normalize(r.stdout, !strings.HasPrefix(name, "rules")))
	}

	r := cli("rules", "apply", "-f", liveRules)
	if r.stdout != "Applied domain(s) live: rules version 0 -> 1.\n" {
		t.Fatalf("rules apply printed %q", r.stdout)
	}
	// Read-your-writes through the same node, follower or not: get and
	// diff are linearizable.
	if r := cli("-o", "json", "rules", "get"); !strings.Contains(r.stdout, `"version": 1,`) {
		t.Fatalf("rules get right after apply:\n%s", r.stdout)
	}
	cli("rules", "diff", "-f", liveRules)
	// --stale reads the node's replica, which may lag the commit a moment.
	waitFor(t, 10*time.Second, "the rules on every node", func() bool {
		for _, n := range nodes {
			if st, err := clusterStatus(n.GRPCAddr()); err != nil || st.RulesVersion != 1 {
				return false
			}
		}
		return true
	})
	golden("rules_get", cli("rules", "get"))
	golden("rules_diff_same", cli("rules", "diff", "-f", liveRules))
	golden("rules_diff", cliCode(exitDiffer, "rules", "diff", "-f", "testdata/live/live-v2.yaml"))
	golden("rules_diff_same", cli("rules", "diff", "--stale", "-f", liveRules))

	// Two agents lease the whole budget of k_1 (10 tokens); a third key is
	// leased by one agent; agent-b reports denials.
	free1 := entries("tier=free", "api_key=k_1")
	g := acquire(t, addr, "agent-a", 1, "live", free1, 6, 0.5, 0)
	t.Logf("agent-a granted %d of k_1 (status %v, remaining %d)", g.Granted, g.Status, g.Remaining)
	g = acquire(t, addr, "agent-b", 1, "live", free1, 6, 0.25, 4)
	t.Logf("agent-b granted %d of k_1 (status %v, remaining %d)", g.Granted, g.Status, g.Remaining)
	acquire(t, addr, "agent-a", 2, "live", entries("tier=free", "api_key=k_2"), 3, 0.1, 0)
	waitFor(t, 10*time.Second, "the follower to apply the leases", func() bool {
		st, err := clusterStatus(addr)
		return err == nil && st.Leases == 3
	})

	st := cli("-o", "json", "status")
	var status struct {
		Members []struct {
			ID, Role, Suffrage string
		}
		LeaderID     string `json:"leader_id"`
		RulesVersion uint64 `json:"rules_version"`
		Agents       int    `json:"agents"`
		Leases       uint64 `json:"leases"`
	}
	if err := json.Unmarshal([]byte(st.stdout), &status); err != nil {
		t.Fatalf("status -o json: %v\n%s", err, st.stdout)
	}
	leaders := 0
	for _, m := range status.Members {
		if m.Role == "leader" {
			leaders++
			if m.ID != status.LeaderID {
				t.Errorf("member %s has role leader, leader_id is %s", m.ID, status.LeaderID)
			}
		}
		if m.Suffrage != "voter" {
			t.Errorf("member %s is %s, want voter", m.ID, m.Suffrage)
		}
	}
	if len(status.Members) != 3 || leaders != 1 || status.Agents != 2 || status.Leases != 3 || status.RulesVersion == 0 {
		t.Errorf("status = %+v, want 3 voters, one leader, 2 agents, 3 leases, rules applied\n%s", status, st.stdout)
	}
	table := cli("status").stdout
	for _, want := range []string{"Leader:", "Rules version:", "n1", "n2", "n3", "voter", "(* = the node that answered)"} {
		if !strings.Contains(table, want) {
			t.Errorf("status table lacks %q:\n%s", want, table)
		}
	}

	// Keys are redacted unless an admin asks for them (with authentication
	// off every caller is an admin).
	for _, args := range [][]string{{"leases"}, {"top", "--once", "--domain", "live"}} {
		if out := cli(args...).stdout; strings.Contains(out, "k_1") || !strings.Contains(out, "key#") {
			t.Errorf("allotctl %v without --show-keys shows a raw key:\n%s", args, out)
		}
	}
	if out := cli("inspect", "live:tier=free,api_key=k_1").stdout; !strings.Contains(out, "Key:     key#") {
		t.Errorf("allotctl inspect without --show-keys shows the raw key:\n%s", out)
	}
	golden("leases", cli("--show-keys", "leases"))
	golden("leases.json", cli("--show-keys", "-o", "json", "leases", "--key", "live:tier=free,api_key=k_1"))
	golden("inspect", cli("--show-keys", "inspect", "--domain", "live", "-d", "tier=free", "-d", "api_key=k_1"))
	golden("inspect.json", cli("--show-keys", "-o", "json", "inspect", "live:tier=free,api_key=k_1"))
	golden("inspect_nomatch", cli("--show-keys", "inspect", "--domain", "live", "-d", "tier=gold", "-d", "api_key=k_1"))
	golden("agents", cli("agents"))
	golden("top", cli("--show-keys", "top", "--once", "--domain", "live"))
	golden("check_over", cli("check", "--domain", "live", "-d", "tier=free", "-d", "api_key=k_1"))
	golden("check_multi", cli("check", "--domain", "live",
		"-D", "tier=free,api_key=k_3", "-D", "api_key=k_shadow", "-D", "tier=gold,api_key=k_3"))
	golden("check_multi.json", cli("-o", "json", "check", "--domain", "live", "-D", "tier=free,api_key=k_4"))

	// Invalid input is the allocator's InvalidArgument, shown as is.
	bad := runCLI(t, "--addr", addr, "inspect", "not-a-key")
	if bad.code != exitError || !strings.HasPrefix(bad.stderr, "allotctl: InspectKey rejected: ") {
		t.Errorf("inspect of a malformed key: exit %d, stderr %q", bad.code, bad.stderr)
	}
}

// TestLiveClusterMembership drives transfer-leader, remove and join
// through the CLI.
func TestLiveClusterMembership(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-node allocator cluster")
	}
	nodes := startCluster(t, 3)
	addr := nodes[0].GRPCAddr()
	st, err := clusterStatus(addr)
	if err != nil {
		t.Fatal(err)
	}
	old := st.LeaderId
	target := "n2"
	if old == "n2" {
		target = "n3"
	}
	r := runCLI(t, "--addr", addr, "--timeout", "15s", "cluster", "transfer-leader", target)
	if r.code != exitOK || r.stdout != "Leader is now "+target+".\n" {
		t.Fatalf("transfer-leader: exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	waitFor(t, 15*time.Second, "the new leader to be reported", func() bool {
		st, err := clusterStatus(addr)
		return err == nil && st.LeaderId == target
	})

	// Remove a follower, then add it back with cluster join (it still runs
	// and keeps its data).
	var victim *allocator.Server
	for _, n := range nodes {
		if id := n.NodeID(); id != target {
			victim = n
			break
		}
	}
	r = runCLI(t, "--addr", addr, "--timeout", "15s", "cluster", "remove", victim.NodeID())
	if r.code != exitOK {
		t.Fatalf("cluster remove: exit %d, stderr %q", r.code, r.stderr)
	}
	other := nodes[2].GRPCAddr()
	if nodes[2] == victim {
		other = nodes[1].GRPCAddr()
	}
	waitFor(t, 15*time.Second, "2 members", func() bool {
		st, err := clusterStatus(other)
		return err == nil && len(st.Members) == 2
	})
	r = runCLI(t, "--addr", other, "--timeout", "15s", "cluster", "join", victim.GRPCAddr(),
		"--id", victim.NodeID(), "--raft-addr", victim.RaftAddr())
	if r.code != exitOK {
		t.Fatalf("cluster join: exit %d, stderr %q", r.code, r.stderr)
	}
	waitFor(t, 15*time.Second, "3 members again", func() bool {
		st, err := clusterStatus(other)
		return err == nil && len(st.Members) == 3
	})
}
