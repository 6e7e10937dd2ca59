package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/allocator/upstream"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The regions scenario: one limit across regions. A global key of R/s
// (burst R) is offered 1.2 R by three regions, 70% of it in one region, the
// hot region moving every 10 s; one region is cut off from the global
// cluster for 10 s.
//
// allot's design: each region's leader runs allocator/upstream for the key
// against a global cluster (the real allocator/state, the regions as its
// agents, 50–100 ms one way away), and its own regional cluster (the real
// allocator/state) sizes the grants to its gateways; a grant is capped at
// what the region's lease holds (upstream.Key.SubGrant), and what the cap
// cut off is handed back to the regional bucket on the gateway's next call.
// A gateway is modelled as the agent's lease cache reduced to its
// arithmetic: a token balance spent in-process, a 1 s demand EWMA, a
// refill every 50 ms below its low watermark or after 1 s, sized for one
// second of demand, returning what exceeds twice that.
//
// The same arrivals go to a static per-region split (an exact token bucket
// of R/3, burst R/3, per region) and to each region enforcing R on its own
// (what a scope: global rule does on clusters with no global upstream).

const (
	regionCount     = 3
	regionHotShare  = 0.7
	regionMoveEvery = 10 * time.Second
	regionInQuota   = 0.9 // offered in the demand-moving run, as a multiple of R
	regionOverload  = 1.2 // offered in the run with a cut
	regionCut       = 2   // the region cut off from the global cluster
	regionCutLength = 10 * time.Second
	gatewayTick     = 50 * time.Millisecond
	globalRefresh   = 500 * time.Millisecond // the global cluster's -refresh-interval
)

// regionWorld is the two-level lease system of the regions scenario.
type regionWorld struct {
	w       *world
	rng     *rand.Rand // cross-region and regional network, commit latency
	global  *state.State
	regions []*regionNode
	gws     []*regionGateway
	ucfg    upstream.Config
	commit  logNormal
	local   logNormal // gateway ↔ regional cluster, one way

	cutFrom, cutTo int64

	globalErrs int64 // calls the global cluster refused (should stay 0)
}

// regionNode is one region: its cluster's state and its leader's policy
// for the global key.
type regionNode struct {
	idx int
	st  *state.State
	key *upstream.Key

	cutTime    time.Duration // time the key was cut off or its call overdue, when it mints (sampled at the leader's ticks)
	maxFallRt  float64       // the highest fallback rate seen while cut off or overdue, tokens/s
	shareAtCut float64       // the fallback rate when the cut was first seen
	calls      int64
}

// regionGateway is one gateway's lease of the global key from its
// regional cluster.
type regionGateway struct {
	rw       *regionWorld
	idx      int
	region   int
	id       string
	bal      int64
	arrived  int64 // arrivals since the last scan
	demand   float64
	reported float64 // the demand of the gateway's last Acquire: what its regional cluster knows
	lastScan int64
	lastCall int64
	inflight bool
	reqID    uint64
	clipped  int64 // granted by the regional state beyond the lease: handed back on the next call
}

var regionDesc = []*allotv1.Entry{{Key: "g", Value: "k0"}}

func regionRules(r int64) *allotv1.RuleFile {
	src := fmt.Sprintf("domain: %s\nscope: global\ndescriptors:\n  - key: g\n    rate_limit: {name: g, unit: second, requests_per_unit: %d, burst: %d}\n", domain, r, r)
	return &allotv1.RuleFile{Name: domain + ".yaml", Domain: domain, Yaml: []byte(src)}
}

func newRegionWorld(w *world, r int64, perRegion int) (*regionWorld, error) {
	ucfg := upstream.DefaultConfig()
	ucfg.RTT = 200 * time.Millisecond // the longest cross-region round trip
	// The global cluster runs with -refresh-interval 500ms: its agents are
	// a few regional leaders, and its grant pacing hands each region its
	// share of the refill per refresh window, so a region the hot spot
	// just moved to, having taken its allowance, waits at most half a
	// second for the next. With 1 s the demand-moving run's false rejects
	// were 1.3–2.1% (tiny to full scale), with 500 ms 0.62–0.84%.
	gcfg := state.DefaultConfig()
	gcfg.RefreshInterval = globalRefresh
	rw := &regionWorld{w: w, rng: newRand(w.cfg.seed, "regions"), global: state.New(gcfg),
		ucfg: ucfg, commit: newLogNormal(5*time.Millisecond, 20*time.Millisecond),
		local: newLogNormal(250*time.Microsecond, 1500*time.Microsecond)}
	files := []*allotv1.RuleFile{regionRules(r)}
	put := func(st *state.State) (*rules.Rule, error) {
		res := st.Apply(&allotv1.Command{NowUnixNanos: w.eng.now, Cmd: &allotv1.Command_PutRules{
			PutRules: &allotv1.PutRulesRequest{Files: files, ReplaceAll: true}}})
		if err, ok := res.(error); ok {
			return nil, fmt.Errorf("sim: regions rules: %w", err)
		}
		return st.Rules().Match(domain, []rules.Entry{{Key: "g", Value: "k0"}}), nil
	}
	rule, err := put(rw.global)
	if err != nil {
		return nil, err
	}
	if rule == nil || rule.Scope != rules.ScopeGlobal {
		return nil, fmt.Errorf("sim: regions: the rule is not scope: global")
	}
	for i := range regionCount {
		n := &regionNode{idx: i, st: state.New(state.DefaultConfig())}
		if _, err := put(n.st); err != nil {
			return nil, err
		}
		if n.key, err = upstream.NewKey(rw.ucfg, upstream.RuleOf(rule, "region-"+strconv.Itoa(i))); err != nil {
			return nil, err
		}
		rw.regions = append(rw.regions, n)
	}
	phase := newRand(w.cfg.seed, "regions-phase")
	for i := range regionCount * perRegion {
		g := &regionGateway{rw: rw, idx: i, region: i / perRegion, id: fmt.Sprintf("gw-%d-%03d", i/perRegion, i%perRegion), lastScan: w.eng.now}
		rw.gws = append(rw.gws, g)
		w.eng.at(w.eng.now+phase.Int64N(int64(gatewayTick)), g, 0)
	}
	for _, n := range rw.regions {
		w.eng.at(w.eng.now+phase.Int64N(int64(rw.ucfg.Tick)), n.ticker(rw), 0)
	}
	var expire func()
	expire = func() {
		for _, st := range append([]*state.State{rw.global}, rw.states()...) {
			st.Apply(&allotv1.Command{NowUnixNanos: w.eng.now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}})
		}
		w.eng.after(time.Second, expire)
	}
	w.eng.after(time.Second, expire)
	return rw, nil
}

func (rw *regionWorld) states() []*state.State {
	out := make([]*state.State, len(rw.regions))
	for i, n := range rw.regions {
		out[i] = n.st
	}
	return out
}

// crossOneWay is one cross-region message's delay: 50–100 ms.
func (rw *regionWorld) crossOneWay() time.Duration {
	return 50*time.Millisecond + time.Duration(rw.rng.Int64N(int64(50*time.Millisecond)))
}

// cut reports whether region is cut off from the global cluster at t.
func (rw *regionWorld) cut(region int, t int64) bool {
	return region == regionCut && t >= rw.cutFrom && t < rw.cutTo
}

type regionTicker struct {
	rw *regionWorld
	n  *regionNode
}

func (n *regionNode) ticker(rw *regionWorld) *regionTicker { return &regionTicker{rw, n} }

// fire is the regional leader's tick: evaluate the key, call upstream when
// due. A call made or answered across the cut is lost; the policy's own
// timeout notices.
func (t *regionTicker) fire(int64) {
	rw, n, w := t.rw, t.n, t.rw.w
	demand := 0.0
	for _, g := range rw.gws {
		if g.region == n.idx {
			demand += g.reported
		}
	}
	if req, ok := n.key.Tick(w.eng.now, demand); ok {
		n.calls++
		rw.upstreamCall(n, req)
	}
	if s := n.key.Status(); s.CutOff || s.Overdue {
		if n.cutTime == 0 {
			n.shareAtCut = s.FallbackRt
		}
		n.cutTime += rw.ucfg.Tick
		n.maxFallRt = max(n.maxFallRt, s.FallbackRt)
	}
	w.eng.at(w.eng.now+int64(rw.ucfg.Tick), t, 0)
}

func (rw *regionWorld) upstreamCall(n *regionNode, req upstream.Request) {
	w := rw.w
	if rw.cut(n.idx, w.eng.now) {
		return
	}
	w.eng.after(rw.crossOneWay()+time.Duration(rw.commit.sample(rw.rng)), func() {
		res := rw.global.Apply(&allotv1.Command{NowUnixNanos: w.eng.now, Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{
			Requests: []*allotv1.AcquireRequest{{AgentId: "region-" + strconv.Itoa(n.idx), RequestId: req.ID, Keys: []*allotv1.KeyAcquire{{
				Domain: domain, Entries: regionDesc, Want: req.Want, Held: req.Held, Returned: req.Returned,
				Demand: req.Demand, OutageCharged: req.OutageCharged, WantShare: true}}}}}}})
		br, _ := res.(*state.AcquireBatchResult)
		if br == nil || br.Errs[0] != nil {
			rw.globalErrs++
			return // the policy times the call out
		}
		kg := br.Responses[0].Grants[0]
		g := upstream.Grant{ID: req.ID, Granted: kg.GetGranted(), RefreshAfter: time.Duration(kg.GetRefreshAfterMs()) * time.Millisecond,
			Share: kg.GetShare(), HasShare: kg.Share != nil}
		if rw.cut(n.idx, w.eng.now) {
			return
		}
		w.eng.after(rw.crossOneWay(), func() { _ = n.key.Granted(w.eng.now, g) })
	})
}

// fire is the gateway's refill tick.
func (g *regionGateway) fire(int64) {
	w := g.rw.w
	now := w.eng.now
	if dt := float64(now-g.lastScan) / 1e9; dt > 0 {
		a := 1 - math.Exp(-dt)
		g.demand += a * (float64(g.arrived)/dt - g.demand)
		g.arrived, g.lastScan = 0, now
	}
	if !g.inflight {
		lat := 2*gatewayTick.Seconds() + 0.01
		low := int64(math.Ceil(g.demand * lat))
		target := int64(math.Ceil(g.demand * (1 + lat)))
		returned := int64(0)
		if g.bal > 2*target+1 {
			returned = g.bal - target
		}
		if g.bal < max(low, 1) || now-g.lastCall >= int64(time.Second) || returned > 0 || g.clipped > 0 {
			g.bal -= returned
			g.call(max(target-g.bal, 0), returned)
		}
	}
	w.eng.at(now+int64(gatewayTick), g, 0)
}

// call is one Acquire to the regional cluster: returned goes back to the
// region's lease, the clipped tokens of the previous grant to the regional
// bucket, and the grant is capped at what the lease holds.
func (g *regionGateway) call(want, returned int64) {
	rw, w := g.rw, g.rw.w
	n := rw.regions[g.region]
	g.inflight, g.lastCall = true, w.eng.now
	g.reqID++
	g.reported = g.demand
	clipped := g.clipped
	g.clipped = 0
	req := &allotv1.AcquireRequest{AgentId: g.id, RequestId: g.reqID, Keys: []*allotv1.KeyAcquire{{
		Domain: domain, Entries: regionDesc, Want: want, Held: g.bal, Returned: returned + clipped, Demand: g.demand}}}
	w.eng.after(time.Duration(rw.local.sample(rw.rng)+rw.commit.sample(rw.rng)), func() {
		// The leader caps the want at what the region holds before it
		// commits the entry, so the regional grant policy sizes the grant
		// from the lease.
		req.Keys[0].Want = n.key.Cap(w.eng.now, want)
		res := n.st.Apply(&allotv1.Command{NowUnixNanos: w.eng.now, Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{
			Requests: []*allotv1.AcquireRequest{req}}}})
		n.key.SubReturn(w.eng.now, returned)
		var got int64
		if br, _ := res.(*state.AcquireBatchResult); br != nil && br.Errs[0] == nil {
			granted := br.Responses[0].Grants[0].GetGranted()
			got = n.key.SubGrant(w.eng.now, granted)
			g.clipped = max(granted-got, 0)
		} else {
			w.fail(fmt.Errorf("sim: regions: regional Acquire failed: %v", res))
		}
		w.eng.after(time.Duration(rw.local.sample(rw.rng)), func() {
			g.bal += got
			g.inflight = false
		})
	})
}

// regionRouter sends 70% of the requests to the hot region (it moves every
// 10 s) and the rest evenly to the others; a uniform gateway within.
type regionRouter struct {
	w   *world
	rng *rand.Rand
	per int
}

func hotRegion(now int64) int { return int((now - epoch) / int64(regionMoveEvery) % regionCount) }

func (r *regionRouter) pick(int) int {
	reg := hotRegion(r.w.eng.now)
	if r.rng.Float64() >= regionHotShare {
		reg = (reg + 1 + r.rng.IntN(regionCount-1)) % regionCount
	}
	return reg*r.per + r.rng.IntN(r.per)
}

// perRegionBuckets is a system of one exact token bucket per region.
func perRegionBuckets(name string, lim bucket.Limit, per int, now func() int64, stats *[regionCount]regionCounts, cutFrom, cutTo int64) *system {
	st := make([]bucket.State, regionCount)
	return &system{name: name, check: func(ag, _ int, _ []agent.Descriptor) (bool, time.Duration) {
		r := ag / per
		res := lim.AllowN(&st[r], now(), 1)
		stats[r].count(now(), res.Allowed, cutFrom, cutTo)
		return res.Allowed, res.RetryAfter
	}}
}

// regionCounts are one system's admissions in one region during the cut.
type regionCounts struct{ offered, admitted int64 }

func (c *regionCounts) count(now int64, ok bool, from, to int64) {
	if now >= from && now < to {
		c.offered++
		if ok {
			c.admitted++
		}
	}
}

// regionRun is one run of the regions scenario: its world, the lease
// system's two levels, and per-region counts during the cut.
type regionRun struct {
	w           *world
	rw          *regionWorld
	g           *group
	lease       *system
	counts      [3][regionCount]regionCounts
	admittedAll int64 // the lease system's admissions, whole run
	arrivals    int64
	offered     float64 // as a multiple of R
	cutAt       time.Duration
}

// simulateRegions runs the three systems on one set of arrivals offered
// offered·R; with cut, region regionCut is cut off from the global
// cluster for regionCutLength from cutAt.
func simulateRegions(sc scale, seed uint64, offered float64, cut bool) (*regionRun, error) {
	per, r := sc.regionGateways, sc.regionRate
	g := &group{name: "g", quota: r, unit: time.Second, burst: r}
	cfg := worldConfig{name: "regions", seed: seed, agents: regionCount * per, keys: 1, groups: []*group{g},
		warmup: 5 * time.Second, duration: 40 * time.Second, track: []int{0}}
	w, err := newWorld(cfg)
	if err != nil {
		return nil, err
	}
	defer w.shutdown()
	rw, err := newRegionWorld(w, r, per)
	if err != nil {
		return nil, err
	}
	run := &regionRun{w: w, rw: rw, g: g, offered: offered, cutAt: 25 * time.Second}
	if cut {
		rw.cutFrom, rw.cutTo = epoch+int64(run.cutAt), epoch+int64(run.cutAt+regionCutLength)
	}
	now := func() int64 { return w.eng.now }
	run.lease = &system{name: "allot: regional leases of a global lease", check: func(ag, _ int, _ []agent.Descriptor) (bool, time.Duration) {
		gw := rw.gws[ag]
		gw.arrived++
		ok := gw.bal >= 1
		if ok {
			gw.bal--
			run.admittedAll++
		}
		run.counts[0][gw.region].count(w.eng.now, ok, rw.cutFrom, rw.cutTo)
		return ok, 0
	}}
	w.addSystem(run.lease)
	split, err := bucket.NewLimit(bucket.TokenBucket, r, regionCount*time.Second, max(r/regionCount, 1))
	if err != nil {
		return nil, err
	}
	w.addSystem(perRegionBuckets("static per-region split (R/3 each)", split, per, now, &run.counts[1], rw.cutFrom, rw.cutTo))
	w.addSystem(perRegionBuckets("each region enforces R (no global upstream)", g.limit, per, now, &run.counts[2], rw.cutFrom, rw.cutTo))

	arr := &arrivals{w: w, rng: newRand(seed, "regions-traffic"), rate: constant(offered * float64(r)),
		route: &regionRouter{w: w, rng: newRand(seed, "regions-route"), per: per}, key: func() int { return 0 }}
	arr.start()
	if err := w.run(); err != nil {
		return nil, err
	}
	if rw.globalErrs > 0 {
		return nil, fmt.Errorf("sim: regions: the global cluster refused %d calls", rw.globalErrs)
	}
	run.arrivals = arr.n
	return run, nil
}

// systemsTable is the per-system summary of one run.
func (run *regionRun) systemsTable(title string) table {
	w, g := run.w, run.g
	secs := w.seconds()
	t := table{title: title, header: []string{"system", "admitted rate", "of R", "max over-admission / 10 s", "false rejects"}}
	for _, s := range w.systems {
		t.add(s.name, rate(float64(s.rec.admitted)/secs), fmt.Sprintf("%.3f", float64(s.rec.admitted)/secs/g.rate()),
			pct(max(s.rec.maxOver, 0)), pct(s.rec.falseRejectRate()))
	}
	return t
}

// leaseTable describes the regional leaders' leases; it also returns the
// bounds on fallback tokens they imply: over the run, and in any window.
func (run *regionRun) leaseTable(title string) (t table, net, minted, mintBound, windowBound float64) {
	t = table{title: title,
		header: []string{"region", "upstream calls", "received", "returned", "sub-granted (net)", "fallback tokens", "time cut off or overdue", "fallback rate at the cut"}}
	for _, n := range run.rw.regions {
		s := n.key.Status()
		t.add(strconv.Itoa(n.idx), count(n.calls), count(s.Received), count(s.Returned), count(s.SubGranted-s.SubReturned),
			count(s.Minted), n.cutTime.String(), rate(n.shareAtCut))
		net += float64(s.Received - s.Returned)
		minted += float64(s.Minted)
		tickCap := max(n.maxFallRt*run.rw.ucfg.Tick.Seconds(), min(1, n.maxFallRt)) + 1
		mintBound += n.maxFallRt*n.cutTime.Seconds() + tickCap
		windowBound += n.maxFallRt*min(n.cutTime, run.w.cfg.window).Seconds() + tickCap
	}
	return t, net, minted, mintBound, windowBound
}

// strictBounds are the lease system's guarantees in one run.
func (run *regionRun) strictBounds(label string, net, minted, mintBound float64) []bound {
	g := run.g
	name := run.lease.name + " (" + label + ")"
	return []bound{
		{system: name, what: "admitted, whole run", promise: "no token twice: ≤ lease tokens the global bucket granted (net of returns) + fallback tokens",
			measured: float64(run.admittedAll), limit: net + minted, unit: "tokens"},
		{system: name, what: "lease tokens held by the regions (net of returns)", promise: "the global bucket: ≤ B + R·t",
			measured: net, limit: float64(g.burst) + g.rate()*time.Duration(run.w.end-epoch).Seconds(), unit: "tokens"},
		{system: name, what: "fallback tokens while cut off or overdue", promise: "≤ fallback rate × time cut off or overdue + one tick of it + 1, per region",
			measured: minted, limit: mintBound, unit: "tokens"},
	}
}

func runRegions(sc scale, seed uint64) (*result, error) {
	moving, err := simulateRegions(sc, seed, regionInQuota, false)
	if err != nil {
		return nil, err
	}
	cut, err := simulateRegions(sc, seed, regionOverload, true)
	if err != nil {
		return nil, err
	}
	g := moving.g
	res := &result{name: "regions", title: fmt.Sprintf("one limit across %d regions: demand moving, one region cut off", regionCount)}
	res.what = []string{
		fmt.Sprintf("%d regions × %d gateways; one scope: global key, limit %s burst %s; Poisson arrivals, %.0f%% of them in the hot region, which moves every %s; cross-region one-way latency 50–100 ms, regional one way 0.25 ms (p50), Raft commit 5 ms (p50) at both levels; the global cluster's refresh interval %s; %s warm-up, %s measured.",
			regionCount, sc.regionGateways, rate(g.rate()), count(g.burst), 100*regionHotShare, regionMoveEvery, globalRefresh, moving.w.cfg.warmup, moving.w.cfg.duration),
		fmt.Sprintf("Run 1, demand moving: offered %.1f R (%s arrivals), every request in quota. Run 2, one region cut off: offered %.1f R (%s arrivals); region %d is cut off from the global cluster from t=%s to t=%s (its gateways still reach their regional cluster); it is the hot region for the first %s of the cut.",
			regionInQuota, count(moving.arrivals), regionOverload, count(cut.arrivals), regionCut, cut.cutAt, cut.cutAt+regionCutLength,
			time.Duration(regionCut+1)*regionMoveEvery-cut.cutAt),
		"allot: the global cluster and each regional cluster are the real allocator/state; each regional leader runs allocator/upstream for the key, with the region's demand the sum of what its gateways reported in their last Acquire, and caps each gateway's want at what the region holds; gateways are the agent's lease arithmetic (balance, 1 s demand EWMA, 50 ms refill below the low watermark or after 1 s).",
	}
	res.tables = append(res.tables, moving.systemsTable("Run 1, demand moving: per system, same arrivals"))
	lt1, net1, minted1, mb1, _ := moving.leaseTable("Run 1: the regional leaders' leases of the global key")
	res.tables = append(res.tables, lt1)
	res.tables = append(res.tables, cut.systemsTable("Run 2, one region cut off: per system, same arrivals"))
	ct := table{title: fmt.Sprintf("Run 2 during the cut (t=%s–%s): admitted of offered, per region", cut.cutAt, cut.cutAt+regionCutLength),
		header: []string{"system"}}
	for i := range regionCount {
		h := fmt.Sprintf("region %d", i)
		if i == regionCut {
			h += " (cut off)"
		}
		ct.header = append(ct.header, h)
	}
	ct.header = append(ct.header, "all, of R")
	for si, s := range cut.w.systems {
		row := []string{s.name}
		var adm int64
		for i := range regionCount {
			c := cut.counts[si][i]
			row = append(row, fmt.Sprintf("%s of %s", count(c.admitted), count(c.offered)))
			adm += c.admitted
		}
		row = append(row, fmt.Sprintf("%.3f", float64(adm)/(regionCutLength.Seconds()*g.rate())))
		ct.rows = append(ct.rows, row)
	}
	res.tables = append(res.tables, ct)
	lt2, net2, minted2, mb2, wb2 := cut.leaseTable("Run 2: the regional leaders' leases of the global key")
	res.tables = append(res.tables, lt2)

	res.bounds = append(moving.strictBounds("run 1", net1, minted1, mb1), cut.strictBounds("run 2", net2, minted2, mb2)...)
	res.bounds = append(res.bounds,
		bound{system: moving.lease.name + " (run 1)", what: "false rejects, demand moving between regions", target: true, promise: "target ≤ 1%",
			measured: moving.lease.rec.falseRejectRate(), limit: 0.01, unit: "%"},
		bound{system: cut.lease.name + " (run 2)", what: "over-admission per 10 s window (of R·W, beyond B + R·W)", target: true,
			promise:  "≤ fallback rate × min(cut, W) + one tick, per cut region",
			measured: max(cut.lease.rec.maxOver, 0), limit: wb2 / (g.rate() * cut.w.cfg.window.Seconds()), unit: "%"})
	res.notes = append(res.notes,
		"The static split admits at most R/3 in the hot region while the others idle; each region enforcing R on its own admits up to 3 R. A region cut off spends its lease, then falls to its fair share at its last grant (global_fallback: fair_share); the global cluster meanwhile hands that share to the others as the region's claim lapses, so the share is what a cut can over-admit. Run 2's false rejects are mostly the cut region's while it is still the hot region: its share at the last grant is its max-min share of R, less than its demand. Run 1's false rejects are the second after each move: the region the hot spot left still reports its old demand (its gateways hold a second of it and do not call) and claims that much of the global refill, while the region it moved to reports its demand as its gateways' EWMAs rise and builds up its stock within its allowance per refresh window. The regional leader reads a clear fall (what it sub-granted over the last second, or the reported sum inverted over 500 ms, at most half the report) and acts on the fallen rate at once, handing back what it holds beyond the new target.")

	for _, run := range []*regionRun{moving, cut} {
		name, title := "moving", "demand moving"
		var marks []float64
		if run == cut {
			name, title = "cut", "one region cut off"
			marks = []float64{cut.cutAt.Seconds(), (cut.cutAt + regionCutLength).Seconds()}
		}
		plot := run.w.keyPlot("sim-"+sc.name+"-regions-"+name+".png",
			fmt.Sprintf("one global key across regions, %s (%s): admitted vs limit", title, sc.name), 0, run.lease, g.rate())
		plot.marks = marks
		res.plots = append(res.plots, plot)
	}
	return res, nil
}
