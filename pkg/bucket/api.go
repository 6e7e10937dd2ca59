// Package bucket holds allot's limiter algorithms as pure, deterministic
// state machines: token bucket (the default), GCRA, sliding-window counter
// and fixed window.
//
// A Limit is the immutable, validated parameters of one rule; a State is one
// key's 16-byte mutable state. Every operation takes the current time as an
// argument (int64 Unix nanoseconds) and reads no clock, so the same calls
// give the same results on every replica. The zero State is a full bucket /
// an empty window. Neither type is safe for concurrent mutation: callers
// serialise access to a State (the allocator's FSM lock, the agent's per-key
// lock). Limiter wraps one Limit and State in a mutex for callers that want a
// goroutine-safe single-key limiter, like golang.org/x/time/rate.Limiter.
//
// Most callers want Limit.AllowN (check-and-take). The allocator grants
// leases with TakeUpTo and takes unspent tokens back with GiveBack; Debit
// charges tokens that were admitted before they could be leased; Drain
// empties a state (pkg/redislimit empties sub-keys before they go live).
//
// The arithmetic is exact: integers, with 128-bit intermediates
// (math/bits) where products may overflow, and no floating point. A token
// bucket refilling one token every 333,333,333⅓ ns keeps the ⅓, so however
// often it is called it admits exactly quota tokens per window, and
// RetryAfter is the exact wait rounded up to the nanosecond. Time may go
// backwards between calls; no call mints tokens (see Limit.AllowN). Times are
// clamped to [0, MaxTime].
package bucket

import "time"

// Algorithm selects the limiter algorithm of a Limit.
type Algorithm uint8

const (
	// TokenBucket refills continuously at quota/window up to burst. Default.
	TokenBucket Algorithm = iota
	// GCRA tracks one theoretical arrival time; equivalent to TokenBucket.
	GCRA
	// SlidingWindow estimates prev·(W−elapsed)/W + curr over two windows.
	SlidingWindow
	// FixedWindow counts per window aligned to Unix-epoch multiples of the
	// window, as envoyproxy/ratelimit does.
	FixedWindow
)

// Result is the outcome of a check.
type Result struct {
	Allowed    bool
	Remaining  int64         // tokens (or window capacity) left after the call; negative in debt, never below −burst
	RetryAfter time.Duration // when denied: until n tokens could be taken (Never if n > burst); 0 when allowed
	ResetAfter time.Duration // until the state is back to full / the window resets; 0 when already full
}
