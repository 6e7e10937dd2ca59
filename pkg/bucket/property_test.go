package bucket

import (
	"math/big"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// drawLimit draws a valid Limit of algorithm alg. Rates include fractional
// ones (window not a multiple of quota) and huge ones.
func drawLimit(t *rapid.T, alg Algorithm) Limit {
	quota := rapid.OneOf(rapid.Int64Range(1, 20), rapid.Int64Range(1, 1_000_000), rapid.Int64Range(1, 1<<40)).Draw(t, "quota")
	window := time.Duration(rapid.OneOf(
		rapid.Int64Range(1, 1000),
		rapid.Int64Range(int64(time.Millisecond), int64(time.Minute)),
		rapid.SampledFrom([]int64{int64(time.Second), int64(time.Minute), int64(time.Hour), int64(24 * time.Hour)}),
	).Draw(t, "window"))
	burst := quota
	if alg == TokenBucket || alg == GCRA {
		burst = rapid.Int64Range(1, 3*quota).Draw(t, "burst")
	}
	if alg == SlidingWindow && quota > MaxSlidingQuota {
		quota, burst = MaxSlidingQuota, MaxSlidingQuota
	}
	l, err := NewLimit(alg, quota, window, burst)
	if err != nil {
		t.Skip(err) // e.g. refill longer than MaxWindow
	}
	return l
}

// drawN draws a token count of the scale of the limit's burst.
func drawN(t *rapid.T, l Limit, label string) int64 {
	return rapid.OneOf(rapid.Int64Range(0, 3), rapid.Int64Range(0, 2*l.Burst()+1)).Draw(t, label)
}

// drawDt draws a time step of the scale of the limit's refill period.
func drawDt(t *rapid.T, l Limit, label string) int64 {
	per := max64(int64(l.Window())/l.Quota(), 1)
	return rapid.OneOf(
		rapid.Int64Range(0, 2),
		rapid.Int64Range(0, per*2),
		rapid.Int64Range(0, int64(l.Window())*2),
	).Draw(t, label)
}

// ratTokens returns (t1 − t0)·quota/window as a rational.
func ratTokens(l Limit, dt int64) *big.Rat {
	return new(big.Rat).SetFrac(new(big.Int).Mul(big.NewInt(dt), big.NewInt(l.Quota())), big.NewInt(int64(l.Window())))
}

// A token bucket (and GCRA) never admits more than burst + rate·T in any
// interval of length T: checked over every sub-interval of a random history.
func TestTokenBucketAdmitsAtMostBurstPlusRate(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := drawLimit(t, alg)
				var st State
				now := base
				var at, got []int64
				for range rapid.IntRange(1, 60).Draw(t, "calls") {
					now += drawDt(t, l, "dt")
					n := drawN(t, l, "n")
					var g int64
					if rapid.Bool().Draw(t, "take") {
						g = l.TakeUpTo(&st, now, n)
					} else if l.AllowN(&st, now, n).Allowed {
						g = max64(n, 0)
					}
					at, got = append(at, now), append(got, g)
				}
				for i := range at {
					sum := int64(0)
					for j := i; j < len(at); j++ {
						sum += got[j]
						bound := ratTokens(l, at[j]-at[i])
						bound.Add(bound, new(big.Rat).SetInt64(l.Burst()))
						if new(big.Rat).SetInt64(sum).Cmp(bound) > 0 {
							t.Fatalf("%v admitted %d in [%d, %d], more than burst + rate·T = %s", l, sum, at[i]-base, at[j]-base, bound.FloatString(3))
						}
					}
				}
			})
		})
	}
}

// tbModel is a reference token bucket in exact rationals, written the
// textbook way: tokens refill by elapsed·rate up to burst.
type tbModel struct {
	l      Limit
	tokens *big.Rat
	last   int64
}

func newModel(l Limit, now int64) *tbModel {
	return &tbModel{l: l, tokens: new(big.Rat).SetInt64(l.Burst()), last: now}
}

func (m *tbModel) advance(now int64) {
	m.tokens.Add(m.tokens, ratTokens(m.l, now-m.last))
	if b := new(big.Rat).SetInt64(m.l.Burst()); m.tokens.Cmp(b) > 0 {
		m.tokens = b
	}
	m.last = now
}

func ratFloor(r *big.Rat) int64 {
	q, _ := new(big.Int).DivMod(r.Num(), r.Denom(), new(big.Int))
	return q.Int64() // Euclidean division by a positive denominator is floor
}

// ratCeilNs returns ⌈(need tokens)·window/quota⌉ in ns.
func ratCeilNs(l Limit, need *big.Rat) time.Duration {
	ns := new(big.Rat).Mul(need, new(big.Rat).SetFrac64(int64(l.Window()), l.Quota()))
	return time.Duration(-ratFloor(new(big.Rat).Neg(ns)))
}

func (m *tbModel) allowN(now, n int64) Result {
	m.advance(now)
	r := Result{}
	nr := new(big.Rat).SetInt64(n)
	if n <= m.l.Burst() && m.tokens.Cmp(nr) >= 0 {
		m.tokens.Sub(m.tokens, nr)
		r.Allowed = true
	} else if n > m.l.Burst() {
		r.RetryAfter = Never
	} else {
		r.RetryAfter = ratCeilNs(m.l, new(big.Rat).Sub(nr, m.tokens))
	}
	r.Remaining = ratFloor(m.tokens)
	r.ResetAfter = ratCeilNs(m.l, new(big.Rat).Sub(new(big.Rat).SetInt64(m.l.Burst()), m.tokens))
	return r
}

// Both token algorithms make exactly the decisions of the rational model,
// with the same Remaining, RetryAfter and ResetAfter: no drift, no rounding.
func TestTokenBucketMatchesRationalModel(t *testing.T) {
	for _, alg := range []Algorithm{TokenBucket, GCRA} {
		t.Run(alg.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := drawLimit(t, alg)
				var st State
				now := base
				m := newModel(l, now)
				for i := range rapid.IntRange(1, 80).Draw(t, "calls") {
					now += drawDt(t, l, "dt")
					n := rapid.Int64Range(1, l.Burst()+1).Draw(t, "n")
					got, want := l.AllowN(&st, now, n), m.allowN(now, n)
					if got != want {
						t.Fatalf("step %d: %v AllowN(+%d, %d) = %+v, want %+v", i, l, now-base, n, got, want)
					}
				}
			})
		})
	}
}

// GCRA and the token bucket are the same limiter computed two ways: every
// operation, at any instants (including going backwards), gives identical
// results and identical states.
func TestGCRAMatchesTokenBucket(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		tb := drawLimit(t, TokenBucket)
		g := mustLimit(t, GCRA, tb.Quota(), tb.Window(), tb.Burst())
		var s1, s2 State
		now := base
		for i := range rapid.IntRange(1, 80).Draw(t, "calls") {
			now += drawDt(t, tb, "dt")
			at := now
			if rapid.IntRange(0, 9).Draw(t, "back") == 0 {
				at -= drawDt(t, tb, "backwards")
			}
			n := drawN(t, tb, "n")
			switch op := rapid.IntRange(0, 5).Draw(t, "op"); op {
			case 0:
				if r1, r2 := tb.AllowN(&s1, at, n), g.AllowN(&s2, at, n); r1 != r2 {
					t.Fatalf("step %d: AllowN(%d): token bucket %+v, GCRA %+v", i, n, r1, r2)
				}
			case 1:
				if g1, g2 := tb.TakeUpTo(&s1, at, n), g.TakeUpTo(&s2, at, n); g1 != g2 {
					t.Fatalf("step %d: TakeUpTo(%d): token bucket %d, GCRA %d", i, n, g1, g2)
				}
			case 2:
				tb.GiveBack(&s1, at, n)
				g.GiveBack(&s2, at, n)
			case 3:
				tb.Debit(&s1, at, n)
				g.Debit(&s2, at, n)
			case 5:
				tb.Drain(&s1, at)
				g.Drain(&s2, at)
			case 4:
				if r1, r2 := tb.Peek(s1, at), g.Peek(s2, at); r1 != r2 {
					t.Fatalf("step %d: Peek: token bucket %+v, GCRA %+v", i, r1, r2)
				}
			}
			if s1 != s2 {
				t.Fatalf("step %d: states differ: token bucket %+v, GCRA %+v", i, s1, s2)
			}
		}
	})
}

// randomHistory returns the state after up to 10 random operations from
// full, and the instant of the last.
func randomHistory(t *rapid.T, l Limit) (State, int64) {
	var st State
	now := base
	for range rapid.IntRange(0, 10).Draw(t, "prefix") {
		now += drawDt(t, l, "dt")
		applyRandom(t, l, &st, now)
	}
	return st, now
}

// applyRandom applies one random operation to st at now.
func applyRandom(t *rapid.T, l Limit, st *State, now int64) {
	n := drawN(t, l, "n")
	switch rapid.IntRange(0, 4).Draw(t, "op") {
	case 0:
		l.AllowN(st, now, n)
	case 1:
		l.TakeUpTo(st, now, n)
	case 2:
		l.GiveBack(st, now, n)
	case 3:
		l.Debit(st, now, n)
	case 4:
		l.Drain(st, now)
	}
}

// TakeUpTo followed by GiveBack of at most what was taken never creates
// tokens, whatever the instants (GiveBack may even be earlier): afterwards the
// state never has more available than it would have had without the pair,
// and never more than its burst.
func TestTakeThenGiveBackNeverMints(t *testing.T) {
	for a := TokenBucket; a <= FixedWindow; a++ {
		t.Run(a.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := drawLimit(t, a)
				st, now := randomHistory(t, l)
				without := st
				ta := now + drawDt(t, l, "ta")
				took := l.TakeUpTo(&st, ta, drawN(t, l, "take"))
				tb := ta + drawDt(t, l, "tb") - drawDt(t, l, "tb back")
				l.GiveBack(&st, tb, rapid.Int64Range(0, took).Draw(t, "give"))
				after := max64(ta, tb)
				for range 5 {
					at := after + drawDt(t, l, "check")
					with, wo := l.Peek(st, at), l.Peek(without, at)
					if with.Remaining > wo.Remaining || with.Remaining > l.Burst() {
						t.Fatalf("%v: took %d at +%d, gave back at +%d; at +%d available %d, without the pair %d", l, took, ta-base, tb-base, at-base, with.Remaining, wo.Remaining)
					}
				}
			})
		})
	}
}

// Every result stays in range under any operations at any instants, and
// Debit's floor holds: Remaining ∈ [−burst, burst], durations ≥ 0, a denial
// that waiting can fix has RetryAfter > 0.
func TestResultsInRangeAndDebitFloor(t *testing.T) {
	for a := TokenBucket; a <= FixedWindow; a++ {
		t.Run(a.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := drawLimit(t, a)
				var st State
				now := base
				for i := range rapid.IntRange(1, 60).Draw(t, "calls") {
					now += drawDt(t, l, "dt")
					at := now - rapid.OneOf(rapid.Just(int64(0)), rapid.Int64Range(0, 2*int64(l.Window()))).Draw(t, "back")
					n := rapid.OneOf(rapid.Int64Range(-2, 2*l.Burst()+2), rapid.Just(int64(1)<<62)).Draw(t, "n")
					var r Result
					switch rapid.IntRange(0, 3).Draw(t, "op") {
					case 0:
						r = l.AllowN(&st, at, n)
						checkResult(t, l, r, n, i)
					case 1:
						if g := l.TakeUpTo(&st, at, n); g < 0 || g > max64(n, 0) || g > l.Burst() {
							t.Fatalf("step %d: TakeUpTo(%d) = %d", i, n, g)
						}
					case 2:
						l.GiveBack(&st, at, n)
					case 3:
						l.Debit(&st, at, n)
					}
					checkResult(t, l, l.Peek(st, at), 1, i)
					checkResult(t, l, l.Peek(st, now), 1, i)
				}
			})
		})
	}
}

func checkResult(t interface{ Fatalf(string, ...any) }, l Limit, r Result, n int64, step int) {
	switch {
	case r.Remaining < -l.Burst() || r.Remaining > l.Burst():
		t.Fatalf("step %d: %v: Remaining %d outside [−%d, %d] (%+v)", step, l, r.Remaining, l.Burst(), l.Burst(), r)
	case r.RetryAfter < 0 || r.ResetAfter < 0:
		t.Fatalf("step %d: %v: negative duration %+v", step, l, r)
	case r.Allowed && r.RetryAfter != 0:
		t.Fatalf("step %d: %v: allowed with RetryAfter %v", step, l, r.RetryAfter)
	case !r.Allowed && r.RetryAfter == 0:
		t.Fatalf("step %d: %v: denied with RetryAfter 0 (n=%d, %+v)", step, l, n, r)
	case !r.Allowed && n > l.Burst() && r.RetryAfter != Never:
		t.Fatalf("step %d: %v: n=%d > burst denied with RetryAfter %v, want Never", step, l, n, r.RetryAfter)
	case r.ResetAfter == 0 && r.Remaining != l.Burst():
		t.Fatalf("step %d: %v: ResetAfter 0 but Remaining %d", step, l, r.Remaining)
	}
}

// RetryAfter is exact for every algorithm: the request it was denied is
// admitted at now + RetryAfter and not 1ns earlier.
func TestRetryAfterIsExact(t *testing.T) {
	for a := TokenBucket; a <= FixedWindow; a++ {
		t.Run(a.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := drawLimit(t, a)
				var st State
				now := base
				for range rapid.IntRange(0, 20).Draw(t, "prefix") {
					now += drawDt(t, l, "dt")
					applyRandom(t, l, &st, now)
				}
				now += drawDt(t, l, "dt")
				n := rapid.Int64Range(0, l.Burst()).Draw(t, "n")
				probe := st
				r := l.AllowN(&probe, now, n)
				if r.Allowed {
					return
				}
				early, ok := st, st
				if l.AllowN(&early, now+int64(r.RetryAfter)-1, n).Allowed {
					t.Fatalf("%v: AllowN(%d) admitted 1ns before RetryAfter %v", l, n, r.RetryAfter)
				}
				if !l.AllowN(&ok, now+int64(r.RetryAfter), n).Allowed {
					t.Fatalf("%v: AllowN(%d) denied at RetryAfter %v", l, n, r.RetryAfter)
				}
			})
		})
	}
}

// A fixed window admits at most its quota per aligned window, so at most 2L
// in any span shorter than the window (and TestFixedWindowAdmitsTwoL shows
// the 2L happening).
func TestFixedWindowAtMostTwoL(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := drawLimit(t, FixedWindow)
		var st State
		now := base + rapid.Int64Range(0, int64(l.Window())).Draw(t, "start")
		var at, got []int64
		perWindow := map[int64]int64{}
		for range rapid.IntRange(1, 60).Draw(t, "calls") {
			now += drawDt(t, l, "dt")
			n := drawN(t, l, "n")
			var g int64
			if rapid.Bool().Draw(t, "take") {
				g = l.TakeUpTo(&st, now, n)
			} else if l.AllowN(&st, now, n).Allowed {
				g = max64(n, 0)
			}
			at, got = append(at, now), append(got, g)
			w := now - now%int64(l.Window())
			if perWindow[w] += g; perWindow[w] > l.Quota() {
				t.Fatalf("%v admitted %d in the window at %d", l, perWindow[w], w-base)
			}
		}
		for i := range at {
			sum := int64(0)
			for j := i; j < len(at) && at[j]-at[i] < int64(l.Window()); j++ {
				if sum += got[j]; sum > 2*l.Quota() {
					t.Fatalf("%v admitted %d in [%d, %d], more than 2L", l, sum, at[i]-base, at[j]-base)
				}
			}
		}
	})
}

func TestFixedWindowAdmitsTwoL(t *testing.T) {
	l := mustLimit(t, FixedWindow, 100, time.Minute, 100)
	var st State
	boundary := base + int64(time.Minute)
	if r := l.AllowN(&st, boundary-1, 100); !r.Allowed {
		t.Fatalf("100 at 1ns before the boundary: %+v", r)
	}
	if r := l.AllowN(&st, boundary, 100); !r.Allowed {
		t.Fatalf("100 at the boundary: %+v", r)
	}
	// 200 = 2L admitted within 1ns; the token bucket with the same quota and
	// burst admits 100 + 1ns·rate = 100.
	tb := mustLimit(t, TokenBucket, 100, time.Minute, 100)
	var s2 State
	tb.AllowN(&s2, boundary-1, 100)
	if r := tb.AllowN(&s2, boundary, 1); r.Allowed {
		t.Fatalf("token bucket admitted past burst + rate·1ns: %+v", r)
	}
}

// swModel is a reference sliding-window counter in rationals.
type swModel struct {
	l      Limit
	counts map[int64]int64 // tokens taken per aligned window start
}

func (m *swModel) estimate(now int64) *big.Rat {
	w := int64(m.l.Window())
	start := now - now%w
	prev := new(big.Rat).SetFrac(new(big.Int).Mul(big.NewInt(m.counts[start-w]), big.NewInt(w-(now-start))), big.NewInt(w))
	return prev.Add(prev, new(big.Rat).SetInt64(m.counts[start]))
}

// The sliding window makes exactly the decisions of the rational model
// prev·(W−elapsed)/W + curr ≤ quota, with the same Remaining.
func TestSlidingWindowMatchesRationalModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := drawLimit(t, SlidingWindow)
		var st State
		m := &swModel{l: l, counts: map[int64]int64{}}
		now := base
		for i := range rapid.IntRange(1, 80).Draw(t, "calls") {
			now += drawDt(t, l, "dt")
			n := rapid.Int64Range(0, l.Quota()).Draw(t, "n")
			got := l.AllowN(&st, now, n)
			e := m.estimate(now)
			rem := new(big.Rat).Sub(new(big.Rat).SetInt64(l.Quota()), e)
			want := rem.Cmp(new(big.Rat).SetInt64(n)) >= 0
			if got.Allowed != want {
				t.Fatalf("step %d: %v AllowN(+%d, %d) = %v, want %v (estimate %s)", i, l, now-base, n, got.Allowed, want, e.FloatString(3))
			}
			if want {
				m.counts[now-now%int64(l.Window())] += n
				rem.Sub(rem, new(big.Rat).SetInt64(n))
			}
			if got.Remaining != ratFloor(rem) {
				t.Fatalf("step %d: %v AllowN(+%d, %d).Remaining = %d, want %d", i, l, now-base, n, got.Remaining, ratFloor(rem))
			}
		}
	})
}
