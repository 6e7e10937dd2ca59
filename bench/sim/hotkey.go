package main

import (
	"fmt"
	"math"
	"time"

	"github.com/allot/allot/agent"
)

// runHotKey: chaos scenario 3. One key offered 100k+ requests/s over every
// gateway, limited to two thirds of that. The lease design spends leases
// in-process and refills in batches; Redis per request puts every request
// on the one shard (one core) that owns the key.
//
// The key is spread over sc.hotAgents gateways (200 at the quick and full
// scales: the number of agents sharing a contended key is what sets the
// calls per admitted request).
func runHotKey(sc scale, seed uint64) (*result, error) {
	n := sc.hotAgents
	quota := int64(math.Round(sc.hotRate/1.5/1000) * 1000)
	g := &group{name: "hot", quota: quota, unit: time.Second, burst: quota}
	tr := []*traffic{{g: g, keys: 1, demand: sc.hotRate}}
	groups, groupOf, keys := layout(tr)
	warm, measure := 4*time.Second, 10*time.Second
	if sc.name == "tiny" {
		warm, measure = 3*time.Second, 4*time.Second
	}
	cfg := worldConfig{name: "hot-key", seed: seed, agents: n, keys: keys, groups: groups, groupOf: groupOf,
		lease: true, redis: true, baselines: true, warmup: warm, duration: measure, track: []int{0}}
	w, err := newWorld(cfg)
	if err != nil {
		return nil, err
	}
	defer w.shutdown()
	arr := startTraffic(w, seed, tr)
	if err := w.run(); err != nil {
		return nil, err
	}

	res := &result{name: "hot-key", title: fmt.Sprintf("one hot key at %s", rate(sc.hotRate))}
	res.what = []string{
		fmt.Sprintf("%d agents; one key offered %s (Poisson, spread uniformly), limit %d/s burst %d; %s warm-up, %s measured (%s arrivals).",
			n, rate(sc.hotRate), quota, quota, warm, measure, count(arr[0].n)),
		"Redis: the key lives on one shard, one core at 100k script calls/s, 5 ms client deadline.",
	}
	res.what = withStatic(res.what)
	secs := w.seconds()
	m := w.measured()
	lease := w.systems[0]
	t := table{title: "Per system, same arrivals",
		header: []string{"system", "admitted rate", "of R", "max over-admission / 10 s", "false rejects", "coordination", "added latency p50 / p99"}}
	for _, s := range w.systems {
		rec := s.rec
		coord, lat := "none", "0"
		switch s.name {
		case "allot leases":
			coord = fmt.Sprintf("%.5f Acquire calls per admitted (%.0f calls/s)", ratioF(m.calls, rec.admitted), float64(m.calls)/secs)
		case "Redis per request":
			ops := w.redis.ops - w.redisAt[0]
			coord = fmt.Sprintf("%s store ops/s on one shard; %s timed out, %s failed fast",
				rate(float64(ops)/secs), count(w.redis.timeouts), count(w.redis.fastFails))
			lat = dur(w.redis.lat.quantile(50)) + " / " + dur(w.redis.lat.quantile(99))
		}
		t.add(s.name, rate(float64(rec.admitted)/secs), fmt.Sprintf("%.3f", float64(rec.admitted)/secs/g.rate()),
			pct(max(rec.maxOver, 0)), pct(rec.falseRejectRate()), coord, lat)
	}
	res.tables = append(res.tables, t)
	res.tables = append(res.tables, table{title: "allot's hot path",
		header: []string{"decided from a lease", "from the fallback bucket", "keys per Acquire", "Raft entries/s"},
		rows: [][]string{{count(lease.sources[agent.SourceLease]), count(lease.sources[agent.SourceFallback]),
			fmt.Sprintf("%.1f", ratioF(m.keyAcquires, m.acquireRPCs)), fmt.Sprintf("%.0f", float64(m.entries)/secs)}}})
	res.bounds = []bound{
		{system: "allot leases", what: "coordination on the hot key (Acquire calls per admitted request)", target: true, promise: "target ≤ 0.01",
			measured: ratioF(m.calls, lease.rec.admitted), limit: 0.01},
		{system: "allot leases", what: "over-admission per 10 s window (of R·W, beyond B + R·W)", target: true, promise: "target ≤ 1%",
			measured: max(lease.rec.maxOver, 0), limit: 0.01, unit: "%"},
		{system: "allot leases", what: "false rejects", target: true, promise: "target ≤ 1%",
			measured: lease.rec.falseRejectRate(), limit: 0.01, unit: "%"},
	}
	res.notes = append(res.notes, "pkg/redislimit's `shards:` (sub-keys) and batched modes exist for this case; they are not modelled here: the baseline is one script call per request.")
	res.plots = append(res.plots, w.keyPlot("sim-"+sc.name+"-hot-key.png",
		fmt.Sprintf("hot key (%s): offered %s, limit %s", sc.name, rate(sc.hotRate), rate(g.rate())), 0, lease, g.rate()))
	return res, nil
}
