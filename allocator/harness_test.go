package allocator

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// testRules: domain "test"; every user value has 100 tokens/s with a burst
// of 50; every slow value 10/s, burst 5; every quota value 3600/hour (one
// token a second), burst 100.
const testRules = `domain: test
descriptors:
  - key: user
    rate_limit:
      unit: second
      requests_per_unit: 100
      burst: 50
  - key: slow
    rate_limit:
      unit: second
      requests_per_unit: 10
      burst: 5
  - key: quota
    rate_limit:
      unit: hour
      requests_per_unit: 3600
      burst: 100
`

func testRuleFiles() []rules.File {
	return []rules.File{{Name: "test.yaml", Source: []byte(testRules)}}
}

// testLogger sends slog output to t.Log until the test ends.
func testLogger(t testing.TB, level slog.Level) *slog.Logger {
	w := &tWriter{t: t}
	t.Cleanup(w.stop)
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

type tWriter struct {
	mu      sync.Mutex // guards stopped; serialises t.Log
	t       testing.TB
	stopped bool
}

func (w *tWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.stopped {
		w.t.Log(string(bytes.TrimRight(p, "\n")))
	}
	return len(p), nil
}

func (w *tWriter) stop() {
	w.mu.Lock()
	w.stopped = true
	w.mu.Unlock()
}

// testCluster is an in-process cluster over raft.InmemTransport; gRPC runs
// on real loopback ports.
type testCluster struct {
	t     testing.TB
	mu    sync.Mutex // guards nodes and trans
	nodes []*Server  // nil once stopped
	cfgs  []Config
	trans []*raft.InmemTransport
	// tcpRaft: Raft runs over TCP on loopback (Config.RaftAddr), not over
	// trans (which stays nil).
	tcpRaft bool
	// opts and dir make the configuration of a node added later (add).
	opts []clusterOpt
	dir  string
	log  *slog.Logger
}

type clusterOpt func(i int, c *Config)

// newTestCluster starts n nodes: node 0 bootstraps with the test rules, the
// others join through node 0. It waits until every node is ready.
func newTestCluster(t testing.TB, n int, opts ...clusterOpt) *testCluster {
	t.Helper()
	return startTestCluster(t, n, false, opts...)
}

// newTCPTestCluster is newTestCluster with Raft over TCP on loopback (the
// real transport, so RaftTLS applies).
func newTCPTestCluster(t testing.TB, n int, opts ...clusterOpt) *testCluster {
	t.Helper()
	return startTestCluster(t, n, true, opts...)
}

func startTestCluster(t testing.TB, n int, tcpRaft bool, opts ...clusterOpt) *testCluster {
	t.Helper()
	tc := &testCluster{t: t, tcpRaft: tcpRaft, opts: opts, dir: t.TempDir(), log: testLogger(t, slog.LevelInfo)}
	for i := range n {
		tc.cfgs = append(tc.cfgs, tc.config(i))
	}
	tc.nodes = make([]*Server, n)
	tc.trans = make([]*raft.InmemTransport, n)
	for i := range n {
		if !tcpRaft {
			tc.newTransport(i)
		}
	}
	t.Cleanup(tc.stopAll)
	tc.start(0)
	tc.waitReady(0)
	for i := 1; i < n; i++ {
		tc.cfgs[i].Join = tc.nodes[0].GRPCAddr()
		tc.start(i)
	}
	for i := range n {
		tc.waitReady(i)
	}
	tc.waitVoters(n)
	tc.waitMembers(n)
	return tc
}

// config returns node i's configuration: node 0 bootstraps with the test
// rules; the cluster's options apply to every node.
func (tc *testCluster) config(i int) Config {
	cfg := DefaultConfig()
	cfg.NodeID = fmt.Sprintf("n%d", i)
	cfg.DataDir = filepath.Join(tc.dir, cfg.NodeID)
	cfg.GRPCAddr = "127.0.0.1:0"
	cfg.RaftAddr = "127.0.0.1:0"
	cfg.HTTPAddr = ""
	// Short, but with room for a loaded 2-core machine.
	cfg.HeartbeatTimeout = 250 * time.Millisecond
	cfg.ElectionTimeout = 250 * time.Millisecond
	cfg.LeaderLeaseTimeout = 125 * time.Millisecond
	cfg.ExpireInterval = 100 * time.Millisecond
	cfg.ForwardWait = 3 * time.Second
	cfg.Logger = tc.log.With("test_node", cfg.NodeID)
	if i == 0 {
		cfg.Bootstrap = true
		cfg.InitialRules = testRuleFiles()
	}
	for _, o := range tc.opts {
		o(i, &cfg)
	}
	return cfg
}

// add starts one more node, joining through node join, waits until it
// is ready, and returns its index.
func (tc *testCluster) add(join int) int {
	tc.t.Helper()
	tc.mu.Lock()
	i := len(tc.nodes)
	tc.nodes = append(tc.nodes, nil)
	tc.trans = append(tc.trans, nil)
	tc.mu.Unlock()
	cfg := tc.config(i)
	cfg.Join = tc.node(join).GRPCAddr()
	tc.cfgs = append(tc.cfgs, cfg)
	if !tc.tcpRaft {
		tc.newTransport(i)
	}
	tc.start(i)
	tc.waitReady(i)
	return i
}

// waitMembers waits until every running node has n member records with
// gRPC addresses.
func (tc *testCluster) waitMembers(n int) {
	tc.t.Helper()
	waitFor(tc.t, 10*time.Second, fmt.Sprintf("%d member records everywhere", n), func() bool {
		for i := range tc.nodes {
			s := tc.node(i)
			if s == nil {
				continue
			}
			got := 0
			for _, m := range s.st.Members() {
				if m.GetGrpcAddr() != "" {
					got++
				}
			}
			if got != n {
				return false
			}
		}
		return true
	})
}

// newTransport creates node i's in-memory transport and connects it both
// ways to every other node's.
func (tc *testCluster) newTransport(i int) {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	_, tr := raft.NewInmemTransportWithTimeout(raft.ServerAddress(tc.cfgs[i].NodeID), time.Second)
	tc.trans[i] = tr
	for j, other := range tc.trans {
		if j == i || other == nil {
			continue
		}
		tr.Connect(other.LocalAddr(), other)
		other.Connect(tr.LocalAddr(), tr)
	}
}

func (tc *testCluster) start(i int) {
	tc.t.Helper()
	cfg := tc.cfgs[i]
	if !tc.tcpRaft {
		cfg.transport = tc.trans[i]
	}
	s, err := New(cfg)
	if err != nil {
		tc.t.Fatalf("start %s: %v", cfg.NodeID, err)
	}
	tc.mu.Lock()
	tc.nodes[i] = s
	tc.mu.Unlock()
}

// restart starts a stopped node again on its data directory with a fresh
// transport at the same address.
func (tc *testCluster) restart(i int) {
	tc.t.Helper()
	if tc.tcpRaft {
		tc.t.Fatal("restart: not supported with Raft over TCP (the port would change)")
	}
	tc.newTransport(i)
	tc.start(i)
}

func (tc *testCluster) node(i int) *Server {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	return tc.nodes[i]
}

func (tc *testCluster) stop(i int, graceful bool) {
	tc.t.Helper()
	s := tc.node(i)
	if s == nil {
		return
	}
	if graceful {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			tc.t.Errorf("shutdown %s: %v", s.NodeID(), err)
		}
	} else {
		s.kill()
	}
	// Like a dead host's refused connections: RPCs to it fail at once.
	tc.mu.Lock()
	tc.nodes[i] = nil
	for j, other := range tc.trans {
		if j != i && other != nil {
			other.Disconnect(raft.ServerAddress(tc.cfgs[i].NodeID))
		}
	}
	tc.mu.Unlock()
}

func (tc *testCluster) stopAll() {
	for i := range tc.nodes {
		tc.stop(i, true)
	}
}

func (tc *testCluster) waitReady(i int) {
	tc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tc.node(i).WaitReady(ctx); err != nil {
		tc.t.Fatalf("%s not ready: %v", tc.cfgs[i].NodeID, err)
	}
}

// leader waits for a node that leads and returns its index.
func (tc *testCluster) leader() int {
	tc.t.Helper()
	var idx int
	waitFor(tc.t, 10*time.Second, "a leader", func() bool {
		for i := range tc.nodes {
			if s := tc.node(i); s != nil && s.IsLeader() {
				idx = i
				return true
			}
		}
		return false
	})
	return idx
}

// follower returns the index of a running node that does not lead.
func (tc *testCluster) follower() int {
	tc.t.Helper()
	l := tc.leader()
	for i := range tc.nodes {
		if i != l && tc.node(i) != nil {
			return i
		}
	}
	tc.t.Fatal("no running follower")
	return -1
}

// waitVoters waits until the leader's configuration has n voters.
func (tc *testCluster) waitVoters(n int) {
	tc.t.Helper()
	waitFor(tc.t, 10*time.Second, fmt.Sprintf("%d voters", n), func() bool {
		s := tc.node(tc.leader())
		if s == nil {
			return false
		}
		f := s.node.raft.GetConfiguration()
		if f.Error() != nil {
			return false
		}
		voters := 0
		for _, srv := range f.Configuration().Servers {
			if srv.Suffrage == raft.Voter {
				voters++
			}
		}
		return voters == n
	})
}

// clients returns gRPC clients to node i.
func (tc *testCluster) clients(i int) (allotv1.AllocatorClient, allotv1.AdminClient) {
	tc.t.Helper()
	return dial(tc.t, tc.node(i).GRPCAddr())
}

func dial(t testing.TB, addr string) (allotv1.AllocatorClient, allotv1.AdminClient) {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { cc.Close() })
	return allotv1.NewAllocatorClient(cc), allotv1.NewAdminClient(cc)
}

// waitFor polls cond every few milliseconds until it holds or the deadline
// passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !until(timeout, cond) {
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

// until polls cond every 5 ms until it holds (true) or timeout passes
// (false).
func until(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// key builds one KeyAcquire for domain "test".
func key(k, v string, want int64) *allotv1.KeyAcquire {
	return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: k, Value: v}}, Want: want}
}
