package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/allot/allot/agent"
)

// report is the harness's output: written as JSON (-out) and printed as
// tables.
type report struct {
	Command       string       `json:"command"`
	Time          string       `json:"time"`
	Workload      workloadInfo `json:"workload"`
	Machine       machineInfo  `json:"machine"`
	TimerOverhead latencyNS    `json:"timer_pair_overhead_ns"`
	Lease         *runResult   `json:"lease"`
	Redis         *runResult   `json:"redis,omitempty"` // -redis-modes eval: one EVALSHA per check
	// RedisModes holds the other -redis-modes runs by mode name (sharded,
	// batched, sharded-batched).
	RedisModes   map[string]*runResult `json:"redis_modes,omitempty"`
	RedisSkipped string                `json:"redis_skipped,omitempty"`
	// Backends is the comparison table: the lease run, then each Redis run
	// in -redis-modes order.
	Backends   []backendRow `json:"backends,omitempty"`
	redisOrder []redisMode
	Ratios     *ratios  `json:"ratios,omitempty"`
	Targets    []target `json:"targets"`
}

type workloadInfo struct {
	Name               string   `json:"name"`
	Keys               int      `json:"keys"`
	ZipfS              float64  `json:"zipf_s"`
	Rate               float64  `json:"target_rate"`
	Limit              int      `json:"limit_per_second"`
	Burst              int      `json:"burst"`
	Agents             int      `json:"agents"`
	Skew               float64  `json:"skew"`
	SkewRotate         string   `json:"skew_rotate"`
	Duration           string   `json:"duration"`
	Window             string   `json:"window"`
	Workers            int      `json:"workers"`
	Seed               uint64   `json:"seed"`
	ColdShareExpected  float64  `json:"cold_share_expected"`  // requests to keys whose expected rate < 1/s
	ColdShareGenerated float64  `json:"cold_share_generated"` // requests to keys that got < 1/s in the lease run
	RedisModes         []string `json:"redis_modes,omitempty"`
	RedisShards        int      `json:"redis_shards,omitempty"`   // the rule's shards in the sharded modes (before capping)
	RedisDuration      string   `json:"redis_duration,omitempty"` // each Redis run's length when not Duration
}

func newWorkloadInfo(o options) workloadInfo {
	name := o.workload
	if name == "" {
		name = "custom"
	}
	w := workloadInfo{Name: name, Keys: o.keys, ZipfS: o.zipfS, Rate: o.rate, Limit: o.limit, Burst: o.burst,
		Agents: o.agents, Skew: o.skew, SkewRotate: o.skewRotate.String(), Duration: o.duration.String(),
		Window: o.window.String(), Workers: o.workers, Seed: o.seed,
		ColdShareExpected: round(coldShareExpected(o.keys, o.zipfS, o.rate), 4)}
	if o.redis != "off" {
		for _, m := range o.redisModes {
			w.RedisModes = append(w.RedisModes, string(m))
			if m.sharded() {
				w.RedisShards = o.redisShards
			}
		}
		if o.redisDuration > 0 {
			w.RedisDuration = o.redisDuration.String()
		}
	}
	return w
}

type machineInfo struct {
	CPUs         int    `json:"cpus"`
	GOMAXPROCS   int    `json:"gomaxprocs"`
	LoadAvgStart string `json:"load_avg_start"`
	LoadAvgEnd   string `json:"load_avg_end"`
}

// latencyNS is a latency distribution in nanoseconds.
type latencyNS struct {
	N    int64 `json:"n,omitempty"`
	P50  int64 `json:"p50"`
	P99  int64 `json:"p99"`
	P999 int64 `json:"p999,omitempty"`
	Max  int64 `json:"max,omitempty"`
}

func latencyOf(h *hdrhistogram.Histogram) latencyNS {
	if h.TotalCount() == 0 {
		return latencyNS{}
	}
	return latencyNS{N: h.TotalCount(), P50: h.ValueAtQuantile(50), P99: h.ValueAtQuantile(99),
		P999: h.ValueAtQuantile(99.9), Max: h.Max()}
}

// runResult is one backend's run.
type runResult struct {
	Backend      string  `json:"backend"`
	RedisMode    string  `json:"redis_mode,omitempty"` // eval, sharded, batched, sharded-batched
	Shards       int     `json:"shards,omitempty"`     // sub-keys per key in the sharded modes (the rule's shards, capped)
	Seconds      float64 `json:"seconds"`
	Scheduled    int64   `json:"scheduled"`
	Issued       int64   `json:"issued"`
	Dropped      int64   `json:"dropped_late"`
	CheckErrors  int64   `json:"check_errors"`
	ChecksPerSec float64 `json:"checks_per_second"`

	Latency  map[string]latencyNS `json:"latency_ns"`          // all, lease (allowed from a live lease), fallback, redis
	BySource map[string][2]int64  `json:"decisions_by_source"` // [denied, allowed]
	Accuracy accuracy             `json:"accuracy"`

	// StoreOps: Acquire calls (lease) or script calls (redis: checks,
	// batch takes and give-backs, the give-backs at the end included).
	StoreOps            int64   `json:"store_ops"`
	StoreOpsPerAdmitted float64 `json:"store_ops_per_admitted"`
	StoreErrors         int64   `json:"store_errors,omitempty"`
	SecondTries         int64   `json:"redis_second_tries,omitempty"` // sharded checks that tried a second sub-key
	AcquireFailed       int64   `json:"acquire_failed,omitempty"`
	AcquireKeys         int64   `json:"acquire_keys,omitempty"`
	TokensGranted       int64   `json:"tokens_granted,omitempty"`
	TokensCharged       int64   `json:"tokens_charged,omitempty"`
	BreakerOpens        int64   `json:"breaker_opens"`

	// CPUSeconds is the CPU time of this process (agents and load) plus
	// the servers (allocators or redis-server) over the run.
	CPUSeconds     float64      `json:"cpu_seconds"`
	CPUHarness     float64      `json:"cpu_seconds_harness"` // this process: load goroutines and agents
	CPUServers     float64      `json:"cpu_seconds_servers"` // allocator processes or redis-server (0 when not started here)
	CPUPerCheckNS  float64      `json:"cpu_per_check_ns"`
	Memory         *memResult   `json:"allocator_memory,omitempty"`
	MemoryError    string       `json:"allocator_memory_error,omitempty"`
	Probe          *probeResult `json:"probe,omitempty"`
	hAll, hLease   *hdrhistogram.Histogram
	hFall, hRemote *hdrhistogram.Histogram
}

// merge sums the workers' results.
func (r *runResult) merge(ws []*workerResult, elapsed time.Duration) {
	r.Seconds = elapsed.Seconds()
	r.hAll = hdrhistogram.New(1, histMax, histSigFigs)
	r.hLease = hdrhistogram.New(1, histMax, histSigFigs)
	r.hFall = hdrhistogram.New(1, histMax, histSigFigs)
	r.hRemote = hdrhistogram.New(1, histMax, histSigFigs)
	r.BySource = map[string][2]int64{}
	for _, w := range ws {
		r.Scheduled += w.scheduled
		r.Issued += w.issued
		r.Dropped += w.dropped
		r.CheckErrors += w.errs
		r.hAll.Merge(w.all)
		r.hLease.Merge(w.lease)
		r.hFall.Merge(w.fallback)
		r.hRemote.Merge(w.remote)
		for s, c := range w.bySource {
			if c[0]+c[1] == 0 {
				continue
			}
			name := agent.Source(s).String()
			v := r.BySource[name]
			v[0] += c[0]
			v[1] += c[1]
			r.BySource[name] = v
		}
	}
	r.ChecksPerSec = float64(r.Issued) / r.Seconds
	r.Latency = map[string]latencyNS{"all": latencyOf(r.hAll)}
	if r.hLease.TotalCount() > 0 {
		r.Latency["lease"] = latencyOf(r.hLease)
	}
	if r.hFall.TotalCount() > 0 {
		r.Latency["fallback"] = latencyOf(r.hFall)
	}
	if r.hRemote.TotalCount() > 0 {
		r.Latency["redis"] = latencyOf(r.hRemote)
	}
}

func (r *runResult) finish() {
	if r.Accuracy.Admitted > 0 {
		r.StoreOpsPerAdmitted = float64(r.StoreOps) / float64(r.Accuracy.Admitted)
	}
	if r.Issued > 0 {
		r.CPUPerCheckNS = r.CPUSeconds * 1e9 / float64(r.Issued)
	}
}

// memResult is the leader's memory growth per tracked key over the run.
type memResult struct {
	Before          memSample `json:"before"`
	After           memSample `json:"after"`
	HeapPerKey      float64   `json:"heap_bytes_per_key"`
	RSSPerKey       float64   `json:"rss_bytes_per_key,omitempty"`
	LeasedShare     float64   `json:"leased_share"` // leases / keys at the end (a key may have several leases)
	DifferentLeader bool      `json:"leader_changed,omitempty"`
	// Released is sampled after the agents closed (no leases left);
	// HeapPerKeyReleased is its heap growth per tracked key.
	Released           *memSample `json:"released,omitempty"`
	HeapPerKeyReleased float64    `json:"heap_bytes_per_key_released,omitempty"`
}

func (m *memResult) setReleased(s memSample) {
	m.Released = &s
	if dk := float64(s.Keys) - float64(m.Before.Keys); dk > 0 {
		m.HeapPerKeyReleased = (float64(s.HeapInuse) - float64(m.Before.HeapInuse)) / dk
	}
}

func newMemResult(before, after memSample) *memResult {
	m := &memResult{Before: before, After: after, DifferentLeader: before.Leader != after.Leader}
	if dk := float64(after.Keys) - float64(before.Keys); dk > 0 {
		m.HeapPerKey = (float64(after.HeapInuse) - float64(before.HeapInuse)) / dk
		if after.RSS > 0 && before.RSS > 0 {
			m.RSSPerKey = (float64(after.RSS) - float64(before.RSS)) / dk
		}
	}
	if after.Keys > 0 {
		m.LeasedShare = float64(after.Leases) / float64(after.Keys)
	}
	return m
}

type probeResult struct {
	BatchSize  int       `json:"batch_size"`
	Batches    int       `json:"batches"`
	BatchMean  latencyNS `json:"batch_mean_ns"` // distribution of per-batch mean check time
	Single     latencyNS `json:"single_ns"`     // the same key, each check timed alone
	LeaseShare float64   `json:"lease_share"`   // share of probe checks decided from the lease
	// Workload: the run's own keys and agents, batch-timed back to back
	// (per-batch mean check time), any source.
	Workload latencyNS `json:"workload_batch_mean_ns"`
}

// ratios compare lease to Redis (>1: lease is better, except over-admission
// which is a plain pair of numbers).
type ratios struct {
	ChecksPerSec     float64    `json:"checks_per_second_lease_over_redis"`
	P50              float64    `json:"p50_redis_over_lease"`
	P99              float64    `json:"p99_redis_over_lease"`
	StoreOpsPerAdmit float64    `json:"store_ops_per_admitted_redis_over_lease"`
	CPUPerCheck      float64    `json:"cpu_per_check_redis_over_lease"`
	OverAdmissionPct [2]float64 `json:"worst_over_admission_pct_lease_redis"`
	FalseRejectPct   [2]float64 `json:"false_reject_pct_lease_redis"`
}

// backendRow is one row of the comparison table: one backend or
// Redis mode on the same workload.
type backendRow struct {
	Backend             string  `json:"backend"`
	ChecksPerSec        float64 `json:"checks_per_second"`
	Dropped             int64   `json:"dropped_late"`
	P50                 int64   `json:"p50_ns"`
	P99                 int64   `json:"p99_ns"`
	StoreOps            int64   `json:"store_ops"` // Acquire calls or Redis script calls
	StoreOpsPerAdmitted float64 `json:"store_ops_per_admitted"`
	Admitted            int64   `json:"admitted"`
	WorstOverPct        float64 `json:"worst_over_admission_pct"`
	OverAdmittedTokens  float64 `json:"over_admitted_tokens"`
	KeysOver1Pct        int     `json:"keys_over_1pct"`
	FalseRejectPct      float64 `json:"false_reject_pct"`
	CPUPerCheckNS       float64 `json:"cpu_per_check_ns"`
}

func newBackendRow(name string, r *runResult) backendRow {
	a := r.Accuracy
	return backendRow{Backend: name, ChecksPerSec: round(r.ChecksPerSec, 1), Dropped: r.Dropped,
		P50: r.Latency["all"].P50, P99: r.Latency["all"].P99,
		StoreOps: r.StoreOps, StoreOpsPerAdmitted: round(r.StoreOpsPerAdmitted, 5), Admitted: a.Admitted,
		WorstOverPct: round(a.WorstOverPct, 3), OverAdmittedTokens: a.OverAdmittedTokens, KeysOver1Pct: a.KeysOver1Pct,
		FalseRejectPct: round(a.FalseRejectPct, 3), CPUPerCheckNS: round(r.CPUPerCheckNS, 0)}
}

// rowName is a run's name in the comparison table.
func rowName(r *runResult) string {
	switch redisMode(r.RedisMode) {
	case modeEval:
		return "redis: EVAL per check"
	case modeSharded:
		return fmt.Sprintf("redis: %d sharded sub-keys", r.Shards)
	case modeBatched:
		return "redis: batched"
	case modeShardedBatched:
		return fmt.Sprintf("redis: batched, %d sub-keys", r.Shards)
	}
	return r.Backend
}

// redisRuns returns the Redis runs in -redis-modes order.
func (rep *report) redisRuns() []*runResult {
	var out []*runResult
	for _, m := range rep.redisOrder {
		if m == modeEval {
			if rep.Redis != nil {
				out = append(out, rep.Redis)
			}
		} else if r := rep.RedisModes[string(m)]; r != nil {
			out = append(out, r)
		}
	}
	return out
}

// target is one of the performance targets, evaluated on this run.
type target struct {
	Name     string  `json:"name"`
	Workload string  `json:"defined_for"` // the workload the target is stated for ("" any)
	Bound    float64 `json:"bound"`
	Unit     string  `json:"unit"`
	Measured float64 `json:"measured"`
	Met      bool    `json:"met"`
}

// finish computes the ratios and evaluates the targets.
func (rep *report) finish(o options) {
	rep.Time = time.Now().UTC().Format(time.RFC3339)
	l, r := rep.Lease, rep.Redis
	if redis := rep.redisRuns(); len(redis) > 0 && l != nil {
		rep.Backends = []backendRow{newBackendRow("lease", l)}
		for _, rr := range redis {
			rep.Backends = append(rep.Backends, newBackendRow(rowName(rr), rr))
		}
	}
	if l != nil && r != nil {
		div := func(a, b float64) float64 {
			if b == 0 {
				return 0
			}
			return round(a/b, 3)
		}
		rep.Ratios = &ratios{
			ChecksPerSec:     div(l.ChecksPerSec, r.ChecksPerSec),
			P50:              div(float64(r.Latency["all"].P50), float64(l.Latency["all"].P50)),
			P99:              div(float64(r.Latency["all"].P99), float64(l.Latency["all"].P99)),
			StoreOpsPerAdmit: div(r.StoreOpsPerAdmitted, l.StoreOpsPerAdmitted),
			CPUPerCheck:      div(r.CPUPerCheckNS, l.CPUPerCheckNS),
			OverAdmissionPct: [2]float64{round(l.Accuracy.WorstOverPct, 3), round(r.Accuracy.WorstOverPct, 3)},
			FalseRejectPct:   [2]float64{round(l.Accuracy.FalseRejectPct, 3), round(r.Accuracy.FalseRejectPct, 3)},
		}
	}
	if l == nil {
		return
	}
	add := func(name, wl string, bound float64, unit string, measured float64) {
		rep.Targets = append(rep.Targets, target{Name: name, Workload: wl, Bound: bound, Unit: unit,
			Measured: round(measured, 6), Met: measured <= bound})
	}
	add("allocator RPCs per admitted request", "hot", 0.01, "calls", l.StoreOpsPerAdmitted)
	add("allocator RPCs per admitted request", "longtail", 0.05, "calls", l.StoreOpsPerAdmitted)
	add("over-admission, worst key, per window", "", 1, "% of R·window", l.Accuracy.WorstOverPct)
	add("false rejects", "skew", 1, "% of in-quota", l.Accuracy.FalseRejectPct)
	if lat, ok := l.Latency["lease"]; ok {
		add("check p99 with a live lease (in the run)", "", 5000, "ns", float64(lat.P99))
	}
	if l.Probe != nil {
		add("check p99 with a live lease (probe, each check timed)", "", 5000, "ns", float64(l.Probe.Single.P99))
		add("check p99 with a live lease (probe, batch-timed mean)", "", 5000, "ns", float64(l.Probe.BatchMean.P99))
	}
	add("check p99 over the whole workload", "longtail", 1e6, "ns", float64(l.Latency["all"].P99))
}

func (rep *report) writeJSON(path string) error {
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// print writes the human tables.
func (rep *report) print(w io.Writer) {
	wl := rep.Workload
	fmt.Fprintf(w, "workload %s: %d keys, Zipf s=%g, %.0f req/s target, limit %d/s burst %d, %d agents, skew %g (rotate %s), %s per backend, %d workers, seed %d\n",
		wl.Name, wl.Keys, wl.ZipfS, wl.Rate, wl.Limit, wl.Burst, wl.Agents, wl.Skew, wl.SkewRotate, wl.Duration, wl.Workers, wl.Seed)
	fmt.Fprintf(w, "requests to keys under 1 req/s: %.1f%% of the lease run's checks (%.1f%% expected from the Zipf weights)\n",
		100*wl.ColdShareGenerated, 100*wl.ColdShareExpected)
	fmt.Fprintf(w, "machine: %d CPUs, load average %s at start, %s at end; timer pair overhead p50 %s p99 %s (included in every check time)\n\n",
		rep.Machine.CPUs, rep.Machine.LoadAvgStart, rep.Machine.LoadAvgEnd, ns(rep.TimerOverhead.P50), ns(rep.TimerOverhead.P99))

	l, r := rep.Lease, rep.Redis
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head := "\tlease"
	if r != nil {
		head += "\tredis (EVAL per check)\tlease vs redis"
	}
	fmt.Fprintln(tw, head)
	row := func(name string, lv, rv string, ratio string) {
		line := name + "\t" + lv
		if r != nil {
			line += "\t" + rv + "\t" + ratio
		}
		fmt.Fprintln(tw, line)
	}
	get := func(f func(*runResult) string) string {
		if r == nil {
			return ""
		}
		return f(r)
	}
	x := func(v float64, what string) string {
		if v == 0 {
			return "-"
		}
		return fmt.Sprintf("%.3g× %s", v, what)
	}
	ra := rep.Ratios
	if ra == nil {
		ra = &ratios{}
	}
	row("checks/s (issued)", fmt.Sprintf("%.0f", l.ChecksPerSec), get(func(r *runResult) string { return fmt.Sprintf("%.0f", r.ChecksPerSec) }), x(ra.ChecksPerSec, "more"))
	row("dropped (> max-lag late) / errors", fmt.Sprintf("%d / %d", l.Dropped, l.CheckErrors), get(func(r *runResult) string { return fmt.Sprintf("%d / %d", r.Dropped, r.CheckErrors) }), "")
	for _, q := range []struct {
		name string
		f    func(latencyNS) int64
	}{{"check p50", func(l latencyNS) int64 { return l.P50 }}, {"check p99", func(l latencyNS) int64 { return l.P99 }},
		{"check p99.9", func(l latencyNS) int64 { return l.P999 }}, {"check max", func(l latencyNS) int64 { return l.Max }}} {
		ratio := ""
		switch q.name {
		case "check p50":
			ratio = x(ra.P50, "lower")
		case "check p99":
			ratio = x(ra.P99, "lower")
		}
		row(q.name, ns(q.f(l.Latency["all"])), get(func(r *runResult) string { return ns(q.f(r.Latency["all"])) }), ratio)
	}
	if lat, ok := l.Latency["lease"]; ok {
		row("  from a live lease: p50 / p99 / p99.9", fmt.Sprintf("%s / %s / %s (n=%d)", ns(lat.P50), ns(lat.P99), ns(lat.P999), lat.N), "", "")
	}
	if lat, ok := l.Latency["fallback"]; ok {
		row("  fallback bucket: p50 / p99 / p99.9", fmt.Sprintf("%s / %s / %s (n=%d)", ns(lat.P50), ns(lat.P99), ns(lat.P999), lat.N), "", "")
	}
	row("decisions by source (allowed/denied)", sources(l.BySource), get(func(r *runResult) string { return sources(r.BySource) }), "")
	row("store ops (Acquire calls | EVALSHAs)", fmt.Sprintf("%d (%d failed)", l.StoreOps, l.AcquireFailed), get(func(r *runResult) string { return fmt.Sprintf("%d (%d errors)", r.StoreOps, r.StoreErrors) }), "")
	row("store ops per admitted request", fmt.Sprintf("%.4f", l.StoreOpsPerAdmitted), get(func(r *runResult) string { return fmt.Sprintf("%.4f", r.StoreOpsPerAdmitted) }), x(ra.StoreOpsPerAdmit, "fewer"))
	row("admitted / checks", fmt.Sprintf("%d / %d", l.Accuracy.Admitted, l.Accuracy.Offered), get(func(r *runResult) string { return fmt.Sprintf("%d / %d", r.Accuracy.Admitted, r.Accuracy.Offered) }), "")
	over := func(a accuracy) string {
		s := fmt.Sprintf("%.3f%%", a.WorstOverPct)
		if a.WorstKey != "" {
			s += fmt.Sprintf(" (%s: %d > %.0f)", a.WorstKey, a.WorstWindowCount, a.WorstWindowBound)
		}
		return s
	}
	row(fmt.Sprintf("over-admission, worst key (%% of R·%gs)", l.Accuracy.WindowSeconds), over(l.Accuracy), get(func(r *runResult) string { return over(r.Accuracy) }), "")
	row("keys over 1% / keys at the limit", fmt.Sprintf("%d / %d", l.Accuracy.KeysOver1Pct, l.Accuracy.KeysAtLimit), get(func(r *runResult) string {
		return fmt.Sprintf("%d / %d", r.Accuracy.KeysOver1Pct, r.Accuracy.KeysAtLimit)
	}), "")
	row("over-admitted tokens (% of admitted)", fmt.Sprintf("%.0f (%.3f%%)", l.Accuracy.OverAdmittedTokens, l.Accuracy.OverAdmittedPct), get(func(r *runResult) string {
		return fmt.Sprintf("%.0f (%.3f%%)", r.Accuracy.OverAdmittedTokens, r.Accuracy.OverAdmittedPct)
	}), "")
	fr := func(a accuracy) string {
		return fmt.Sprintf("%.3f%% (%d of %d)", a.FalseRejectPct, a.FalseRejects, a.IdealAdmitted)
	}
	row("false rejects (% of in-quota)", fr(l.Accuracy), get(func(r *runResult) string { return fr(r.Accuracy) }), "")
	later := func(a accuracy) string {
		if a.LaterIdealAdmitted == 0 {
			return "(one window)"
		}
		return fmt.Sprintf("%.3f%% (%d of %d)", a.LaterFalseRejectPct, a.LaterFalseRejects, a.LaterIdealAdmitted)
	}
	row(fmt.Sprintf("  past the first %gs", l.Accuracy.WindowSeconds), later(l.Accuracy), get(func(r *runResult) string { return later(r.Accuracy) }), "")
	row("  by the source that denied", bySource(l.Accuracy.FalseRejectsBy), get(func(r *runResult) string { return bySource(r.Accuracy.FalseRejectsBy) }), "")
	row("  static R/N split, replayed", fmt.Sprintf("%.3f%%", l.Accuracy.StaticFalseRejectPct), get(func(r *runResult) string { return fmt.Sprintf("%.3f%%", r.Accuracy.StaticFalseRejectPct) }), "")
	row("CPU per check (all processes)", ns(int64(l.CPUPerCheckNS)), get(func(r *runResult) string { return ns(int64(r.CPUPerCheckNS)) }), x(ra.CPUPerCheck, "less"))
	cpuSplit := func(r *runResult) string {
		return fmt.Sprintf("%.2fs harness + %.2fs servers", r.CPUHarness, r.CPUServers)
	}
	row("  CPU time over the run", cpuSplit(l), get(cpuSplit), "")
	if m := l.Memory; m != nil {
		note := ""
		if m.After.Keys < m.Before.Keys+10000 {
			note = "; under 10,000 new keys: noise, not a per-key figure"
		}
		row("allocator memory per tracked key (leader)", fmt.Sprintf("%.0f B heap, %.0f B RSS (%d → %d keys, %d leases%s)", m.HeapPerKey, m.RSSPerKey, m.Before.Keys, m.After.Keys, m.After.Leases, note), "", "")
		if rel := m.Released; rel != nil {
			row("  the same keys after the agents released their leases", fmt.Sprintf("%.0f B heap (%d keys, %d leases)", m.HeapPerKeyReleased, rel.Keys, rel.Leases), "", "")
		}
	} else if l.MemoryError != "" {
		row("allocator memory per tracked key", "error: "+l.MemoryError, "", "")
	}
	if p := l.Probe; p != nil {
		row("probe: leased check, batch-timed mean p50 / p99", fmt.Sprintf("%s / %s (%d×%d checks, %.1f%% from the lease)", ns(p.BatchMean.P50), ns(p.BatchMean.P99), p.Batches, p.BatchSize, 100*p.LeaseShare), "", "")
		row("probe: the same, each check timed p50 / p99 / p99.9", fmt.Sprintf("%s / %s / %s", ns(p.Single.P50), ns(p.Single.P99), ns(p.Single.P999)), "", "")
		row("probe: workload keys, batch-timed mean p50 / p99", fmt.Sprintf("%s / %s (200×500 checks, unpaced)", ns(p.Workload.P50), ns(p.Workload.P99)), "", "")
	}
	row("breaker opens", fmt.Sprint(l.BreakerOpens), get(func(*runResult) string { return "-" }), "")
	tw.Flush()
	if l.AcquireFailed > 0 || l.BreakerOpens > 0 {
		fmt.Fprintf(w, "\nnote: %d Acquire calls failed (timed out) and agents' breakers opened %d times: the allocators did not keep up on this machine during the run, and the lease figures include the fallback's admission while they did not answer (fail-open, not charged once a breaker is open)\n",
			l.AcquireFailed, l.BreakerOpens)
	}
	if rep.RedisSkipped != "" {
		fmt.Fprintf(w, "\nredis baseline skipped: %s\n", rep.RedisSkipped)
	}
	if len(rep.RedisModes) > 0 {
		rep.printBackends(w)
	}
	fmt.Fprintln(w, "\ntargets (lease):")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, t := range rep.Targets {
		applies := "any workload"
		if t.Workload != "" {
			applies = t.Workload + " workload"
			if t.Workload != wl.Name {
				applies += " (not this run)"
			}
		}
		met := "MISSED"
		if t.Met {
			met = "met"
		}
		bound, measured := fmt.Sprintf("≤ %g %s", t.Bound, t.Unit), fmt.Sprintf("%.4g", t.Measured)
		if t.Unit == "ns" {
			bound, measured = "≤ "+ns(int64(t.Bound)), ns(int64(t.Measured))
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", t.Name, applies, bound, measured, met)
	}
	tw.Flush()
}

// printBackends writes the comparison table: one row per backend or Redis
// mode (four rows with -redis-modes eval,sharded,batched).
func (rep *report) printBackends(w io.Writer) {
	fmt.Fprintf(w, "\nbackends on the same requests (Redis runs %s each):\n", rep.redisDuration())
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\tchecks/s\tdropped\tp50\tp99\tstore ops / admitted\tover-admission, worst key\tover-admitted tokens\tfalse rejects\tCPU / check")
	for _, b := range rep.Backends {
		fmt.Fprintf(tw, "%s\t%.0f\t%d\t%s\t%s\t%.4f (%d)\t%.3f%% (%d keys > 1%%)\t%.0f\t%.3f%%\t%s\n",
			b.Backend, b.ChecksPerSec, b.Dropped, ns(b.P50), ns(b.P99), b.StoreOpsPerAdmitted, b.StoreOps,
			b.WorstOverPct, b.KeysOver1Pct, b.OverAdmittedTokens, b.FalseRejectPct, ns(int64(b.CPUPerCheckNS)))
	}
	tw.Flush()
	for _, r := range rep.redisRuns() {
		if r.StoreErrors > 0 || r.CheckErrors > 0 {
			fmt.Fprintf(w, "note: %s: %d Redis call errors, %d check errors\n", rowName(r), r.StoreErrors, r.CheckErrors)
		}
		if r.SecondTries > 0 {
			fmt.Fprintf(w, "%s: %d checks tried a second sub-key\n", rowName(r), r.SecondTries)
		}
	}
}

// redisDuration is each Redis run's scheduled length.
func (rep *report) redisDuration() string {
	if d := rep.Workload.RedisDuration; d != "" {
		return d
	}
	return rep.Workload.Duration
}

func sources(m map[string][2]int64) string {
	var parts []string
	for _, s := range []agent.Source{agent.SourceLease, agent.SourceStatic, agent.SourceFallback, agent.SourceRedis, agent.SourceLocal, agent.SourceUnlimited} {
		if v, ok := m[s.String()]; ok {
			parts = append(parts, fmt.Sprintf("%s %d/%d", s, v[1], v[0]))
		}
	}
	return strings.Join(parts, ", ")
}

// ns formats nanoseconds with a unit that keeps 2–3 significant digits.
func ns(v int64) string {
	d := time.Duration(v)
	switch {
	case d < time.Microsecond:
		return fmt.Sprintf("%dns", v)
	case d < time.Millisecond:
		return fmt.Sprintf("%.3gµs", float64(v)/1e3)
	case d < time.Second:
		return fmt.Sprintf("%.3gms", float64(v)/1e6)
	}
	return fmt.Sprintf("%.3gs", d.Seconds())
}

// bySource formats false rejects by source, in name order.
func bySource(m map[string]int64) string {
	if len(m) == 0 {
		return "none"
	}
	ks := slices.Sorted(maps.Keys(m))
	parts := make([]string, len(ks))
	for i, k := range ks {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}
