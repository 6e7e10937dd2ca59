package allocator

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/allocator/groupdir"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The region flags: bad names, an upstream without a region, the node's
// own address as its global allocator, a bad address and a bad policy
// setting are refused with an error naming the flag.
func TestRegionConfigValidate(t *testing.T) {
	good := DefaultConfig()
	good.NodeID, good.DataDir, good.GRPCAddr = "a", "/tmp/x", "127.0.0.1:7420"
	good.Region = RegionConfig{Name: "eu-west", GlobalAllocators: []string{"10.0.0.1:7420", "10.0.0.2:7420"}}
	if err := good.Validate(); err != nil {
		t.Fatalf("a regional config is invalid: %v", err)
	}
	for name, tc := range map[string]struct {
		mut  func(*Config)
		want string
	}{
		"bad name":          {func(c *Config) { c.Region.Name = "EU West" }, `-region "EU West"`},
		"upstream, no name": {func(c *Config) { c.Region.Name = "" }, "-global-allocators needs -region"},
		"own address":       {func(c *Config) { c.Region.GlobalAllocators = []string{"127.0.0.1:7420"} }, "this node's own gRPC address"},
		"own wildcard": {func(c *Config) {
			c.GRPCAddr = "127.0.0.1:7421"
			c.AdvertiseGRPCAddr = "alloc-1:7420"
			c.Region.GlobalAllocators = []string{"alloc-1:7420"}
		}, "own gRPC address"},
		"no port":      {func(c *Config) { c.Region.GlobalAllocators = []string{"10.0.0.1"} }, `-global-allocators "10.0.0.1"`},
		"twice":        {func(c *Config) { c.Region.GlobalAllocators = []string{"10.0.0.1:1", "10.0.0.1:1"} }, "twice"},
		"negative rtt": {func(c *Config) { c.Region.Upstream.RTT = -time.Second }, "RTT"},
		"groups":       {func(c *Config) { c.Bootstrap, c.Groups = true, 2 }, "-region with -groups 2"},
	} {
		c := good
		c.Region.GlobalAllocators = append([]string(nil), good.Region.GlobalAllocators...)
		tc.mut(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want an error with %q", name, err, tc.want)
		}
	}
	if c := good; !c.stateConfig().Regional {
		t.Error("a region's state config is not regional")
	}
}

func TestIsRegionAgent(t *testing.T) {
	for id, want := range map[string]bool{"region:eu": true, "region:": false, "region:EU": false, "eu": false, "gw-region:eu": false} {
		if got := isRegionAgent(id); got != want {
			t.Errorf("isRegionAgent(%q) = %v, want %v", id, got, want)
		}
	}
}

// TestRegionCycleFoundLate: a region whose global allocator does not
// answer at startup checks it before its calls until one answers; when the
// one that then answers is itself a region, the runner refuses to lease
// from it (state "cycle") rather than leasing unchecked for the term.
func TestRegionCycleFoundLate(t *testing.T) {
	// The address the other region binds later: free now.
	addr := testproc.FreeAddr(t)
	const global = "domain: g\nscope: global\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}\n"
	a := newTestCluster(t, 1, func(_ int, c *Config) {
		c.Region = RegionConfig{Name: "a", GlobalAllocators: []string{addr}}
		c.InitialRules = append(c.InitialRules, rules.File{Name: "g.yaml", Source: []byte(global)})
	})
	alloc, _ := a.clients(0)
	reg := a.node(0).region
	state := func() string {
		reg.mu.Lock()
		defer reg.mu.Unlock()
		return reg.state
	}
	reqID := uint64(0)
	acquire := func() {
		reqID++
		k := &allotv1.KeyAcquire{Domain: "g", Entries: []*allotv1.Entry{{Key: "k"}}, Want: 1}
		_, _ = alloc.Acquire(ctxT(t), acquireReq("gw", reqID, k))
	}
	// Nothing answers at the global address: the region is cut off.
	waitFor(t, 20*time.Second, "the region cut off", func() bool { acquire(); return state() == "cut_off" })
	// Another region starts there.
	newTestCluster(t, 1, func(_ int, c *Config) {
		c.GRPCAddr = addr
		c.Region = RegionConfig{Name: "b", GlobalAllocators: []string{"127.0.0.1:1"}}
	})
	waitFor(t, 30*time.Second, "the region to refuse the cycle", func() bool { acquire(); return state() == "cycle" })
	errs := testutilCounter(reg.calls.WithLabelValues("error"))
	cycles := testutilCounter(reg.calls.WithLabelValues("cycle"))
	if cycles != 1 || testutilCounter(reg.calls.WithLabelValues("ok")) != 0 {
		t.Errorf("upstream calls: cycle %v, ok %v; want one refused, none answered", cycles, testutilCounter(reg.calls.WithLabelValues("ok")))
	}
	t.Logf("upstream calls: %v failed while nothing answered, 1 refused as a cycle", errs)
}

// -region with several data groups is refused: at validation with
// -groups N, and at startup on a node whose data dir holds a cluster of
// several groups (the region's runner serves only the meta group, where
// no pool lives).
func TestRegionRefusesGroups(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NodeID, cfg.DataDir = "r0", t.TempDir()
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0", ""
	cfg.Logger = testLogger(t, 0)
	cfg.Region = RegionConfig{Name: "eu", GlobalAllocators: []string{"127.0.0.1:1"}, SkipCycleCheck: true}
	l, err := groupdir.Init(cfg.DataDir, groupdir.NewClusterID(), cfg.NodeID)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range []slots.GroupID{0, 1, 2} {
		if _, err := l.CreateGroup(g); err != nil {
			t.Fatal(err)
		}
	}
	if err := writeHosted(cfg.DataDir, []slots.GroupID{0, 1, 2}); err != nil {
		t.Fatal(err)
	}
	s, err := New(cfg)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	}
	if !errors.Is(err, errRegionGroups) {
		t.Fatalf("New of a region in a cluster of several groups: %v, want %v", err, errRegionGroups)
	}
}

// TestNextUpstreamSeq: a region's upstream request ids rise by one at
// least, and follow the clock in microseconds, so a region restored from a
// backup whose ledger ends at a lower id does not reuse an id the global
// cluster has answered since (it would replay that answer onto other keys).
func TestNextUpstreamSeq(t *testing.T) {
	now := time.Date(2026, 12, 4, 20, 0, 0, 0, time.UTC).UnixNano()
	us := uint64(now / 1000)
	for _, c := range []struct {
		last uint64
		now  int64
		want uint64
	}{
		{0, now, us},              // a new region starts at the clock
		{us, now, us + 1},         // two calls within a microsecond
		{us + 50, now, us + 51},   // the clock behind the last id
		{us - 3_000_000, now, us}, // restored from a backup 3 s old
		{7, 0, 8}, {7, -1, 8},     // no clock: one past the last
		{^uint64(0) - 1, now, ^uint64(0)},
	} {
		if got := nextUpstreamSeq(c.last, c.now); got != c.want {
			t.Errorf("nextUpstreamSeq(%d, %d) = %d, want %d", c.last, c.now, got, c.want)
		}
	}
	// Restored: every id the region sent before the backup's last is below
	// the restored region's next one.
	sent := nextUpstreamSeq(0, now)
	for i := range 1000 {
		sent = nextUpstreamSeq(sent, now+int64(i)*1000)
	}
	if next := nextUpstreamSeq(us, now+int64(time.Second)); next <= sent {
		t.Fatalf("restored region's next id %d does not pass %d, sent before", next, sent)
	}
}
