package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/internal/proccpu"
	"github.com/allot/allot/pkg/redislimit"
	"github.com/allot/allot/pkg/rules"
)

// run sets up, runs the lease backend and then each Redis mode on the same
// workload, and returns the report.
func run(o options) (*report, error) {
	ctx := context.Background()
	dir := o.dir
	if dir == "" {
		d, err := os.MkdirTemp("", "allot-bench-load-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(d)
		dir = d
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	rep := &report{
		Workload: newWorkloadInfo(o),
		Machine:  machineInfo{CPUs: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), LoadAvgStart: proccpu.LoadAvg()},
	}
	p50, p99 := timerOverhead(200_000)
	rep.TimerOverhead = latencyNS{P50: int64(p50), P99: int64(p99)}
	wl := newWorkload(o)

	lease, err := runLease(ctx, o, dir, wl)
	if err != nil {
		return nil, fmt.Errorf("lease run: %w", err)
	}
	rep.Lease = lease
	rep.Workload.ColdShareGenerated = lease.Accuracy.ColdShare

	switch o.redis {
	case "off":
		rep.RedisSkipped = "-redis off"
	default:
		runs, skip, err := runRedis(ctx, o, dir)
		switch {
		case err != nil:
			return nil, fmt.Errorf("redis run: %w", err)
		case skip != "":
			rep.RedisSkipped = skip
			o.progress("redis runs skipped: %s", skip)
		}
		for _, res := range runs {
			if res.RedisMode == string(modeEval) {
				rep.Redis = res
				continue
			}
			if rep.RedisModes == nil {
				rep.RedisModes = map[string]*runResult{}
			}
			rep.RedisModes[res.RedisMode] = res
		}
		rep.redisOrder = o.redisModes
	}
	rep.Machine.LoadAvgEnd = proccpu.LoadAvg()
	rep.finish(o)
	return rep, nil
}

// runLease runs the workload against K agents leasing from the cluster.
func runLease(ctx context.Context, o options, dir string, wl *workload) (*runResult, error) {
	var c *cluster
	var err error
	if o.allocators != "" {
		o.progress("connecting to %s", o.allocators)
		c, err = connectCluster(strings.Split(o.allocators, ","))
	} else {
		o.progress("starting 3 allocators (data and logs in %s)", dir)
		c, err = startCluster(ctx, o, dir)
	}
	if err != nil {
		return nil, err
	}
	defer c.stop()
	version, err := c.putRules(ctx, rulesYAML(o.limit, o.burst, "lease", 0))
	if err != nil {
		return nil, err
	}
	memBefore, memErr := c.memory(ctx)

	logf, err := os.Create(filepath.Join(dir, "agents.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	logger := slog.New(slog.NewTextHandler(logf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	agents := make([]*agent.Agent, o.agents)
	regs := make([]*prometheus.Registry, o.agents)
	defer func() { closeAgents(agents) }()
	for i := range agents {
		cfg := agent.DefaultConfig()
		cfg.ID = fmt.Sprintf("load-%d-%d-%d", os.Getpid(), time.Now().UnixNano(), i)
		cfg.Allocators = c.addrs
		regs[i] = prometheus.NewRegistry()
		cfg.Registerer = regs[i]
		cfg.Logger = logger.With("agent", i)
		cfg.RefillInterval = o.refill
		cfg.CallTimeout = o.callTimeout
		if agents[i], err = agent.New(cfg); err != nil {
			return nil, err
		}
	}
	if err := waitAgents(ctx, agents, version, 30*time.Second); err != nil {
		return nil, err
	}
	if !o.coldAgents {
		if err := warmAgents(ctx, agents, regs, 30*time.Second); err != nil {
			return nil, err
		}
	}
	m0, err := sumAgentMetrics(regs)
	if err != nil {
		return nil, err
	}

	o.progress("lease run: %s, %.0f req/s, %d keys, %d agents", o.duration, o.rate, o.keys, o.agents)
	res := &runResult{Backend: "lease"}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return nil, err
		}
	}
	cpu := startCPU(c.pids())
	t0 := time.Now()
	workers := wl.drive(ctx, checkers(agents))
	elapsed := time.Since(t0)
	cpu.stop(res)
	if o.cpuProfile != "" {
		pprof.StopCPUProfile()
	}
	res.merge(workers, elapsed)

	if memErr == nil {
		if memAfter, err := c.memory(ctx); err == nil {
			res.Memory = newMemResult(memBefore, memAfter)
		} else {
			res.MemoryError = err.Error()
		}
	} else {
		res.MemoryError = memErr.Error()
	}
	m1, err := sumAgentMetrics(regs)
	if err != nil {
		return nil, err
	}
	res.StoreOps = m1.calls - m0.calls
	res.AcquireFailed = m1.failed - m0.failed
	res.AcquireKeys = m1.keys - m0.keys
	res.TokensGranted = m1.granted - m0.granted
	res.TokensCharged = m1.charged - m0.charged
	res.BreakerOpens = m1.opens - m0.opens
	if o.probe {
		o.progress("probe: batch-timed checks on a leased key")
		pr, err := probe(ctx, agents[0])
		if err != nil {
			return nil, err
		}
		if pr.Workload, err = probeWorkload(ctx, wl, checkers(agents)); err != nil {
			return nil, err
		}
		res.Probe = pr
	}
	closeAgents(agents)
	agents = nil
	if res.Memory != nil {
		// The agents released their leases on Close: measure the same keys
		// without them (the state drops keys with a full bucket and no
		// lease only gradually, a sweep segment per Expire).
		if s, err := c.memoryWithoutLeases(ctx, 10*time.Second); err == nil {
			res.Memory.setReleased(s)
		} else {
			res.MemoryError = err.Error()
		}
	}

	o.progress("analysing %d decisions", res.Issued)
	events, err := mergeEvents(workers)
	if err != nil {
		return nil, err
	}
	if res.Accuracy, err = analyze(events, int64(o.limit), int64(o.burst), o.agents, o.window, o.duration); err != nil {
		return nil, err
	}
	if o.traceKey != "" {
		traceKey(os.Stderr, events, o.traceKey, o.traceStep)
	}
	res.finish()
	return res, nil
}

// runRedis starts a redis-server (or connects to -redis HOST:PORT) and
// runs the workload against it once per -redis-modes entry, in order, each
// on the same request sequence (a prefix of it with -redis-duration). skip
// is non-empty when the runs cannot happen (no redis-server).
func runRedis(ctx context.Context, o options, dir string) (runs []*runResult, skip string, err error) {
	addr := o.redis
	var pids []int
	if o.redis == "auto" {
		srv, err := startRedis(ctx, o.redisBin, dir)
		if errors.Is(err, exec.ErrNotFound) {
			return nil, fmt.Sprintf("%s not found (apt-get install redis-server)", o.redisBin), nil
		}
		if err != nil {
			return nil, "", err
		}
		defer srv.stop()
		addr = srv.addr
		pids = append(pids, srv.pid())
	} else if err := waitRedis(ctx, addr, 10*time.Second); err != nil {
		return nil, "", err
	}
	ro := o
	if o.redisDuration > 0 {
		ro.duration = o.redisDuration
	}
	// newWorkload(ro) draws the same keys and agents in the same order as
	// the lease run's workload: only the end differs.
	wl := newWorkload(ro)
	for _, m := range o.redisModes {
		res, err := runRedisMode(ctx, ro, addr, pids, wl, m)
		if err != nil {
			return runs, "", fmt.Errorf("%s: %w", m, err)
		}
		runs = append(runs, res)
	}
	return runs, "", nil
}

// runRedisMode runs the workload against K standalone agents whose rule has
// the redis backend, decided as mode says: every check one EVALSHA of
// pkg/redislimit's script (eval), the same on one sub-key of the rule's
// -redis-shards (sharded, a second sub-key when the first denies), or from
// local batches a Batcher per agent takes from Redis and gives back
// (batched, sharded-batched). Every agent has its own Backend (connection
// pool); all share one key prefix, fresh per run, so that each key is one
// global budget and a running server's old keys do not count.
func runRedisMode(ctx context.Context, o options, addr string, pids []int, wl *workload, mode redisMode) (*runResult, error) {
	shards := 0
	if mode.sharded() {
		shards = o.redisShards
	}
	set, err := rules.Compile(1, []rules.File{{Name: domain + ".yaml", Domain: domain, Source: rulesYAML(o.limit, o.burst, "redis", shards)}})
	if err != nil {
		return nil, err
	}
	agents := make([]*agent.Agent, o.agents)
	backends := make([]*redislimit.Backend, o.agents)
	batchers := make([]*redislimit.Batcher, o.agents)
	closeBatchers := func() error {
		// Hand every held token back before the stats are read and the
		// backends close.
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var errs []error
		for i, bt := range batchers {
			if bt != nil {
				errs = append(errs, bt.Close(cctx))
				batchers[i] = nil
			}
		}
		return errors.Join(errs...)
	}
	defer func() {
		closeAgents(agents)
		_ = closeBatchers()
		for _, b := range backends {
			if b != nil {
				_ = b.Close()
			}
		}
	}()
	prefix := fmt.Sprintf("allot-load-%d-%s:", time.Now().UnixNano(), mode)
	for i := range agents {
		rc := redislimit.DefaultConfig()
		rc.Addrs = []string{addr}
		// One connection per worker that may route to this agent, a
		// timeout and breaker generous enough that a stall of the shared
		// machine does not turn the run into a failure test: every
		// check goes to Redis (or to a batch taken from it), and errors
		// are counted.
		rc.PoolSize = o.workers
		rc.Timeout = 2 * time.Second
		rc.BreakerFailures = 1 << 20
		rc.KeyPrefix = prefix
		if backends[i], err = redislimit.New(rc); err != nil {
			return nil, err
		}
		rl := &redislimit.RuleLimiter{Backend: backends[i]}
		if mode.batched() {
			if batchers[i], err = redislimit.NewBatcher(backends[i], redislimit.DefaultBatchConfig()); err != nil {
				return nil, err
			}
			rl.Batcher = batchers[i]
		}
		cfg := agent.DefaultConfig()
		cfg.Rules = set
		cfg.Redis = rl
		if agents[i], err = agent.New(cfg); err != nil {
			return nil, err
		}
	}

	res := &runResult{Backend: mode.backend(), RedisMode: string(mode)}
	if mode.sharded() {
		if r := set.Match(domain, wl.descs[0].Entries); r != nil {
			res.Shards = redislimit.Shards(r.Limit, r.Shards)
		}
	}
	o.progress("redis run (%s): %s, %.0f req/s, %s", mode, o.duration, o.rate, mode.about(res.Shards))
	cpu := startCPU(pids)
	t0 := time.Now()
	workers := wl.drive(ctx, checkers(agents))
	elapsed := time.Since(t0)
	if err := closeBatchers(); err != nil {
		// The failed calls are counted in the backends' Errors below.
		o.progress("redis run (%s): giving batches back: %v", mode, err)
	}
	cpu.stop(res)
	res.merge(workers, elapsed)
	for _, b := range backends {
		st := b.Stats()
		res.StoreOps += int64(st.Calls)
		res.StoreErrors += int64(st.Errors + st.FastFails)
		res.SecondTries += int64(st.SecondTries)
	}
	o.progress("analysing %d decisions", res.Issued)
	events, err := mergeEvents(workers)
	if err != nil {
		return nil, err
	}
	if res.Accuracy, err = analyze(events, int64(o.limit), int64(o.burst), o.agents, o.window, o.duration); err != nil {
		return nil, err
	}
	res.finish()
	return res, nil
}

// about describes the mode in a progress line.
func (m redisMode) about(shards int) string {
	switch m {
	case modeSharded:
		return fmt.Sprintf("%d sub-keys, one EVALSHA per check (two near the limit)", shards)
	case modeBatched:
		return "batches taken from the key and spent locally"
	case modeShardedBatched:
		return fmt.Sprintf("batches taken from one of %d sub-keys and spent locally", shards)
	}
	return "one EVALSHA per check"
}

func checkers(agents []*agent.Agent) []checker {
	out := make([]checker, len(agents))
	for i, a := range agents {
		out[i] = a
	}
	return out
}

// cpuMeter measures the CPU time of this process and of the server
// processes over a run.
type cpuMeter struct {
	servers         []int
	self, srv       time.Duration
	selfErr, srvErr error
}

func startCPU(servers []int) *cpuMeter {
	m := &cpuMeter{servers: servers}
	m.self, m.selfErr = cpuTime(0)
	if len(servers) > 0 {
		m.srv, m.srvErr = cpuTime(servers...)
	}
	return m
}

// stop records the CPU used since startCPU into r (nothing for a part that
// could not be read).
func (m *cpuMeter) stop(r *runResult) {
	if self, err := cpuTime(0); err == nil && m.selfErr == nil {
		r.CPUHarness = (self - m.self).Seconds()
	}
	if len(m.servers) > 0 {
		if srv, err := cpuTime(m.servers...); err == nil && m.srvErr == nil {
			r.CPUServers = (srv - m.srv).Seconds()
		}
	}
	r.CPUSeconds = r.CPUHarness + r.CPUServers
}

// closeAgents closes every agent (handing leases back), bounded.
func closeAgents(agents []*agent.Agent) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i, a := range agents {
		if a != nil {
			_ = a.Close(ctx)
			agents[i] = nil
		}
	}
}

// waitAgents waits until every agent has talked to an allocator and uses
// rules version ≥ version.
func waitAgents(ctx context.Context, agents []*agent.Agent, version uint64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ready := 0
		for _, a := range agents {
			if a.Ready() && a.Rules() != nil && a.Rules().Version() >= version {
				ready++
			}
		}
		if ready == len(agents) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d agents have rules version %d after %v", ready, len(agents), version, timeout)
		}
		if err := sleepCtx(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

// warmAgents makes every agent learn the number of live agents (N) before
// the run, as agents that have been running do: each agent checks a fresh
// warm-up key, which its refill loop sends in an Acquire, and once every
// agent has had an answer, once more, so that the answers count all of
// them. Without this (-cold-agents), an agent decides the run's first keys
// with N = 1 until its first Acquire returns.
func warmAgents(ctx context.Context, agents []*agent.Agent, regs []*prometheus.Registry, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for round := range 2 {
		before := make([]int64, len(agents))
		for i, reg := range regs {
			m, err := gatherAgentMetrics(reg)
			if err != nil {
				return err
			}
			before[i] = m.ok
		}
		descs := []agent.Descriptor{{Entries: []rules.Entry{{Key: "probe", Value: fmt.Sprintf("warm%d", round)}}}}
		for _, a := range agents {
			if _, err := a.Check(ctx, domain, descs, 1); err != nil {
				return err
			}
		}
		for i := 0; i < len(agents); {
			m, err := gatherAgentMetrics(regs[i])
			if err != nil {
				return err
			}
			if m.ok > before[i] {
				i++
				continue
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("agent %d had no Acquire answer within %v", i, timeout)
			}
			if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
				return err
			}
		}
	}
	return nil
}

// agentMetrics are the counters the harness reads from an agent's registry.
type agentMetrics struct {
	calls, ok, failed, keys, granted, charged, opens int64
}

func sumAgentMetrics(regs []*prometheus.Registry) (agentMetrics, error) {
	var sum agentMetrics
	for _, reg := range regs {
		m, err := gatherAgentMetrics(reg)
		if err != nil {
			return sum, err
		}
		sum.calls += m.calls
		sum.ok += m.ok
		sum.failed += m.failed
		sum.keys += m.keys
		sum.granted += m.granted
		sum.charged += m.charged
		sum.opens += m.opens
	}
	return sum, nil
}

func gatherAgentMetrics(reg prometheus.Gatherer) (agentMetrics, error) {
	var m agentMetrics
	fams, err := reg.Gather()
	if err != nil {
		return m, err
	}
	for _, f := range fams {
		for _, mt := range f.GetMetric() {
			v := int64(mt.GetCounter().GetValue())
			label := func(name string) string {
				for _, l := range mt.GetLabel() {
					if l.GetName() == name {
						return l.GetValue()
					}
				}
				return ""
			}
			switch f.GetName() {
			case "allot_agent_acquire_calls_total":
				m.calls += v
				switch label("result") {
				case "ok":
					m.ok += v
				case "failed":
					m.failed += v
				}
			case "allot_agent_acquire_keys_total":
				m.keys += v
			case "allot_agent_tokens_total":
				switch label("kind") {
				case "granted":
					m.granted += v
				case "charged":
					m.charged += v
				}
			case "allot_agent_breaker_transitions_total":
				if label("to") == "open" {
					m.opens += v
				}
			}
		}
	}
	return m, nil
}

// probe measures the leased hot path on its own, on a key whose limit is
// far above what it spends. It first spins on the key until its demand
// estimate has converged and whole batches are served from the lease (at
// least 2 s, at most 6 s), then times 100,000 checks one by one with the
// monotonic clock (two reads, ~20 ns, measured by timerOverhead) and 2,000
// batches of 50 back-to-back checks (two clock reads per batch, so the
// timer's cost is spread over 50 checks; only batches served entirely from
// the lease are kept). Small batches keep the batch p99 from being decided
// by the few batches a preemption lands in.
func probe(ctx context.Context, a *agent.Agent) (*probeResult, error) {
	descs := []agent.Descriptor{{Entries: []rules.Entry{{Key: "probe", Value: "p"}}}}
	const batches, per, single = 2000, 50, 100_000
	batch := func() (leased int, err error) {
		for range per {
			d, err := a.Check(ctx, domain, descs, 1)
			if err != nil {
				return 0, err
			}
			if d.Source == agent.SourceLease && d.Allowed {
				leased++
			}
		}
		return leased, nil
	}
	// The demand estimate is an EWMA with a 1 s time constant: spin for 2 s
	// before looking for a streak of fully leased batches.
	start := time.Now()
	for streak := 0; streak < 20 || time.Since(start) < 2*time.Second; {
		n, err := batch()
		if err != nil {
			return nil, err
		}
		if n == per {
			streak++
		} else {
			streak = 0
		}
		if time.Since(start) > 6*time.Second {
			break
		}
	}
	pr := &probeResult{BatchSize: per, Batches: batches}
	hb := hdrhistogram.New(1, histMax, 3)
	var leased, total int64
	for range batches {
		t0 := time.Now()
		n, err := batch()
		el := time.Since(t0)
		if err != nil {
			return nil, err
		}
		if n == per {
			_ = hb.RecordValue(max(int64(el)/per, 1))
		}
		leased += int64(n)
		total += per
	}
	pr.BatchMean = latencyOf(hb)
	hs := hdrhistogram.New(1, histMax, 3)
	start = time.Now()
	for range single {
		t0 := time.Since(start)
		d, _ := a.Check(ctx, domain, descs, 1)
		t1 := time.Since(start)
		if d.Source == agent.SourceLease && d.Allowed {
			leased++
			rec(hs, int64(t1-t0))
		}
	}
	total += single
	pr.Single = latencyOf(hs)
	pr.LeaseShare = float64(leased) / float64(total)
	return pr, nil
}

// probeWorkload batch-times the workload's own checks without pacing: 200
// batches of 500 checks, keys and agents drawn as in the run, back to back.
// Compared with the run's per-check times, it separates what a check costs
// from what waking up to issue it costs (cold caches after a sleep, other
// processes' work on the same cores).
func probeWorkload(ctx context.Context, wl *workload, agents []checker) (latencyNS, error) {
	const batches, per = 200, 500
	keys := wl.picker(1 << 40)
	route := rand.New(rand.NewPCG(wl.o.seed, 1<<41))
	h := hdrhistogram.New(1, histMax, 3)
	ks, as := make([]uint32, per), make([]int, per)
	for range batches {
		for i := range per {
			ks[i], as[i] = keys.next(), wl.agentFor(route, 0)
		}
		t0 := time.Now()
		for i := range per {
			if _, err := agents[as[i]].Check(ctx, domain, wl.descs[ks[i]:ks[i]+1], 1); err != nil {
				return latencyNS{}, err
			}
		}
		_ = h.RecordValue(max(int64(time.Since(t0))/per, 1))
	}
	return latencyOf(h), nil
}

// mergeEvents concatenates the workers' decision logs. The accuracy is
// computed from every decision, so a log that missed one is an error.
func mergeEvents(ws []*workerResult) ([]event, error) {
	n := 0
	for _, w := range ws {
		n += len(w.events)
		if w.unrecorded > 0 {
			return nil, fmt.Errorf("%d checks were not recorded (event log full)", w.unrecorded)
		}
	}
	out := make([]event, 0, n)
	for _, w := range ws {
		out = append(out, w.events...)
		w.events = nil
	}
	return out, nil
}
