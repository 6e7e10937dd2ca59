package raftmux

import (
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// logFSM records the data of every entry it applies, once: a test
// retries an Apply that failed with a change of leader, and the first
// attempt may have been committed after all.
type logFSM struct {
	mu      sync.Mutex // guards entries
	entries []string
}

func (f *logFSM) Apply(l *raft.Log) any {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !slices.Contains(f.entries, string(l.Data)) {
		f.entries = append(f.entries, string(l.Data))
	}
	return len(f.entries)
}

func (f *logFSM) get() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.entries)
}

func (f *logFSM) Snapshot() (raft.FSMSnapshot, error) { return logSnap(f.get()), nil }

func (f *logFSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	var e []string
	if err := json.NewDecoder(rc).Decode(&e); err != nil {
		return err
	}
	f.mu.Lock()
	f.entries = e
	f.mu.Unlock()
	return nil
}

type logSnap []string

func (s logSnap) Persist(sink raft.SnapshotSink) error {
	if err := json.NewEncoder(sink).Encode([]string(s)); err != nil {
		_ = sink.Cancel()
		return err
	}
	return sink.Close()
}

func (logSnap) Release() {}

// tWriter sends raft's log lines to t.Log.
type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// group is one replica of one Raft group: raft on bolt, over a Stream.
type group struct {
	raft  *raft.Raft
	fsm   *logFSM
	trans *raft.NetworkTransport
	store *raftboltdb.BoltStore
	up    bool
}

func (g *group) stop(t testing.TB) {
	t.Helper()
	if !g.up {
		return
	}
	g.up = false
	if err := g.raft.Shutdown().Error(); err != nil {
		t.Errorf("raft shutdown: %v", err)
	}
	g.trans.CloseStreams()
	_ = g.trans.Close()
	_ = g.store.Close()
}

type node struct {
	id     string
	dir    string
	mux    *Mux
	groups map[uint32]*group
}

type cluster struct {
	t     testing.TB
	nodes []*node
	ids   []uint32
}

// newCluster starts n nodes on 127.0.0.1, each with a Mux from cfg(i) and
// a bolt-backed replica of every group in ids, all groups bootstrapped
// with every node a voter.
func newCluster(t testing.TB, n int, ids []uint32, cfg func(i int) Config) *cluster {
	t.Helper()
	c := &cluster{t: t, ids: ids}
	t.Cleanup(c.close)
	for i := range n {
		mc := cfg(i)
		var m *Mux
		var err error
		if mc.Listener != nil {
			m, err = New(mc)
		} else {
			m, err = Listen("127.0.0.1:0", mc)
		}
		if err != nil {
			t.Fatal(err)
		}
		c.nodes = append(c.nodes, &node{id: fmt.Sprintf("n%d", i), dir: t.TempDir(), mux: m, groups: map[uint32]*group{}})
	}
	var servers []raft.Server
	for _, o := range c.nodes {
		servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(o.id), Address: raft.ServerAddress(o.mux.Addr().String())})
	}
	for _, nd := range c.nodes {
		for _, id := range ids {
			c.startWith(nd, id, servers, nil)
		}
	}
	return c
}

// start restarts a replica from its data.
func (c *cluster) start(nd *node, id uint32) { c.startWith(nd, id, nil, nil) }

// startWith starts nd's replica of group id, bootstrapping it with
// servers unless nil, over trans or (nil) over a Stream of nd's Mux.
func (c *cluster) startWith(nd *node, id uint32, servers []raft.Server, trans *raft.NetworkTransport) {
	t := c.t
	t.Helper()
	logger := hclog.New(&hclog.LoggerOptions{Name: fmt.Sprintf("%s/g%d", nd.id, id), Output: tWriter{t}, Level: hclog.Warn})
	if trans == nil {
		s, err := nd.mux.Group(id)
		if err != nil {
			t.Fatal(err)
		}
		trans = raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
			Stream: s, MaxPool: 3, Timeout: 2 * time.Second, Logger: logger,
		})
	}
	dir := filepath.Join(nd.dir, fmt.Sprint(id))
	store, err := raftboltdb.New(raftboltdb.Options{Path: dir + ".db"})
	if err != nil {
		t.Fatal(err)
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(dir, 1, logger)
	if err != nil {
		t.Fatal(err)
	}
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(nd.id)
	rc.HeartbeatTimeout = 250 * time.Millisecond
	rc.ElectionTimeout = 250 * time.Millisecond
	rc.LeaderLeaseTimeout = 125 * time.Millisecond
	rc.CommitTimeout = 5 * time.Millisecond
	rc.TrailingLogs = 2 // a compacted log sends a lagging replica a snapshot
	rc.Logger = logger
	if servers != nil {
		if err := raft.BootstrapCluster(rc, store, store, snaps, trans, raft.Configuration{Servers: servers}); err != nil {
			t.Fatal(err)
		}
	}
	f := &logFSM{}
	r, err := raft.NewRaft(rc, f, store, store, snaps, trans)
	if err != nil {
		t.Fatal(err)
	}
	nd.groups[id] = &group{raft: r, fsm: f, trans: trans, store: store, up: true}
}

func (c *cluster) close() {
	for _, nd := range c.nodes {
		for _, g := range nd.groups {
			g.stop(c.t)
		}
	}
	for _, nd := range c.nodes {
		if nd.mux == nil {
			continue
		}
		if err := nd.mux.Close(); err != nil {
			c.t.Errorf("mux close: %v", err)
		}
	}
}

// waitFor polls cond until it holds or d passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// leader waits for a replica of group id that is leader and returns its
// node's index.
func (c *cluster) leader(id uint32) int {
	c.t.Helper()
	idx := -1
	waitFor(c.t, 10*time.Second, fmt.Sprintf("a leader of group %d", id), func() bool {
		for i, nd := range c.nodes {
			if g := nd.groups[id]; g != nil && g.up && g.raft.State() == raft.Leader {
				idx = i
				return true
			}
		}
		return false
	})
	return idx
}

// apply commits data in group id through its leader, retrying across a
// change of leader.
func (c *cluster) apply(id uint32, data string) {
	c.t.Helper()
	c.applyNotVia(id, data, -1)
}

// applyNotVia is apply through a leader other than node not: while node
// not leads group id, its leadership is transferred away first.
func (c *cluster) applyNotVia(id uint32, data string, not int) {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l := c.leader(id)
		g := c.nodes[l].groups[id]
		var err error
		if l == not {
			err = g.raft.LeadershipTransfer().Error()
		} else if err = g.raft.Apply([]byte(data), 2*time.Second).Error(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("apply %q in group %d: %v", data, id, err)
		}
	}
}

// waitReplicated waits until every running replica of group id holds
// exactly want.
func (c *cluster) waitReplicated(id uint32, want []string) {
	c.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var behind string
		for _, nd := range c.nodes {
			if g := nd.groups[id]; g != nil && g.up {
				if got := g.fsm.get(); !slices.Equal(got, want) {
					behind = fmt.Sprintf("%s holds %v", nd.id, got)
					break
				}
			}
		}
		if behind == "" {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("group %d: want %v on every replica, but %s", id, want, behind)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Three groups on three nodes, each node one Mux: every group elects and
// replicates only its own entries; stopping one group's leader fails that
// group over while the others keep committing; the stopped replica comes
// back on the same Mux, re-registering its group, and catches up from a
// snapshot sent through the Mux.
func TestGroupsElectReplicateFailOver(t *testing.T) {
	ids := []uint32{0, 1, 2}
	c := newCluster(t, 3, ids, func(int) Config { return Config{} })
	want := map[uint32][]string{}
	put := func(id uint32, n int) {
		for range n {
			e := fmt.Sprintf("g%d-%d", id, len(want[id]))
			c.apply(id, e)
			want[id] = append(want[id], e)
		}
	}
	for _, id := range ids {
		put(id, 5)
	}
	for _, id := range ids {
		c.waitReplicated(id, want[id])
	}

	old := c.leader(1)
	c.nodes[old].groups[1].stop(t)
	if l := c.leader(1); l == old {
		t.Fatalf("group 1 leader still node %d after stopping it", old)
	}
	for _, id := range ids {
		put(id, 3)
	}
	for _, id := range ids {
		c.waitReplicated(id, want[id])
	}
	// The other groups' replicas on the node kept running.
	for _, id := range []uint32{0, 2} {
		if got := c.nodes[old].groups[id].fsm.get(); !slices.Equal(got, want[id]) {
			t.Fatalf("node %d group %d = %v, want %v", old, id, got, want[id])
		}
	}

	// Compact group 1's log past what the stopped replica holds, so that
	// it catches up by an InstallSnapshot through the Mux.
	put(1, 5)
	for _, nd := range c.nodes {
		if g := nd.groups[1]; g.up {
			if err := g.raft.Snapshot().Error(); err != nil {
				t.Fatal(err)
			}
		}
	}
	c.start(c.nodes[old], 1)
	put(1, 2)
	c.waitReplicated(1, want[1])
	if s := c.nodes[old].groups[1].raft.Stats()["last_snapshot_index"]; s == "" || s == "0" {
		t.Fatal("the restarted replica caught up without a snapshot")
	}
}
