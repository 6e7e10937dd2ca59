package main

import (
	"fmt"
	"time"

	"github.com/allot/allot/pkg/bucket"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// runRuleChange: the rule-change journey. An operator halves a rule's
// limit with PutRules while its keys are over the limit; the allocator
// commits the new rules and pushes them down every agent's WatchRules
// stream. One agent is cut off from the allocators around the change, so
// its stream breaks and it catches up after reconnecting.
func runRuleChange(sc scale, seed uint64) (*result, error) {
	n := sc.agents
	oldQ := int64(50 * n)
	newQ := oldQ / 2
	g := &group{name: "plan", quota: oldQ, unit: time.Second, burst: oldQ}
	tf := &traffic{g: g, keys: 10, demand: 1.5 * float64(oldQ)}
	if sc.name == "tiny" {
		tf.keys = 3
	}
	tr := []*traffic{tf}
	groups, groupOf, keys := layout(tr)
	warm := min(sc.warmup, 5*time.Second)
	cfg := worldConfig{name: "rule-change", seed: seed, agents: n, keys: keys, groups: groups, groupOf: groupOf,
		lease: true, warmup: warm, duration: sc.chaos, track: tf.keysOf()}
	w, err := newWorld(cfg)
	if err != nil {
		return nil, err
	}
	defer w.shutdown()

	change := warm + 3*time.Second
	cut := n - 1 // this agent is partitioned around the change
	cutFrom, cutTo := change-time.Second, change+3*time.Second
	w.net.cuts = append(w.net.cuts, partition{from: cut, to: cut + 1, start: epoch + int64(cutFrom), end: epoch + int64(cutTo)})
	ng := *g
	ng.quota, ng.burst = newQ, newQ
	if err := ng.compile(); err != nil {
		return nil, err
	}
	var version uint64
	var committed int64
	w.eng.atFunc(epoch+int64(change), func() {
		w.cl.putRules([]*allotv1.RuleFile{rulesFile([]*group{&ng})}, func(v uint64, err error) {
			if err != nil {
				w.fail(fmt.Errorf("sim: PutRules: %w", err))
				return
			}
			version, committed = v, w.eng.now
			// From now on the limit is the new one (the allocator resets a
			// key whose limit changed to a full bucket, and so does the
			// exact limiter).
			*g = ng
			for _, k := range tf.keysOf() {
				w.truth[k] = bucket.State{}
			}
		})
	})
	arr := startTraffic(w, seed, tr)
	if err := w.run(); err != nil {
		return nil, err
	}
	if version == 0 {
		return nil, fmt.Errorf("sim: the rule change was not committed")
	}

	put := epoch + int64(change)
	var worst, cutAt int64
	missing := 0
	for i, wt := range w.cl.watches {
		at, ok := wt.applied[version]
		if !ok {
			missing++
			continue
		}
		if i == cut {
			cutAt = at - put
		} else {
			worst = max(worst, at-put)
		}
	}
	// Convergence: from the commit, the first instant after which every
	// 1 s window admits at most the new limit (+2%).
	sum := sumSeries(trackedOf(w.systems[0].rec, tf.keysOf())...)
	k := float64(tf.keys)
	newR := float64(newQ)
	from := time.Duration(committed - epoch)
	conv := time.Duration(-1)
	endT := time.Duration(w.end-epoch) - time.Second
	for t := from; t <= endT; t += w.cfg.bin {
		ok := true
		for u := t; u <= endT; u += w.cfg.bin {
			if float64(w.sumBins(sum, u, u+time.Second)) > 1.02*k*newR {
				ok = false
				break
			}
		}
		if ok {
			conv = t - time.Duration(put-epoch)
			break
		}
	}
	// Over-admission in the 10 s after the commit, against the new limit.
	win := min(10*time.Second, time.Duration(w.end-committed))
	adm := w.sumBins(sum, from, from+win)
	over := float64(adm) - k*(float64(newQ)+newR*win.Seconds())
	capOld := float64(oldQ) // C = max(B, R·F) at the old limit: what agents may hold
	allow := k * (capOld + float64(newQ))

	res := &result{name: "rule-change", title: "rule-change journey: PutRules halves a limit under load"}
	res.what = []string{
		fmt.Sprintf("%d agents; %d keys at %d/s burst %d, each offered 1.5× that, spread (%s arrivals);", n, tf.keys, oldQ, oldQ, count(arr[0].n)),
		fmt.Sprintf("at t=%s PutRules sets %d/s burst %d (one Raft commit, then every WatchRules stream pushes it: one hop, plus one forward for streams on followers);", change, newQ, newQ),
		fmt.Sprintf("agent %d is cut off from t=%s to t=%s: its stream breaks and reconnects with the agent's jittered backoff (rule watch modelled as agent/rulewatch.go does it).", cut, cutFrom, cutTo),
	}
	res.tables = append(res.tables, table{title: "Propagation and enforcement",
		header: []string{"commit after PutRules", "every connected agent enforces after", "the cut-off agent after", "admitted ≤ new limit after", "over the new limit in the 10 s after commit"},
		rows: [][]string{{dur(time.Duration(committed - put)), dur(time.Duration(worst)), dur(time.Duration(cutAt)), dur(conv),
			fmt.Sprintf("%+.0f tokens (%s of R_new·W)", over, pct(over/(k*newR*win.Seconds())))}}})
	res.bounds = []bound{
		{system: "allot leases", what: "every connected agent enforces the new rules after PutRules", promise: "one Raft commit + one push (≤ 1 s)",
			measured: time.Duration(worst).Seconds(), limit: 1, unit: "s"},
		{system: "allot leases", what: "the cut-off agent enforces them after PutRules", promise: "partition end + the watch's max backoff (5 s) + 1 s",
			measured: time.Duration(cutAt).Seconds(), limit: (cutTo - change + 6*time.Second).Seconds(), unit: "s"},
		{system: "allot leases", what: "tokens over the new limit in the 10 s after the commit", promise: "leases held at the old size (C_old per key) + the balance carried over (≤ B_new)",
			measured: max(over, 0), limit: allow, unit: "tokens"},
	}
	if missing > 0 {
		res.bounds = append(res.bounds, bound{system: "allot leases", what: "agents that never got the new rules", promise: "every agent gets them", measured: float64(missing), limit: 0, unit: "tokens"})
	}
	res.notes = append(res.notes, "when a limit's parameters change, the allocator carries each key's balance over, capped at the new capacity (allocator/state: carryOver), so a tightened limit hands out no fresh burst; only the leases agents already hold at the old size are spent on top.")
	plot := plotSpec{file: "sim-" + sc.name + "-rule-change.png", title: fmt.Sprintf("rule change (%s): %d keys, limit halved at t=%s", sc.name, tf.keys, change),
		marks: []float64{change.Seconds()}}
	plot.lines = append(plot.lines, w.seriesLine("allot leases", sum, 5))
	plot.lines = append(plot.lines,
		plotLine{name: "limit (keys × R)", xs: []float64{0, change.Seconds(), change.Seconds(), float64(w.end-epoch) / 1e9},
			ys: []float64{k * float64(oldQ), k * float64(oldQ), k * newR, k * newR}, ref: true, black: true})
	res.plots = append(res.plots, plot)
	return res, nil
}
