package allocator

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/internal/proccpu"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// startOneNodeGroups starts a one-node cluster with groups data groups on
// loopback, ready to serve; it shuts down when the test ends.
func startOneNodeGroups(t testing.TB, groups int) *Server {
	t.Helper()
	addrs := testproc.FreeAddrs(t, 2)
	cfg := DefaultConfig()
	cfg.NodeID, cfg.DataDir = "n0", t.TempDir()
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = addrs[0], addrs[1], ""
	cfg.Bootstrap, cfg.Groups = true, groups
	cfg.InitialRules = testRuleFiles()
	cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = 250*time.Millisecond, 250*time.Millisecond, 125*time.Millisecond
	cfg.Logger = testLogger(t, slog.LevelWarn)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Error(err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := s.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestGroupsAddressedCall: a call addressed to a group goes whole to that
// group's state machine, its keys packed or not. The group's own keys are
// granted; a key of another group is answered MOVED with its canonical
// key, neither granted nor charged anywhere, and the answer carries the
// topology although the caller's is current; without a MOVED key and with
// a current topology the answer carries none; the call retried with its
// keys as messages gets the recorded grants back.
func TestGroupsAddressedCall(t *testing.T) {
	s := startOneNodeGroups(t, 2)
	alloc, admin := dial(t, s.GRPCAddr())
	even, err := slots.Even(1, []slots.GroupID{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	var keys []*allotv1.KeyAcquire
	var owners []slots.GroupID
	var own1 []*allotv1.KeyAcquire
	for i := 0; len(keys) < 16; i++ {
		v := "u" + strconv.Itoa(i)
		g := even.Owner(slots.OfKey("test:user=" + v))
		keys, owners = append(keys, key("user", v, 5)), append(owners, g)
		if g == 1 {
			own1 = append(own1, key("user", v, 5))
		}
	}
	if len(own1) == 0 || len(own1) == len(keys) {
		t.Fatalf("keys over one group only: %v", owners)
	}
	packed, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Group: 1, TopologyVersion: 1,
		PackedGrants: true, PackedKeys: allotv1.AppendPackedKeys(nil, keys)})
	if err != nil {
		t.Fatal(err)
	}
	got, err := allotv1.GrantsOf(packed)
	if err != nil || len(got) != len(keys) {
		t.Fatalf("%d grants, %v", len(got), err)
	}
	for i, g := range got {
		want := "test:user=" + keys[i].GetEntries()[0].GetValue()
		switch {
		case owners[i] == 1 && (g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK || g.GetGranted() != 5):
			t.Errorf("grant %d (group 1's key): %v, want OK with 5 granted", i, g)
		case owners[i] == 2 && (g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_MOVED || g.GetGranted() != 0 || g.GetKey() != want):
			t.Errorf("grant %d (group 2's key): %v, want MOVED with key %s and nothing granted", i, g, want)
		}
	}
	if topo := packed.GetTopology(); topo.GetVersion() != 1 || len(topo.GetGroups()) != 2 || !packed.GetReadsPackedKeys() {
		t.Errorf("answer with MOVED keys: topology %v, reads_packed_keys %v; want the topology and true", topo, packed.GetReadsPackedKeys())
	}
	st, err := admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range st.GetGroups() {
		want := uint64(0)
		if g.GetId() == 1 {
			want = uint64(len(own1))
		}
		if g.GetId() != 0 && g.GetKeys() != want {
			t.Errorf("group %d tracks %d keys, want %d (MOVED keys are tracked nowhere)", g.GetId(), g.GetKeys(), want)
		}
	}

	plain, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Group: 1, TopologyVersion: 1, Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	for i, g := range plain.GetGrants() {
		if !proto.Equal(g, got[i]) {
			t.Errorf("grant %d: packed %v, retried as messages %v", i, got[i], g)
		}
	}

	own, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Group: 1, TopologyVersion: 1,
		PackedGrants: true, PackedKeys: allotv1.AppendPackedKeys(nil, own1)})
	if err != nil {
		t.Fatal(err)
	}
	if own.GetTopology() != nil {
		t.Errorf("answer to a caller with the current topology and no MOVED key carries topology %v", own.GetTopology())
	}
	stale, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 3, Group: 1,
		PackedGrants: true, PackedKeys: allotv1.AppendPackedKeys(nil, own1)})
	if err != nil {
		t.Fatal(err)
	}
	if stale.GetTopology().GetVersion() != 1 {
		t.Errorf("answer to a caller with no topology: topology %v, want version 1", stale.GetTopology())
	}
}

// BenchmarkGroupsAcquirePath: the CPU of this process (server and client
// over loopback gRPC) per Acquire of 1,000 packed keys, all of one group,
// on a one-node cluster: addressed to the group that serves them
// (acquireAddressed: the call goes whole to the group's batcher), sent
// with no group (acquireRouted: unpacked, routed key by key, each group's
// keys sent as messages and the grants packed again), and the same call on
// a single-group cluster. cpu-ns/op is what to compare; ns/op waits on
// commits.
func BenchmarkGroupsAcquirePath(b *testing.B) {
	even, err := slots.Even(1, []slots.GroupID{1, 2})
	if err != nil {
		b.Fatal(err)
	}
	var keys []*allotv1.KeyAcquire
	for i := 0; len(keys) < 1000; i++ {
		v := "u" + strconv.Itoa(i)
		if even.Owner(slots.OfKey("test:user="+v)) == 1 {
			keys = append(keys, key("user", v, 1))
		}
	}
	packed := allotv1.AppendPackedKeys(nil, keys)
	for _, c := range []struct {
		name   string
		groups int
		group  uint32
	}{{"addressed", 2, 1}, {"routed", 2, 0}, {"single-group", 1, 0}} {
		b.Run(c.name, func(b *testing.B) {
			s := startOneNodeGroups(b, c.groups)
			alloc, _ := dial(b, s.GRPCAddr())
			var agents atomic.Int64
			b.ReportAllocs()
			c0, err := proccpu.Self()
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				id := fmt.Sprintf("a%d", agents.Add(1))
				for n := uint64(1); pb.Next(); n++ {
					_, err := alloc.Acquire(context.Background(), &allotv1.AcquireRequest{AgentId: id, RequestId: n,
						Group: c.group, TopologyVersion: 1, PackedGrants: true, PackedKeys: packed})
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			if c1, err := proccpu.Self(); err == nil {
				b.ReportMetric(float64(c1-c0)/float64(b.N), "cpu-ns/op")
			}
		})
	}
}
