package agent

import (
	"sync/atomic"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// fallbackLimit derives an agent's share of limit l when n agents share the
// key: rate R/n and burst ⌈burst/n⌉ (at least 1). For the token bucket and
// GCRA the rate is exact: the window is stretched n-fold when the quota does
// not divide by n. Window algorithms keep their window (it defines the
// counting period) and get ⌈quota/n⌉ per window.
func fallbackLimit(l bucket.Limit, n uint32) (bucket.Limit, error) {
	if n <= 1 || l.DeniesAll() {
		return l, nil
	}
	nn := int64(n)
	q, w, b := l.Quota(), l.Window(), max(ceilDiv(l.Burst(), nn), 1)
	alg := l.Algorithm()
	if alg == bucket.TokenBucket || alg == bucket.GCRA {
		switch {
		case q%nn == 0:
			return bucket.NewLimit(alg, q/nn, w, b)
		case int64(w) <= int64(bucket.MaxWindow)/nn:
			if fl, err := bucket.NewLimit(alg, q, w*time.Duration(nn), b); err == nil {
				return fl, nil
			}
		}
		// Stretching the window is out of range: round the rate up.
		return bucket.NewLimit(alg, max(ceilDiv(q, nn), 1), w, b)
	}
	q = max(ceilDiv(q, nn), 1)
	return bucket.NewLimit(alg, q, w, q)
}

func ceilDiv(a, b int64) int64 {
	if a <= 0 {
		return 0
	}
	return (a-1)/b + 1
}

// capacity is what a full state holds under l.
func capacity(l bucket.Limit, now int64) int64 {
	return l.Peek(bucket.State{}, now).Remaining
}

// rebase lowers *st, if it holds more, to a state that had avail tokens
// (clamped to [0, capacity]) at time at, refilled since. It never raises
// what *st holds: a grant's view of the global remaining does not include
// this agent's own uncharged fallback admissions.
func rebase(l bucket.Limit, st *bucket.State, avail, at, now int64) {
	if at > now {
		at = now
	}
	c := capacity(l, at)
	avail = min(max(avail, 0), c)
	var s bucket.State
	if take := c - avail; take > 0 {
		l.TakeUpTo(&s, at, take)
	}
	if l.Peek(s, now).Remaining < l.Peek(*st, now).Remaining {
		*st = s
	}
}

// sendable takes a count of fallback-admitted tokens (charged or outage)
// out of *c for a report. Negative (a refund arrived after its charge was
// sent): it reports 0 and keeps the credit for the next report. Beyond the
// protocol's bound: it reports the bound and keeps the rest.
func sendable(c *atomic.Int64) int64 {
	n := c.Swap(0)
	if n < 0 || n > maxWant {
		keep := n - min(max(n, 0), maxWant)
		c.Add(keep)
		n -= keep
	}
	return n
}
