package main

import (
	"fmt"
	"time"
)

// runChurn: chaos scenario 4. Keys routed by consistent hashing (rule
// routing: consistent_hash), each offered 1.5 R; the ring changes: a gateway
// leaves, comes back, and the ring is re-seeded twice (every key moves).
// Designs that keep a key's counter on the gateway that sees it (no
// coordination with sticky routing, as in a hash-routed local limiter)
// start a moved key from a full bucket; allot's new gateway starts from its
// fallback bucket (burst B under consistent hashing) and is charged for it.
func runChurn(sc scale, seed uint64) (*result, error) {
	n := sc.agents
	const quota = 100
	k := 40
	if sc.name == "tiny" {
		k = 12
	}
	rg := newRing(n, seed)
	tf := &traffic{g: &group{name: "sticky", quota: quota, unit: time.Second, burst: quota, routing: "consistent_hash"},
		keys: k, demand: 1.5 * quota, route: rg}
	tr := []*traffic{tf}
	groups, groupOf, keys := layout(tr)
	warm := min(sc.warmup, 5*time.Second)
	cfg := worldConfig{name: "churn", seed: seed, agents: n, keys: keys, groups: groups, groupOf: groupOf,
		lease: true, redis: true, baselines: true, warmup: warm, duration: sc.chaos, track: tf.keysOf()}
	w, err := newWorld(cfg)
	if err != nil {
		return nil, err
	}
	defer w.shutdown()

	// Ring changes, and per key how many times it moved.
	moves := make([]int, keys)
	owner := func() []int {
		o := make([]int, keys)
		for i := range o {
			o[i] = rg.pick(i)
		}
		return o
	}
	step := sc.chaos / 5
	leaver := rg.pick(0) // the gateway that owns key 0 leaves and rejoins
	changes := []struct {
		at   time.Duration
		what string
		do   func()
	}{
		{warm + step, fmt.Sprintf("gateway %d leaves the ring", leaver), func() { rg.remove(leaver) }},
		{warm + 2*step, fmt.Sprintf("gateway %d rejoins", leaver), func() { rg.add(leaver) }},
		{warm + 3*step, "the ring is re-seeded (every key moves)", func() { rg.reseed(seed + 1) }},
		{warm + 4*step, "re-seeded again", func() { rg.reseed(seed + 2) }},
	}
	var marks []float64
	for _, c := range changes {
		c := c
		marks = append(marks, c.at.Seconds())
		w.eng.atFunc(epoch+int64(c.at), func() {
			before := owner()
			c.do()
			after := owner()
			for i := range before {
				if before[i] != after[i] {
					moves[i]++
				}
			}
		})
	}
	arr := startTraffic(w, seed, tr)
	if err := w.run(); err != nil {
		return nil, err
	}

	var totalMoves int
	for _, m := range moves {
		totalMoves += m
	}
	res := &result{name: "churn", title: "routing churn: the hash ring reshuffles, per-gateway counters start over"}
	res.what = []string{
		fmt.Sprintf("%d agents; %d keys at %d/s burst %d, each offered 1.5 R, routed to one gateway by a consistent-hash ring (%d virtual nodes per gateway) (%s arrivals);",
			n, k, quota, quota, ringVNodes, count(arr[0].n)),
	}
	var ev []string
	for _, c := range changes {
		ev = append(ev, fmt.Sprintf("t=%s %s", c.at, c.what))
	}
	res.what = append(res.what, fmt.Sprintf("ring changes: %s; %d key moves in all.", joinComma(ev), totalMoves))

	secs := w.seconds()
	t := table{title: fmt.Sprintf("Admitted over the %s measured, per key, against the exact limiter's maximum B + R·T", time.Duration(secs*float64(time.Second))),
		header: []string{"system", "mean excess (of R·T)", "worst key (of R·T)", "excess tokens per move", "false rejects"}}
	lease := w.systems[0]
	var leaseWorst float64
	for _, s := range w.systems {
		var sum, worst, tokens float64
		for i := range keys {
			o := s.rec.overRun(i)
			sum += o
			worst = max(worst, o)
			tokens += max(o, 0) * tf.g.rate() * secs
			if s == lease {
				// The promise, per key: B + R·T plus one fallback burst B per move.
				leaseWorst = max(leaseWorst, o-float64(moves[i])*float64(tf.g.burst)/(tf.g.rate()*secs))
			}
		}
		t.add(s.name, pct(sum/float64(keys)), pct(worst), fmt.Sprintf("%.1f", tokens/float64(max(totalMoves, 1))), pct(s.rec.falseRejectRate()))
	}
	res.tables = append(res.tables, t)
	res.bounds = []bound{
		{system: "allot leases", what: "worst key: admitted beyond B + R·T + (moves × B), of R·T",
			promise: "a cold key over-admits at most one fallback burst per gateway that saw it (docs/leases.md)", measured: max(leaseWorst, 0), limit: 0, unit: "%"},
		{system: "allot leases", what: "false rejects", target: true, promise: "target ≤ 1%",
			measured: lease.rec.falseRejectRate(), limit: 0.01, unit: "%"},
	}
	res.notes = append(res.notes, "no coordination here is a hash-routed local limiter (each key counted on the one gateway that sees it): a moved key starts over from a full bucket at its new gateway. The static R/N split is shown for completeness (under consistent hashing it caps a key at R/N).")

	plot := plotSpec{file: "sim-" + sc.name + "-churn.png", title: fmt.Sprintf("routing churn (%s): %d keys, admitted vs limit", sc.name, k), marks: marks}
	for _, s := range w.systems {
		plot.lines = append(plot.lines, w.seriesLine(s.name, sumSeries(trackedOf(s.rec, tf.keysOf())...), 5))
	}
	plot.lines = append(plot.lines, flatLine("limit (keys × R)", 0, float64(w.end-epoch)/1e9, float64(k)*tf.g.rate()))
	res.plots = append(res.plots, plot)
	return res, nil
}

func joinComma(s []string) string {
	out := ""
	for i, x := range s {
		if i > 0 {
			out += ", "
		}
		out += x
	}
	return out
}
