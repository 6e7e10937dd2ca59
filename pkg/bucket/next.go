package bucket

import "time"

// NextAfter is how long from now until more quota becomes available, for a
// key whose state is full again after resetAfter (Result.ResetAfter): the
// next whole token for TokenBucket and GCRA, the next window boundary for
// FixedWindow and SlidingWindow. It is 0 when resetAfter ≤ 0 (the state is
// full: nothing more is to come) and for unlimited and deny-all limits.
// This is draft-ietf-httpapi-ratelimit-headers' t on an allowed response.
//
// For the token buckets, whole tokens come back every window/quota; the
// bucket is full at resetAfter, so the next token is due resetAfter modulo
// window/quota from now (a full interval when that is 0), rounded up to the
// nanosecond. The window algorithms count in windows aligned to multiples
// of the window since the Unix epoch, whatever the state.
func (l Limit) NextAfter(now int64, resetAfter time.Duration) time.Duration {
	if l.tokenNs && resetAfter > 0 {
		// r in nextAfter is at most window ≤ quota: a nanosecond once
		// rounded up.
		return 1
	}
	return l.nextAfter(now, resetAfter)
}

// nextAfter is NextAfter past its case without a division (apart, so that
// NextAfter is inlined).
func (l Limit) nextAfter(now int64, resetAfter time.Duration) time.Duration {
	if resetAfter <= 0 || l.quota == 0 {
		return 0
	}
	switch l.alg {
	case TokenBucket, GCRA:
		// r = resetAfter·quota mod window, in (0, window]: the part of the
		// deficit that is not a whole token.
		_, r := mul64(uint64(resetAfter), uint64(l.quota)).divmod(uint64(l.window))
		if r == 0 {
			r = uint64(l.window)
		}
		return dur(int64((r + uint64(l.quota) - 1) / uint64(l.quota)))
	default:
		now = clampTime(now)
		return min(resetAfter, dur(l.window-now%l.window))
	}
}
