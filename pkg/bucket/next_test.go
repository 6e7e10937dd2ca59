package bucket

import (
	"math/rand/v2"
	"testing"
	"time"
)

// TestNextAfterSteps: t for allowed responses, at fixed instants: the next
// token for the token buckets, the next window boundary for the windows,
// and 0 for a full state.
func TestNextAfterSteps(t *testing.T) {
	const s = int64(time.Second)
	t0 := 1_700_000_040 * s // a multiple of 60 s
	for _, alg := range []Algorithm{TokenBucket, GCRA, FixedWindow, SlidingWindow} {
		burst := int64(10)
		if alg == FixedWindow || alg == SlidingWindow {
			burst = 30
		}
		l, err := NewLimit(alg, 30, time.Minute, burst) // a token every 2 s
		if err != nil {
			t.Fatal(err)
		}
		var st State
		steps := []struct {
			at   int64
			take int64
			want time.Duration
		}{
			{t0, 0, 0},                      // full
			{t0 + 15*s, 1, 2 * time.Second}, // one spent: tokens back at +2 s; windows: boundary at t0+60
			{t0 + 16*s, 1, time.Second},     // the first token is due at t0+17
			{t0 + 16*s + s/2, 1, s2(0.5)},   // ... half a second on
			{t0 + 17*s, 0, 2 * time.Second}, // one came back; the next is due at t0+19
		}
		for i, step := range steps {
			res := l.AllowN(&st, step.at, step.take)
			got := l.NextAfter(step.at, res.ResetAfter)
			want := step.want
			if alg == FixedWindow || alg == SlidingWindow {
				want = 0
				if res.ResetAfter > 0 {
					want = time.Duration(t0 + 60*s - step.at)
				}
			}
			if got != want {
				t.Errorf("%v step %d: NextAfter(t0+%v, %v) = %v, want %v", alg, i, time.Duration(step.at-t0), res.ResetAfter, got, want)
			}
		}
	}
	if got := (Limit{}).NextAfter(t0, time.Second); got != 0 {
		t.Errorf("the unlimited Limit: NextAfter = %v, want 0", got)
	}
}

func s2(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }

// TestNextAfterBounds: for a state that is not full, more quota comes no
// later than the state is full, and for the token buckets within one
// token's interval.
func TestNextAfterBounds(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 10000; i++ {
		alg := Algorithm(r.IntN(4))
		quota := 1 + r.Int64N(1_000_000)
		window := time.Duration(1+r.Int64N(3600)) * time.Second
		burst := quota
		if alg == TokenBucket || alg == GCRA {
			burst = 1 + r.Int64N(2*quota)
		}
		l, err := NewLimit(alg, quota, window, burst)
		if err != nil {
			t.Fatal(err)
		}
		reset := time.Duration(1 + r.Int64N(int64(2*window)))
		now := r.Int64N(1 << 62)
		got := l.NextAfter(now, reset)
		if got <= 0 || got > reset+1 {
			t.Fatalf("%v: NextAfter(%d, %v) = %v, want in (0, resetAfter]", l, now, reset, got)
		}
		if interval := (int64(window) + quota - 1) / quota; (alg == TokenBucket || alg == GCRA) && int64(got) > interval {
			t.Fatalf("%v: NextAfter(%d, %v) = %v, more than one token's interval %v", l, now, reset, got, time.Duration(interval))
		}
	}
}

// TestNextAfterTokenNs: for a token bucket of a token per nanosecond or
// more, NextAfter's shortcut answers what the division does.
func TestNextAfterTokenNs(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 10000; i++ {
		alg := []Algorithm{TokenBucket, GCRA}[r.IntN(2)]
		window := time.Duration(1 + r.Int64N(int64(time.Minute)))
		quota := int64(window) + r.Int64N(MaxTokens-int64(window)+1)
		if r.IntN(4) == 0 {
			quota = int64(window) // the edge: exactly a token a nanosecond
		}
		burst := 1 + r.Int64N(quota)
		l, err := NewLimit(alg, quota, window, burst)
		if err != nil {
			t.Fatal(err)
		}
		reset := time.Duration(1 + r.Int64N(int64(2*window)))
		now := r.Int64N(1 << 62)
		if got, want := l.NextAfter(now, reset), l.nextAfter(now, reset); got != want {
			t.Fatalf("%v: NextAfter(%d, %v) = %v, the division gives %v", l, now, reset, got, want)
		}
	}
}
