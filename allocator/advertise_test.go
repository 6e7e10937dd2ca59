package allocator

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// relay is a TCP proxy on 127.0.0.1:0 whose target can change: it stands
// for a stable name (a Kubernetes pod's DNS name) in front of a node whose
// bound port changes across restarts. Its goroutines end with close.
type relay struct {
	ln     net.Listener
	target atomic.Pointer[string]
	conns  atomic.Int64 // connections forwarded

	mu     sync.Mutex // guards open and closed
	open   map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

func newRelay(t testing.TB) *relay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &relay{ln: ln, open: make(map[net.Conn]struct{})}
	empty := ""
	r.target.Store(&empty)
	r.wg.Add(1)
	go r.accept()
	t.Cleanup(r.close)
	return r
}

// name is the relay's address under the name "localhost", resolved by
// whoever dials it.
func (r *relay) name() string {
	_, port, _ := net.SplitHostPort(r.ln.Addr().String())
	return "localhost:" + port
}

func (r *relay) setTarget(addr string) { r.target.Store(&addr) }

func (r *relay) accept() {
	defer r.wg.Done()
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		target := *r.target.Load()
		if target == "" {
			c.Close() // like a pod not started yet: connection refused
			continue
		}
		up, err := net.DialTimeout("tcp", target, time.Second)
		if err != nil {
			c.Close()
			continue
		}
		if !r.track(c, up) {
			return
		}
		r.conns.Add(1)
		r.wg.Add(2)
		go r.pipe(c, up)
		go r.pipe(up, c)
	}
}

// track registers a connection pair; false once the relay is closed.
func (r *relay) track(cs ...net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		for _, c := range cs {
			c.Close()
		}
		return false
	}
	for _, c := range cs {
		r.open[c] = struct{}{}
	}
	return true
}

func (r *relay) pipe(dst, src net.Conn) {
	defer r.wg.Done()
	_, _ = io.Copy(dst, src)
	dst.Close()
	src.Close()
	r.mu.Lock()
	delete(r.open, dst)
	delete(r.open, src)
	r.mu.Unlock()
}

func (r *relay) close() {
	r.mu.Lock()
	r.closed = true
	for c := range r.open {
		c.Close()
	}
	r.mu.Unlock()
	r.ln.Close()
	r.wg.Wait()
}

// advertisedCluster is n nodes over TCP Raft, each bound to 127.0.0.1:0
// and advertising "localhost:<relay port>" for gRPC, Raft and HTTP.
type advertisedCluster struct {
	*testCluster
	grpc, raft, http []*relay
}

func newAdvertisedCluster(t *testing.T, n int) *advertisedCluster {
	t.Helper()
	ac := &advertisedCluster{}
	for range n {
		ac.grpc = append(ac.grpc, newRelay(t))
		ac.raft = append(ac.raft, newRelay(t))
		ac.http = append(ac.http, newRelay(t))
	}
	ac.testCluster = &testCluster{t: t, tcpRaft: true, nodes: make([]*Server, n), trans: make([]*raft.InmemTransport, n)}
	logger := testLogger(t, slog.LevelInfo)
	base := t.TempDir()
	for i := range n {
		cfg := DefaultConfig()
		cfg.NodeID = fmt.Sprintf("n%d", i)
		cfg.DataDir = filepath.Join(base, cfg.NodeID)
		cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
		cfg.AdvertiseGRPCAddr, cfg.AdvertiseRaftAddr, cfg.AdvertiseHTTPAddr = ac.grpc[i].name(), ac.raft[i].name(), ac.http[i].name()
		cfg.HeartbeatTimeout = 250 * time.Millisecond
		cfg.ElectionTimeout = 250 * time.Millisecond
		cfg.LeaderLeaseTimeout = 125 * time.Millisecond
		cfg.ExpireInterval = 200 * time.Millisecond
		cfg.ForwardWait = 3 * time.Second
		cfg.Logger = logger.With("test_node", cfg.NodeID)
		if i == 0 {
			cfg.Bootstrap = true
			cfg.InitialRules = testRuleFiles()
		} else {
			cfg.Join = ac.grpc[0].name() // through the name, not the bound port
		}
		ac.cfgs = append(ac.cfgs, cfg)
	}
	t.Cleanup(ac.stopAll)
	ac.startNode(0)
	ac.waitReady(0)
	for i := 1; i < n; i++ {
		ac.startNode(i)
	}
	for i := range n {
		ac.waitReady(i)
	}
	ac.waitVoters(n)
	ac.waitMembers(n)
	return ac
}

// startNode starts node i (on fresh bound ports) and points its relays at
// the ports it bound.
func (ac *advertisedCluster) startNode(i int) {
	ac.t.Helper()
	ac.start(i)
	s := ac.node(i)
	ac.grpc[i].setTarget(s.GRPCAddr())
	ac.raft[i].setTarget(s.RaftAddr())
	ac.http[i].setTarget(s.HTTPAddr())
}

// raftServers returns the Raft configuration as node i sees it.
func raftServers(t testing.TB, s *Server) map[string]string {
	t.Helper()
	f := s.node.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, srv := range f.Configuration().Servers {
		out[string(srv.ID)] = string(srv.Address)
	}
	return out
}

// TestAdvertiseAddresses: nodes bound to 127.0.0.1:<random> that advertise
// localhost:<relay> form a cluster through the advertised names only (the
// Raft configuration, the member records, ClusterStatus, leader hints and
// forwarding all use them), and the whole cluster restarts on new bound
// ports behind the same names, which is a Kubernetes StatefulSet whose pods
// all get new IPs.
func TestAdvertiseAddresses(t *testing.T) {
	ac := newAdvertisedCluster(t, 3)
	l := ac.leader()
	ls := ac.node(l)

	for i := range ac.nodes {
		s := ac.node(i)
		if s.AdvertiseRaftAddr() != ac.raft[i].name() || s.AdvertiseGRPCAddr() != ac.grpc[i].name() ||
			s.AdvertiseHTTPAddr() != ac.http[i].name() {
			t.Errorf("n%d advertises %s %s %s", i, s.AdvertiseGRPCAddr(), s.AdvertiseRaftAddr(), s.AdvertiseHTTPAddr())
		}
		if !strings.HasPrefix(s.RaftAddr(), "127.0.0.1:") || s.RaftAddr() == s.AdvertiseRaftAddr() {
			t.Errorf("n%d RaftAddr() = %q, want the bound address", i, s.RaftAddr())
		}
	}
	for id, addr := range raftServers(t, ls) {
		var i int
		fmt.Sscanf(id, "n%d", &i)
		if addr != ac.raft[i].name() {
			t.Errorf("Raft configuration: %s at %s, want %s", id, addr, ac.raft[i].name())
		}
	}
	_, fadmin := ac.clients((l + 1) % 3)
	st, err := fadmin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range st.GetMembers() {
		var i int
		fmt.Sscanf(m.GetId(), "n%d", &i)
		if m.GetRaftAddr() != ac.raft[i].name() || m.GetGrpcAddr() != ac.grpc[i].name() || m.GetHttpAddr() != ac.http[i].name() {
			t.Errorf("ClusterStatus member %v, want the advertised addresses", m)
		}
	}
	// A follower's leader hint is the leader's advertised gRPC address, and
	// it forwards there. Both are about one leader: an election under load
	// (250 ms timeouts) that moves it during the check runs it again.
	var reqID uint64
	inStableTerm(t, ac.testCluster, func(l int) string {
		ls, f := ac.node(l), (l+1)%3
		var id, addr string
		if !until(5*time.Second, func() bool {
			id, addr = ac.node(f).Leader()
			return id == ls.NodeID() && addr == ac.grpc[l].name()
		}) {
			return fmt.Sprintf("leader hint on n%d = %s at %s, want %s at %s", f, id, addr, ls.NodeID(), ac.grpc[l].name())
		}
		falloc, _ := ac.clients(f)
		reqID++
		if _, err := falloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "adv", RequestId: reqID,
			Keys: []*allotv1.KeyAcquire{key("user", "adv", 5)}}); err != nil {
			return fmt.Sprintf("Acquire through follower n%d: %v", f, err)
		}
		if !ac.node(f).fwd.has(ac.grpc[l].name()) || ac.grpc[l].conns.Load() == 0 {
			return "the follower did not forward through the leader's advertised address"
		}
		return ""
	})
	for i := range ac.nodes {
		if i != l && ac.raft[i].conns.Load() == 0 {
			t.Errorf("the leader's Raft connections to n%d did not go through its advertised address", i)
		}
	}

	// The whole cluster stops and comes back on other bound ports behind
	// the same names.
	for i := range ac.nodes {
		ac.stop(i, false)
	}
	for i := range ac.nodes {
		ac.grpc[i].setTarget("")
		ac.raft[i].setTarget("")
		ac.http[i].setTarget("")
	}
	for i := range ac.nodes {
		ac.startNode(i)
	}
	for i := range ac.nodes {
		ac.waitReady(i)
	}
	for i := range ac.nodes {
		s := ac.node(i)
		waitFor(t, 20*time.Second, fmt.Sprintf("n%d's address check", i), func() bool { return s.reregisterOutcome() != "" })
		if got := s.reregisterOutcome(); got != outcomeUnchanged {
			t.Errorf("n%d: address check %q, want %q (the names did not change)", i, got, outcomeUnchanged)
		}
	}
	ls = ac.node(ac.leader())
	if v := ls.rulesVersion(); v != 1 {
		t.Errorf("rules version after the restart = %d, want 1", v)
	}
	for id, addr := range raftServers(t, ls) {
		var i int
		fmt.Sscanf(id, "n%d", &i)
		if addr != ac.raft[i].name() {
			t.Errorf("after the restart: Raft configuration has %s at %s, want %s", id, addr, ac.raft[i].name())
		}
	}
	// Every node is a working member: a write reaches all of them, and
	// each serves (forwards) an Acquire. The write is conditional on
	// version 1: a put that an election interrupted ("leadership lost
	// while committing log") may still have committed, and is put again
	// only if it did not.
	newRules := []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(strings.Replace(testRules, "burst: 50", "burst: 60", 1))}}
	inStableTerm(t, ac.testCluster, func(l int) string {
		s := ac.node(l)
		if s.rulesVersion() == 2 {
			return ""
		}
		_, admin := ac.clients(l)
		_, err := admin.PutRules(ctxT(t), &allotv1.PutRulesRequest{ExpectedVersion: 1, Files: newRules})
		if err != nil && s.rulesVersion() != 2 {
			return fmt.Sprintf("PutRules on the leader n%d: %v", l, err)
		}
		return ""
	})
	for i := range ac.nodes {
		s := ac.node(i)
		waitFor(t, 10*time.Second, fmt.Sprintf("n%d applies rules version 2", i), func() bool { return s.rulesVersion() == 2 })
		alloc, _ := ac.clients(i)
		inStableTerm(t, ac.testCluster, func(int) string {
			if _, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: fmt.Sprintf("after-%d", i), RequestId: 1,
				Keys: []*allotv1.KeyAcquire{key("user", "adv", 1)}}); err != nil {
				return fmt.Sprintf("Acquire through n%d after the restart: %v", i, err)
			}
			return ""
		})
	}
}

// TestMovedNodeReregisters: a follower that comes back at a new address
// (no advertise address: its bound port changed) re-registers itself, so
// the leader reaches it again without an operator; a node removed while it
// was down does not add itself back.
func TestMovedNodeReregisters(t *testing.T) {
	tc := newTCPTestCluster(t, 3)
	ctx := ctxT(t)
	l := tc.leader()
	f := (l + 1) % 3
	oldRaft := tc.node(f).RaftAddr()
	tc.stop(f, true)
	// Join names a member that is up (n0, the bootstrapping node, may be the
	// one restarting: a node restarted with its data dir does not bootstrap,
	// and Bootstrap with Join is refused).
	tc.cfgs[f].Join = tc.node(l).GRPCAddr()
	tc.cfgs[f].Bootstrap = false
	tc.start(f) // 127.0.0.1:0 again: new ports
	s := tc.node(f)
	if s.AdvertiseRaftAddr() == oldRaft {
		t.Fatalf("the restarted node kept its Raft port %s", oldRaft)
	}
	waitFor(t, 20*time.Second, "the leader's configuration to hold the new address", func() bool {
		ls := tc.node(tc.leader())
		return raftServers(t, ls)[s.NodeID()] == s.AdvertiseRaftAddr()
	})
	waitFor(t, 10*time.Second, "the re-register loop to end", func() bool { return s.reregisterOutcome() != "" })
	if got := s.reregisterOutcome(); got != outcomeReregistered {
		t.Errorf("outcome %q, want %q", got, outcomeReregistered)
	}
	_, admin := tc.clients(tc.leader())
	if _, err := admin.PutRules(ctx, &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "test.yaml",
		Yaml: []byte(strings.Replace(testRules, "burst: 50", "burst: 70", 1))}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the moved node to apply the new rules", func() bool { return s.rulesVersion() == 2 })

	// Removed while down: it must stay out.
	tc.stop(f, true)
	if _, err := admin.RemoveServer(ctx, &allotv1.RemoveServerRequest{Id: s.NodeID()}); err != nil {
		t.Fatal(err)
	}
	tc.start(f)
	s = tc.node(f)
	waitFor(t, 20*time.Second, "the re-register loop to end", func() bool { return s.reregisterOutcome() != "" })
	if got := s.reregisterOutcome(); got != outcomeNotMember {
		t.Errorf("outcome %q, want %q", got, outcomeNotMember)
	}
	if _, ok := raftServers(t, tc.node(tc.leader()))[s.NodeID()]; ok {
		t.Error("the removed node is back in the configuration")
	}
}

// TestMovedSingleNode: a one-node cluster restarted on new ports leads
// and fixes its own Raft address, also from a data directory without the
// address record (an older version's).
func TestMovedSingleNode(t *testing.T) {
	dir := t.TempDir()
	s, err := New(testNodeConfig(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	waitReady(t, s)
	first := s.AdvertiseRaftAddr()
	if rec, ok, err := readAdvertised(dir); err != nil || !ok || rec.Raft != first {
		t.Fatalf("record after the first start: %+v %v %v, want raft %s", rec, ok, err, first)
	}
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}

	s, err = New(testNodeConfig(t, dir)) // port 0: new ports
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(context.Background()) }()
	waitFor(t, 20*time.Second, "the address check", func() bool { return s.reregisterOutcome() != "" })
	if got := s.reregisterOutcome(); got != outcomeReregistered {
		t.Errorf("outcome %q, want %q", got, outcomeReregistered)
	}
	if got := raftServers(t, s)[s.NodeID()]; got != s.AdvertiseRaftAddr() || got == first {
		t.Errorf("configuration holds %s, want the new %s", got, s.AdvertiseRaftAddr())
	}
	if rec, _, _ := readAdvertised(dir); rec.Raft != s.AdvertiseRaftAddr() {
		t.Errorf("record %+v, want raft %s", rec, s.AdvertiseRaftAddr())
	}
	alloc, _ := dial(t, s.GRPCAddr())
	if _, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "moved", RequestId: 1,
		Keys: []*allotv1.KeyAcquire{key("user", "m", 1)}}); err != nil {
		t.Fatalf("Acquire after the move: %v", err)
	}
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}

	// No record (a data directory from an older version): the replica's
	// own view of the node stands in for it.
	if err := os.Remove(filepath.Join(dir, advertisedFile)); err != nil {
		t.Fatal(err)
	}
	s, err = New(testNodeConfig(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "the address check without a record", func() bool { return s.reregisterOutcome() != "" })
	if got := s.reregisterOutcome(); got != outcomeReregistered {
		t.Errorf("without a record: outcome %q, want %q", got, outcomeReregistered)
	}
	if rec, ok, _ := readAdvertised(dir); !ok || rec.Raft != s.AdvertiseRaftAddr() {
		t.Errorf("without a record: now %+v, want raft %s", rec, s.AdvertiseRaftAddr())
	}
}

// TestReregisterDecision: a moved node re-registers only over its own old
// addresses; it leaves alone what an operator registered, and does not
// add itself back once removed.
func TestReregisterDecision(t *testing.T) {
	m := func(raft, grpc, http string) *allotv1.Member {
		return &allotv1.Member{Id: "n", RaftAddr: raft, GrpcAddr: grpc, HttpAddr: http}
	}
	old, cur := m("10.0.0.1:7421", "10.0.0.1:7420", "10.0.0.1:7422"), m("a-1.peers:7421", "a-1.peers:7420", "a-1.peers:7422")
	for _, tt := range []struct {
		name string
		rec  *allotv1.Member
		want string
	}{
		{"removed", nil, outcomeNotMember},
		{"already new", m("a-1.peers:7421", "a-1.peers:7420", "a-1.peers:7422"), outcomeConfirmed},
		{"new raft, member record not applied yet", m("a-1.peers:7421", "", ""), outcomeConfirmed},
		{"old", m("10.0.0.1:7421", "10.0.0.1:7420", "10.0.0.1:7422"), outcomeReregistered},
		{"old raft only", m("10.0.0.1:7421", "", ""), outcomeReregistered},
		{"old raft, new grpc (it led after it moved)", m("10.0.0.1:7421", "a-1.peers:7420", ""), outcomeReregistered},
		{"a proxy by hand", m("proxy:9000", "10.0.0.1:7420", "10.0.0.1:7422"), outcomeElsewhere},
		{"old raft, a gRPC proxy by hand", m("10.0.0.1:7421", "proxy:9000", ""), outcomeElsewhere},
	} {
		if got := reregisterDecision(tt.rec, old, cur); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
	// Only the gRPC port moved (the Raft address is the same).
	old2, cur2 := m("r:1", "g:1", ""), m("r:1", "g:2", "")
	if got := reregisterDecision(m("r:1", "g:1", ""), old2, cur2); got != outcomeReregistered {
		t.Errorf("gRPC port moved: %q, want %q", got, outcomeReregistered)
	}
}

// TestAdvertiseValidation: a listen address on 0.0.0.0 needs an advertise
// address; advertise addresses need a host and an explicit port.
func TestAdvertiseValidation(t *testing.T) {
	good := DefaultConfig()
	good.NodeID, good.DataDir = "a", "/tmp/x"
	// Off loopback, authentication (or Insecure) is required too: this test
	// is about the addresses (TestOpenAdminRefusedOffLoopback covers that).
	good.AdminTokens = []string{testToken}
	for name, tt := range map[string]struct {
		mut  func(*Config)
		want string // "" valid; else a part of the error
	}{
		"wildcard bind advertised": {func(c *Config) {
			c.GRPCAddr, c.RaftAddr, c.HTTPAddr = "0.0.0.0:7420", ":7421", "0.0.0.0:7422"
			c.AdvertiseGRPCAddr, c.AdvertiseRaftAddr, c.AdvertiseHTTPAddr = "a-0.peers:7420", "a-0.peers:7421", "a-0.peers:7422"
		}, ""},
		"wildcard bind not advertised": {func(c *Config) { c.RaftAddr = "0.0.0.0:7421" }, "RaftAddr"},
		"advertise port 0":             {func(c *Config) { c.AdvertiseGRPCAddr = "a-0.peers:0" }, "AdvertiseGRPCAddr"},
		"advertise no port":            {func(c *Config) { c.AdvertiseRaftAddr = "a-0.peers" }, "AdvertiseRaftAddr"},
		"advertise wildcard":           {func(c *Config) { c.AdvertiseRaftAddr = "0.0.0.0:7421" }, "AdvertiseRaftAddr"},
		"advertise no host":            {func(c *Config) { c.AdvertiseGRPCAddr = ":7420" }, "AdvertiseGRPCAddr"},
		"advertise http without http":  {func(c *Config) { c.HTTPAddr, c.AdvertiseHTTPAddr = "", "a:1" }, "AdvertiseHTTPAddr"},
	} {
		c := good
		tt.mut(&c)
		err := c.Validate()
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%s: %v", name, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("%s: Validate() = %v, want an error about %s", name, err, tt.want)
		}
	}
}

// TestSnapshotMetrics: a forced snapshot shows in /metrics (capture and
// persist times, size, the newest snapshot's index and time), and a
// restart restores from it (restore time).
func TestSnapshotMetrics(t *testing.T) {
	dir := t.TempDir()
	start := time.Now()
	s, err := New(testNodeConfig(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Shutdown(context.Background())
	waitReady(t, s)
	alloc, _ := dial(t, s.GRPCAddr())
	if _, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "snap", RequestId: 1,
		Keys: []*allotv1.KeyAcquire{key("user", "a", 5), key("user", "b", 5)}}); err != nil {
		t.Fatal(err)
	}
	body := scrape(t, s.HTTPAddr())
	for _, want := range []string{"allot_allocator_snapshot_capture_seconds_count 0", "allot_allocator_snapshot_last_index 0"} {
		if !strings.Contains(body, want+"\n") {
			t.Errorf("before any snapshot, /metrics lacks %q", want)
		}
	}
	if err := s.node.raft.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	index := parseUint(s.node.raft.Stats()["last_snapshot_index"])
	body = scrape(t, s.HTTPAddr())
	for _, want := range []string{
		"allot_allocator_snapshot_capture_seconds_count 1",
		"allot_allocator_snapshot_persist_seconds_count 1",
		"allot_allocator_snapshot_bytes_count 1",
		fmt.Sprintf("allot_allocator_snapshot_last_index %d", index),
	} {
		if !strings.Contains(body, want+"\n") {
			t.Errorf("after a snapshot, /metrics lacks %q", want)
		}
	}
	if v := sample(t, body, "allot_allocator_snapshot_bytes_sum"); v < 32 {
		t.Errorf("snapshot_bytes_sum = %v, want the snapshot's size", v)
	}
	if v := sample(t, body, "allot_allocator_snapshot_last_timestamp_seconds"); v < float64(start.Unix()-1) || v > float64(time.Now().Unix()+1) {
		t.Errorf("snapshot_last_timestamp_seconds = %v, want between %d and now", v, start.Unix())
	}

	// A restart restores the snapshot and reports it at once.
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	cfg := testNodeConfig(t, dir)
	s2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Shutdown(context.Background())
	body = scrape(t, s2.HTTPAddr())
	for _, want := range []string{
		"allot_allocator_snapshot_restore_seconds_count 1",
		fmt.Sprintf("allot_allocator_snapshot_last_index %d", index),
	} {
		if !strings.Contains(body, want+"\n") {
			t.Errorf("after a restart, /metrics lacks %q", want)
		}
	}
}

func scrape(t testing.TB, httpAddr string) string {
	t.Helper()
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("/metrics = %d, %v", resp.StatusCode, err)
	}
	// The failure counters exist from the start, at 0 while nothing failed.
	for _, stage := range snapshotStages {
		if !strings.Contains(string(b), `allot_allocator_snapshot_failures_total{stage="`+stage+`"} 0`+"\n") {
			t.Errorf("a snapshot stage failed, or its counter is missing:\n%s", grepLines(string(b), "snapshot_failures_total"))
		}
	}
	return string(b)
}

// sample returns the value of the first sample named exactly name.
func sample(t testing.TB, body, name string) float64 {
	t.Helper()
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			var f float64
			if _, err := fmt.Sscan(v, &f); err == nil {
				return f
			}
		}
	}
	t.Fatalf("no sample %s", name)
	return 0
}
