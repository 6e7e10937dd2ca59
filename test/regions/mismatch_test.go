package regions

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/allot/allot/internal/faultnet"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
)

// copyOf is a region's copy of the global rule (R = 100/s, B = 100 at the
// global cluster) with another rate and burst.
func copyOf(rpu int) string {
	return fmt.Sprintf(`domain: reg
scope: global
descriptors:
  - key: k
    rate_limit: {name: shared, unit: second, requests_per_unit: %d, burst: %d}
`, rpu, rpu)
}

// TestRuleMismatch: the global cluster's rule is R = 100/s, B = 100; region
// r0's copy is tighter (30/s) and region r1's looser (300/s), their
// gateways given the same copy as their region. The global cluster's limit
// decides in both directions:
//
//   - r0 alone offers 70/s, within R: it admits them (its copy would cap it
//     at 30/s);
//   - then r1 alone offers 200/s: it admits at most B + R·t over the phase,
//     plus the debt its gateways' fallback buckets ran up (charged to its
//     pool), and at least 0.8·R once it holds the key (its copy would
//     allow 300/s).
//
// Both regions' status lists the mismatch with both limits.
func TestRuleMismatch(t *testing.T) {
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	dir := t.TempDir()
	bins := testproc.Build(t)
	for _, d := range []string{"global", "r0", "r1"} {
		if err := os.MkdirAll(dir+"/"+d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	global := testproc.StartCluster(t, testproc.ClusterConfig{Bin: bins.Allocator, Dir: dir + "/global", Size: 1,
		Rules: []string{testproc.WriteFile(t, dir+"/global", "reg.yaml", globalRules)}, Args: testproc.FastLeaseArgs})
	copies := []int{30, 300}
	var regions []*region
	for i, rpu := range copies {
		r := &region{name: fmt.Sprintf("r%d", i)}
		src := copyOf(rpu)
		set, err := rules.Compile(1, []rules.File{{Name: "reg.yaml", Source: []byte(src)}})
		if err != nil {
			t.Fatal(err)
		}
		args := append([]string{"-region", r.name, "-upstream-rtt", (2 * oneWay).String()}, testproc.FastLeaseArgs...)
		for _, addr := range global.GRPCAddrs() {
			p, err := faultnet.Listen(addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			p.Delay(faultnet.ToTarget, oneWay)
			p.Delay(faultnet.ToClient, oneWay)
			r.links = append(r.links, p)
			args = append(args, "-global-allocators", p.Addr())
		}
		rdir := dir + "/" + r.name
		r.c = testproc.StartCluster(t, testproc.ClusterConfig{Bin: bins.Allocator, Dir: rdir, Size: 1,
			Rules: []string{testproc.WriteFile(t, rdir, "reg.yaml", src)}, Args: args})
		for j := range 2 {
			r.agents = append(r.agents, startAgent(t, fmt.Sprintf("%s-a%d", r.name, j), r.c.GRPCAddrs(), set))
		}
		regions = append(regions, r)
	}

	// phase runs offered/s in region r for d, and returns its tally and
	// the instant it held the key (its first grant).
	phase := func(r *region, offered float64, d time.Duration) (*tally, time.Time) {
		start := time.Now()
		tl := newTally(start)
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		defer func() { cancel(); wg.Wait() }()
		load(ctx, &wg, r, tl, func(time.Time) float64 { return offered })
		var held time.Time
		testproc.Eventually(t, 30*time.Second, r.name+" holding the global key", func() bool {
			st := regionStatus(t, r)
			for _, k := range st.GetUpstream().GetKeys() {
				if k.GetReceived() > 0 {
					held = time.Now()
					return true
				}
			}
			return false
		})
		testproc.Eventually(t, d+10*time.Second, fmt.Sprintf("%v of load in %s", d, r.name), func() bool { return time.Since(start) > d })
		cancel()
		wg.Wait()
		if n := tl.errs.Load(); n != 0 {
			t.Errorf("%s: %d errors at the agents", r.name, n)
		}
		return tl, held
	}
	slot := 100 * time.Millisecond

	// Tighter: 70/s in r0, within the global 100/s.
	tight, held := phase(regions[0], 70, 7*time.Second)
	from := int(held.Sub(tight.start)/slot) + 10 // a second after the first grant
	to := tight.slots()
	adm, off := tight.sum(from, to)
	secs := float64(to-from) * slot.Seconds()
	t.Logf("r0 (copy 30/s, global 100/s): admitted %d of %d over %.1f s (%.1f/s) from a second after its first grant",
		adm, off, secs, float64(adm)/secs)
	if float64(adm) < 0.9*float64(off) || float64(adm)/secs < 2*30 {
		t.Errorf("r0 admitted %d of %d in-quota requests (%.1f/s): its tighter copy (30/s) bounded it, want the global limit to decide",
			adm, off, float64(adm)/secs)
	}

	// Looser: 200/s in r1, twice the global 100/s.
	loose, held := phase(regions[1], 200, 7*time.Second)
	end := loose.slots()
	adm, off = loose.sum(0, end)
	secs = float64(end) * slot.Seconds()
	// What the agents' fallback buckets admit (before the first grant,
	// and between a denial's end and the next answer) is charged to the
	// pool and repaid from what it receives: r1 admits at most what it
	// received (≤ B + R·t: the global bucket was full at most when r1
	// started) plus its debt at the end, plus what the agents admitted
	// and have not charged yet (a refresh interval, 200 ms, of 200/s).
	st := regionStatus(t, regions[1])
	if st == nil || len(st.GetUpstream().GetKeys()) != 1 {
		t.Fatalf("r1: no status with one global key: %v", st)
	}
	debt := float64(st.GetUpstream().GetKeys()[0].GetDebt())
	bound := burst + rate*secs + debt + 200*0.2
	t.Logf("r1 (copy 300/s, global 100/s): admitted %d of %d over %.1f s (bound B + R·t + debt %.0f + 40 = %.0f); first grant at %.2f s",
		adm, off, secs, debt, bound, held.Sub(loose.start).Seconds())
	if float64(adm) > bound {
		t.Errorf("r1 admitted %d in %.1f s, bound B + R·t + debt + 40 = %.0f: its looser copy widened it", adm, secs, bound)
	}
	from = int(held.Sub(loose.start)/slot) + 10
	adm, _ = loose.sum(from, end)
	if got := float64(adm) / (float64(end-from) * slot.Seconds()); got < 0.8*rate {
		t.Errorf("r1 admitted %.1f/s once it held the key, want at least 0.8·R = %.0f/s", got, 0.8*rate)
	}

	// Status on each region: the mismatch, with both limits.
	for i, r := range regions {
		st := regionStatus(t, r)
		if st == nil || len(st.GetUpstream().GetKeys()) != 1 {
			t.Fatalf("%s: no status with one global key: %v", r.name, st)
		}
		k := st.GetUpstream().GetKeys()[0]
		if !k.GetRuleMismatch() || k.GetRegionLimit().GetRequestsPerUnit() != uint32(copies[i]) ||
			k.GetLimit().GetRequestsPerUnit() != uint32(rate) || k.GetLimit().GetBurst() != burst || k.GetGlobalRulesVersion() == 0 {
			t.Errorf("%s: status %+v, want a mismatch of the copy %d/s against the global %.0f/s in force", r.name, k, copies[i], rate)
		}
	}
}
