package allocator

import (
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/allocator/upstream"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const globalTenantRule = "domain: t\nscope: global\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}\n"

// newRegionPair starts a global cluster and a one-node region of it, both
// with rule (and the test rules), the region's policy tuned by ucfg.
func newRegionPair(t *testing.T, rule string, ucfg upstream.Config) (global, region *testCluster) {
	t.Helper()
	file := rules.File{Name: "global.yaml", Source: []byte(rule)}
	global = newTestCluster(t, 1, func(_ int, c *Config) { c.InitialRules = append(c.InitialRules, file) })
	region = newTestCluster(t, 1, func(_ int, c *Config) {
		c.NodeID = "r0"
		c.Region = RegionConfig{Name: "eu", GlobalAllocators: []string{global.node(0).GRPCAddr()}, Upstream: ucfg}
		c.InitialRules = append(c.InitialRules, file)
	})
	return global, region
}

// staticGlobalRule: a global key g/k whose fallback is a static share
// (half its rate) for region eu.
const staticGlobalRule = "domain: g\nscope: global\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 100, burst: 100, global_fallback: static, static_fraction: {eu: 0.5}}\n"

func tenants(from, to int, want int64) []*allotv1.KeyAcquire {
	var keys []*allotv1.KeyAcquire
	for i := from; i < to; i++ {
		keys = append(keys, &allotv1.KeyAcquire{Domain: "t", Entries: []*allotv1.Entry{{Key: "tenant", Value: fmt.Sprint(i)}}, Want: want, Demand: 1})
	}
	return keys
}

// A region with more global keys due than one Acquire may carry
// (allotv1.MaxKeysPerCall) leases them in calls of at most that many:
// every key is granted, and the global cluster refuses no call.
func TestRegionLeasesMoreKeysThanOneCallCarries(t *testing.T) {
	const n = allotv1.MaxKeysPerCall + 1
	_, reg := newRegionPair(t, globalTenantRule, upstream.Config{})
	alloc, _ := reg.clients(0)
	r := reg.node(0).region
	granted := make([]bool, n)
	left, id := n, uint64(0)
	waitFor(t, 30*time.Second, fmt.Sprintf("all %d global keys granted", n), func() bool {
		for from := 0; from < n; from += allotv1.MaxKeysPerCall {
			to := min(from+allotv1.MaxKeysPerCall, n)
			id++
			resp, err := alloc.Acquire(ctxT(t), acquireReq("gw", id, tenants(from, to, 1)...))
			if err != nil {
				t.Fatal(err)
			}
			gs, err := allotv1.GrantsOf(resp)
			if err != nil {
				t.Fatal(err)
			}
			for i, g := range gs {
				if g.GetGranted() > 0 && !granted[from+i] {
					granted[from+i] = true
					left--
				}
			}
		}
		return left == 0
	})
	if errs := testutilCounter(r.calls.WithLabelValues("error")); errs > 0 {
		r.mu.Lock()
		defer r.mu.Unlock()
		t.Errorf("%v upstream calls failed (%s)", errs, r.err)
	}
}

// A global key its gateways no longer use turns idle: the region hands
// back what its pool holds, then forgets the pool (a replicated forget),
// and makes no more calls for it.
func TestRegionForgetsIdleKey(t *testing.T) {
	_, reg := newRegionPair(t, globalTenantRule, upstream.Config{IdleAfter: 300 * time.Millisecond})
	alloc, _ := reg.clients(0)
	s, r := reg.node(0), reg.node(0).region
	id := uint64(0)
	var held int64
	waitFor(t, 10*time.Second, "the key granted", func() bool {
		id++
		resp, err := alloc.Acquire(ctxT(t), acquireReq("gw", id, tenants(0, 1, 20)...))
		if err != nil {
			t.Fatal(err)
		}
		held = resp.GetGrants()[0].GetHeld()
		return held > 0
	})
	// The gateway hands everything back and ends its lease.
	id++
	back := tenants(0, 1, 0)
	back[0].Returned, back[0].Demand = held, 0
	if _, err := alloc.Acquire(ctxT(t), acquireReq("gw", id, back...)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the idle pool forgotten", func() bool { return len(s.st.Pools(time.Now().UnixNano())) == 0 })
	received := testutilCounter(r.tokens.WithLabelValues("received"))
	if returned := testutilCounter(r.tokens.WithLabelValues("returned")); returned != received {
		t.Errorf("the region received %v tokens and returned %v before forgetting the pool, want all", received, returned)
	}
	calls := func() float64 {
		return testutilCounter(r.calls.WithLabelValues("ok")) + testutilCounter(r.calls.WithLabelValues("error"))
	}
	before := calls()
	// Two server-directed refresh intervals (1 s) and more: no call.
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); {
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctxT(t).Done():
		}
		if n := calls(); n != before {
			t.Fatalf("%v upstream calls after the pool was forgotten", n-before)
		}
	}
}

// A region cut off from its global cluster mints its fallback share and
// tries its calls again and again; each failed call owes its outage
// charge again, so while no call was answered the ledger owes every
// token it minted.
func TestRegionOwesOutageChargeAcrossFailedCalls(t *testing.T) {
	reg := newTestCluster(t, 1, func(_ int, c *Config) {
		c.NodeID = "r0"
		c.Region = RegionConfig{Name: "eu", GlobalAllocators: []string{testproc.FreeAddr(t)}, SkipCycleCheck: true,
			Upstream: upstream.Config{CallTimeout: 200 * time.Millisecond, RetryBackoff: 200 * time.Millisecond}}
		c.InitialRules = append(c.InitialRules, rules.File{Name: "g.yaml", Source: []byte(staticGlobalRule)})
	})
	alloc, _ := reg.clients(0)
	s, r := reg.node(0), reg.node(0).region
	id := uint64(0)
	var pool state.Pool
	failedAtMint := -1.0
	waitFor(t, 20*time.Second, "several failed calls after the first mint, with every minted token owed", func() bool {
		id++
		k := &allotv1.KeyAcquire{Domain: "g", Entries: []*allotv1.Entry{{Key: "k"}}, Want: 10, Demand: 50}
		if _, err := alloc.Acquire(ctxT(t), acquireReq("gw", id, k)); err != nil {
			t.Fatal(err)
		}
		ps := s.st.Pools(time.Now().UnixNano())
		if len(ps) != 1 || ps[0].Minted == 0 {
			return false
		}
		pool = ps[0]
		errs := testutilCounter(r.calls.WithLabelValues("error"))
		if failedAtMint < 0 {
			failedAtMint = errs
		}
		return errs >= failedAtMint+3 && pool.Owed == pool.Minted
	})
	if testutilCounter(r.calls.WithLabelValues("ok")) != 0 {
		t.Fatal("a call was answered")
	}
	t.Logf("minted %d, owed %d after %v failed calls", pool.Minted, pool.Owed, testutilCounter(r.calls.WithLabelValues("error")))
}

// The region's demand for a key is the sum of its gateways' (each ≤
// allotv1.MaxAmount), and a pool's debt may be anything: the call built
// for it stays within the protocol's bounds, which the global cluster
// checks.
func TestRegionRequestWithinProtocolBounds(t *testing.T) {
	k, err := upstream.NewKey(upstream.Config{}, upstream.Rule{Rate: 100, Burst: 100})
	if err != nil {
		t.Fatal(err)
	}
	r, ok := k.Tick(time.Now().UnixNano(), 2*allotv1.MaxAmount)
	if !ok {
		t.Fatal("no call")
	}
	p := state.Pool{Hash: 1, Domain: "g", Entries: []rules.Entry{{Key: "k"}}, Debt: math.MaxInt64}
	g := &regional{agent: regionAgentPrefix + "eu"}
	req, _ := g.request(1, []due{{p: p, rk: &regKey{k: k}, req: r}})
	if err := state.ValidateAcquire(req); err != nil {
		t.Errorf("the global cluster refuses the region's call: %v (key %v)", err, req.GetKeys()[0])
	}
}

// A new regional leader gives up the previous leader's call that fails
// again; a give-up whose commit fails is committed again, so that the
// call's outage charges are owed in the ledger before the runner sends
// anything else (a new send would replace the pending one).
func TestRegionRecoverRetriesGiveUpCommit(t *testing.T) {
	s, key, pool := owingRegion(t, 1)
	if h := keyHashOf(s.st.Rules(), key); h != pool.Hash {
		t.Fatalf("key hash %x, pool %x", h, pool.Hash)
	}
	// A previous leader's call, unanswered, that reported all it owed.
	charged := pool.Owed
	sent := &allotv1.KeyAcquire{Domain: "g", Entries: key.Entries, Want: 10, Demand: 50, OutageCharged: charged}
	raw, err := proto.Marshal(&allotv1.AcquireRequest{Keys: []*allotv1.KeyAcquire{sent}})
	if err != nil {
		t.Fatal(err)
	}
	last, _ := s.st.PendingUpstream()
	seq := nextUpstreamSeq(last, s.stamp())
	if _, err := s.proposeData(state.AppendUpstreamSend(nil, s.stamp(), seq, raw,
		[]state.UpstreamReturn{{Hash: pool.Hash, Charged: charged}})); err != nil {
		t.Fatal(err)
	}
	if p, _ := s.st.PendingUpstream(); p != seq {
		t.Fatalf("pending seq %d, want %d", p, seq)
	}
	// A runner of this node's term, with an unreachable global allocator,
	// whose first give-up commit fails.
	g := testRunner(s, []string{testproc.FreeAddr(t)}, upstream.Config{CallTimeout: 200 * time.Millisecond})
	fails := 0
	g.settleCommit = func(data []byte) error {
		if fails == 0 {
			fails++
			return errors.New("enqueue timeout")
		}
		return g.commit(data)
	}
	g.recover(ctxT(t))
	if fails != 1 {
		t.Fatalf("the give-up commit failed %d times, want 1", fails)
	}
	if _, raw := s.st.PendingUpstream(); raw != nil {
		t.Error("the previous leader's call is still pending after recover")
	}
	p, ok := s.st.PoolOf(pool.Hash, time.Now().UnixNano())
	if !ok {
		t.Fatal("pool gone")
	}
	// Every minted token is owed, the recovered call's charges too.
	if p.Owed != p.Minted {
		t.Errorf("owed %d of %d minted tokens (the recovered call charged %d)", p.Owed, p.Minted, charged)
	}
}

// owingRegion starts a one-node region "eu" with no global allocators, so
// that its own runner mints (each minted token owed) and sends nothing,
// and acquires the global key g/k until its pool owes at least minOwed
// tokens. It returns the node, the key and the pool as it was then.
func owingRegion(t *testing.T, minOwed int64) (*Server, *allotv1.KeyAcquire, state.Pool) {
	t.Helper()
	reg := newTestCluster(t, 1, func(_ int, c *Config) {
		c.NodeID = "r0"
		c.Region = RegionConfig{Name: "eu", SkipCycleCheck: true}
		c.InitialRules = append(c.InitialRules, rules.File{Name: "g.yaml", Source: []byte(staticGlobalRule)})
	})
	alloc, _ := reg.clients(0)
	s := reg.node(0)
	key := &allotv1.KeyAcquire{Domain: "g", Entries: []*allotv1.Entry{{Key: "k"}}, Want: 10, Demand: 50}
	id := uint64(0)
	var pool state.Pool
	waitFor(t, 20*time.Second, "tokens minted and owed", func() bool {
		id++
		if _, err := alloc.Acquire(ctxT(t), acquireReq("gw", id, key)); err != nil {
			t.Fatal(err)
		}
		ps := s.st.Pools(time.Now().UnixNano())
		if len(ps) != 1 || ps[0].Owed < minOwed {
			return false
		}
		pool = ps[0]
		return true
	})
	return s, key, pool
}

// testRunner returns a regional runner of s's term calling addrs, with the
// node's region counters.
func testRunner(s *Server, addrs []string, cfg upstream.Config) *regional {
	nr := s.region
	return &regional{s: s, name: "eu", agent: regionAgentPrefix + "eu", addrs: addrs, cfg: cfg,
		maxKeys: allotv1.MaxKeysPerCall, keys: map[uint64]keyView{},
		calls: nr.calls, tokens: nr.tokens, fbKeys: nr.fbKeys}
}
