package state

import (
	"testing"
	"time"

	"pgregory.net/rapid"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// outageKey is a KeyAcquire of key big=v (100/s, burst 100) reporting
// outage fallback admissions.
func outageKey(v string, want, outage int64) *allotv1.KeyAcquire {
	k := ka("big", v, want, 0, 0, 0)
	k.OutageCharged = outage
	return k
}

// Regression (a full-cluster crash handed out a second burst): a key
// drained at t0, an outage during which the agents' fallback buckets admit
// 600 tokens, the allocator back at t6. The bucket refilled to its burst
// meanwhile; the outage charge takes that refill, so the first grant after
// recovery is empty, and the key refills at its rate from then on (no
// debt).
func TestOutageChargePaysRefill(t *testing.T) {
	s := newTestState(t)
	steps := []struct {
		at          time.Duration
		want        int64
		outage      int64
		granted     int64
		remaining   int64
		status      allotv1.KeyStatus
		description string
	}{
		{0, 100, 0, 100, 0, allotv1.KeyStatus_KEY_STATUS_OK, "drain the bucket"},
		{6 * time.Second, 100, 600, 0, 0, allotv1.KeyStatus_KEY_STATUS_EXHAUSTED, "outage charge takes the refill (burst 100) and no more"},
		{6500 * time.Millisecond, 100, 0, 50, 0, allotv1.KeyStatus_KEY_STATUS_OK, "0.5 s later: the rate's refill, not a debt"},
	}
	for i, st := range steps {
		resp := mustAcquire(t, s, at(st.at), "a", uint64(i+1), outageKey("x", st.want, st.outage))
		g := resp.GetGrants()[0]
		if g.GetGranted() != st.granted || g.GetRemaining() != st.remaining || g.GetStatus() != st.status {
			t.Fatalf("step %d (%s): granted %d remaining %d %v, want %d %d %v",
				i, st.description, g.GetGranted(), g.GetRemaining(), g.GetStatus(), st.granted, st.remaining, st.status)
		}
	}
	// The same outage reported as an ordinary charge would leave the key
	// in debt (−burst): nothing for a whole second after recovery.
	s = newTestState(t)
	mustAcquire(t, s, at(0), "a", 1, outageKey("x", 100, 0))
	mustAcquire(t, s, at(6*time.Second), "a", 2, ka("big", "x", 0, 0, 0, 600))
	if g := mustAcquire(t, s, at(6500*time.Millisecond), "a", 3, outageKey("x", 100, 0)).GetGrants()[0]; g.GetGranted() != 0 {
		t.Fatalf("ordinary charge: granted %d 0.5 s after recovery, want 0 (the debt the outage charge avoids)", g.GetGranted())
	}
}

// Over any outage and any outage fallback admissions f, reported by one or
// two agents in either order: what the allocator grants from the drained
// instant up to x after recovery, plus f, never exceeds R·T + B, unless f
// alone exceeds it (fail open admits what it admits: then nothing is
// granted until the recovery's refill); and the key is never left in debt
// by an outage charge, so x after recovery the bucket holds the refill of
// x (within one token). Tokens are whole and the bucket's arithmetic is
// exact (pkg/bucket), so the refill of T is ⌊R·T⌋, computed in integers
// here.
func TestPropertyOutageCharge(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		checkOutageCharge(rt,
			time.Duration(rapid.Int64Range(0, 20_000).Draw(rt, "outage_ms"))*time.Millisecond,
			time.Duration(rapid.Int64Range(1, 2_000).Draw(rt, "after_ms"))*time.Millisecond,
			rapid.Int64Range(0, 3000).Draw(rt, "fallback_a"),
			rapid.Int64Range(0, 3000).Draw(rt, "fallback_b"),
			rapid.Int64Range(0, 200).Draw(rt, "want"))
	})
}

// TestOutageChargeCases runs TestPropertyOutageCharge's check on fixed
// cases, on every run.
func TestOutageChargeCases(t *testing.T) {
	for _, c := range []struct {
		outage, after time.Duration
		fa, fb, want  int64
	}{
		// Regression (the bound computed in float64: 100·0.29 s is
		// 28.999…, truncated to 28, while the bucket refills exactly 29
		// tokens in 290 ms and granted them).
		{290 * time.Millisecond, time.Millisecond, 0, 0, 29},
		{6 * time.Second, 500 * time.Millisecond, 600, 0, 100},
		{700 * time.Millisecond, 10 * time.Millisecond, 30, 20, 200},
	} {
		checkOutageCharge(t, c.outage, c.after, c.fa, c.fb, c.want)
	}
}

// wholeRefill is what a bucket of rate tokens per second refills in d, in
// whole tokens: ⌊rate·d⌋.
func wholeRefill(rate int64, d time.Duration) int64 { return rate * int64(d) / int64(time.Second) }

// checkOutageCharge drains the key at 0, reports outage admissions fa
// (agent a) and fb (agent b, asking for want) after outage, and asks again
// after more: TestPropertyOutageCharge's bounds.
func checkOutageCharge(rt tb, outage, after time.Duration, fa, fb, want int64) {
	rt.Helper()
	const rate, burst = 100, 100
	s := newTestState(rt)
	granted := mustAcquire(rt, s, at(0), "a", 1, outageKey("x", burst, 0)).GetGrants()[0].GetGranted()
	if granted != burst {
		rt.Fatalf("initial drain granted %d, want %d", granted, burst)
	}
	back := at(outage)
	// Both agents report their outage admissions first, then ask.
	mustAcquire(rt, s, back, "a", 2, outageKey("x", 0, fa))
	g := mustAcquire(rt, s, back, "b", 1, outageKey("x", want, fb)).GetGrants()[0]
	if g.GetRemaining() < 0 {
		rt.Fatalf("remaining %d after the outage charges: debt", g.GetRemaining())
	}
	granted = g.GetGranted()
	refill := min(burst, wholeRefill(rate, outage))
	if f := fa + fb; granted+min(f, refill) > refill {
		rt.Fatalf("outage %v: granted %d at recovery after outage admissions %d against a refill of %d", outage, granted, f, refill)
	}
	// x later: the refill of x is there for the asking (no debt).
	g = mustAcquire(rt, s, back+int64(after), "a", 3, outageKey("x", burst, 0)).GetGrants()[0]
	if g.GetRemaining() < 0 {
		rt.Fatalf("remaining %d %v after recovery: debt", g.GetRemaining(), after)
	}
	// Granted plus remaining is what the bucket held before this grant.
	if held, least := g.GetGranted()+g.GetRemaining(), min(burst, wholeRefill(rate, after))-1; held < least {
		rt.Fatalf("the bucket held %d %v after recovery, want ≥ %d: the outage charge left a debt", held, after, least)
	}
}
