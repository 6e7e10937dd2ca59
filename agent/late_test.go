package agent

import (
	"fmt"
	"testing"
	"time"
)

// fleet is n stepped agents sharing one fake allocator and one fake clock.
type fleet struct {
	clock  *fakeClock
	fake   *fakeAllocator
	agents []*Agent
}

func newFleet(t *testing.T, n int, yamls ...string) *fleet {
	t.Helper()
	clock := newFakeClock()
	fake := newFake(t, clock.now, yamls...)
	srv := serveFake(t, fake)
	fl := &fleet{clock: clock, fake: fake}
	for i := range n {
		cfg := DefaultConfig()
		cfg.ID = fmt.Sprintf("agent-%d", i)
		cfg.Allocators = []string{srv.addr}
		cfg.Now = clock.now
		cfg.Rules = mustCompile(t, 0, yamls...)
		cfg.CallTimeout = 5 * time.Second // a slow CI machine must not fail a call
		cfg.manual = true
		fl.agents = append(fl.agents, newAgent(t, cfg))
	}
	// Two rounds of an Acquire each: every agent learns that n agents
	// are live, as a warm gateway knows.
	for range 2 {
		for _, a := range fl.agents {
			check(t, a, desc("hot", "warm-up"))
			a.refillOnce(t.Context())
		}
	}
	for _, a := range fl.agents {
		if got := a.liveAgents.Load(); got != uint32(n) {
			t.Fatalf("an agent knows %d live agents, want %d", got, n)
		}
	}
	return fl
}

// TestLateRefillsHoldTheLimit pins the over-admission bench/load measured
// on a CPU-starved machine (-burn): agents whose refills were merely late
// (the allocator reachable, the breaker closed) admitted from fallback
// buckets that refilled at R/N each on their own clocks, and kept the
// promises of those buckets' denials, beside the leases the allocator kept
// granting to the other agents; the charges for both took the global
// bucket to its debt floor of −B, and what went beyond it was forgiven.
// Here eight agents each see 200 requests/s on a key of 100/s (burst 100),
// and each runs its refill loop only every 500 ms (instead of every
// 50 ms), staggered. Over every 10 s window the fleet must admit at most
// R·10 s + B, +1%, and once the cold start is paid for, at least R·T, −1%.
func TestLateRefillsHoldTheLimit(t *testing.T) {
	const (
		agents   = 8
		perTick  = 2 // checks per agent per 10 ms tick: 200/s each
		tick     = 10 * time.Millisecond
		late     = 50 // ticks between two refill steps of one agent: 500 ms
		duration = 1400
		window   = 1000 // ticks: 10 s
		warm     = 300  // ticks: 3 s
		r, b     = 100, 100
	)
	fl := newFleet(t, agents, hotRules)
	d := desc("hot", "k")
	admitted := make([]int, duration) // per tick
	bySrc := map[Source]int{}
	defer func() { t.Logf("by source %v; books %+v", bySrc, fl.fake.booksOf("test:hot=k")) }()
	for tk := range duration {
		for i, a := range fl.agents {
			for range perTick {
				if dec := check(t, a, d); dec.Allowed {
					admitted[tk]++
					bySrc[dec.Source]++
				}
			}
			if (tk+i*late/agents)%late == 0 {
				a.refillOnce(t.Context())
			}
		}
		fl.clock.advance(tick)
	}
	for sec := 0; sec < duration/100; sec++ {
		n := 0
		for _, x := range admitted[sec*100 : sec*100+100] {
			n += x
		}
		t.Logf("DBG second %d: %d", sec, n)
	}
	worst, at := 0, 0
	sum := 0
	for tk := range duration {
		sum += admitted[tk]
		if tk >= window {
			sum -= admitted[tk-window]
		}
		if tk >= window-1 {
			if sum > worst {
				worst, at = sum, tk-window+1
			}
		}
	}
	limit := r*window/100 + b
	t.Logf("admitted per 10 s window: most %d (from t=%v); bound %d", worst, time.Duration(at)*tick, limit)
	if worst > limit+limit/100 {
		t.Errorf("a 10 s window from t=%v admitted %d, more than R·10 s + B = %d (+1%%)", time.Duration(at)*tick, worst, limit)
	}
	// After the cold start's fallback burst has been charged and paid
	// for (the first second), the key must run at R.
	steady := 0
	for _, x := range admitted[warm:] {
		steady += x
	}
	if floor := r * (duration - warm) / 100; steady < floor-floor/100 {
		t.Errorf("admitted %d from t=%v on, under R·T = %d (−1%%): late refills must not starve a key", steady, time.Duration(warm)*tick, floor)
	}
}

// TestHeldFallbackFailsOpenAfterTheBucketFills: a key whose answer found
// its budget spent has its fallback bucket held (no refill) while its
// refill is late, and only for as long as the key's bucket takes to fill
// (B/R, 1 s here): past that, with still no answer, the fallback refills
// at R/N again, so an allocator that stopped answering fails open.
func TestHeldFallbackFailsOpenAfterTheBucketFills(t *testing.T) {
	fl := newFleet(t, 2, hotRules)
	d := desc("hot", "k")
	// Agent 1 admits its fallback's burst, ⌈100/2⌉; its charge and grant
	// take the rest of the budget. Agent 0 then admits one, and its
	// charge finds the budget spent: EXHAUSTED, not paced (the retry is
	// short).
	for range 50 {
		if !check(t, fl.agents[1], d).Allowed {
			t.Fatal("a cold key's first burst was denied")
		}
	}
	fl.agents[1].refillOnce(t.Context())
	a := fl.agents[0]
	if !check(t, a, d).Allowed {
		t.Fatal("a cold key's first request was denied")
	}
	a.refillOnce(t.Context())
	ks := keyOf(t, a, d)
	ks.mu.Lock()
	spent, at := ks.fbSpent, ks.fbAt
	ks.mu.Unlock()
	if !spent || ks.Paced {
		t.Fatalf("after the charges the answer did not find the budget spent (spent %v, paced %v)", spent, ks.Paced)
	}
	for _, after := range []time.Duration{50 * time.Millisecond, 500 * time.Millisecond, 990 * time.Millisecond} {
		fl.clock.ns.Store(at + int64(after))
		if got := check(t, a, d); got.Allowed {
			t.Fatalf("%v after the answer, no refill landed: %+v, want denied (the held fallback has ⌈0/2⌉ tokens)", after, got)
		}
	}
	fl.clock.ns.Store(at + int64(1100*time.Millisecond))
	if got := check(t, a, d); !got.Allowed || got.Source != SourceFallback {
		t.Fatalf("1.1 s after the answer (past B/R) with no answer since: %+v, want allowed by the fallback", got)
	}
}

// TestPacedFallbackStartsAtTheGrace: a paced key's dry lease denies until
// its ask is answered plus a grace; when the answer is later than that,
// the fallback bucket decides, and it starts from the share of the
// remaining the last answer reported at the end of the grace, not refilled
// since that answer: the refill of the paced time belongs to the paced
// ask's grant. A fallback refilled since the answer admitted the whole
// pace and grace at R/N at once, for every agent, on every late answer.
func TestPacedFallbackStartsAtTheGrace(t *testing.T) {
	s := newStepped(t, hotRules)
	d := desc("hot", "h")
	ks := spendBudget(t, s, d) // paced; N = 1: the fallback is 100/s, burst 100
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1 << 20 })
	until := ks.deniedUntil.Load()
	for s.clock.now() < until {
		s.clock.advance(s.cfg.RefillInterval)
		s.step()
	}
	s.clock.advance(s.cfg.RefillInterval)
	late := time.Duration(s.clock.now() - until)
	admitted := 0
	for range 200 {
		if check(t, s.Agent, d).Allowed {
			admitted++
		}
	}
	// ⌈remaining/N⌉ = 0 at the answer, then R·late.
	if most := int(late.Seconds()*100) + 1; admitted < 1 || admitted > most {
		t.Fatalf("%v after the grace the fallback admitted %d, want 1 to %d (R·%v, fail open from the end of the grace)", late, admitted, most, late)
	}
}
