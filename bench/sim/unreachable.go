package main

import (
	"fmt"
	"time"
)

// runUnreachable: the "degraded" journey and chaos scenario 2. Every
// gateway loses the allocator (and, for the Redis design, Redis) for a
// while; agents fail open onto their local buckets. Three kinds of keys:
//
//   - spread: the load balancer spreads each key over every gateway, and the
//     rule says so (routing: spread): each agent's fallback is R/N;
//   - hashed: the load balancer routes each key to one gateway by
//     consistent hashing, and the rule says so (routing: consistent_hash):
//     that agent's fallback is R;
//   - skewed: a spread rule, but 70% of each key's traffic lands on one
//     gateway, in quota (0.8 R): what a static R/N split gets wrong; once
//     with the same low limit (20/s, under one token per second per agent
//     once split N ways), once with a higher one (1000/s).
//
// The hot kinds are offered 1.5·N·R, so that a design without coordination
// shows its N×R ceiling.
func runUnreachable(sc scale, seed uint64) (*result, error) {
	n := sc.agents
	const quota = 20
	keysPer := 3
	if sc.name == "tiny" {
		keysPer = 2
	}
	sp := &traffic{g: &group{name: "spread", quota: quota, unit: time.Second, burst: quota}, keys: keysPer, demand: 1.5 * float64(n*quota)}
	hs := &traffic{g: &group{name: "hashed", quota: quota, unit: time.Second, burst: quota, routing: "consistent_hash"}, keys: keysPer,
		demand: 1.5 * float64(n*quota), route: newRing(n, seed)}
	sk := &traffic{g: &group{name: "skewed", quota: quota, unit: time.Second, burst: quota}, keys: keysPer, demand: 0.8 * quota,
		route: &skewed{rng: newRand(seed, "skew"), n: n, home: 0.7}}
	const fastQ = 1000
	sf := &traffic{g: &group{name: "skewed_fast", quota: fastQ, unit: time.Second, burst: fastQ}, keys: keysPer, demand: 0.8 * fastQ,
		route: &skewed{rng: newRand(seed, "skew-fast"), n: n, home: 0.7}}
	tr := []*traffic{sp, hs, sk, sf}
	groups, groupOf, keys := layout(tr)
	warm := min(sc.warmup, 5*time.Second)
	var track []int
	for _, t := range tr {
		track = append(track, t.keysOf()...)
	}
	cfg := worldConfig{name: "unreachable", seed: seed, agents: n, keys: keys, groups: groups, groupOf: groupOf,
		lease: true, redis: true, baselines: true, warmup: warm, duration: sc.chaos, track: track}
	w, err := newWorld(cfg)
	if err != nil {
		return nil, err
	}
	defer w.shutdown()
	start := warm + 3*time.Second
	outage := min(15*time.Second, sc.chaos-6*time.Second)
	end := start + outage
	w.net.cuts = append(w.net.cuts, partition{from: 0, to: n, start: epoch + int64(start), end: epoch + int64(end)})
	w.redis.failover(epoch+int64(start), outage, 0)
	var lat [3]time.Duration
	w.eng.atFunc(epoch+int64(start), func() { w.redis.lat = newHistogram() })
	w.eng.atFunc(epoch+int64(end), func() {
		lat = [3]time.Duration{w.redis.lat.quantile(50), w.redis.lat.quantile(99), w.redis.lat.quantile(100)}
	})
	arr := startTraffic(w, seed, tr)
	if err := w.run(); err != nil {
		return nil, err
	}
	var arrivals int64
	for _, a := range arr {
		arrivals += a.n
	}

	res := &result{name: "unreachable", title: "degraded journey: the allocator (and Redis) unreachable, fail-open onto local buckets"}
	res.what = []string{
		fmt.Sprintf("%d agents; per kind %d keys at %d/s burst %d: spread and hashed keys offered 1.5·N·R = %s each, skewed keys 0.8 R with 70%% on one gateway; skewed fast keys the same at %d/s (%s arrivals);",
			n, keysPer, quota, quota, rate(sp.demand), fastQ, count(arrivals)),
		fmt.Sprintf("from t=%s to t=%s every agent is cut off from every allocator node (a black hole: calls time out, the breaker opens and probes), and Redis is down for the same %s.", start, end, outage),
	}
	res.what = withStatic(res.what)
	steadyFrom := start + 3*time.Second
	t := table{title: fmt.Sprintf("Admitted rate as a multiple of R: before the outage (t=%s–%s) and during it (t=%s–%s, after the breakers opened)", warm, start, steadyFrom, end),
		header: []string{"system", "spread: before", "spread: outage", "hashed: before", "hashed: outage",
			"skewed 20/s (in quota): admitted before", "during outage", "skewed 1000/s: admitted before", "during outage"}}
	rateOf := func(s *system, tf *traffic, from, to time.Duration) float64 {
		sum := sumSeries(trackedOf(s.rec, tf.keysOf())...)
		return float64(w.sumBins(sum, from, to)) / ((to - from).Seconds() * float64(tf.keys) * tf.g.rate())
	}
	shareOf := func(s *system, tf *traffic, from, to time.Duration) float64 {
		adm := w.sumBins(sumSeries(trackedOf(s.rec, tf.keysOf())...), from, to)
		off := w.sumBins(sumSeries(offerOf(s.rec, tf.keysOf())...), from, to)
		return ratio(adm, off)
	}
	for _, s := range w.systems {
		t.add(s.name,
			fmt.Sprintf("%.2f R", rateOf(s, sp, warm, start)), fmt.Sprintf("%.2f R", rateOf(s, sp, steadyFrom, end)),
			fmt.Sprintf("%.2f R", rateOf(s, hs, warm, start)), fmt.Sprintf("%.2f R", rateOf(s, hs, steadyFrom, end)),
			pct(shareOf(s, sk, warm, start)), pct(shareOf(s, sk, steadyFrom, end)),
			pct(shareOf(s, sf, warm, start)), pct(shareOf(s, sf, steadyFrom, end)))
	}
	res.tables = append(res.tables, t)
	res.tables = append(res.tables, table{title: "What a request waits for during the outage",
		header: []string{"system", "added latency p50", "p99", "max"},
		rows: [][]string{
			{"allot leases", "0 (every check is in-process; Acquire runs in the refill loop)", "0", "0"},
			{"Redis per request (deadline 5 ms, then the breaker fails fast)", dur(lat[0]), dur(lat[1]), dur(lat[2])},
		}})

	// Bounds: during the outage each agent's fallback is R/N (spread) or R
	// (consistent hash), so a key admits about R, plus the fallback bursts.
	steady := (end - steadyFrom).Seconds()
	lease := w.systems[0]
	spreadAllow := 1 + float64(n)*float64((quota+int64(n)-1)/int64(n))/(quota*steady)
	hashAllow := 1 + 1/steady
	before := (start - warm).Seconds()
	res.bounds = []bound{
		{system: "allot leases", what: "spread keys, admitted before the outage (allocator reachable)", promise: "exact: B + R·W over the window",
			measured: rateOf(lease, sp, warm, start), limit: 1 + 1/before, unit: "x"},
		{system: "allot leases", what: "spread keys, admitted during the outage", promise: "fail-open bound: R/N per agent → R, + N·⌈B/N⌉",
			measured: rateOf(lease, sp, steadyFrom, end), limit: spreadAllow, unit: "x"},
		{system: "allot leases", what: "consistent-hash keys, admitted during the outage", promise: "fail-open bound: R at the key's one gateway, + B",
			measured: rateOf(lease, hs, steadyFrom, end), limit: hashAllow, unit: "x"},
		{system: "allot leases", what: "skewed in-quota keys at 20/s, admitted before the outage", target: true, promise: "target: false rejects ≤ 1% under skew",
			measured: shareOf(lease, sk, warm, start), limit: 0.99, atLeast: true, unit: "%"},
		{system: "allot leases", what: "skewed in-quota keys at 1000/s, admitted before the outage", target: true, promise: "target: false rejects ≤ 1% under skew",
			measured: shareOf(lease, sf, warm, start), limit: 0.99, atLeast: true, unit: "%"},
	}
	res.notes = append(res.notes,
		"No coordination admits N×R on spread keys; every design admits R on consistent-hash keys, where one gateway sees the key. During the outage allot's R/N fail-open cannot follow skew: the busy gateway's R/N share is too small for 70% of the traffic (the static split's problem, for the outage's duration).",
		"Before the outage, with the allocator reachable, the skewed keys are admitted as far as the busy agent's grants follow its traffic. The allocator weighs a lightly used agent's lease (one token, demand·F < 1) by its demand·F, not a whole token, and a claim on the refill by what the agent asks for, not what it holds; the agent reports no demand for a key it used once, and spreads tokens of a sparse key over the time since its previous use. Where the agent's share of a key is under one token per second (20/s over 200 gateways), a gateway's first use, admitted by its fallback bucket and charged, asks for no token, and the fallback gets its token back once the charge is debited: prefetching one made each light request cost the key two tokens, 20.8/s against 20/s. A measurement is 143 requests of the 20/s keys, so one reject is 0.7%; what is left are single events (a light gateway's second request within a millisecond of its first, against a fallback burst of one; the busy gateway's lease running dry just before its refill).")

	for _, tf := range []*traffic{sp, hs} {
		plot := plotSpec{file: "sim-" + sc.name + "-unreachable-" + tf.g.name + ".png",
			title: fmt.Sprintf("allocator unreachable (%s), %s keys: admitted vs limit", sc.name, tf.g.name),
			marks: []float64{start.Seconds(), end.Seconds()}}
		for _, s := range w.systems {
			plot.lines = append(plot.lines, w.seriesLine(s.name, sumSeries(trackedOf(s.rec, tf.keysOf())...), 5))
		}
		plot.lines = append(plot.lines, flatLine("limit (keys × R)", 0, float64(w.end-epoch)/1e9, float64(tf.keys)*tf.g.rate()))
		res.plots = append(res.plots, plot)
	}
	return res, nil
}
