package agent

import (
	"context"
	"math/rand/v2"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// directClient calls the fake allocator in-process: the Config.Clients hook
// without gRPC. down makes every call fail with Unavailable, unapplied.
type directClient struct {
	f     *fakeAllocator
	down  atomic.Bool
	calls atomic.Int64
}

func (c *directClient) Acquire(ctx context.Context, req *allotv1.AcquireRequest, _ ...grpc.CallOption) (*allotv1.AcquireResponse, error) {
	c.calls.Add(1)
	if c.down.Load() {
		return nil, status.Error(codes.Unavailable, "direct: down")
	}
	return c.f.Acquire(ctx, req)
}

func (c *directClient) Release(ctx context.Context, req *allotv1.ReleaseRequest, _ ...grpc.CallOption) (*allotv1.ReleaseResponse, error) {
	c.calls.Add(1)
	if c.down.Load() {
		return nil, status.Error(codes.Unavailable, "direct: down")
	}
	return c.f.Release(ctx, req)
}

func (c *directClient) WatchRules(context.Context, *allotv1.WatchRulesRequest, ...grpc.CallOption) (grpc.ServerStreamingClient[allotv1.RuleSet], error) {
	return nil, status.Error(codes.Unimplemented, "direct: no rule stream")
}

func manualAgent(t *testing.T, clock *fakeClock, cl *directClient, seed uint64) *Agent {
	t.Helper()
	cfg := drivenConfig(t, "manual", clock, cl, testRules)
	cfg.Rand = rand.New(rand.NewPCG(seed, seed))
	return newAgent(t, cfg)
}

// drivenConfig is the configuration of a driven agent (no goroutine, the
// refill stepped by hand) with the fake clock, calling cl directly.
func drivenConfig(t testing.TB, id string, clock *fakeClock, cl *directClient, yamls ...string) Config {
	t.Helper()
	cfg := DefaultConfig()
	cfg.ID = id
	cfg.Clients = []allotv1.AllocatorClient{cl}
	cfg.Now = clock.now
	cfg.driven = true
	cfg.Rules = mustCompile(t, 0, yamls...)
	return cfg
}

// TestManualAgentWithClients drives an agent with no goroutines through an
// in-process client: a cold key is decided by the fallback, Refill leases
// it, and Close releases through the same client.
func TestManualAgentWithClients(t *testing.T) {
	clock := newFakeClock()
	fake := newFake(t, clock.now, testRules)
	cl := &directClient{f: fake}
	before := runtime.NumGoroutine()
	a := manualAgent(t, clock, cl, 1)
	if n := runtime.NumGoroutine(); n > before {
		t.Fatalf("a Manual agent started %d goroutines", n-before)
	}
	d := desc("api_key", "k1")
	if got := check(t, a, d); !got.Allowed || got.Source != SourceFallback {
		t.Fatalf("first check: %+v, want allowed by the fallback", got)
	}
	if err := a.refill(context.Background()); err != nil {
		t.Fatal(err)
	}
	if acq, _, _ := fake.counts(); acq != 1 {
		t.Fatalf("Acquire calls after one Refill: %d, want 1", acq)
	}
	clock.advance(time.Millisecond)
	if got := check(t, a, d); !got.Allowed || got.Source != SourceLease {
		t.Fatalf("check after Refill: %+v, want allowed from the lease", got)
	}
	if err := a.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, rel, _ := fake.counts(); rel != 1 {
		t.Fatalf("Release calls at Close: %d, want 1", rel)
	}
}

// TestManualApplyRuleSet: a newer set replaces the rules, an older one is
// ignored, and one that does not compile is an error that keeps the rules.
func TestManualApplyRuleSet(t *testing.T) {
	clock := newFakeClock()
	a := manualAgent(t, clock, &directClient{f: newFake(t, clock.now, testRules)}, 1)
	rs := func(v uint64, yaml string) *allotv1.RuleSet {
		return &allotv1.RuleSet{Version: v, Files: []*allotv1.RuleFile{{Name: "t.yaml", Yaml: []byte(yaml)}}}
	}
	if err := a.applyRuleSet(rs(3, testRules)); err != nil {
		t.Fatalf("ApplyRuleSet(v3): %v", err)
	}
	if v := a.Rules().Version(); v != 3 {
		t.Fatalf("version after v3: %d", v)
	}
	if err := a.applyRuleSet(rs(2, "domain: other\n")); err != nil || a.Rules().Version() != 3 {
		t.Fatalf("an older set: err %v, version %d; want ignored", err, a.Rules().Version())
	}
	if err := a.applyRuleSet(rs(4, "domain: [\n")); err == nil || a.Rules().Version() != 3 {
		t.Fatalf("a broken set: err %v, version %d; want an error and version 3", err, a.Rules().Version())
	}
}

// TestManualJitterSeeded: two Manual agents with equally seeded Rand open
// their breakers with the same probe schedule.
func TestManualJitterSeeded(t *testing.T) {
	probes := func(seed uint64) []int64 {
		clock := newFakeClock()
		cl := &directClient{f: newFake(t, clock.now, testRules)}
		cl.down.Store(true)
		a := manualAgent(t, clock, cl, seed)
		check(t, a, desc("api_key", "k1"))
		var out []int64
		for range 8 {
			if err := a.refill(context.Background()); err != nil {
				t.Fatal(err)
			}
			if p := a.nextProbe.Load(); p != 0 {
				out = append(out, p-clock.now())
				clock.ns.Store(p)
			} else {
				clock.advance(20 * time.Millisecond)
			}
		}
		return out
	}
	a, b := probes(7), probes(7)
	if len(a) < 3 {
		t.Fatalf("breaker probes: %v, want the breaker open and probing", a)
	}
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("probe delays differ with the same seed: %v vs %v", a, b)
		}
	}
}

func TestManualConfigValidate(t *testing.T) {
	cl := &directClient{}
	for _, tc := range []struct {
		name string
		cfg  func(*Config)
	}{
		{"manual without Now", func(c *Config) { c.driven = true }},
		{"manual with RulesFiles", func(c *Config) {
			c.driven, c.Now, c.RulesFiles = true, func() int64 { return 1 }, []string{"r.yaml"}
		}},
		{"nil client", func(c *Config) { c.Clients = []allotv1.AllocatorClient{nil} }},
		{"names do not match clients", func(c *Config) {
			c.Clients, c.Allocators = []allotv1.AllocatorClient{cl}, []string{"a", "b"}
		}},
		{"clients with RulesFiles", func(c *Config) {
			c.Clients, c.RulesFiles = []allotv1.AllocatorClient{cl}, []string{"r.yaml"}
		}},
	} {
		cfg := DefaultConfig()
		tc.cfg(&cfg)
		if err := cfg.Validate(); err == nil {
			t.Errorf("%s: Validate() = nil, want an error", tc.name)
		}
	}
}

// TestRefillNotManual: Refill refuses an agent that runs its own loop.
func TestRefillNotManual(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Rules = mustCompile(t, 0, testRules)
	a := newAgent(t, cfg)
	if err := a.refill(context.Background()); err == nil {
		t.Fatal("Refill on a non-Manual agent: nil error")
	}
}
