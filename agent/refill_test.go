package agent

import (
	"context"
	"testing"
	"time"

	"github.com/allot/allot/agent/internal/policy"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestRetryUsesSameRequestID: an Acquire whose answer was lost is retried
// with the same request id; the allocator answers from its record, so the
// charge is applied once and the grant counted once.
func TestRetryUsesSameRequestID(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "r")
	for range 5 {
		check(t, s.Agent, d)
	}
	s.fake.with(func(f *fakeAllocator) { f.dropReplies = 1 })
	s.step() // applied, answer lost
	s.step() // retried
	s.fake.mu.Lock()
	reqs := append(s.fake.acquires[:0:0], s.fake.acquires...)
	applied := s.fake.applied
	s.fake.mu.Unlock()
	if len(reqs) != 2 || reqs[0].RequestId != reqs[1].RequestId {
		t.Fatalf("calls %d, ids %v; want the same request twice", len(reqs), ids(reqs))
	}
	if applied != 1 {
		t.Fatalf("applied %d times, want 1", applied)
	}
	ks := keyOf(t, s.Agent, d)
	want := reqs[0].Keys[0].Want
	if b := ks.balance.Load(); b != want {
		t.Fatalf("balance %d, want %d (granted once)", b, want)
	}
	if rem := s.fake.bucketRemaining(t, "test:api_key=r"); rem != 50-5-want {
		t.Fatalf("global remaining %d, want %d (charged once)", rem, 50-5-want)
	}
	// The next request gets a new, larger id.
	check(t, s.Agent, d)
	ks.charged.Store(1)
	s.step()
	if last := s.fake.lastAcquire(); last.RequestId <= reqs[0].RequestId {
		t.Fatalf("next id %d, want > %d", last.RequestId, reqs[0].RequestId)
	}
}

// TestRejectedBatchKeepsCharges: an Acquire the allocator rejects (applied
// nothing) puts its charges back; its keys wait, then go one per call so a
// key the allocator refuses cannot starve the others.
func TestRejectedBatchKeepsCharges(t *testing.T) {
	s := newStepped(t)
	d, d2 := desc("api_key", "rj"), desc("api_key", "rj2")
	for range 4 {
		check(t, s.Agent, d)
	}
	check(t, s.Agent, d2)
	s.fake.with(func(f *fakeAllocator) { f.rejectNext = 1 })
	s.step()
	if n := len(s.fake.lastAcquire().Keys); n != 2 {
		t.Fatalf("first call had %d keys, want 2", n)
	}
	ks := keyOf(t, s.Agent, d)
	if c := ks.charged.Load(); c != 4 {
		t.Fatalf("charged %d after a rejected call, want 4", c)
	}
	if s.breakerOpen.Load() || s.rf.core.Failures() != 0 {
		t.Fatalf("a rejection counted as a transport failure")
	}
	calls, _, _ := s.fake.counts()
	s.clock.advance(s.cfg.ScanInterval)
	s.step()
	if c, _, _ := s.fake.counts(); c != calls {
		t.Fatalf("rejected keys resent before their hold time")
	}
	s.clock.advance(policy.NotLeasedRetry)
	s.step()
	s.fake.mu.Lock()
	last2 := s.fake.acquires[len(s.fake.acquires)-2:]
	s.fake.mu.Unlock()
	if len(last2[0].Keys) != 1 || len(last2[1].Keys) != 1 {
		t.Fatalf("after the hold: calls with %d and %d keys, want one key each", len(last2[0].Keys), len(last2[1].Keys))
	}
	if rem := s.fake.bucketRemaining(t, "test:api_key=rj"); rem > 50-4 {
		t.Fatalf("global remaining %d, want ≤ 46 (the charge delivered)", rem)
	}
	if ks.Suspect {
		t.Fatalf("key still suspect after a successful call")
	}
}

// TestBreakerOpensChargesAndRecovers: after FailureThreshold failures the
// breaker opens; fallback admissions made while open are not charged after
// recovery, those made before are.
func TestBreakerOpensChargesAndRecovers(t *testing.T) {
	// A scan at every tick 1 ms apart (ticks at one instant scan once).
	s := newSteppedWith(t, func(c *Config) { c.RefillInterval, c.ScanInterval = time.Millisecond, time.Millisecond })
	d := desc("api_key", "b")
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1 << 30 })
	check(t, s.Agent, d)
	check(t, s.Agent, d) // 2 charged while the allocator is believed reachable
	for i := 0; i < s.cfg.FailureThreshold; i++ {
		if s.breakerOpen.Load() {
			t.Fatalf("breaker open after %d failures, threshold %d", i, s.cfg.FailureThreshold)
		}
		s.step()
	}
	if !s.breakerOpen.Load() {
		t.Fatalf("breaker closed after %d failures", s.cfg.FailureThreshold)
	}
	// While open: decided by the fallback, not charged but counted for
	// the outage charge.
	for range 3 {
		if got := check(t, s.Agent, d); !got.Allowed || got.Source != SourceFallback {
			t.Fatalf("while open: %+v", got)
		}
	}
	ks := keyOf(t, s.Agent, d)
	if c, o := ks.charged.Load(), ks.outage.Load(); c != 0 || o != 3 {
		// the first two are in the unacknowledged batch
		t.Fatalf("charged %d, outage %d while open, want 0 and 3", c, o)
	}
	// Not yet time to probe: no call, even when a scan picks a key.
	other := desc("api_key", "other")
	check(t, s.Agent, other)
	s.clock.advance(time.Millisecond)
	calls, _, _ := s.fake.counts()
	s.step()
	if c, _, _ := s.fake.counts(); c != calls {
		t.Fatalf("called the allocator before the probe time")
	}
	if keyOf(t, s.Agent, other).Inflight {
		t.Fatalf("a key picked while waiting to probe stays in flight")
	}
	// Recover.
	s.fake.with(func(f *fakeAllocator) { f.failNext = 0 })
	s.clock.advance(s.cfg.MaxProbeBackoff)
	s.step()
	if s.breakerOpen.Load() {
		t.Fatalf("breaker still open after a successful probe")
	}
	// The retried call asked for nothing (its want predates the outage):
	// only the 2 pre-outage admissions are charged, nothing is granted.
	if rem, bal := s.fake.bucketRemaining(t, "test:api_key=b"), ks.balance.Load(); rem != 48 || bal != 0 {
		t.Fatalf("after the retry: global remaining %d, balance %d; want 48, 0", rem, bal)
	}
	// The next call reports the 3 outage admissions ahead of its want.
	s.clock.advance(time.Millisecond)
	s.step()
	if rem := s.fake.bucketRemaining(t, "test:api_key=b"); rem != 50-2-3-ks.balance.Load() {
		t.Fatalf("global remaining %d, want %d (2 charged, 3 outage-charged, the rest granted)", rem, 50-2-3-ks.balance.Load())
	}
	if got := check(t, s.Agent, d); got.Source != SourceLease {
		t.Fatalf("after recovery: source %v, want lease", got.Source)
	}
	s.clock.advance(time.Millisecond)
	s.step()
	if ks := keyOf(t, s.Agent, other); !ks.leased.Load() {
		t.Fatalf("the key picked during the outage was never sent")
	}
}

// TestFailClosedDeniesWhileUnreachable: failure_mode closed denies once the
// breaker is open and no lease is left; open rules keep deciding locally.
func TestFailClosedDeniesWhileUnreachable(t *testing.T) {
	s := newStepped(t)
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1 << 30 })
	check(t, s.Agent, desc("api_key", "first")) // something to send
	for range s.cfg.FailureThreshold {
		s.step()
	}
	if !s.breakerOpen.Load() {
		t.Fatalf("breaker not open")
	}
	got := check(t, s.Agent, desc("closed", "c"))
	if got.Allowed || got.RetryAfter < time.Second {
		t.Fatalf("closed rule: %+v, want denied with RetryAfter ≥ 1s", got)
	}
	if got := check(t, s.Agent, desc("api_key", "o")); !got.Allowed || got.Source != SourceFallback {
		t.Fatalf("open rule: %+v, want allowed by the fallback", got)
	}
}

// TestIdleKeyHandsBackAndIsForgotten: an idle key returns its balance and
// is dropped from the table.
func TestIdleKeyHandsBackAndIsForgotten(t *testing.T) {
	s := newStepped(t)
	s.fake.with(func(f *fakeAllocator) { f.ttl = time.Minute })
	d := desc("api_key", "idle")
	check(t, s.Agent, d)
	ks := keyOf(t, s.Agent, d)
	ks.Demand.Rate = 10 // ask for a sizeable lease
	s.step()
	bal := ks.balance.Load()
	if bal < 2 {
		t.Fatalf("balance %d, want a sizeable lease", bal)
	}
	s.clock.advance(s.cfg.IdleTimeout)
	s.step()
	last := s.fake.lastAcquire()
	if len(last.Keys) != 1 || last.Keys[0].Returned != bal || last.Keys[0].Want != 0 {
		t.Fatalf("idle report %+v, want returned %d, want 0", last.Keys, bal)
	}
	s.clock.advance(s.cfg.ScanInterval)
	s.step()
	if keyOf(t, s.Agent, d) != nil {
		t.Fatalf("idle key still tracked")
	}
	if rem := s.fake.bucketRemaining(t, "test:api_key=idle"); rem != 49 {
		t.Fatalf("global remaining %d, want 49 (the unspent lease credited back)", rem)
	}
}

// TestCloseReleasesLeases: Close hands back every balance in one Release
// with all=true; Close twice is fine.
func TestCloseReleasesLeases(t *testing.T) {
	s := newStepped(t)
	d1, d2 := desc("api_key", "c1"), desc("api_key", "c2")
	check(t, s.Agent, d1)
	check(t, s.Agent, d2)
	keyOf(t, s.Agent, d1).Demand.Rate = 5
	keyOf(t, s.Agent, d2).Demand.Rate = 5
	s.step()
	b1, b2 := keyOf(t, s.Agent, d1).balance.Load(), keyOf(t, s.Agent, d2).balance.Load()
	check(t, s.Agent, d1) // one more spent from the lease
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	s.fake.mu.Lock()
	rel := s.fake.releases
	s.fake.mu.Unlock()
	if len(rel) != 1 || !rel[0].All {
		t.Fatalf("releases %v, want one with all", rel)
	}
	var returned int64
	for _, k := range rel[0].Keys {
		returned += k.Returned
	}
	if returned != b1-1+b2 {
		t.Fatalf("returned %d, want %d", returned, b1-1+b2)
	}
	if rem := s.fake.bucketRemaining(t, "test:api_key=c1"); rem != 48 {
		t.Fatalf("c1 global remaining %d, want 48", rem)
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

// TestRejectedRetryKeepsReturnedTokens: a rejected call applied nothing,
// so what its keys carried goes back to them; but a rejected retry (the
// same request id after a lost answer) may follow a first attempt that
// was applied, whose returned tokens the allocator credited already: its
// charges go back (at worst charged twice), its returned tokens do not
// (restoring them would admit them twice).
func TestRejectedRetryKeepsReturnedTokens(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "rr")
	check(t, s.Agent, d)
	s.step()
	ks := keyOf(t, s.Agent, d)
	if ks.expiry.Load() <= s.loopNow() {
		t.Fatal("the key holds no lease")
	}
	checkUndone(t, "rejected", ks, func(k *allotv1.KeyAcquire, retried bool) {
		s.reject(&batch{req: &allotv1.AcquireRequest{Keys: []*allotv1.KeyAcquire{k}}, keys: []*keyState{ks}, retried: retried}, false, false)
	})
}

// checkUndone checks what undo (the agent's handling of a call that did
// not apply its entry k: rejected, or answered MOVED) gives back to ks:
// the charges always, the returned tokens only when the call was not a
// retry (retried false), whose first attempt may have been applied.
func checkUndone(t *testing.T, what string, ks *keyState, undo func(k *allotv1.KeyAcquire, retried bool)) {
	t.Helper()
	for _, retried := range []bool{true, false} {
		balance, charged := ks.balance.Load(), ks.charged.Load()
		undo(&allotv1.KeyAcquire{Returned: 10, Charged: 3}, retried)
		wantBalance := balance + 10
		if retried {
			wantBalance = balance
		}
		if got := ks.balance.Load(); got != wantBalance {
			t.Errorf("%s, retried %v: balance %d, want %d", what, retried, got, wantBalance)
		}
		if got := ks.charged.Load(); got != charged+3 {
			t.Errorf("%s, retried %v: charged %d, want %d", what, retried, got, charged+3)
		}
	}
}
