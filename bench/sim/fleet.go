package main

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/allot/allot/pkg/rules"
)

// runFleet is the reference fleet (scaled by sc): Zipf(1.1) traffic over
// sc.keys keys spread uniformly over sc.agents gateways, one key-only rule
// whose limit R is chosen so that 2% of the traffic is over its key's limit.
// It covers the "allow" journey (in-quota traffic is admitted) and the
// "deny" journey (keys over their limit are held at R) at scale, with the
// three baselines on the same arrivals, and the allocator's load on
// sc.groups Raft groups.
func runFleet(sc scale, seed uint64) (*result, error) {
	return simulateFleet("fleet", "the reference fleet: allow and deny journeys at scale", sc, sc.groups, true, seed)
}

// runFleet10x is the fleet ten times over (what breaks at 10×): ten times
// the gateways, keys and request rate of sc's fleet on sc.groups10 groups,
// the lease system alone.
func runFleet10x(sc scale, seed uint64) (*result, error) {
	big := sc
	big.agents *= 10
	big.keys *= 10
	big.base *= 10
	big.peak *= 10
	big.fleet = sc.fleet10
	big.sample = sc.sample10
	big.nodes = sc.nodes10
	if sc.peak10 > 0 {
		big.peakFrom, big.peakTo = sc.peak10From, sc.peak10From+sc.peak10
	}
	return simulateFleet("fleet-10x", "the fleet ten times over: the allocator's groups", big, sc.groups10, false, seed)
}

// sampleGroups returns the groups whose keys a fleet run on w's cluster
// simulates: all of them, or (sample > 0) the group that owns the hottest
// key, then the other groups its leader leads, highest-numbered first (so
// that once sample reaches the groups one node leads, the busiest node's
// guard and leaders see every call they would in the whole fleet), then
// the highest-numbered others: groups whose load is the long tail's, as
// most groups' is.
func sampleGroups(w *world, sample int) []bool {
	in := make([]bool, len(w.cl.groups))
	if sample <= 0 || sample >= len(in) {
		for i := range in {
			in[i] = true
		}
		return in
	}
	hot := w.groupOfKey(0)
	in[hot] = true
	n := 1
	mine := w.cl.ledBy(w.cl.groups[hot].leader)
	for i := len(mine) - 1; i >= 0 && n < sample; i-- {
		if g := mine[i]; !in[g] {
			in[g] = true
			n++
		}
	}
	for g := len(in) - 1; n < sample; g-- {
		if !in[g] {
			in[g] = true
			n++
		}
	}
	return in
}

// groupList names the groups in.
func groupList(in []bool) string {
	var ids []string
	for g, ok := range in {
		if ok {
			ids = append(ids, fmt.Sprint(g))
		}
	}
	return strings.Join(ids, " and ")
}

// groupOfKey is the allocator group that owns key's slot.
func (w *world) groupOfKey(key int) int {
	d := w.desc(key)
	return int(w.cl.slots.OwnerOf(rules.KeyHash(nil, domain, d[0].Entries)))
}

func simulateFleet(name, title string, sc scale, groups int, baselines bool, seed uint64) (*result, error) {
	p := zipfWeights(sc.keys, 1.1)
	r := limitForOverLimit(p, sc.base, 0.02)
	quota := max(int64(math.Round(r)), 1)
	g := &group{name: "api_key", quota: quota, unit: time.Second, burst: quota}
	// Tracked: the hottest key, and the hottest key whose demand is under
	// 80% of its limit.
	near := 0
	for near < len(p)-1 && sc.base*p[near] > 0.8*float64(quota) {
		near++
	}
	cfg := worldConfig{
		name: name, seed: seed, agents: sc.agents, keys: sc.keys, groups: []*group{g},
		lease: true, redis: baselines, baselines: baselines, raftGroups: groups, nodes: sc.nodes,
		warmup: sc.warmup, duration: sc.fleet, track: []int{0, near},
	}
	w, err := newWorld(cfg)
	if err != nil {
		return nil, err
	}
	defer w.shutdown()

	prof := constant(sc.base)
	if sc.peak > sc.base {
		ramp := 5.0
		a, b := (sc.warmup + sc.peakFrom).Seconds(), (sc.warmup + sc.peakTo).Seconds()
		prof = profile{{0, sc.base}, {a - ramp, sc.base}, {a, sc.peak}, {b, sc.peak}, {b + ramp, sc.base}}
	}
	zipf := rand.NewZipf(newRand(seed, "keys"), 1.1, 1, uint64(sc.keys-1))
	arr := &arrivals{w: w, rng: newRand(seed, "arrivals"), rate: prof,
		key: func() int { return int(zipf.Uint64()) }, route: &spread{rng: newRand(seed, "route"), n: sc.agents}}
	// With a sample, every arrival is drawn and those on the keys of the
	// groups not simulated are dropped: a simulated group gets all of its
	// keys' requests, from every agent.
	simulated := sampleGroups(w, sc.sample)
	sims := 0
	for _, in := range simulated {
		if in {
			sims++
		}
	}
	var kept int64
	if sims < len(simulated) {
		arr.onFire = func(key, ag int) {
			if simulated[w.groupOfKey(key)] {
				kept++
				w.arrive(key, ag)
			}
		}
	}
	arr.start()
	if err := w.run(); err != nil {
		return nil, err
	}
	if sims == len(simulated) {
		kept = arr.n
	}
	// share is the part of the fleet's requests the run simulated.
	share := ratioF(kept, arr.n)

	res := &result{name: name, title: title}
	meanRate := prof.mean(w.seconds() + sc.warmup.Seconds())
	res.what = []string{
		fmt.Sprintf("%d agents, %s keys (Zipf s=1.1), %s on average (%s), spread uniformly over the agents;",
			sc.agents, count(int64(sc.keys)), rate(meanRate), profDesc(sc)),
		fmt.Sprintf("the allocator: %d Raft group(s) over the 1024 slots (pkg/slots), their leaders spread over %d nodes; %s;%s", groups, w.cl.nodes, measuredCPU, staticNote()),
		fmt.Sprintf("one rule: every key %d/s, burst %d (R chosen so that %.1f%% of the traffic is over its key's limit);",
			quota, quota, 2.0),
	}
	if sims == len(simulated) {
		res.what = append(res.what, fmt.Sprintf("%s of warm-up, then %s measured; every request is simulated (%s arrivals).",
			sc.warmup, sc.fleet, count(arr.n)))
	} else {
		res.what = append(res.what, fmt.Sprintf("%s of warm-up, then %s measured; sampled by slot: every request on the keys of %d of the %d groups (%s: the hottest key's, then the others its leader leads, then the highest-numbered) is simulated, %s of the %s arrivals (%.1f%%), from every agent; the other groups get no calls. Each simulated group's figures are exact; the totals are the simulated groups'; %s.",
			sc.warmup, sc.fleet, sims, len(simulated), groupList(simulated), count(kept), count(arr.n), 100*share, nodeCoverage(w.cl, simulated)))
	}
	// rounds is the Acquire and Release calls the agents made in the
	// measured period. A sample's agents call only the simulated groups,
	// so they may skip a tick the whole fleet's would not: the fleet-wide
	// figure is taken as every agent calling at every refill tick, unless
	// the sample made more calls than that (retries).
	m := w.measured()
	secs := w.seconds()
	rounds := float64(m.rounds)
	if sims < len(simulated) {
		rounds = max(rounds, float64(sc.agents)*secs/w.cfg.refill.Seconds())
	}
	lease := w.systems[0]
	t := table{title: "Per system, same arrivals (measured period)",
		header: []string{"system", "admitted", "denied", "over limit (exact)", "false rejects", "max over-admission per key/10 s", "excess over exact", "coordination", "check latency added p50 / p99"}}
	for _, s := range w.systems {
		rec := s.rec
		coord, lat := "none", "0 (local)"
		switch s.name {
		case "allot leases":
			coord = fmt.Sprintf("%.4f calls, %.4f keys per admitted", rounds/(float64(rec.admitted)/share), ratioF(m.keyAcquires, rec.admitted))
			if len(w.cl.groups) > 1 {
				coord += fmt.Sprintf(" (%.4f RPCs: one per group a call has keys in)", ratioF(m.calls, rec.admitted))
			}
			lat = "0 (in-process)"
		case "Redis per request":
			coord = fmt.Sprintf("%.2f store ops per admitted", ratioF(w.redis.ops-w.redisAt[0], rec.admitted))
			lat = dur(w.redis.lat.quantile(50)) + " / " + dur(w.redis.lat.quantile(99))
		}
		t.add(s.name, pct(ratioF(rec.admitted, rec.offered)), pct(1-ratioF(rec.admitted, rec.offered)),
			pct(1-ratioF(rec.inQuota, rec.offered)), pct(rec.falseRejectRate()), pct(max(rec.maxOver, 0)),
			pct(rec.excessOverExact()), coord, lat)
	}
	res.tables = append(res.tables, t)

	ng := float64(sims)
	var leases, keys uint64
	peak, busiest := 0.0, 0
	for _, rg := range w.cl.groups {
		st := rg.st.Stats()
		leases += st.Leases
		keys += st.Keys
		if d := rg.peakDemand(w.measureFrom, w.end); d > peak {
			peak, busiest = d, rg.id
		}
	}
	perEntry := ratioF(m.keyAcquires, m.entries)
	groupsCell := fmt.Sprint(len(w.cl.groups))
	if sims < len(simulated) {
		groupsCell += fmt.Sprintf(" (%d simulated)", sims)
	}
	res.tables = append(res.tables, table{title: "allot's allocator during the measured period",
		header: []string{"groups", "agent calls/s", "RPCs/s per group", "keys per RPC", "key-grants/s", "Raft entries/s per group", "keys per entry",
			"live leases / tracked keys at end", "leader CPU per group, used / demanded (cores)", "busiest group, busiest second (cores)",
			"one group's capacity (key-grants/s)", "CPU over 3 replicas (cores)", "calls refused: queue full / guard"},
		rows: [][]string{{
			groupsCell, fmt.Sprintf("%.0f", rounds/secs), fmt.Sprintf("%.0f", float64(m.calls)/secs/ng), fmt.Sprintf("%.1f", ratioF(m.keyAcquires, m.acquireRPCs)),
			count(int64(float64(m.keyAcquires) / secs)),
			fmt.Sprintf("%.0f", float64(m.entries)/secs/ng), fmt.Sprintf("%.0f", perEntry),
			count(int64(leases)) + " / " + count(int64(keys)),
			fmt.Sprintf("%.2f / %.2f", float64(m.leaderCPU)/1e9/secs/ng, float64(m.demandCPU)/1e9/secs/ng),
			fmt.Sprintf("%.2f (group %d)", peak, busiest),
			count(int64(measuredCPU.capacity(max(perEntry, 1)))),
			fmt.Sprintf("%.2f", float64(m.groupCPU)/1e9/secs),
			count(m.refused) + " / " + count(m.throttled),
		}}})

	if sims < len(simulated) || w.cl.nodes != 3 {
		res.tables = append(res.tables, nodeTable(w, simulated))
	}

	// The guard limits each agent's calls to a node, and an agent calls
	// every group it has keys in at a tick: a node leading more groups
	// takes more of an agent's calls. In a sample the other groups get no
	// calls, so the bound is the measured calls per group and agent
	// times the groups the busiest node leads (leaders i mod nodes).
	perNode := (len(w.cl.groups) + w.cl.nodes - 1) / w.cl.nodes
	perAgentNode := float64(m.calls) / secs / ng / float64(sc.agents) * float64(perNode)
	lr := lease.rec
	res.bounds = []bound{
		{system: "allot leases", what: "allow journey: false rejects of in-quota requests", target: true, promise: "target ≤ 1%",
			measured: lr.falseRejectRate(), limit: 0.01, unit: "%"},
		{system: "allot leases", what: "deny journey: over-admission, max over keys and 10 s windows (of R·W, beyond B + R·W)", target: true, promise: "target ≤ 1% of R",
			measured: max(lr.maxOver, 0), limit: 0.01, unit: "%"},
		{system: "allot leases", what: "coordination on the long-tail workload (Acquire calls per admitted request: an agent's refill call, however many groups it goes to)", target: true, promise: "target ≤ 0.05",
			measured: rounds / (float64(lr.admitted) / share), limit: 0.05},
		{system: "allot leases", what: fmt.Sprintf("every allocator group carries its load (%d groups): the leader CPU its calls and entries demand in the busiest second of the busiest group, at the measured cost per entry and per key", len(w.cl.groups)),
			promise: "the leader's cores", measured: peak, limit: measuredCPU.cores, unit: "cores"},
		{system: "allot leases", what: fmt.Sprintf("an agent's calls to one node (%d groups, at most %d led by one of the %d nodes): its calls per group and second, times the groups one node leads", len(w.cl.groups), perNode, w.cl.nodes),
			promise: "the guard's calls per agent and node (-agent-rate)", measured: perAgentNode, limit: float64(agentRate), unit: "/s"},
		{system: "allot leases", what: "Acquire calls refused as overloaded (a group's queue full, a node's in-flight cap, an agent's call rate)", promise: "none",
			measured: float64(m.refused + m.throttled), limit: 0},
	}
	res.notes = append(res.notes,
		"over-admission counts a key's admissions in each aligned 10 s window beyond B + R·W, the most an exact token bucket can admit in W; false rejects count, per key and 10 s window, how many fewer requests the system admitted than one exact token bucket per key fed the same arrivals (over all in-quota requests); excess over exact is the converse, per key over the whole run.",
		"the allocator's CPU: an Acquire entry of k keys costs its group's three replicas the measured CPU per entry plus k times the CPU per key-grant, the leader its share of that; the leader works through its entries one after another on its cores, and a group whose leader is behind queues its calls (an entry commits after its Raft latency or once the leader's CPU is through it) and refuses them past the batcher's queue bound (docs/performance.md has the measured rows; one group's capacity is the key-grants/s its leader can apply at the keys per entry measured here).")
	if baselines {
		res.notes = append(res.notes, "Redis per request is modelled (16 shards, one core each at 100k script calls/s, 5 ms client deadline, breaker, fail-open onto a local bucket at R); the baselines are per-gateway token buckets at R (no coordination) and at R/N (static split).")
	}

	smooth := 5
	limit := float64(quota)
	plot := plotSpec{file: "sim-" + sc.name + "-" + name + "-hot.png", title: fmt.Sprintf("%s (%s): the hottest key, offered %s vs limit %d/s", name, sc.name, rate(sc.base*p[0]), quota)}
	plot.lines = append(plot.lines, w.seriesLine("offered", lr.offer[0], smooth))
	plot.lines[0].ref = true
	for _, s := range w.systems {
		plot.lines = append(plot.lines, w.seriesLine(s.name, s.rec.tracked[0], smooth))
	}
	plot.lines = append(plot.lines, flatLine("limit R", 0, (sc.warmup+sc.fleet).Seconds(), limit))
	res.plots = append(res.plots, plot)
	return res, nil
}

// nodeCoverage says which nodes a sample sees every call of: those whose
// led groups are all simulated, the hottest key's group's leader first.
func nodeCoverage(c *cluster, in []bool) string {
	hot := -1
	for g, ok := range in {
		if ok {
			hot = c.groups[g].leader
			break
		}
	}
	if hot < 0 {
		return "no node is simulated"
	}
	var sim, all int
	for _, g := range c.ledBy(hot) {
		all++
		if in[g] {
			sim++
		}
	}
	if sim == all {
		return fmt.Sprintf("node %d leads %d group(s), all simulated, the hottest key's among them: its guard and its leaders get every call the whole fleet sends them", hot, all)
	}
	return fmt.Sprintf("node %d leads %d groups, %d of them simulated: its guard sees only their calls, and the guard's bound counts the rest from the calls per group", hot, all, sim)
}

// nodeTable reports the guard of the busiest nodes (at most 4, by calls
// during the measured period) among those leading a simulated group.
func nodeTable(w *world, in []bool) table {
	c := w.cl
	secs := w.seconds()
	var nodes []int
	for n := range c.nodes {
		for _, g := range c.ledBy(n) {
			if in[g] {
				nodes = append(nodes, n)
				break
			}
		}
	}
	slices.SortStableFunc(nodes, func(a, b int) int { return cmp.Compare(c.nodeMeasured(b).calls, c.nodeMeasured(a).calls) })
	t := table{title: fmt.Sprintf("The busiest allocator nodes during the measured period (%d nodes; each node's guard: %d calls in flight, %d calls/s per agent, burst %d)", c.nodes, c.maxInflight, agentRate, agentBurst),
		header: []string{"node", "groups it leads (simulated)", "calls/s to it", "an agent's calls/s to it (mean)", "most calls in flight", "refused: agent rate / in-flight cap", "its leaders' busiest second (cores; one core a leader)"}}
	for _, n := range nodes[:min(len(nodes), 4)] {
		led := c.ledBy(n)
		var ids []string
		var bins []int64
		for _, g := range led {
			if !in[g] {
				continue
			}
			ids = append(ids, fmt.Sprint(g))
			for s, v := range c.groups[g].demandBins {
				for len(bins) <= s {
					bins = append(bins, 0)
				}
				bins[s] += v
			}
		}
		var peak int64
		for s := int((w.measureFrom - epoch) / int64(time.Second)); s < int((w.end-epoch)/int64(time.Second)) && s < len(bins); s++ {
			peak = max(peak, bins[s])
		}
		nc := c.nodeMeasured(n)
		t.add(fmt.Sprint(n), fmt.Sprintf("%d (%s)", len(led), strings.Join(ids, ", ")),
			fmt.Sprintf("%.0f", float64(nc.calls)/secs), fmt.Sprintf("%.1f", float64(nc.calls)/secs/float64(w.cfg.agents)),
			count(int64(nc.peak)), count(nc.rateRefused)+" / "+count(nc.fullRefused),
			fmt.Sprintf("%.2f of %d", float64(peak)/1e9, len(led)))
	}
	return t
}

func profDesc(sc scale) string {
	if sc.peak <= sc.base {
		return "constant"
	}
	return fmt.Sprintf("%s base, %s peak from %s to %s", rate(sc.base), rate(sc.peak), sc.warmup+sc.peakFrom, sc.warmup+sc.peakTo)
}

func ratioF(a, b int64) float64 { return ratio(a, b) }
