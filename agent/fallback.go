package agent

import (
	"time"

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
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

// thinShare reports whether the key's fallback bucket is a thin share of a
// limit shared by several agents (see policy.ThinShare): its first use
// then asks for no token (policy.FirstUse).
func (ks *keyState) thinShare() bool {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	return ks.fbRule != nil && !ks.fbStatic && policy.ThinShare(ks.fbLimit.Quota(), ks.fbLimit.Window(), ks.fbN)
}

// shareRetryAfter is the RetryAfter of a request of n tokens that the
// key's own bucket, of limit share (this agent's fallback or static share
// of rule r), denied with retryAfter at now.
//
// The share's burst is ⌈B/N⌉, so a request of more tokens than that gets
// bucket.Never from it, though it fits the rule's burst B: the share alone
// can never admit it, but a lease can (once the key holds one with n
// tokens; the refill loop asks for it, and while the allocator is
// unreachable it asks again on recovery), and so can a larger share when
// N falls. When that happens is not known here. The wait reported is the
// time the rule's own limit takes to refill n tokens from empty: a client
// that waits it asks again no sooner than the whole fleet's rate R could
// have refilled the request (n/R for a token bucket or GCRA, until the
// next window for the window algorithms). It may be denied again; it is
// not told the request can never succeed. (On a leased key with the
// breaker closed this wait is also the key's promise, promise.go: a retry
// at that moment the lease path denies is admitted once and charged to
// the allocator.) Only a request of more than the rule's burst keeps
// bucket.Never: no lease can admit it either; the transports clamp it to
// httplimit.MaxRetryAfter.
func shareRetryAfter(r *rules.Rule, share bucket.Limit, now, n int64, retryAfter time.Duration) time.Duration {
	l := r.Limit
	if retryAfter != bucket.Never || n <= share.Burst() || n > l.Burst() || l.DeniesAll() || l.IsZero() {
		return retryAfter
	}
	var s bucket.State
	l.TakeUpTo(&s, now, capacity(l, now))
	if ra := l.AllowN(&s, now, n).RetryAfter; ra > 0 && ra != bucket.Never {
		return ra
	}
	return retryAfter
}
