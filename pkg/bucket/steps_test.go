package bucket

import (
	"fmt"
	"testing"
	"time"
)

// base is a realistic instant (2023-11-15T00:00:00Z) that is a multiple of a
// second, minute, hour and day, so window tests start on a boundary.
const base = int64(1_700_006_400) * int64(time.Second)

type opKind uint8

const (
	opAllow opKind = iota // AllowN; checks allowed, remaining, retry, reset
	opPeek                // Peek; checks allowed, remaining, retry, reset
	opTake                // TakeUpTo; checks took
	opGive                // GiveBack
	opDebit               // Debit
)

func (o opKind) String() string {
	return [...]string{"AllowN", "Peek", "TakeUpTo", "GiveBack", "Debit"}[o]
}

// step is one call at instant ts[t] (t0..t9).
type step struct {
	t    int
	op   opKind
	n    int64
	ok   bool
	rem  int64
	retr time.Duration
	rst  time.Duration
	took int64
}

func allow(t int, n int64, ok bool, rem int64, retry, reset time.Duration) step {
	return step{t: t, op: opAllow, n: n, ok: ok, rem: rem, retr: retry, rst: reset}
}

func peek(t int, ok bool, rem int64, retry, reset time.Duration) step {
	return step{t: t, op: opPeek, ok: ok, rem: rem, retr: retry, rst: reset}
}

func take(t int, n, took int64) step { return step{t: t, op: opTake, n: n, took: took} }
func give(t int, n int64) step       { return step{t: t, op: opGive, n: n} }
func debit(t int, n int64) step      { return step{t: t, op: opDebit, n: n} }

// runSteps applies steps to a fresh State; ts are offsets from base.
func runSteps(t *testing.T, l Limit, ts []time.Duration, steps []step) {
	t.Helper()
	var s State
	for i, st := range steps {
		now := base + int64(ts[st.t])
		call := fmt.Sprintf("step %d: %v(t%d, %d)", i, st.op, st.t, st.n)
		if st.op == opPeek {
			call = fmt.Sprintf("step %d: Peek(t%d)", i, st.t)
		}
		var r Result
		switch st.op {
		case opAllow:
			r = l.AllowN(&s, now, st.n)
		case opPeek:
			r = l.Peek(s, now)
		case opTake:
			if got := l.TakeUpTo(&s, now, st.n); got != st.took {
				t.Fatalf("%s = %d, want %d", call, got, st.took)
			}
			continue
		case opGive:
			l.GiveBack(&s, now, st.n)
			continue
		case opDebit:
			l.Debit(&s, now, st.n)
			continue
		}
		if r.Allowed != st.ok {
			t.Fatalf("%s = %v, want %v (%+v)", call, r.Allowed, st.ok, r)
		}
		if r.Remaining != st.rem {
			t.Fatalf("%s.Remaining = %d, want %d", call, r.Remaining, st.rem)
		}
		if r.RetryAfter != st.retr {
			t.Fatalf("%s.RetryAfter = %v, want %v", call, r.RetryAfter, st.retr)
		}
		if r.ResetAfter != st.rst {
			t.Fatalf("%s.ResetAfter = %v, want %v", call, r.ResetAfter, st.rst)
		}
	}
}

func mustLimit(t interface {
	Helper()
	Fatal(...any)
}, alg Algorithm, quota int64, window time.Duration, burst int64) Limit {
	t.Helper()
	l, err := NewLimit(alg, quota, window, burst)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

const (
	ms = time.Millisecond
	s  = time.Second
)

// The example rules: 30/minute with burst 10 admits 10 at once, then denies
// the 11th with RetryAfter exactly 2s (one token every 2s).
func TestDesignCard(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			l := mustLimit(t, alg, 30, time.Minute, 10)
			var st State
			for i := range 10 {
				if r := l.AllowN(&st, base, 1); !r.Allowed || r.Remaining != int64(9-i) {
					t.Fatalf("request %d: %+v, want allowed with %d remaining", i+1, r, 9-i)
				}
			}
			r := l.AllowN(&st, base, 1)
			if r.Allowed || r.RetryAfter != 2*s || r.Remaining != 0 || r.ResetAfter != 20*s {
				t.Fatalf("request 11: %+v, want denied, RetryAfter 2s, Remaining 0, ResetAfter 20s", r)
			}
			lim := NewLimiter(l)
			at := time.Unix(0, base)
			for i := range 10 {
				if !lim.AllowN(at, 1).Allowed {
					t.Fatalf("Limiter request %d denied", i+1)
				}
			}
			if r := lim.AllowN(at, 1); r.Allowed || r.RetryAfter != 2*s {
				t.Fatalf("Limiter request 11: %+v, want denied after 2s", r)
			}
		})
	}
}

// TokenBucket and GCRA run the same table: they are one limiter.
func TestTokenBucketSteps(t *testing.T) {
	ts := []time.Duration{0, 1 * s, 2 * s, 7 * s, 8 * s, 100 * s, 125 * s, 126 * s, 127 * s, 127*s + 1}
	steps := []step{
		allow(0, 5, true, 5, 0, 10*s),
		allow(0, 5, true, 0, 0, 20*s),
		allow(0, 1, false, 0, 2*s, 20*s),
		allow(0, 0, true, 0, 0, 20*s), // check without consuming
		allow(1, 1, false, 0, 1*s, 19*s),
		allow(2, 1, true, 0, 0, 20*s), // one token refilled
		allow(3, 3, false, 2, 1*s, 15*s),
		allow(4, 3, true, 0, 0, 20*s),
		peek(4, false, 0, 2*s, 20*s),
		peek(5, true, 10, 0, 0), // full again
		allow(5, 11, false, 10, Never, 0),
		debit(5, 25), // floored at −burst
		peek(5, false, -10, 22*s, 40*s),
		allow(5, 0, false, -10, 20*s, 40*s), // in debt: even a 0-check is denied
		take(6, 5, 2),                       // 25s refilled 12.5 tokens: −10 → 2.5
		peek(6, false, 0, 1*s, 19*s),        // 0.5 left: 9.5 tokens to full
		give(6, 1),
		peek(6, true, 1, 0, 17*s),
		give(6, 100), // capped at burst
		peek(6, true, 10, 0, 0),
		take(7, 100, 10),
		debit(8, 3), // 0.5 refilled, 3 debited: −2.5
		peek(8, false, -3, 7*s, 25*s),
		give(9, 2), // 1ns later: −0.5 + 0.5·10⁻⁹
		peek(9, false, -1, 3*s-1, 21*s-1),
		take(9, 1, 0),
	}
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			runSteps(t, mustLimit(t, alg, 30, time.Minute, 10), ts, steps)
		})
	}
}

// 3 per second: one token every 333,333,333⅓ ns. The fraction is kept
// exactly, so tokens arrive at ⌈k/3 s⌉ for ever: 3 per second, no drift.
func TestTokenBucketFractionalRate(t *testing.T) {
	ts := []time.Duration{0, 333_333_333, 333_333_334, 666_666_666, 666_666_667, 999_999_999, s, 1000 * s, 1001*s - 1}
	steps := []step{
		allow(0, 3, true, 0, 0, s),            // full again at 1s
		allow(1, 1, false, 0, 1, 666_666_667), // the token is ⅓ ns away
		allow(2, 1, true, 0, 0, s),            // full at 1,333,333,333⅓
		allow(3, 1, false, 0, 1, 666_666_668), // next token at 666,666,666⅔
		allow(4, 1, true, 0, 0, s),            // full at 1,666,666,666⅔
		allow(5, 1, false, 0, 1, 666_666_668), // next token at 1s
		allow(6, 1, true, 0, 0, s),            // full at exactly 2s
		peek(7, true, 3, 0, 0),                // long idle: full, no drift
		allow(7, 3, true, 0, 0, s),            // full at exactly 1001s
		peek(8, true, 2, 0, 1),                // 1ns before: 3 − 3·10⁻⁹ tokens
	}
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			runSteps(t, mustLimit(t, alg, 3, time.Second, 3), ts, steps)
		})
	}
}

func TestFixedWindowSteps(t *testing.T) {
	ts := []time.Duration{0, 9999 * ms, 10 * s, 5 * s, 25 * s, 30 * s, 39 * s}
	steps := []step{
		allow(0, 2, true, 1, 0, 10*s),
		allow(0, 1, true, 0, 0, 10*s),
		allow(0, 1, false, 0, 10*s, 10*s),
		allow(1, 1, false, 0, 1*ms, 1*ms),
		allow(2, 3, true, 0, 0, 10*s),     // 6 admitted within 1ms across the boundary: 2L
		allow(3, 1, false, 0, 10*s, 10*s), // clock went back into the previous window: stays in [10s, 20s)
		peek(4, true, 3, 0, 0),
		debit(4, 10), // capped at 2·quota
		peek(4, false, -3, 5*s, 5*s),
		allow(4, 0, false, -3, 5*s, 5*s),
		peek(5, true, 3, 0, 0),
		take(5, 5, 3),
		give(5, 1),
		peek(5, true, 1, 0, 10*s),
		give(5, 10), // floor 0
		peek(5, true, 3, 0, 0),
		allow(5, 4, false, 3, Never, 0),
		take(6, 1, 1),
		allow(6, 0, true, 2, 0, 1*s),
	}
	runSteps(t, mustLimit(t, FixedWindow, 3, 10*time.Second, 3), ts, steps)
}

func TestSlidingWindowSteps(t *testing.T) {
	ts := []time.Duration{0, 11 * s, 15 * s, 16 * s, 5 * s, 30 * s, 45 * s, 50 * s, 61 * s, 12 * s}
	steps := []step{
		allow(0, 10, true, 0, 0, 20*s),
		allow(0, 1, false, 0, 11*s, 20*s),   // next window: 10·(W−e)/W ≤ 9 at e = 1s
		allow(1, 1, true, 0, 0, 19*s),       // 10·0.9 + 0 + 1 = 10
		allow(2, 5, false, 4, 1*s, 15*s),    // 10·0.5 + 1 = 6; room for 5 at 16s
		allow(3, 5, true, 0, 0, 14*s),       // 10·0.4 + 1 + 5 = 10
		allow(9, 1, false, -4, 5*s, 18*s),   // back to 12s, same window: prev weighs 0.8 again (no minting)
		allow(4, 1, false, -6, 7*s, 20*s),   // back to 5s, previous window: seen as 10s, the counts are kept
		peek(5, true, 10, 0, 0),             // two windows later: empty
		debit(5, 25),                        // capped at an estimate of 2·quota
		peek(5, false, -10, 15500*ms, 20*s), // next window: 20·(W−e)/W ≤ 9 at e = 5.5s
		take(6, 1, 0),                       // 20·0.5 = 10: no room
		allow(6, 0, true, 0, 0, 5*s),
		give(6, 4), // from the previous window's count: 16·0.5 = 8
		peek(6, true, 2, 0, 5*s),
		take(7, 20, 10),
		peek(8, true, 1, 0, 9*s), // 10·0.9 = 9
	}
	runSteps(t, mustLimit(t, SlidingWindow, 10, 10*time.Second, 10), ts, steps)
}
