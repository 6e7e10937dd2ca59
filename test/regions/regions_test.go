// Package regions tests one limit across regions on real processes: a
// global allocator cluster, regional allocator clusters leasing its
// scope: global keys over links with cross-region latency
// (internal/faultnet), and in every region gateway processes (cmd/gateway)
// driven over HTTP, or in-process agents; one test runs the allocators
// over mutual TLS.
package regions

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/internal/faultnet"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	testproc.RemoveBuilds()
	os.Exit(code)
}

// The global key: R = 100/s, B = 100, one budget across every region.
const (
	rate  = 100.0
	burst = 100
)

const globalRules = `domain: reg
scope: global
descriptors:
  - key: k
    rate_limit: {name: shared, unit: second, requests_per_unit: 100, burst: 100}
`

// splitRules is the static split of the same budget over three regions:
// a regional rule of R/3 in each.
const splitRules = `domain: split
descriptors:
  - key: k
    rate_limit: {name: split, unit: second, requests_per_unit: 33, burst: 33}
`

// oneWay is the cross-region latency each way (an RTT of 120 ms).
const oneWay = 60 * time.Millisecond

// world is a global cluster, regions, and in every region in-process
// agents or gateway processes.
type world struct {
	t       *testing.T
	dir     string
	bins    testproc.Binaries
	global  *testproc.Cluster
	regions []*region
	rules   *rules.Set
}

// region is one regional cluster behind its cross-region link.
type region struct {
	name   string
	links  []*faultnet.Proxy // the region's links to the global cluster's nodes
	c      *testproc.Cluster
	agents []*agent.Agent
	gws    []*testproc.Gateway
}

// worldConfig sizes a world.
type worldConfig struct {
	global   int   // allocators of the global cluster
	regions  []int // allocators of each region
	agents   int   // in-process agents per region
	gateways int   // gateway processes (cmd/gateway) per region
}

// gatewayConfig makes the gateways check every request against the global
// key reg/k=one.
func gatewayConfig(upstream string) string {
	return fmt.Sprintf(`upstream: %s
domain: reg
descriptors: [[{key: k, value: one}]]
`, upstream)
}

// newWorld starts the global cluster, the regions, their agents and
// gateways.
func newWorld(t *testing.T, cfg worldConfig) *world {
	t.Helper()
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
	w := &world{t: t, dir: t.TempDir(), bins: testproc.Build(t)}
	file := testproc.WriteFile(t, w.dir, "reg.yaml", globalRules)
	split := testproc.WriteFile(t, w.dir, "split.yaml", splitRules)
	set, err := rules.Compile(1, []rules.File{{Name: "reg.yaml", Source: []byte(globalRules)}, {Name: "split.yaml", Source: []byte(splitRules)}})
	if err != nil {
		t.Fatal(err)
	}
	w.rules = set
	if err := os.MkdirAll(w.dir+"/global", 0o755); err != nil {
		t.Fatal(err)
	}
	w.global = testproc.StartCluster(t, testproc.ClusterConfig{Bin: w.bins.Allocator, Dir: w.dir + "/global", Size: cfg.global,
		Rules: []string{file, split}, Args: testproc.FastLeaseArgs})
	var up *testproc.Upstream
	if cfg.gateways > 0 {
		up = testproc.StartUpstream(t)
	}
	for i, regionSize := range cfg.regions {
		r := &region{name: fmt.Sprintf("r%d", i)}
		if err := os.MkdirAll(w.dir+"/"+r.name, 0o755); err != nil {
			t.Fatal(err)
		}
		var links []string
		for _, addr := range w.global.GRPCAddrs() {
			p, err := faultnet.Listen(addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			p.Delay(faultnet.ToTarget, oneWay)
			p.Delay(faultnet.ToClient, oneWay)
			links = append(links, p.Addr())
			r.links = append(r.links, p)
		}
		args := append([]string{"-region", r.name, "-upstream-rtt", (2 * oneWay).String()}, testproc.FastLeaseArgs...)
		for _, l := range links {
			args = append(args, "-global-allocators", l)
		}
		r.c = testproc.StartCluster(t, testproc.ClusterConfig{Bin: w.bins.Allocator, Dir: w.dir + "/" + r.name,
			Size: regionSize, Rules: []string{file, split}, Args: args})
		for j := range cfg.agents {
			r.agents = append(r.agents, startAgent(t, fmt.Sprintf("%s-a%d", r.name, j), r.c.GRPCAddrs(), set))
		}
		for j := range cfg.gateways {
			g := testproc.StartGateway(t, w.bins.Gateway, w.dir+"/"+r.name, fmt.Sprintf("%s-gw%d", r.name, j),
				gatewayConfig(up.URL), r.c.GRPCAddrs())
			r.gws = append(r.gws, g)
		}
		w.regions = append(w.regions, r)
	}
	for _, r := range w.regions {
		for _, g := range r.gws {
			testproc.Eventually(t, 30*time.Second, g.Name+" /readyz", g.Ready)
		}
	}
	return w
}

// partition cuts the region off from the global cluster; heal ends it.
func (r *region) partition() {
	for _, l := range r.links {
		l.Partition()
	}
}

func (r *region) heal() {
	for _, l := range r.links {
		l.Heal()
	}
}

// tally counts one region's decisions per 100 ms slot from the start.
type tally struct {
	mu                sync.Mutex // guards admitted and offered
	admitted, offered []int
	errs              atomic.Int64
	start             time.Time
	slot              time.Duration
}

func newTally(start time.Time) *tally { return &tally{start: start, slot: 100 * time.Millisecond} }

func (t *tally) add(at time.Time, ok bool) {
	i := int(at.Sub(t.start) / t.slot)
	if i < 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for len(t.offered) <= i {
		t.offered = append(t.offered, 0)
		t.admitted = append(t.admitted, 0)
	}
	t.offered[i]++
	if ok {
		t.admitted[i]++
	}
}

// sum returns what was admitted and offered in slots [from, to).
// checkPrefixes checks that the regions' tallies admitted, from the start,
// at most B + R·t plus connected in every prefix of whole slots up to end,
// plus extra in the prefixes that end past slot after. connected is what
// the regions reported, at the event the test measures, as their gateways'
// fallback debt and their minting while a call was overdue (regions.md's
// bound for connected regions); a debt run up and repaid before that
// instant is not in it, so a prefix ending then is checked without it. It
// reports every prefix over its bound and returns the largest excess
// (negative: the closest margin) and the prefix's length in seconds.
func checkPrefixes(t *testing.T, tallies []*tally, slot time.Duration, end int, connected float64, after int, extra float64) (worst, worstAt float64) {
	t.Helper()
	worst = -1e9
	for to := 1; to <= end; to++ {
		adm := 0
		for _, tl := range tallies {
			a, _ := tl.sum(0, to)
			adm += a
		}
		secs := float64(to) * slot.Seconds()
		bound := burst + rate*secs + connected
		if to > after {
			bound += extra
		}
		if float64(adm) > bound {
			t.Errorf("admitted %d in the first %.1f s across regions, bound B + R·t + %.0f (the regions' debt and overdue minting) (+ %.0f past %.1f s) = %.0f",
				adm, secs, connected, extra, float64(after)*slot.Seconds(), bound)
		}
		if float64(adm)-bound > worst {
			worst, worstAt = float64(adm)-bound, secs
		}
	}
	return worst, worstAt
}

func (t *tally) sum(from, to int) (admitted, offered int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := max(from, 0); i < min(to, len(t.offered)); i++ {
		admitted += t.admitted[i]
		offered += t.offered[i]
	}
	return admitted, offered
}

func (t *tally) slots() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.offered)
}

// load offers rate(now) requests/s of the global key in region r, spread
// over its agents, until ctx ends; it counts them in tl.
func load(ctx context.Context, wg *sync.WaitGroup, r *region, tl *tally, rateOf func(time.Time) float64) {
	loadDomain(ctx, wg, r, "reg", tl, rateOf)
}

// loadDomain is load on domain's key k=one.
func loadDomain(ctx context.Context, wg *sync.WaitGroup, r *region, domain string, tl *tally, rateOf func(time.Time) float64) {
	desc := []agent.Descriptor{{Entries: []rules.Entry{{Key: "k", Value: "one"}}}}
	wg.Add(1)
	go func() {
		defer wg.Done()
		next := time.Now()
		n := 0
		for ctx.Err() == nil {
			rt := rateOf(next)
			if rt <= 0 {
				next = next.Add(10 * time.Millisecond)
			} else {
				a := r.agents[n%len(r.agents)]
				n++
				d, err := a.Check(ctx, domain, desc, 1)
				if err != nil {
					if ctx.Err() == nil {
						tl.errs.Add(1)
					}
				} else {
					tl.add(time.Now(), d.Allowed)
				}
				next = next.Add(time.Duration(float64(time.Second) / rt))
			}
			if d := time.Until(next); d > 0 {
				select {
				case <-ctx.Done():
				case <-time.After(d):
				}
			} else if d < -time.Second {
				next = time.Now() // fell behind: do not burst to catch up
			}
		}
	}()
}

// gatewayLoad offers requests of the global key over HTTP to every
// region's gateway processes (testproc.Load: a fixed rate, round-robin
// over the region's gateways).
type gatewayLoad struct {
	start time.Time
	loads []*testproc.Load
}

// gatewayLoad starts perRegion requests/s in every region; it is stopped
// at cleanup (tallies stops it first).
func (w *world) gatewayLoad(start time.Time, perRegion float64) *gatewayLoad {
	gl := &gatewayLoad{start: start}
	for _, r := range w.regions {
		var proxies []string
		for _, g := range r.gws {
			proxies = append(proxies, g.Proxy)
		}
		l := &testproc.Load{Proxies: proxies, Keys: []string{"client"}, Rate: perRegion}
		l.Start()
		w.t.Cleanup(l.Stop)
		gl.loads = append(gl.loads, l)
	}
	return gl
}

// tallies stops the load and counts each region's answers per 100 ms
// slot from start, by when each answer arrived: 200 admitted, 429 denied,
// anything else (a 5xx, another code, a request that failed) an error.
func (gl *gatewayLoad) tallies(t *testing.T) []*tally {
	out := make([]*tally, len(gl.loads))
	for i, l := range gl.loads {
		l.Stop()
		tl := newTally(gl.start)
		codes := map[int]int{}
		for _, r := range l.Results() {
			switch r.Code {
			case http.StatusOK, http.StatusTooManyRequests:
				tl.add(time.Unix(0, r.End), r.Code == http.StatusOK)
			default:
				codes[r.Code]++
				tl.errs.Add(1)
			}
		}
		if len(codes) > 0 {
			t.Logf("region %d: answers other than 200 and 429 (code 0: the request failed): %v", i, codes)
		}
		if n := l.Skipped(); n > 0 {
			t.Logf("region %d: the load generator skipped %d ticks (every worker busy)", i, n)
		}
		out[i] = tl
	}
	return out
}

// limiterErrors sums the requests the region's gateways answered with a
// limiter error (their /metrics); an error when a gateway cannot be
// scraped or reports no allowed request.
func (r *region) limiterErrors() (float64, error) {
	sum := 0.0
	for _, g := range r.gws {
		m, err := g.Metrics()
		if err != nil {
			return 0, err
		}
		if m.Get(`allot_gateway_requests_total{result="allowed"}`) <= 0 {
			return 0, fmt.Errorf("%s: no allowed request in its metrics", g.Name)
		}
		sum += max(m.Get(`allot_gateway_requests_total{result="limiter_error"}`), 0)
	}
	return sum, nil
}

// startAgent starts an agent of the allocators at addrs, closed at cleanup.
func startAgent(t *testing.T, id string, addrs []string, set *rules.Set) *agent.Agent {
	t.Helper()
	a, err := agent.New(agent.Config{ID: id, Allocators: addrs, Rules: set})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = a.Close(ctx)
	})
	return a
}

// waitHolding waits until every region's leader holds the global key.
func (w *world) waitHolding(within time.Duration) {
	w.t.Helper()
	for _, r := range w.regions {
		testproc.Eventually(w.t, within, r.name+" holding the global key", func() bool {
			st := regionStatus(w.t, r)
			if st == nil || st.GetUpstream().GetState() != "connected" {
				return false
			}
			for _, k := range st.GetUpstream().GetKeys() {
				if k.GetReceived() > 0 {
					return true
				}
			}
			return false
		})
	}
}

// regionStatus is the ClusterStatus of the region's leader (nil when none
// answers).
func regionStatus(t *testing.T, r *region) *allotv1.ClusterStatusResponse {
	for _, n := range r.c.Running() {
		st, err := n.Status(t)
		if err == nil && st.GetState() == "leader" {
			return st
		}
	}
	return nil
}

// heldKey is the global key as r's leader reports it, waiting up to 10 s
// for a leader that answers (an election may be under way).
func heldKey(t *testing.T, r *region) *allotv1.GlobalKeyHeld {
	t.Helper()
	var k *allotv1.GlobalKeyHeld
	testproc.Eventually(t, 10*time.Second, r.name+"'s leader reporting the global key", func() bool {
		if keys := regionStatus(t, r).GetUpstream().GetKeys(); len(keys) > 0 {
			k = keys[0]
		}
		return k != nil
	})
	return k
}

// fullWorld is the setup of the regions tests: a global cluster of three
// allocators, three regions (one of three allocators, two of one) behind
// links with 60 ms of latency each way, and two gateway processes in every
// region, driven over HTTP.
func fullWorld(t *testing.T) *world {
	return newWorld(t, worldConfig{global: 3, regions: []int{3, 1, 1}, gateways: 2})
}

// loadedFullWorld starts fullWorld with every region's gateways loaded at
// perRegion requests/s, waits for every region to hold the global key, and
// lets the regions settle on their shares for 4 s of contended load. It
// returns the instant every region held the key, where settling began.
func loadedFullWorld(t *testing.T, perRegion float64) (*world, *gatewayLoad, time.Time) {
	t.Helper()
	w := fullWorld(t)
	load := w.gatewayLoad(time.Now(), perRegion)
	w.waitHolding(30 * time.Second)
	settle := time.Now()
	testproc.Eventually(t, 20*time.Second, "4 s of contended load", func() bool { return time.Since(settle) > 4*time.Second })
	return w, load, settle
}

// TestAcrossRegions: three regions lease one global key (R = 100/s,
// B = 100) from a global cluster of three, their gateways loaded with
// 60 requests/s each (180/s in all).
//
//   - Exact across regions: from the start, the total admitted by every
//     region is at most B + R·t at every instant t, plus the regions'
//     fallback debt and overdue minting at the cut (regions.md's bound for
//     connected regions) and the partition's own over-admission below; and in every window of 1 s after the
//     first grants, at most B + R·t plus the lead the regions hold
//     (docs/regions.md).
//   - Partition: the region of three allocators cut off from the global
//     cluster for 10 s admits at most its fallback share S (its share at
//     the last grant) over the cut, plus what it held and the debt its
//     gateways' fallback buckets ran up meanwhile; the other two keep
//     at least their share of R.
//   - No answer other than 200 or 429 at any gateway.
func TestAcrossRegions(t *testing.T) {
	const perRegion = 60.0
	w, load, settle := loadedFullWorld(t, perRegion)
	start := load.start

	// The share region 0 was granted at its last grant, and what it holds.
	cut := w.regions[0]
	k0 := heldKey(t, cut)
	share := k0.GetShare()
	t.Logf("before the cut: %s share %.1f/s, holds %d", cut.name, share, k0.GetAvailable())
	// What regions.md's bound for connected regions adds to B + R·t: the
	// debt the gateways' fallback buckets ran up (admitted beyond a pool,
	// repaid from later grants) and what a region minted while a call was
	// overdue, as each region reports them at the cut.
	connected := 0.0
	var cutDebt int64 // the cut region's debt at the cut
	for i, r := range w.regions {
		k := heldKey(t, r)
		if i == 0 {
			cutDebt = k.GetDebt()
		}
		t.Logf("at the cut: %s received %d, minted %d, returned %d, available %d, debt %d", r.name,
			k.GetReceived(), k.GetMinted(), k.GetReturned(), k.GetAvailable(), k.GetDebt())
		connected += float64(k.GetDebt() + k.GetMinted())
	}
	cutAt := time.Now()
	cut.partition()
	testproc.Eventually(t, 30*time.Second, "10 s cut off", func() bool { return time.Since(cutAt) > 10*time.Second })
	fb := heldKey(t, cut)
	cut.heal()
	healAt := time.Now()
	testproc.Eventually(t, 20*time.Second, "3 s after the heal", func() bool { return time.Since(healAt) > 3*time.Second })
	tallies := load.tallies(t)
	end := tallies[0].slots()
	for i, r := range w.regions {
		k := heldKey(t, r)
		a, o := tallies[i].sum(0, end)
		t.Logf("%s: admitted %d of %d; received %d, minted %d, returned %d, available %d, debt %d", r.name, a, o,
			k.GetReceived(), k.GetMinted(), k.GetReturned(), k.GetAvailable(), k.GetDebt())
	}
	w.checkNoErrors(tallies)

	slot := 100 * time.Millisecond
	at := func(t time.Time) int { return int(t.Sub(start) / slot) }
	total := func(from, to int) (adm, off int) {
		for _, tl := range tallies {
			a, o := tl.sum(from, to)
			adm += a
			off += o
		}
		return adm, off
	}
	// The partition's own over-admission: region 0 admits from its fallback
	// share while the global cluster goes on granting R to the others.
	if !fb.GetCutOff() {
		t.Errorf("%s not reported cut off during the partition: %+v", cut.name, fb)
	}
	cutSecs := healAt.Sub(cutAt).Seconds()
	// The share over the cut and the detection, plus the region's debt:
	// what its gateways' fallback buckets admitted beyond the pool, repaid
	// out of later grants (docs/regions.md, "A region cut off").
	debt := max(fb.GetDebt(), heldKey(t, cut).GetDebt())
	extra := fb.GetFallbackRate()*(cutSecs+0.5) + float64(debt)
	// Exact from the start: every prefix [0, t].
	worstPrefix, worstPrefixAt := checkPrefixes(t, tallies, slot, end, connected, at(cutAt), extra)
	// Every 1 s window: B + R·t plus the lead (each region holds at most a
	// horizon plus its low watermark of its demand, 60/s × 1.3 s, and its
	// gateways a refresh interval, 60/s × 0.2 s), plus the partition's share
	// in the windows that meet it.
	lead := 3 * perRegion * 1.5
	worst, worstCut := 0.0, 0.0
	for from := at(settle); from+10 <= end; from++ {
		adm, _ := total(from, from+10)
		bound := burst + rate + lead
		during := from+10 > at(cutAt) && from < at(healAt)+5
		if during {
			bound += extra
			worstCut = max(worstCut, float64(adm))
		} else {
			worst = max(worst, float64(adm))
		}
		if float64(adm) > bound {
			t.Errorf("admitted %d in the 1 s window from %.1f s, bound %.0f", adm, float64(from)/10, bound)
		}
	}
	// The cut region: within what it held (at most the lead), its share
	// over the cut and a tick, and the debt its gateways' fallback buckets
	// ran up meanwhile (regions.md: admitted beyond the pool, repaid out of
	// later mints and grants); the others keep at least their share of R
	// (R/3 each).
	adm, off := tallies[0].sum(at(cutAt), at(healAt))
	cutBound := fb.GetFallbackRate()*cutSecs + perRegion*1.5 + 1 + float64(max(0, fb.GetDebt()-cutDebt))
	t.Logf("partition %.1f s: %s admitted %d of %d offered (bound %.0f: share %.1f/s at the last grant %.1f/s, debt %d → %d)",
		cutSecs, cut.name, adm, off, cutBound, fb.GetFallbackRate(), share, cutDebt, fb.GetDebt())
	if float64(adm) > cutBound {
		t.Errorf("%s admitted %d while cut off, bound %.0f", cut.name, adm, cutBound)
	}
	for i := 1; i < len(tallies); i++ {
		a, o := tallies[i].sum(at(cutAt)+10, at(healAt)) // from a second after the cut
		secs := cutSecs - 1
		t.Logf("partition: region %d admitted %d of %d (%.1f/s)", i, a, o, float64(a)/secs)
		if float64(a)/secs < 0.8*rate/3 {
			t.Errorf("region %d admitted %.1f/s during the partition, want at least 0.8 × R/3 = %.1f/s", i, float64(a)/secs, 0.8*rate/3)
		}
	}
	allAdm, allOff := total(0, end)
	t.Logf("whole run %.1f s: admitted %d of %d; prefix [0, t] closest to its bound by %.0f at t = %.1f s; worst 1 s window after settling %.0f outside the cut, %.0f meeting it (bound B + R + lead = %.0f, + %.0f meeting the cut)",
		float64(end)*slot.Seconds(), allAdm, allOff, worstPrefix, worstPrefixAt, worst, worstCut, burst+rate+lead, extra)
}

// checkNoErrors fails the test for any answer other than 200 or 429 at
// the load generator, and for any limiter error the gateways count.
func (w *world) checkNoErrors(tallies []*tally) {
	w.t.Helper()
	for i, tl := range tallies {
		if n := tl.errs.Load(); n != 0 {
			w.t.Errorf("region %d: %d answers other than 200 or 429 at the gateways", i, n)
		}
		if n, err := w.regions[i].limiterErrors(); err != nil || n != 0 {
			w.t.Errorf("region %d: %v limiter errors counted by the gateways (%v)", i, n, err)
		}
	}
}

// TestRegionFailover: fullWorld under 50 requests/s in each region
// (150/s against R = 100/s: the key is oversubscribed, so no region holds
// a lead); a kill -9 of the leader of the region of three, then of the
// global leader, gives no error at the gateways (no answer but 200 or 429,
// no limiter error in their metrics), every region keeps admitting in
// every second, what the region holds survives its failover (the regional
// ledger is replicated), and the total admitted from the start stays
// within B + R·t plus the gateways' fallback bursts (each gateway decides
// from its fallback bucket, R/N with burst ⌈B/N⌉, while its allocator
// fails over).
//
// After the global leader's kill each region's call in flight waits at a
// global follower that retries for the new leader; once it is overdue
// (three measured round trips) a region with nothing held falls to its
// share, as if cut off, rather than admitting nothing until the call's
// timeout. The region of three still owes what its gateways' fallbacks
// admitted during its own failover (a debt of 30-60 tokens at a share of
// ~20/s); while its call is overdue it keeps half of each mint for its
// gateways and repays the debt with the rest, rather than admitting
// nothing while it repays.
func TestRegionFailover(t *testing.T) {
	// The regions settle on their shares first: the share a region falls
	// to while the global cluster fails over is what it was granted lately.
	w, load, _ := loadedFullWorld(t, 50)
	start := load.start
	r0 := w.regions[0]
	before := heldKey(t, r0)

	// The region's leader.
	leader := r0.c.Leader(t, 10*time.Second)
	killAt := time.Now()
	leader.Proc.Kill()
	testproc.Eventually(t, 20*time.Second, "a new leader in "+r0.name+" holding the global key", func() bool {
		st := regionStatus(t, r0)
		return st != nil && st.GetNodeId() != leader.ID && st.GetUpstream().GetState() == "connected"
	})
	after := heldKey(t, r0)
	t.Logf("%s leader %s killed; the new leader took over within %v: received %d before, %d after",
		r0.name, leader.ID, time.Since(killAt).Round(10*time.Millisecond), before.GetReceived(), after.GetReceived())
	if after.GetReceived() < before.GetReceived() || after.GetMinted() < before.GetMinted() {
		t.Errorf("the regional failover lost part of the ledger: before %+v, after %+v", before, after)
	}

	// The global leader.
	settle := time.Now()
	testproc.Eventually(t, 20*time.Second, "2 s more of load", func() bool { return time.Since(settle) > 2*time.Second })
	gl := w.global.Leader(t, 10*time.Second)
	received := make([]int64, len(w.regions))
	for i, r := range w.regions {
		k := heldKey(t, r)
		received[i] = k.GetReceived()
		t.Logf("before the global leader's kill: %s share %.1f/s, fallback %.1f/s, holds %d, debt %d", r.name, k.GetShare(), k.GetFallbackRate(), k.GetAvailable(), k.GetDebt())
	}
	gKillAt := time.Now()
	gl.Proc.Kill()
	testproc.Eventually(t, 30*time.Second, "every region granted again after the global leader's kill", func() bool {
		for i, r := range w.regions {
			st := regionStatus(t, r)
			if st == nil || len(st.GetUpstream().GetKeys()) == 0 || st.GetUpstream().GetKeys()[0].GetReceived() <= received[i] {
				return false
			}
		}
		return true
	})
	t.Logf("global leader %s killed; every region granted again within %v", gl.ID, time.Since(gKillAt).Round(10*time.Millisecond))
	testproc.Eventually(t, 20*time.Second, "3 s after the global leader's kill", func() bool { return time.Since(gKillAt) > 3*time.Second })
	tallies := load.tallies(t)
	w.checkNoErrors(tallies)

	slot := 100 * time.Millisecond
	end := tallies[0].slots()
	idle := false
	fewest := make([]string, len(tallies))
	for i, tl := range tallies {
		least := -1
		for from := int(killAt.Sub(start) / slot); from+10 <= end; from += 10 {
			a, _ := tl.sum(from, from+10)
			if a == 0 {
				t.Errorf("region %d admitted nothing in the second from %.1f s", i, float64(from)/10)
				idle = true
			}
			if least < 0 || a < least {
				least = a
			}
		}
		fewest[i] = fmt.Sprint(least)
	}
	t.Logf("fewest admitted in a second from the regional kill on, per region: %s", strings.Join(fewest, ", "))
	if idle {
		t.Logf("regional kill at %.1f s, global kill at %.1f s; admitted/offered per 500 ms:", killAt.Sub(start).Seconds(), gKillAt.Sub(start).Seconds())
		for from := int(killAt.Sub(start)/slot) - 10; from < end; from += 5 {
			line := fmt.Sprintf("%5.1f s:", float64(from)/10)
			for _, tl := range tallies {
				a, o := tl.sum(from, from+5)
				line += fmt.Sprintf(" %3d/%3d", a, o)
			}
			t.Log(line)
		}
	}
	// Gateways' fallback bursts: ⌈B/N⌉ each, N the gateways in their region.
	gateways := 0
	for _, r := range w.regions {
		gateways += len(r.gws)
	}
	slack := float64(gateways) * burst / 2
	adm := 0
	for to := 1; to <= end; to++ {
		adm = 0
		for _, tl := range tallies {
			a, _ := tl.sum(0, to)
			adm += a
		}
		secs := float64(to) * slot.Seconds()
		if bound := burst + rate*secs + slack; float64(adm) > bound {
			t.Errorf("admitted %d in the first %.1f s across regions, bound B + R·t + fallback bursts = %.0f", adm, secs, bound)
			break
		}
	}
	t.Logf("whole run %.1f s: admitted %d (B + R·t = %.0f); 0 errors required at %d gateways",
		float64(end)*slot.Seconds(), adm, burst+rate*float64(end)*slot.Seconds(), gateways)
}
