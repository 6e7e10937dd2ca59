package agent

import (
	"testing"
	"time"

	"github.com/allot/allot/agent/internal/policy"
)

// hotRules: one key at 100/s, burst 100 (B/(2R) = 500 ms: paced keys ask
// every policy.MaxPace).
const hotRules = `
domain: test
descriptors:
  - key: hot
    rate_limit:
      name: hot
      unit: second
      requests_per_unit: 100
      burst: 100
`

// spendBudget makes the key's global budget empty: 100 fallback admissions
// at first sight (N = 1), charged in the first Acquire, which then finds
// nothing to grant (EXHAUSTED).
func spendBudget(t *testing.T, s *steppedAgent, d Descriptor) *keyState {
	t.Helper()
	s.fake.with(func(f *fakeAllocator) { f.keyAgents = 50 }) // 50 × policy.PaceStep > policy.MaxPace
	for range 100 {
		if !check(t, s.Agent, d).Allowed {
			t.Fatal("a cold key's first burst was denied")
		}
	}
	s.step()
	ks := keyOf(t, s.Agent, d)
	if !ks.Paced {
		t.Fatalf("after an EXHAUSTED answer on a spent budget the key is not paced (deniedUntil in %v)",
			time.Duration(ks.deniedUntil.Load()-s.clock.now()))
	}
	return ks
}

// TestSpentBudgetPacesAsks pins issue #7's hot-key coordination: once the
// global budget is spent, a dry lease denies (the lease says no) until the
// key's paced ask, instead of admitting from the fallback bucket, owing a
// charge and calling on every refill tick (0.038 Acquire calls per admitted
// request with 200 agents in bench/sim). Nothing is charged while paced, no
// call is made before the paced time, and the ask at that time gets the
// budget's refill.
func TestSpentBudgetPacesAsks(t *testing.T) {
	s := newStepped(t, hotRules)
	d := desc("hot", "h")
	ks := spendBudget(t, s, d)
	calls, _, _ := s.fake.counts()
	ask := ks.RefreshAt
	if got := time.Duration(ask - s.clock.now()); got < policy.MaxPace/2 || got > policy.MaxPace {
		t.Fatalf("paced ask in %v, want %v jittered down to at most half (B/(2R) = 500 ms, policy.MaxPace)", got, policy.MaxPace)
	}
	tick := s.cfg.RefillInterval
	step := 0
	for s.clock.now()+int64(tick) < ask {
		s.clock.advance(tick)
		step++
		dec := check(t, s.Agent, d)
		if dec.Allowed || dec.Source != SourceLease || dec.RetryAfter <= 0 {
			t.Fatalf("step %d: check = %+v, want denied by the lease with a Retry-After", step, dec)
		}
		s.step()
		if c, _, _ := s.fake.counts(); c != calls {
			t.Fatalf("step %d: %d Acquire calls before the paced time, want none", step, c-calls)
		}
		if c := ks.charged.Load(); c != 0 {
			t.Fatalf("step %d: charged %d while paced, want 0", step, c)
		}
	}
	// At the paced time (the next scan) the key asks and gets the refill.
	for c, _, _ := s.fake.counts(); c == calls; c, _, _ = s.fake.counts() {
		if s.clock.now() > ask+int64(s.cfg.ScanInterval) {
			t.Fatalf("no Acquire by %v after the paced time", time.Duration(s.clock.now()-ask))
		}
		s.clock.advance(tick)
		s.step()
	}
	last := s.fake.lastAcquire()
	if k := last.Keys[0]; k.Want <= 0 || k.Charged != 0 {
		t.Fatalf("paced ask: want %d charged %d, want > 0 and 0", k.Want, k.Charged)
	}
	if b := ks.balance.Load(); b <= 0 {
		t.Fatalf("balance %d after the paced ask, want the refill", b)
	}
	if !check(t, s.Agent, d).Allowed {
		t.Fatal("a check after the paced grant was denied")
	}
}

// TestPacedKeyFallsBackWhenUnreachable: pacing must not turn an unreachable
// allocator into denials. When the paced ask gets no answer, the dry lease
// stops denying after the grace and the fallback bucket decides (fail
// open), as for any key.
func TestPacedKeyFallsBackWhenUnreachable(t *testing.T) {
	s := newStepped(t, hotRules)
	d := desc("hot", "h")
	ks := spendBudget(t, s, d)
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1 << 20 })
	until := ks.deniedUntil.Load()
	if grace := time.Duration(until - ks.RefreshAt); grace <= 0 || grace > time.Second {
		t.Fatalf("deny grace %v past the paced ask, want in (0, 1s]", grace)
	}
	for s.clock.now() < until {
		s.clock.advance(s.cfg.RefillInterval)
		s.step()
	}
	s.clock.advance(s.cfg.RefillInterval)
	dec := check(t, s.Agent, d)
	if !dec.Allowed || dec.Source != SourceFallback {
		t.Fatalf("check after the grace with the allocator unreachable = %+v, want allowed by the fallback", dec)
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
