package allocator

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/allocator/groupdir"
	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"
)

// raftsForTest returns every Raft group of the node: the meta group (or
// the only group), then the data groups.
func (s *Server) raftsForTest() []*raft.Raft {
	out := []*raft.Raft{s.node.raft}
	if s.multi() {
		for _, g := range s.dataGroups() {
			out = append(out, g.node.raft)
		}
	}
	return out
}

// TestGroupsRestart: a one-node cluster with two data groups serves keys,
// snapshots every group (the meta group's snapshot holds the meta state),
// restarts on its data dir with the groups and the key's state intact, and
// refuses to start when a group's directory is missing or the data dir
// belongs to another cluster, naming the path.
func TestGroupsRestart(t *testing.T) {
	dir := t.TempDir()
	addrs := testproc.FreeAddrs(t, 2)
	cfg := DefaultConfig()
	cfg.NodeID, cfg.DataDir = "n0", dir
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = addrs[0], addrs[1], ""
	cfg.Bootstrap, cfg.Groups = true, 2
	cfg.InitialRules = testRuleFiles()
	cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = 250*time.Millisecond, 250*time.Millisecond, 125*time.Millisecond
	cfg.Logger = testLogger(t, slog.LevelWarn)
	start := func() *Server {
		t.Helper()
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := s.WaitReady(ctx); err != nil {
			s.kill()
			t.Fatal(err)
		}
		return s
	}
	stop := func(s *Server) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Error(err)
		}
	}
	acquire := func(s *Server, id uint64) *allotv1.KeyGrant {
		t.Helper()
		alloc, _ := dial(t, s.GRPCAddr())
		resp, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: id, Keys: []*allotv1.KeyAcquire{key("user", "u1", 20)}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetGrants()[0]
	}

	s := start()
	g := acquire(s, 1)
	if g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK || g.GetGranted() == 0 {
		t.Fatalf("first grant %v", g)
	}
	remaining := g.GetRemaining()
	for _, r := range s.raftsForTest() {
		if err := r.Snapshot().Error(); err != nil {
			t.Fatal(err)
		}
	}
	stop(s)

	s = start()
	_, admin := dial(t, s.GRPCAddr())
	st, err := admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if st.GetTopologyVersion() != 1 || len(st.GetGroups()) != 3 || st.GetGroups()[1].GetSlots() != "0-511" || st.GetGroups()[2].GetSlots() != "512-1023" {
		t.Fatalf("after the restart: topology version %d, groups %v", st.GetTopologyVersion(), st.GetGroups())
	}
	if g := acquire(s, 2); g.GetRemaining() > remaining {
		t.Errorf("after the restart the key has %d tokens left, more than the %d before (state lost?)", g.GetRemaining(), remaining)
	}
	mfs, err := s.gather.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var keys float64
	series := 0
	for _, mf := range mfs {
		if mf.GetName() == metricsNamespace+"_group_keys" {
			for _, m := range mf.GetMetric() {
				keys += m.GetGauge().GetValue()
				series++
			}
		}
	}
	if series != 2 || keys != 1 {
		t.Errorf("%s_group_keys: %d series summing to %v, want 2 summing to 1", metricsNamespace, series, keys)
	}
	stop(s)

	// A missing group directory.
	gdir := filepath.Join(dir, groupdir.GroupsDir, "2")
	if err := os.Rename(gdir, gdir+".aside"); err != nil {
		t.Fatal(err)
	}
	if _, err := New(cfg); err == nil || !errors.Is(err, groupdir.ErrMissingGroup) || !strings.Contains(err.Error(), gdir) {
		t.Errorf("start without %s: %v, want ErrMissingGroup naming it", gdir, err)
	}
	if err := os.Rename(gdir+".aside", gdir); err != nil {
		t.Fatal(err)
	}
	// Another cluster's cluster.json.
	other := t.TempDir()
	if _, err := groupdir.Init(other, groupdir.NewClusterID(), "n0"); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(other, groupdir.ClusterFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, groupdir.ClusterFile), b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := New(cfg); err == nil || !errors.Is(err, groupdir.ErrOtherCluster) || !strings.Contains(err.Error(), dir) {
		t.Errorf("start with another cluster's %s: %v, want ErrOtherCluster naming the path", groupdir.ClusterFile, err)
	}
}

// TestGroupsConfig: Groups is refused without Bootstrap, with Join and on a
// single-group data dir.
func TestGroupsConfig(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NodeID, cfg.DataDir = "n0", t.TempDir()
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0", ""
	cfg.Groups = 2
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "Groups needs Bootstrap") {
		t.Errorf("Groups without Bootstrap: %v", err)
	}
	cfg.Join = "127.0.0.1:1"
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "Groups and Join") {
		t.Errorf("Groups with Join: %v", err)
	}
	cfg.Join, cfg.Bootstrap, cfg.Groups = "", true, -1
	if err := cfg.Validate(); err == nil {
		t.Errorf("Groups -1: no error")
	}
	// A single-group node's data dir.
	cfg.Groups = 1
	cfg.Logger = testLogger(t, slog.LevelWarn)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.kill()
	cfg.Groups = 2
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), cfg.DataDir) {
		t.Errorf("Groups 2 on a single-group data dir: %v, want an error naming it", err)
	}
}

// TestGroupsPackedKeys: in a cluster with several groups, a call whose
// keys come packed is split among the groups as the same call unpacked is
// (its retry unpacked gets the same grants), and the answer keeps the
// topology the caller lacks.
func TestGroupsPackedKeys(t *testing.T) {
	s := startOneNodeGroups(t, 2)
	alloc, _ := dial(t, s.GRPCAddr())
	var keys []*allotv1.KeyAcquire
	for i := range 16 { // over both groups' slots
		keys = append(keys, key("user", "u"+strconv.Itoa(i), 5))
	}
	packed, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, PackedGrants: true,
		PackedKeys: allotv1.AppendPackedKeys(nil, keys)})
	if err != nil {
		t.Fatal(err)
	}
	got, err := allotv1.GrantsOf(packed)
	if err != nil || len(got) != len(keys) {
		t.Fatalf("%d grants, %v", len(got), err)
	}
	if packed.GetTopology() == nil || !packed.GetReadsPackedKeys() {
		t.Errorf("answer %v: want the topology and reads_packed_keys", packed)
	}
	plain, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	for i, g := range plain.GetGrants() {
		if !proto.Equal(g, got[i]) || g.GetGranted() != 5 {
			t.Errorf("grant %d: packed %v, unpacked retry %v; want 5 granted", i, got[i], g)
		}
	}
}
