package agent

import (
	"math"
	"testing"
	"time"

	"github.com/allot/allot/agent/internal/policy"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestSparseKeyReportsItsRate pins issue #7's skew false rejects: a key
// this agent uses once every 4 s reported demand 4/s (one token since the
// last scan, spread over 250 ms) and asked for 5 tokens (2 once its
// estimate settled), so on a low-rate key shared by many gateways the
// lightly used agents' needs and claims filled the key's capacity and the
// busy agent was starved. It now reports at most its rate from the gaps
// between uses (0.25/s) and asks for one token.
func TestSparseKeyReportsItsRate(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "sparse")
	var reports []float64
	var wants []int64
	// 20 s of 50 ms refill ticks (a scan every other tick); a use every
	// 4 s, just before a tick without a scan, as a gateway's check lands
	// anywhere between scans.
	for i := range 400 {
		if i%80 == 1 {
			check(t, s.Agent, d)
		}
		for _, k := range s.tickAcquired() {
			reports, wants = append(reports, k.Demand), append(wants, k.Want)
		}
	}
	if len(reports) < 3 {
		t.Fatalf("%d reports of the key, want ≥ 3", len(reports))
	}
	// From the third use on the gap is known.
	for i, r := range reports[2:] {
		if r > 0.3 {
			t.Fatalf("report %d: demand %.3f/s for a key used every 4 s, want ≤ 0.3 (all: %v)", i+2, r, reports)
		}
	}
	for i, w := range wants[2:] {
		if w > 1 {
			t.Fatalf("report %d: want %d for a key used every 4 s, want ≤ 1 (all: %v)", i+2, w, wants)
		}
	}
}

// TestBusyKeyDemandUnchanged: the sparse rule leaves a busy key's demand
// (and a key that wakes up with many tokens at once) to the EWMA and the
// recent rate.
func TestBusyKeyDemandUnchanged(t *testing.T) {
	s := newStepped(t)
	d := desc("tier", "free", "route", "/x", "user", "busy") // 10⁹/s: never short
	var last float64
	for range 30 { // 3 s at 100 tokens per 100 ms = 1000/s
		for range 100 {
			check(t, s.Agent, d)
		}
		s.clock.advance(100 * time.Millisecond)
		s.step()
		for _, k := range s.fake.lastAcquire().Keys {
			last = k.Demand
		}
	}
	if math.Abs(last-1000)/1000 > 0.2 {
		t.Fatalf("busy key reported %.0f/s, want about 1000/s", last)
	}
}

// TestRebaseRoundsUp: a grant re-bases the fallback bucket to this agent's
// share of the global remaining rounded up, so with more agents than
// tokens left an agent that uses the key rarely keeps one token (rounding
// down emptied it), and never above the fallback's own burst.
func TestRebaseRoundsUp(t *testing.T) {
	s := newStepped(t)
	s.fake.with(func(f *fakeAllocator) { f.live = 20 })
	d := desc("api_key", "rb")
	check(t, s.Agent, d)
	s.step()
	ks := keyOf(t, s.Agent, d)
	rem := ks.remaining.Load()
	ks.mu.Lock()
	avail := ks.fbAvail
	ks.mu.Unlock()
	if want := (rem + 19) / 20; avail != want || want < 1 {
		t.Fatalf("fallback re-based to %d tokens with %d remaining over 20 agents, want ⌈%d/20⌉ = %d", avail, rem, rem, want)
	}
}

// TestKeyUsedOnceReportsNoDemand pins the full-scale skew bug: a gateway
// that saw a 20/s key once reported the EWMA just after the use (about
// 0.95/s) and asked for two tokens, so 199 such gateways outweighed the busy
// one in the allocator's shares. A key used once has no gap to measure a
// rate from: it reports no demand and asks for one token.
func TestKeyUsedOnceReportsNoDemand(t *testing.T) {
	s := newStepped(t)
	for range 4 { // scans are running when the key is first used
		s.clock.advance(s.cfg.RefillInterval)
		s.step()
	}
	check(t, s.Agent, desc("api_key", "once"))
	var reports []float64
	var wants []int64
	for range 40 {
		for _, k := range s.tickAcquired() {
			reports, wants = append(reports, k.Demand), append(wants, k.Want)
		}
	}
	if len(reports) == 0 {
		t.Fatal("the key was never reported")
	}
	for i := range reports {
		if reports[i] != 0 || wants[i] > 1 {
			t.Fatalf("report %d: demand %.3f/s, want %d for a key used once, want demand 0 and want ≤ 1 (demands %v, wants %v)", i, reports[i], wants[i], reports, wants)
		}
	}
}

// TestSparseKeyPairIsNotAWakeUp pins the skew false rejects at 20 agents: a
// key used about every 4 s got two requests within one scan and reported
// 8/s (two tokens over the 250 ms minimum window), claiming 9 tokens of a
// 20/s key. Tokens of a key used before are spread over the time since its
// previous use.
func TestSparseKeyPairIsNotAWakeUp(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "pair")
	var reports []float64
	for i := range 200 {
		switch i {
		case 1, 81:
			check(t, s.Agent, d)
		case 161:
			check(t, s.Agent, d)
			check(t, s.Agent, d)
		}
		keys := s.tickAcquired()
		if i < 161 {
			continue
		}
		for _, k := range keys {
			reports = append(reports, k.Demand)
		}
	}
	if len(reports) == 0 {
		t.Fatal("the key was not reported after the pair")
	}
	for i, r := range reports {
		if r > 1 {
			t.Fatalf("report %d after two uses in one scan of a key used every 4 s: demand %.3f/s, want ≤ 1 (all: %v)", i, r, reports)
		}
	}
}

// tickAcquired advances the clock one refill interval, runs a tick, and
// returns the keys of the Acquire it sent (none if it sent nothing).
func (s *steppedAgent) tickAcquired() []*allotv1.KeyAcquire {
	s.clock.advance(s.cfg.RefillInterval)
	n, _, _ := s.fake.counts()
	s.step()
	if m, _, _ := s.fake.counts(); m > n {
		return s.fake.lastAcquire().Keys
	}
	return nil
}

// busyDesc is a key under a 10⁹/s rule: never short, so only the demand
// decides what the agent reports.
var busyDesc = desc("tier", "free", "route", "/x", "user", "busy")

// driveRate runs ticks refill ticks of 50 ms with perTick checks of busyDesc
// before each, and returns the key's entries of the Acquires sent, with
// the tick each was sent at (counted from 0 at the call).
func driveRate(t *testing.T, s *steppedAgent, ticks, perTick int) (sent []int, keys []*allotv1.KeyAcquire) {
	t.Helper()
	for i := range ticks {
		for range perTick {
			check(t, s.Agent, busyDesc)
		}
		for _, k := range s.tickAcquired() {
			sent, keys = append(sent, i), append(keys, k)
		}
	}
	return sent, keys
}

// TestDemandDropReportedAtOnce pins issue #7's skew false rejects after a
// rotation: the gateway the load balancer moved a key's traffic away from
// held about a second of its old rate, so it asked for nothing for up to a
// second, and the allocator weighed its old demand (2200/s of a 5000/s
// key) against the gateway the traffic went to, whose allowance then fell
// short of its new rate. The rate's fall is now seen within a scan or two,
// reported at once, and the holding beyond twice the new target is handed
// back.
func TestDemandDropReportedAtOnce(t *testing.T) {
	s := newStepped(t)
	driveRate(t, s, 60, 100) // 3 s at 2000/s
	sent, keys := driveRate(t, s, 20, 10)
	if len(keys) == 0 || sent[0] > 4 {
		t.Fatalf("after the rate fell from 2000/s to 200/s the key was first reported at ticks %v, want within 4 ticks (200 ms)", sent)
	}
	k := keys[0]
	if k.Demand > 400 {
		t.Errorf("first report after the fall: demand %.0f/s, want ≤ 400 (the rate is 200/s)", k.Demand)
	}
	if k.Returned == 0 || k.Held > 2*policy.Want(k.Demand, s.cfg.RefillInterval, s.rf.core.Latency) {
		t.Errorf("first report after the fall: returned %d, held %d, want the holding beyond twice the target (%d) returned",
			k.Returned, k.Held, policy.Want(k.Demand, s.cfg.RefillInterval, s.rf.core.Latency))
	}
	if k.Want != 0 {
		t.Errorf("first report after the fall: want %d, want 0 (it still holds its target)", k.Want)
	}
	if n := len(keys); n > 2 {
		t.Errorf("%d reports in the 1 s after the fall, want at most 2 (one for the fall)", n)
	}
}

// TestDemandFallWhileDeniedIgnored: a key over its limit admits in
// bursts as its grants arrive, and its admitted count per scan drops while
// it waits; that is the limiter's doing, not a shift of its traffic, and
// it must not set the demand to the scan's count (bench/load -workload
// hot: the over-limit keys' claims flapped).
func TestDemandFallWhileDeniedIgnored(t *testing.T) {
	s := newStepped(t)
	driveRate(t, s, 60, 100) // 3 s at 2000/s
	ks := keyOf(t, s.Agent, busyDesc)
	ks.denied.Add(1) // a request denied since the last report
	before := ks.Demand.Rate
	driveRate(t, s, 4, 10)
	if ks.Demand.Rate < before/2 {
		t.Fatalf("demand %.0f/s after 200 ms of fewer admissions with denials, want the EWMA's (from %.0f/s)", ks.Demand.Rate, before)
	}
}
