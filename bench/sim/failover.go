package main

import (
	"fmt"
	"time"

	"github.com/allot/allot/agent"
)

// electionTime is the modelled allocator failover: SIGKILL of the leader
// to the first grant by the new leader, as bench/acquire -failovers
// measures it on three processes with 500/500/250 ms Raft timeouts
// (docs/performance.md#summary).
const electionTime = 1280 * time.Millisecond

// Redis primary failover, as a typical managed Redis: RTO 12 s, RPO 1 s.
const (
	redisRTO = 12 * time.Second
	redisRPO = time.Second
)

// runFailover: chaos scenario 1. Keys over their limit (1.5 R) spread over
// every gateway; the allocator leader dies and a new one is elected, and,
// for the Redis design, the primary dies and a replica is promoted.
func runFailover(sc scale, seed uint64) (*result, error) {
	n := sc.agents
	quota := int64(50 * n) // R/N = 50/s per gateway
	g := &group{name: "fo", quota: quota, unit: time.Second, burst: quota}
	tr := []*traffic{{g: g, keys: 8, demand: 1.5 * float64(quota)}}
	if sc.name == "tiny" {
		tr[0].keys = 3
	}
	groups, groupOf, keys := layout(tr)
	warm := min(sc.warmup, 5*time.Second)
	cfg := worldConfig{name: "failover", seed: seed, agents: n, keys: keys, groups: groups, groupOf: groupOf,
		lease: true, redis: true, baselines: true, warmup: warm, duration: sc.chaos, track: tr[0].keysOf()}
	w, err := newWorld(cfg)
	if err != nil {
		return nil, err
	}
	defer w.shutdown()
	kill := warm + 3*time.Second
	w.eng.atFunc(epoch+int64(kill), func() { w.cl.killLeader(electionTime) })
	w.eng.atFunc(epoch+int64(kill+10*time.Second), func() { w.cl.restart(0) })
	w.redis.failover(epoch+int64(kill), redisRTO, redisRPO)
	arr := startTraffic(w, seed, tr)
	if err := w.run(); err != nil {
		return nil, err
	}

	unavail := time.Duration(w.cl.recoveryAt - w.cl.killedAt)
	k := float64(tr[0].keys)
	r := g.rate()
	b := float64(g.burst)
	span := redisRTO + 3*time.Second // the window scored: from the failure to after Redis is back
	from, to := kill, kill+span
	if end := time.Duration(w.end - epoch); to > end {
		to = end
	}
	tsec := (to - from).Seconds()
	exact := k * (b + r*tsec) // the most an exact limiter admits in the window

	res := &result{name: "failover", title: "allocator leader failover vs Redis primary failover (RTO 12 s, RPO 1 s)"}
	res.what = []string{
		fmt.Sprintf("%d agents; %d keys, each %d/s burst %d, offered 1.5 R spread uniformly (%s arrivals);", n, tr[0].keys, quota, quota, count(arr[0].n)),
		fmt.Sprintf("at t=%s the allocator leader dies (SIGKILL model: calls to it time out); a new leader answers after %s (docs/performance.md, measured kill → first grant); the dead node restarts 10 s later;", kill, electionTime),
		fmt.Sprintf("at the same instant the Redis primary dies; for %s every call times out (the per-agent breaker then fails fast), then a replica is promoted with the state as of %s before the failure (asynchronous replication).", redisRTO, redisRPO),
	}
	res.what = withStatic(res.what)
	t := table{title: fmt.Sprintf("Admitted from the failure to %s after it (all %d keys), against an exact limiter's maximum B + R·T = %s", to-from, tr[0].keys, count(int64(exact))),
		header: []string{"system", "admitted", "beyond B + R·T", "of R·T", "max 1 s rate / R", "false rejects (run)"}}
	lease := w.systems[0]
	var leaseOver float64
	for _, s := range w.systems {
		sum := sumSeries(trackedOf(s.rec, tr[0].keysOf())...)
		adm := w.sumBins(sum, from, to)
		over := float64(adm) - exact
		peak := float64(w.maxWindow(sum, time.Second, from-2*time.Second, to)) / (k * r)
		t.add(s.name, count(adm), fmt.Sprintf("%+.0f", over), pct(over/(k*r*tsec)), fmt.Sprintf("%.2f", peak), pct(s.rec.falseRejectRate()))
		if s == lease {
			leaseOver = over
		}
	}
	res.tables = append(res.tables, t)
	m := w.measured()
	res.tables = append(res.tables, table{title: "allot during the failover",
		header: []string{"kill → first grant", "calls answered Unavailable", "lease decisions", "fallback decisions", "Redis calls timed out / failed fast"},
		rows: [][]string{{dur(unavail), count(m.unavailable), count(lease.sources[agent.SourceLease]), count(lease.sources[agent.SourceFallback]),
			count(w.redis.timeouts+w.redis.downCalls) + " / " + count(w.redis.fastFails)}}})

	// The promise: failover re-grants nothing (architecture.md (d)); what a
	// key admits beyond the limit while no leader answers is the fail-open
	// allowance: R/N per agent for the unavailable time, plus each agent's
	// fallback burst ⌈B/N⌉.
	allow := k * (r*unavail.Seconds() + float64(n)*float64((g.burst+int64(n)-1)/int64(n)))
	res.bounds = []bound{
		{system: "allot leases", what: "tokens admitted beyond B + R·T in the failover window (all keys)",
			promise: "(d): no re-grant; fail-open allowance R·T_unavailable + N·⌈B/N⌉ per key", measured: max(leaseOver, 0), limit: allow, unit: "tokens"},
	}
	res.notes = append(res.notes, fmt.Sprintf("Redis: expected free burst ≈ (N−1)·R·RTO while every gateway fails open at R (≈ %s tokens here, capped by the offered 1.5 R), plus the tokens spent in the last RPO that the promoted replica hands out again (at most B per key).",
		count(int64(k*min(float64(n-1)*r, 0.5*r)*redisRTO.Seconds()))))

	plot := plotSpec{file: "sim-" + sc.name + "-failover.png", title: fmt.Sprintf("failover (%s): %d keys over their limit, admitted vs limit", sc.name, tr[0].keys),
		marks: []float64{kill.Seconds(), (kill + unavail).Seconds(), (kill + redisRTO).Seconds()}}
	plot.lines = append(plot.lines, w.seriesLine("offered", sumSeries(offerOf(lease.rec, tr[0].keysOf())...), 5))
	plot.lines[0].ref = true
	for _, s := range w.systems {
		plot.lines = append(plot.lines, w.seriesLine(s.name, sumSeries(trackedOf(s.rec, tr[0].keysOf())...), 5))
	}
	plot.lines = append(plot.lines, flatLine("limit (keys × R)", 0, float64(w.end-epoch)/1e9, k*r))
	res.plots = append(res.plots, plot)
	return res, nil
}

func trackedOf(r *recorder, keys []int) [][]int32 {
	out := make([][]int32, len(keys))
	for i, k := range keys {
		out[i] = r.tracked[k]
	}
	return out
}

func offerOf(r *recorder, keys []int) [][]int32 {
	out := make([][]int32, len(keys))
	for i, k := range keys {
		out[i] = r.offer[k]
	}
	return out
}
