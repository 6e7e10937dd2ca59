package bucket

import (
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

func TestStateIs16Bytes(t *testing.T) {
	if got := unsafe.Sizeof(State{}); got != 16 {
		t.Fatalf("unsafe.Sizeof(State{}) = %d, want 16", got)
	}
}

func TestAlgorithmNames(t *testing.T) {
	for a, want := range map[Algorithm]string{TokenBucket: "token_bucket", GCRA: "gcra", SlidingWindow: "sliding_window", FixedWindow: "fixed_window"} {
		if a.String() != want {
			t.Errorf("%d.String() = %q, want %q", a, a.String(), want)
		}
		for _, in := range []string{want, strings.ToUpper(want)} {
			if got, err := ParseAlgorithm(in); err != nil || got != a {
				t.Errorf("ParseAlgorithm(%q) = %v, %v; want %v", in, got, err, a)
			}
		}
		var u Algorithm
		if b, err := a.MarshalText(); err != nil || u.UnmarshalText(b) != nil || u != a {
			t.Errorf("text round trip of %v = %v (%v)", a, u, err)
		}
	}
	for _, bad := range []string{"", "leaky_bucket", "token-bucket", " gcra"} {
		if _, err := ParseAlgorithm(bad); err == nil || !strings.HasPrefix(err.Error(), "bucket: ") {
			t.Errorf("ParseAlgorithm(%q) error = %v, want a bucket: error", bad, err)
		}
	}
	if s := Algorithm(9).String(); s != "Algorithm(9)" {
		t.Errorf("Algorithm(9).String() = %q", s)
	}
	if _, err := Algorithm(9).MarshalText(); err == nil {
		t.Error("Algorithm(9).MarshalText() succeeded")
	}
}

func TestNewLimitValidation(t *testing.T) {
	const day = 24 * time.Hour
	bad := []struct {
		alg          Algorithm
		quota        int64
		window       time.Duration
		burst        int64
		wantInErrMsg string
	}{
		{Algorithm(4), 1, s, 1, "unknown algorithm"},
		{TokenBucket, 0, s, 1, "quota must be ≥ 1"},
		{TokenBucket, -5, s, 1, "quota must be ≥ 1"},
		{TokenBucket, MaxTokens + 1, s, 1, "quota must be ≤"},
		{TokenBucket, 1, 0, 1, "window must be > 0"},
		{TokenBucket, 1, -s, 1, "window must be > 0"},
		{TokenBucket, 1, MaxWindow + 1, 1, "window must be ≤"},
		{TokenBucket, 1, s, 0, "burst must be ≥ 1"},
		{GCRA, 1, s, -1, "burst must be ≥ 1"},
		{GCRA, 1, s, MaxTokens + 1, "burst must be ≤"},
		{TokenBucket, 1, 365 * day, 100, "refilling the burst"}, // 100 years to refill
		{FixedWindow, 10, s, 5, "burst must equal quota"},
		{SlidingWindow, 10, s, 11, "burst must equal quota"},
		{SlidingWindow, MaxSlidingQuota + 1, s, MaxSlidingQuota + 1, "sliding_window: quota must be ≤"},
	}
	for _, c := range bad {
		_, err := NewLimit(c.alg, c.quota, c.window, c.burst)
		if err == nil || !errors.Is(err, ErrInvalidLimit) || !strings.HasPrefix(err.Error(), "bucket: ") || !strings.Contains(err.Error(), c.wantInErrMsg) {
			t.Errorf("NewLimit(%v, %d, %v, %d) error = %v, want ErrInvalidLimit containing %q", c.alg, c.quota, c.window, c.burst, err, c.wantInErrMsg)
		}
	}
	good := []struct {
		alg    Algorithm
		quota  int64
		window time.Duration
		burst  int64
	}{
		{TokenBucket, 1, s, 1},
		{TokenBucket, MaxTokens, time.Nanosecond, MaxTokens}, // 2.3e18 per ns
		{GCRA, 1, MaxWindow, 1},
		{TokenBucket, 1, 365 * day, 36}, // 36 years to refill
		{FixedWindow, MaxTokens, MaxWindow, MaxTokens},
		{SlidingWindow, MaxSlidingQuota, MaxWindow, MaxSlidingQuota},
	}
	for _, c := range good {
		l, err := NewLimit(c.alg, c.quota, c.window, c.burst)
		if err != nil {
			t.Errorf("NewLimit(%v, %d, %v, %d): %v", c.alg, c.quota, c.window, c.burst, err)
			continue
		}
		if l.Algorithm() != c.alg || l.Quota() != c.quota || l.Window() != c.window || l.Burst() != c.burst || l.IsZero() {
			t.Errorf("accessors of %v = %v %d %v %d %v", l, l.Algorithm(), l.Quota(), l.Window(), l.Burst(), l.IsZero())
		}
	}
	l := mustLimit(t, TokenBucket, 30, time.Minute, 10)
	if got := l.String(); got != "token_bucket 30/1m0s burst 10" {
		t.Errorf("String() = %q", got)
	}
	if l != mustLimit(t, TokenBucket, 30, time.Minute, 10) {
		t.Error("equal parameters give unequal Limits")
	}
}

func TestZeroLimitIsUnlimited(t *testing.T) {
	var l Limit
	if !l.IsZero() || l.String() != "unlimited" {
		t.Fatalf("zero Limit: IsZero %v, String %q", l.IsZero(), l.String())
	}
	var st State
	for _, now := range []int64{math.MinInt64, 0, base, math.MaxInt64} {
		if r := l.AllowN(&st, now, math.MaxInt64); r != (Result{Allowed: true, Remaining: Unlimited}) {
			t.Fatalf("AllowN = %+v", r)
		}
		if got := l.TakeUpTo(&st, now, 7); got != 7 {
			t.Fatalf("TakeUpTo(7) = %d", got)
		}
		l.GiveBack(&st, now, 3)
		l.Debit(&st, now, 3)
		if r := l.Peek(st, now); !r.Allowed || r.Remaining != Unlimited {
			t.Fatalf("Peek = %+v", r)
		}
	}
	if st != (State{}) {
		t.Fatalf("zero Limit changed the state: %+v", st)
	}
	if !(&Limiter{}).Allow() {
		t.Fatal("zero Limiter denied")
	}
}

// The zero State is full / empty at every instant, including before the
// Unix epoch (clamped to it) and after MaxTime.
func TestZeroStateIsFull(t *testing.T) {
	for _, l := range allAlgorithms(t, 10, time.Minute) {
		for _, now := range []int64{math.MinInt64, -1, 0, 1, base, MaxTime, math.MaxInt64} {
			if r := l.Peek(State{}, now); !r.Allowed || r.Remaining != 10 || r.ResetAfter != 0 || r.RetryAfter != 0 {
				t.Errorf("%v: Peek(State{}, %d) = %+v, want full", l, now, r)
			}
		}
	}
}

func allAlgorithms(t *testing.T, quota int64, window time.Duration) []Limit {
	var ls []Limit
	for a := TokenBucket; a <= FixedWindow; a++ {
		ls = append(ls, mustLimit(t, a, quota, window, quota))
	}
	return ls
}

// Limiter serialises concurrent callers: with no time passing, exactly burst
// of many concurrent requests are admitted (run with -race).
func TestLimiterConcurrent(t *testing.T) {
	for _, l := range allAlgorithms(t, 100, time.Hour) {
		lim := NewLimiter(l)
		at := time.Unix(0, base)
		var wg sync.WaitGroup
		var mu sync.Mutex
		admitted := 0
		for range 8 {
			wg.Go(func() {
				n := 0
				for range 50 {
					if lim.AllowN(at, 1).Allowed {
						n++
					}
				}
				mu.Lock()
				admitted += n
				mu.Unlock()
			})
		}
		wg.Wait()
		if admitted != 100 {
			t.Errorf("%v: admitted %d of 400 concurrent requests, want exactly 100", l, admitted)
		}
		if g := lim.TakeUpTo(at, 5); g != 0 {
			t.Errorf("%v: TakeUpTo on an empty limiter = %d", l, g)
		}
		lim.GiveBack(at, 5)
		if r := lim.Peek(at); r.Remaining != 5 {
			t.Errorf("%v: after GiveBack(5) Peek = %+v", l, r)
		}
		if lim.Limit() != l {
			t.Errorf("Limit() = %v, want %v", lim.Limit(), l)
		}
	}
}
