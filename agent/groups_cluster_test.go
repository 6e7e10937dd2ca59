package agent

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// groupCalls records the agent's Acquire calls addressed to a group: the
// node each went to, and whether a node forwarded it (its answer names
// another leader).
type groupCalls struct {
	mu    sync.Mutex
	calls []groupCallRec
}

type groupCallRec struct {
	group     uint32
	addr      string
	forwarded bool
	err       error
}

func (g *groupCalls) interceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		ar, ok := req.(*allotv1.AcquireRequest)
		if !ok || ar.GetTopologyVersion() == 0 {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		var md metadata.MD
		err := invoker(ctx, method, req, reply, cc, append(opts, grpc.Header(&md))...)
		g.mu.Lock()
		g.calls = append(g.calls, groupCallRec{group: ar.GetGroup(), addr: cc.Target(),
			forwarded: len(md.Get(allotv1.LeaderAddrHeader)) > 0, err: err})
		g.mu.Unlock()
		return err
	}
}

func (g *groupCalls) from(i int) []groupCallRec {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]groupCallRec(nil), g.calls[min(i, len(g.calls)):]...)
}

// TestGroupsRealCluster: an agent in front of three real allocator
// processes with -groups 4 sends each group's keys straight to that
// group's leader (no call forwarded), every key is leased by its group,
// and when the node leading the most groups is killed (-9) no check
// fails and the agent's calls go straight to the new leaders once the
// topology names them.
func TestGroupsRealCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("multi-process cluster: skipped with -short")
	}
	dir := t.TempDir()
	bins := testproc.Build(t)
	rulesFile := testproc.WriteFile(t, dir, "test.yaml", testRules)
	c := testproc.StartCluster(t, testproc.ClusterConfig{Bin: bins.Allocator, Dir: dir, Size: 3,
		Rules: []string{rulesFile}, BootstrapArgs: []string{"-groups", "4"}, Args: testproc.FastLeaseArgs})
	addrOf := map[string]string{}
	for _, n := range c.Nodes {
		addrOf[n.ID] = n.GRPC
	}
	// leaders returns each data group's leader address, as a live node
	// sees them (nil until every data group has a live leader).
	leaders := func(live []*testproc.Node) map[uint32]string {
		for _, n := range live {
			st, err := n.Status(t)
			if err != nil || len(st.GetGroups()) != 5 {
				continue
			}
			out := map[uint32]string{}
			for _, g := range st.GetGroups() {
				alive := false
				for _, l := range live {
					alive = alive || l.ID == g.GetLeaderId()
				}
				if !alive {
					return nil
				}
				if g.GetId() != 0 {
					out[g.GetId()] = addrOf[g.GetLeaderId()]
				}
			}
			return out
		}
		return nil
	}
	var lead map[uint32]string
	waitFor(t, 30*time.Second, "every data group led, the leaders spread", func() bool {
		if lead = leaders(c.Nodes); lead == nil {
			return false
		}
		n := map[string]int{}
		for _, addr := range lead {
			n[addr]++
		}
		return len(n) == 3
	})

	rec := &groupCalls{}
	cfg := DefaultConfig()
	cfg.Allocators = c.GRPCAddrs()
	cfg.RefillInterval = 20 * time.Millisecond
	cfg.ScanInterval = 50 * time.Millisecond
	cfg.CallTimeout = time.Second
	cfg.Logger = testLogger(t)
	cfg.DialOptions = []grpc.DialOption{grpc.WithUnaryInterceptor(rec.interceptor())}
	a := newAgent(t, cfg)
	waitFor(t, 20*time.Second, "agent ready with the topology", func() bool { return a.Ready() && a.rt.topo.Load() != nil })

	// Keys of every data group.
	ds, keys := groupKeys(&groupCluster{t: t, set: a.Rules()}, 40)
	topo := a.rt.topo.Load()
	perGroup := map[slots.GroupID]int{}
	for _, k := range keys {
		perGroup[topo.owner[slots.OfKey(k)]]++
	}
	if len(perGroup) != 4 {
		t.Fatalf("test keys in %d groups, want 4: %v", len(perGroup), perGroup)
	}
	checkAll := func() {
		t.Helper()
		for _, d := range ds {
			if _, err := a.Check(context.Background(), "test", []Descriptor{d}, 1); err != nil {
				t.Fatalf("check %v: %v", d.Entries, err)
			}
		}
	}
	// checkFor checks every key every 50 ms for d.
	checkFor := func(d time.Duration) {
		t.Helper()
		for deadline := time.Now().Add(d); time.Now().Before(deadline); {
			checkAll()
			time.Sleep(50 * time.Millisecond)
		}
	}
	leasedAll := func() bool {
		for _, d := range ds {
			if ks := keyOf(t, a, d); ks == nil || !ks.leased.Load() {
				return false
			}
		}
		return true
	}
	checkAll()
	waitFor(t, 10*time.Second, "every key leased", func() bool { checkAll(); return leasedAll() })
	if n := (dtoCounter{}).read(a.met.keysMoved); n != 0 {
		t.Fatalf("%v keys answered MOVED in a steady cluster", n)
	}
	direct := func(calls []groupCallRec, lead map[uint32]string) error {
		seen := map[uint32]bool{}
		for _, cl := range calls {
			if cl.err == nil && (cl.forwarded || cl.addr != lead[cl.group]) {
				return fmt.Errorf("a call for group %d went to %s (forwarded %v), its leader is %s", cl.group, cl.addr, cl.forwarded, lead[cl.group])
			}
			seen[cl.group] = true
		}
		if len(seen) != 4 {
			return fmt.Errorf("calls for %d groups, want 4", len(seen))
		}
		return nil
	}
	// window checks every key until the calls made meanwhile address
	// every group (a key refreshes its lease every second or so), at
	// most 10 s, and returns them.
	window := func() []groupCallRec {
		from := len(rec.from(0))
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
			checkFor(100 * time.Millisecond)
			seen := map[uint32]bool{}
			for _, cl := range rec.from(from) {
				seen[cl.group] = true
			}
			if len(seen) == 4 {
				break
			}
		}
		return rec.from(from)
	}
	if err := direct(window(), lead); err != nil {
		t.Fatal(err)
	}

	// Kill the node that leads the most data groups.
	count := map[string]int{}
	for _, addr := range lead {
		count[addr]++
	}
	var victim *testproc.Node
	for _, n := range c.Nodes {
		if victim == nil || count[n.GRPC] > count[victim.GRPC] {
			victim = n
		}
	}
	victim.Proc.Kill()
	var live []*testproc.Node
	for _, n := range c.Nodes {
		if n != victim {
			live = append(live, n)
		}
	}
	waitFor(t, 20*time.Second, "every data group led by a live node", func() bool {
		checkAll()
		lead = leaders(live)
		return lead != nil
	})
	// Once the agent's topology names the new leaders (the cluster also
	// spreads them over the live nodes, moving some again), its calls go
	// straight to them: a window of calls to every group, the leaders
	// unchanged throughout, none forwarded.
	waitFor(t, 60*time.Second, "calls straight to the new leaders", func() bool {
		before := leaders(live)
		calls := window()
		lead = leaders(live)
		return before != nil && maps.Equal(before, lead) && direct(calls, lead) == nil
	})
	checkAll()
}
