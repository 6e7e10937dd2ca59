package regions

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
)

// staticRules: the global key falls to half its rate in every region.
const staticRules = `domain: reg
scope: global
global_fallback: static
static_fraction: 0.5
descriptors:
  - key: k
    rate_limit: {name: shared, unit: second, requests_per_unit: 100, burst: 100}
`

// A region with no -global-allocators answers a scope: global key with
// the rule's fallback (static: half of R), never an error, with a log
// line and a metric; a region pointed at another region (a cycle) is
// refused at startup.
func TestRegionWithoutUpstreamAndCycle(t *testing.T) {
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	dir := t.TempDir()
	bins := testproc.Build(t)
	file := testproc.WriteFile(t, dir, "reg.yaml", staticRules)
	set, err := rules.Compile(1, []rules.File{{Name: "reg.yaml", Source: []byte(staticRules)}})
	if err != nil {
		t.Fatal(err)
	}
	c := testproc.StartCluster(t, testproc.ClusterConfig{Bin: bins.Allocator, Dir: dir, Size: 1, Rules: []string{file},
		Args: append([]string{"-region", "lonely"}, testproc.FastLeaseArgs...)})
	r := &region{name: "lonely", c: c, agents: []*agent.Agent{startAgent(t, "lonely-a0", c.GRPCAddrs(), set)}}
	start := time.Now()
	tl := newTally(start)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	load(ctx, &wg, r, tl, func(time.Time) float64 { return 100 })
	testproc.Eventually(t, 20*time.Second, "8 s of load", func() bool { return time.Since(start) > 8*time.Second })
	cancel()
	wg.Wait()
	if n := tl.errs.Load(); n != 0 {
		t.Errorf("%d errors at the agent", n)
	}
	// From 3 s on (the fallback bucket's first burst spent): about R/2.
	adm, off := tl.sum(30, 80)
	t.Logf("no upstream, static 0.5: admitted %d of %d over 5 s (%.1f/s)", adm, off, float64(adm)/5)
	if got := float64(adm) / 5; got > 0.5*rate+5 || got < 0.5*rate*0.7 {
		t.Errorf("admitted %.1f/s without an upstream, want about static_fraction × R = %.0f/s", got, 0.5*rate)
	}
	n := c.Nodes[0]
	m, err := testproc.Scrape("http://" + n.HTTP + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Get("allot_allocator_upstream_fallback_keys"); got != 1 {
		t.Errorf("allot_allocator_upstream_fallback_keys = %v, want 1", got)
	}
	if out := n.Proc.Output(); !strings.Contains(out, "global key served from its fallback share: no global upstream") {
		t.Errorf("no log line for the global key without an upstream:\n%s", testproc.Tail(out, 20))
	}
	st, err := n.Status(t)
	if err != nil {
		t.Fatal(err)
	}
	if st.GetRegion() != "lonely" || st.GetUpstream().GetState() != "none" {
		t.Errorf("status region %q upstream %v, want lonely, none", st.GetRegion(), st.GetUpstream())
	}

	// A cycle: a region whose global allocator is a region. It is never
	// dialed: it binds port 0 (a port found free and released first may
	// be taken by another package's test before it binds).
	p := testproc.NewProc("cycle", dir, bins.Allocator, "-node-id", "c0", "-data-dir", dir+"/cycle", "-grpc-addr", "127.0.0.1:0",
		"-raft-addr", "127.0.0.1:0", "-http-addr", "127.0.0.1:0", "-bootstrap", "-region", "loop", "-global-allocators", n.GRPC)
	if err := p.Run(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	// It refuses at startup, exiting. If the region did not answer its
	// startup check within a second (a loaded machine), the node starts
	// and its leader's runner refuses to lease instead, once the region
	// answers; either way the refusal names the cycle.
	const unanswered = "global allocator not reachable at startup"
	exited := false
	testproc.Eventually(t, 30*time.Second, "the allocator pointed at a region to refuse it", func() bool {
		select {
		case <-p.Done():
			exited = true
			return true
		default:
		}
		out := p.Output()
		return strings.Contains(out, unanswered) && strings.Contains(out, "refusing to lease from the global allocators")
	})
	out := p.Output()
	naming := strings.Contains(out, "cycle in the allocator chain") && strings.Contains(out, n.GRPC+" is a regional cluster (region ")
	switch {
	case exited && (p.ExitErr() == nil || !naming || !strings.Contains(out, fmt.Sprintf("(region %q)", "lonely"))):
		t.Errorf("exit %v, want a refusal naming the cycle:\n%s", p.ExitErr(), testproc.Tail(out, 10))
	case !exited && !naming:
		t.Errorf("the leader refused the region without naming the cycle:\n%s", testproc.Tail(out, 10))
	case !exited:
		t.Logf("the region did not answer the startup check in time; the leader refused it:\n%s", testproc.Tail(out, 5))
	}
}
