package fault

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
)

// TestAgentClockJumps: an in-process agent whose clock (agent.Config.Now)
// jumps 5 s backwards, then 15 s forwards (to 10 s ahead, past every lease
// TTL; 30 s and 40 s with ALLOT_SOAK=1), shares four keys with a steady
// agent, against three real allocator processes. (The gateway binary has
// no clock hook; in production the agent's coarse clock is derived from
// the monotonic clock, so a wall-clock step never reaches it. The hook
// injects the jump anyway, to show the algorithm tolerates it.)
//
// No panic and no Check error; the two agents together admit no more than
// the limiter's B + R·T plus the debt floor B; the jumpy agent leases again
// after each jump (after a backward jump, within the jump's length plus
// the usual recovery: deadlines it computed before the jump, such as an
// EXHAUSTED key's retry time, stretch by the jump); and after the forward
// jump, which is longer than every lease TTL, no token of a lease acquired
// before it is spent: a lease is measured from its Acquire's send time on
// the agent's clock.
func TestAgentClockJumps(t *testing.T) {
	checkLeaks(t)
	e := newEnv(t, envConfig{})
	var offset atomic.Int64
	jumpyReg, steadyReg := prometheus.NewRegistry(), prometheus.NewRegistry()
	newAgent := func(id string, reg *prometheus.Registry, now func() int64) *agent.Agent {
		cfg := agent.DefaultConfig()
		cfg.ID, cfg.Allocators, cfg.Registerer, cfg.Now = id, e.c.GRPCAddrs(), reg, now
		a, err := agent.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = a.Close(ctx)
		})
		testproc.Eventually(t, 30*time.Second, id+" ready", a.Ready)
		return a
	}
	jumpy := newAgent("jumpy", jumpyReg, func() int64 { return time.Now().UnixNano() + offset.Load() })
	steady := newAgent("steady", steadyReg, nil)

	keys := make([]string, 4)
	for i := range keys {
		keys[i] = fmt.Sprintf("clock-k%d", i)
	}
	load := &agentLoad{agents: []*agent.Agent{jumpy, steady}, keys: keys}
	load.start(100) // per agent and second
	t.Cleanup(load.stop)

	leaseAllowed := func(reg *prometheus.Registry) float64 {
		return gathered(t, reg, "allot_agent_decisions_total", map[string]string{"source": "lease", "result": "allowed"})
	}
	okCalls := func() float64 {
		return gathered(t, jumpyReg, "allot_agent_acquire_calls_total", map[string]string{"result": "ok"})
	}
	for _, reg := range []*prometheus.Registry{jumpyReg, steadyReg} {
		testproc.Eventually(t, 30*time.Second, "both agents deciding from leases", func() bool { return leaseAllowed(reg) > 0 })
	}
	load.waitChecks(t, 300)

	back, ahead := 5*time.Second, 10*time.Second
	if soak() {
		back = 30 * time.Second
	}
	// Backwards.
	before := leaseAllowed(jumpyReg)
	backAt := time.Now()
	offset.Store(int64(-back))
	testproc.Eventually(t, back+recoveryBound, "jumpy leasing after the backward jump", func() bool { return leaseAllowed(jumpyReg) > before+20 })
	recBack := time.Since(backAt)
	load.waitChecks(t, 500)

	// Forwards, to 10 s past real time: longer than every lease TTL
	// (FastLeaseArgs: 4 s at most). The first check must not spend a lease
	// acquired before the jump.
	okPre := okCalls()
	before = leaseAllowed(jumpyReg)
	fwdAt := time.Now()
	offset.Store(int64(ahead))
	d, err := jumpy.Check(context.Background(), "fault", []agent.Descriptor{{Entries: []rules.Entry{{Key: "api_key", Value: keys[0]}}}}, 1)
	if err != nil {
		t.Fatal(err)
	}
	if d.Source == agent.SourceLease && okCalls() == okPre {
		t.Errorf("right after a forward jump past every lease TTL, a check spent a lease acquired before it")
	}
	t.Logf("first check after the forward jump: allowed=%v source=%v", d.Allowed, d.Source)
	testproc.Eventually(t, recoveryBound, "jumpy leasing after the forward jump", func() bool { return leaseAllowed(jumpyReg) > before+20 })
	recFwd := time.Since(fwdAt)
	load.waitChecks(t, 500)
	load.stop()
	t.Logf("leasing again %v after the backward jump, %v after the forward jump", recBack, recFwd)

	res := load.results()
	// Per phase, what each agent admitted (the jumpy one's share shows
	// whether a jump costs it availability).
	phases := []struct {
		name     string
		from, to int64
	}{{"before", 0, backAt.UnixNano()}, {"after −" + back.String(), backAt.UnixNano(), fwdAt.UnixNano()},
		{"after +" + (back + ahead).String(), fwdAt.UnixNano(), 1 << 62}}
	for _, ph := range phases {
		var allowed, checked [2]int
		deniedBy := map[agent.Source]int{}
		for _, r := range res {
			if r.at >= ph.from && r.at < ph.to {
				checked[r.agent]++
				if r.allowed {
					allowed[r.agent]++
				} else if r.agent == 0 {
					deniedBy[r.source]++
				}
			}
		}
		t.Logf("%s: jumpy admitted %d of %d checks (denied by lease/exhausted %d, by fallback %d), steady %d of %d",
			ph.name, allowed[0], checked[0], deniedBy[agent.SourceLease], deniedBy[agent.SourceFallback], allowed[1], checked[1])
	}
	first, last := res[0].at, res[0].at
	for _, r := range res {
		first, last = min(first, r.at), max(last, r.at)
	}
	span := time.Duration(last - first)
	ceiling := keyBurst + keyRate*span.Seconds()
	bound := ceiling + keyBurst
	// Neither agent should lose the allocator; if one did (an overloaded
	// machine), its uncharged fallback is the fail-open allowance, counted
	// here for the whole span.
	openings := gathered(t, jumpyReg, "allot_agent_breaker_transitions_total", map[string]string{"to": "open"}) +
		gathered(t, steadyReg, "allot_agent_breaker_transitions_total", map[string]string{"to": "open"})
	if openings > 0 {
		nAgents := float64(e.liveAgents())
		bound += openings*math.Ceil(keyBurst/nAgents) + math.Ceil(keyRate*span.Seconds()/nAgents)
		t.Logf("note: breakers opened %v times; bound widened to %.0f", openings, bound)
	}
	worst := -ceiling
	for k, key := range keys {
		admitted := [2]int{}
		for _, r := range res {
			if r.key == k && r.allowed {
				admitted[r.agent]++
			}
		}
		total := admitted[0] + admitted[1]
		t.Logf("key %s: admitted %d (jumpy %d, steady %d) in %.1fs; B+R·T = %.0f; over-admission %+.0f; bound %.0f",
			key, total, admitted[0], admitted[1], span.Seconds(), ceiling, float64(total)-ceiling, bound)
		if float64(total) > bound {
			t.Errorf("key %s: admitted %d > bound %.0f", key, total, bound)
		}
		worst = max(worst, float64(total)-ceiling)
	}
	if n := load.errs.Load(); n != 0 {
		t.Errorf("%d checks returned an error", n)
	}
	rep := &report{
		fault:     "agent clock −" + back.String() + ", then +" + (back + ahead).String() + " (agent.Config.Now)",
		bound:     "B+R·T + B; no lease spent past its send-time TTL",
		worstOver: worst, worstFrac: worst / ceiling,
		recovery: max(recBack, recFwd), requests: len(res),
	}
	rep.log(t)
}

// agentLoad checks keys round-robin from in-process agents.
type agentLoad struct {
	agents []*agent.Agent
	keys   []string

	mu     sync.Mutex // guards res
	res    []check
	errs   atomic.Int64
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type check struct {
	agent, key int
	at         int64 // Unix ns (real time)
	allowed    bool
	source     agent.Source
}

func (l *agentLoad) start(perSecond int) {
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	for ai, a := range l.agents {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			t := time.NewTicker(time.Second / time.Duration(perSecond))
			defer t.Stop()
			descs := make([][]agent.Descriptor, len(l.keys))
			for k, key := range l.keys {
				descs[k] = []agent.Descriptor{{Entries: []rules.Entry{{Key: "api_key", Value: key}}}}
			}
			for i := 0; ; i++ {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				k := i % len(l.keys)
				d, err := a.Check(ctx, "fault", descs[k], 1)
				if err != nil {
					l.errs.Add(1)
					continue
				}
				l.mu.Lock()
				l.res = append(l.res, check{agent: ai, key: k, at: time.Now().UnixNano(), allowed: d.Allowed, source: d.Source})
				l.mu.Unlock()
			}
		}()
	}
}

// stop ends the load; safe twice.
func (l *agentLoad) stop() {
	if l.cancel != nil {
		l.cancel()
	}
	l.wg.Wait()
}

func (l *agentLoad) results() []check {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]check(nil), l.res...)
}

// waitChecks waits until n more checks have been made.
func (l *agentLoad) waitChecks(t *testing.T, n int) {
	t.Helper()
	target := len(l.results()) + n
	testproc.Eventually(t, 30*time.Second, fmt.Sprintf("%d more checks", n), func() bool { return len(l.results()) >= target })
}

// gathered sums the samples of metric name whose labels include labels.
func gathered(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if matches(m, labels) {
				sum += value(m)
			}
		}
	}
	return sum
}

func matches(m *dto.Metric, labels map[string]string) bool {
	found := 0
	for _, lp := range m.GetLabel() {
		if v, ok := labels[lp.GetName()]; ok {
			if v != lp.GetValue() {
				return false
			}
			found++
		}
	}
	return found == len(labels)
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Untyped != nil:
		return m.GetUntyped().GetValue()
	}
	return 0
}
