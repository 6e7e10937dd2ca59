package bucket

import (
	"math/bits"
	"time"
)

// Share returns k of n equal shares of a TokenBucket or GCRA limit l: rate
// k·R/n and burst k·⌊burst/n⌋, so that the limits of shares that add up
// to n, taken by separate buckets, never admit more than l does in any
// window (their bursts sum to at most l's burst, their rates to at most
// l's rate). The rate is exact when the window stretched n-fold stays in
// range, else rounded down. ok is false when l is not a TokenBucket or
// GCRA limit, k is not in [1, n], or a share would hold less than one
// token or refill at no rate.
func (l Limit) Share(k, n uint32) (s Limit, ok bool) {
	if (l.alg != TokenBucket && l.alg != GCRA) || l.deny || l.quota == 0 || k == 0 || k > n {
		return Limit{}, false
	}
	if k == n {
		return l, true
	}
	per := l.burst / int64(n)
	if per < 1 {
		return Limit{}, false
	}
	burst := per * int64(k)
	quota, window := l.quota*int64(k), time.Duration(l.window)*time.Duration(n)
	hi, _ := bits.Mul64(uint64(l.quota), uint64(k))
	if hi != 0 || quota > MaxTokens || l.window > int64(MaxWindow)/int64(n) {
		// Out of range stretched: k·quota/n tokens per window, rounded
		// down.
		h, lo := bits.Mul64(uint64(l.quota), uint64(k))
		q, _ := bits.Div64(h, lo, uint64(n))
		quota, window = int64(q), time.Duration(l.window)
	}
	if quota < 1 {
		return Limit{}, false
	}
	s, err := NewLimit(l.alg, quota, window, burst)
	return s, err == nil
}
