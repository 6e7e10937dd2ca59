package agent

import (
	"math"
	"testing"
	"time"
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
		s.clock.advance(s.cfg.RefillInterval)
		n, _, _ := s.fake.counts()
		s.step()
		if m, _, _ := s.fake.counts(); m > n {
			for _, k := range s.fake.lastAcquire().Keys {
				reports, wants = append(reports, k.Demand), append(wants, k.Want)
			}
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

// TestWantFor: one lease horizon plus the refill's lead time, rounded up
// once; build floors it at one token.
func TestWantFor(t *testing.T) {
	tick, lat := 50*time.Millisecond, 0.01
	for _, c := range []struct {
		d    float64
		want int64
	}{
		{0, 0}, {0.25, 1}, {0.9, 1}, {1.2, 2}, {11.2, 13}, {1000, 1110},
	} {
		if got := wantFor(c.d, tick, lat); got != c.want {
			t.Errorf("wantFor(%v/s) = %d, want %d", c.d, got, c.want)
		}
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
		s.clock.advance(s.cfg.RefillInterval)
		n, _, _ := s.fake.counts()
		s.step()
		if m, _, _ := s.fake.counts(); m > n {
			for _, k := range s.fake.lastAcquire().Keys {
				reports, wants = append(reports, k.Demand), append(wants, k.Want)
			}
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
		s.clock.advance(s.cfg.RefillInterval)
		n, _, _ := s.fake.counts()
		s.step()
		if m, _, _ := s.fake.counts(); m > n && i >= 161 {
			for _, k := range s.fake.lastAcquire().Keys {
				reports = append(reports, k.Demand)
			}
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
