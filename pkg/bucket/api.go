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
// lock).
//
// Most callers want Limit.AllowN (check-and-take). The allocator grants
// leases with TakeUpTo and takes unspent tokens back with GiveBack; Debit
// charges tokens that were admitted before they could be leased.
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
	Remaining  int64         // tokens (or window capacity) left after the call
	RetryAfter time.Duration // when denied: until n tokens could be taken; 0 when allowed
	ResetAfter time.Duration // until the state is back to full / the window resets
}
