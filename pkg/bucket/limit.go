package bucket

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
)

// Bounds on Limit parameters and on time. They keep every product in range
// of the 128-bit arithmetic and every instant in range of an int64; values
// outside them are configuration mistakes, which NewLimit reports.
const (
	// MaxTokens bounds quota and burst.
	MaxTokens = 1 << 61
	// MaxSlidingQuota bounds a SlidingWindow's quota: the state keeps the
	// previous and current window counts in 32 bits each, and a count can
	// reach twice the quota in debt (see Debit).
	MaxSlidingQuota = math.MaxInt32
	// MaxWindow bounds the window, and for TokenBucket and GCRA the time to
	// refill a whole burst (burst·window/quota): about 36.5 years.
	MaxWindow = time.Duration(1 << 60)
	// MaxTime is the latest instant the algorithms distinguish, about year
	// 2116 in Unix nanoseconds. Later times are treated as MaxTime, and
	// times before the Unix epoch as 0.
	MaxTime = int64(1) << 62
)

// Never is the RetryAfter of a request that no amount of waiting can admit:
// n greater than the burst (or a window's quota).
const Never = time.Duration(math.MaxInt64)

// Unlimited is the Remaining reported by the zero Limit.
const Unlimited = int64(math.MaxInt64)

// String returns the algorithm's configuration name: "token_bucket", "gcra",
// "sliding_window" or "fixed_window".
func (a Algorithm) String() string {
	switch a {
	case TokenBucket:
		return "token_bucket"
	case GCRA:
		return "gcra"
	case SlidingWindow:
		return "sliding_window"
	case FixedWindow:
		return "fixed_window"
	}
	return fmt.Sprintf("Algorithm(%d)", uint8(a))
}

// ParseAlgorithm parses an algorithm's configuration name, ignoring case.
func ParseAlgorithm(s string) (Algorithm, error) {
	for a := TokenBucket; a <= FixedWindow; a++ {
		if strings.EqualFold(s, a.String()) {
			return a, nil
		}
	}
	return 0, fmt.Errorf("bucket: unknown algorithm %q (want token_bucket, gcra, sliding_window or fixed_window)", s)
}

// MarshalText implements encoding.TextMarshaler with String.
func (a Algorithm) MarshalText() ([]byte, error) {
	if a > FixedWindow {
		return nil, fmt.Errorf("bucket: invalid algorithm %d", uint8(a))
	}
	return []byte(a.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler with ParseAlgorithm.
func (a *Algorithm) UnmarshalText(b []byte) error {
	v, err := ParseAlgorithm(string(b))
	if err != nil {
		return err
	}
	*a = v
	return nil
}

// ErrInvalidLimit is wrapped by every NewLimit error.
var ErrInvalidLimit = errors.New("bucket: invalid limit")

// A Limit is the immutable, validated parameters of one rate limit: an
// algorithm admitting quota tokens per window, with a burst. Construct one
// with NewLimit. Limits are small values, comparable with ==, and safe to
// share between goroutines; the per-key mutable part is a State.
//
// The zero Limit is unlimited: it admits everything, changes no State, and
// reports Remaining = Unlimited. (pkg/rules compiles `unlimited: true` rules
// to it.)
type Limit struct {
	alg Algorithm
	// tokenNs: TokenBucket or GCRA with quota ≥ window, a token every
	// nanosecond or faster (NextAfter is a nanosecond).
	tokenNs bool
	quota   int64 // tokens per window, 1..MaxTokens; 0 only in the zero Limit
	window  int64 // ns, 1..MaxWindow
	burst   int64 // bucket capacity; == quota for the window algorithms
	tau     vt    // TokenBucket/GCRA: refill time of a full burst, burst·window/quota
	tau2    vt    // TokenBucket/GCRA: 2·tau, the debt floor
	deny    bool  // DenyAll: quota 0, admits nothing (see DenyAll)
}

// NewLimit returns a Limit admitting quota tokens per window with algorithm
// alg.
//
// For TokenBucket and GCRA, tokens refill continuously at quota/window up to
// burst, so burst tokens can be taken at once and quota per window are
// sustained; burst must be in [1, MaxTokens] and a full refill
// (burst·window/quota) must take at most MaxWindow.
//
// For SlidingWindow and FixedWindow the capacity of a window is its quota,
// and burst must equal quota (pkg/rules defaults burst to requests_per_unit).
// SlidingWindow's quota is at most MaxSlidingQuota.
//
// quota must be in [1, MaxTokens] and window in [1ns, MaxWindow]; quota and
// burst both 0 give DenyAll(window), so that a Limit rebuilt from its
// accessors is itself. Errors wrap ErrInvalidLimit.
func NewLimit(alg Algorithm, quota int64, window time.Duration, burst int64) (Limit, error) {
	fail := func(format string, args ...any) (Limit, error) {
		return Limit{}, fmt.Errorf("%w: "+format, append([]any{ErrInvalidLimit}, args...)...)
	}
	if quota == 0 && burst == 0 && alg <= FixedWindow && window > 0 && window <= MaxWindow {
		// What DenyAll produces, so that a Limit stored as its
		// parameters (allocator snapshots) comes back as itself.
		return DenyAll(window)
	}
	switch {
	case alg > FixedWindow:
		return fail("unknown algorithm %d", uint8(alg))
	case quota < 1:
		return fail("quota must be ≥ 1, got %d", quota)
	case quota > MaxTokens:
		return fail("quota must be ≤ %d, got %d", int64(MaxTokens), quota)
	case window <= 0:
		return fail("window must be > 0, got %v", window)
	case window > MaxWindow:
		return fail("window must be ≤ %v, got %v", MaxWindow, window)
	case burst < 1:
		return fail("burst must be ≥ 1, got %d", burst)
	case burst > MaxTokens:
		return fail("burst must be ≤ %d, got %d", int64(MaxTokens), burst)
	}
	l := Limit{alg: alg, quota: quota, window: int64(window), burst: burst}
	switch alg {
	case TokenBucket, GCRA:
		// burst·window/quota ≤ MaxWindow, compared exactly in 128 bits.
		if mul64(uint64(quota), uint64(MaxWindow)).less(mul64(uint64(burst), uint64(window))) {
			return fail("refilling the burst (burst·window/quota = %d·%v/%d) must take at most %v", burst, window, quota, MaxWindow)
		}
		l.tau = l.span(burst)
		l.tau2 = l.vadd(l.tau, l.tau)
		l.tokenNs = quota >= int64(window)
	case SlidingWindow, FixedWindow:
		if burst != quota {
			return fail("%s: burst must equal quota (%d), got %d", alg, quota, burst)
		}
		if alg == SlidingWindow && quota > MaxSlidingQuota {
			return fail("sliding_window: quota must be ≤ %d, got %d", MaxSlidingQuota, quota)
		}
	}
	return l, nil
}

// DenyAll returns a Limit that admits nothing: envoyproxy/ratelimit's
// `requests_per_unit: 0`, which blocks a key. Every check is denied (a
// check without consuming, n ≤ 0, is allowed), TakeUpTo grants nothing,
// GiveBack and Debit change nothing, Remaining is 0, and RetryAfter is the
// time until the next Unix-epoch multiple of window (when Envoy's fixed
// window would reset — and deny again). window must be in [1ns, MaxWindow].
func DenyAll(window time.Duration) (Limit, error) {
	if window <= 0 || window > MaxWindow {
		return Limit{}, fmt.Errorf("%w: window must be in (0, %v], got %v", ErrInvalidLimit, MaxWindow, window)
	}
	return Limit{window: int64(window), deny: true}, nil
}

// DeniesAll reports whether l was made by DenyAll.
func (l Limit) DeniesAll() bool { return l.deny }

// denyResult is what a DenyAll limit answers for a check of n tokens.
func (l Limit) denyResult(now, n int64) Result {
	if n <= 0 {
		return Result{Allowed: true}
	}
	return Result{RetryAfter: dur(l.window - now%l.window)}
}

// Algorithm returns the limit's algorithm.
func (l Limit) Algorithm() Algorithm { return l.alg }

// Quota returns the tokens admitted per window (0 for the zero Limit).
func (l Limit) Quota() int64 { return l.quota }

// Window returns the window.
func (l Limit) Window() time.Duration { return time.Duration(l.window) }

// Burst returns the capacity: the most tokens that can be taken at once.
// For the window algorithms it equals Quota.
func (l Limit) Burst() int64 { return l.burst }

// IsZero reports whether l is the zero (unlimited) Limit.
func (l Limit) IsZero() bool { return l.quota == 0 && !l.deny }

// String describes the limit, e.g. "token_bucket 30/1m0s burst 10".
func (l Limit) String() string {
	if l.IsZero() {
		return "unlimited"
	}
	if l.deny {
		return fmt.Sprintf("deny all (window %v)", time.Duration(l.window))
	}
	if l.alg == SlidingWindow || l.alg == FixedWindow {
		return fmt.Sprintf("%s %d/%v", l.alg, l.quota, time.Duration(l.window))
	}
	return fmt.Sprintf("%s %d/%v burst %d", l.alg, l.quota, time.Duration(l.window), l.burst)
}

// State is one key's mutable limiter state: 16 bytes, exported so snapshots
// can serialise it. Its meaning depends on the Limit's algorithm:
//
//   - TokenBucket, GCRA: A + B/quota is the instant (Unix ns) at which the
//     bucket is full again, which GCRA calls the theoretical arrival time
//     (TAT); 0 ≤ B < quota. The two algorithms share this encoding, so a rule
//     may switch between them without disturbing its keys.
//   - FixedWindow: A is the start of the window the count belongs to (a
//     Unix-epoch multiple of the window) and B the tokens taken in it.
//   - SlidingWindow: A is the start of the current window; B holds the
//     previous window's count in its high 32 bits and the current window's
//     in its low 32 bits.
//
// The zero State is a full bucket / an empty window at every instant. A State
// is only meaningful with the Limit that produced it. Using it with a changed
// Limit never panics and never reports more than the new burst; the token
// algorithms carry the time to refill over (not the token count), the window
// algorithms carry the counts over.
//
// A State is not safe for concurrent use: callers serialise access (the
// allocator's FSM lock, the agent's per-key lock, or Limiter).
type State struct{ A, B int64 }

// clampTime maps now into [0, MaxTime].
func clampTime(now int64) int64 {
	if now < 0 {
		return 0
	}
	if now > MaxTime {
		return MaxTime
	}
	return now
}

// dur converts nanoseconds to a Duration.
func dur(ns int64) time.Duration { return time.Duration(ns) }

// unlimitedResult is what the zero Limit answers.
var unlimitedResult = Result{Allowed: true, Remaining: Unlimited}

// AllowN takes n tokens from s at now if all n are available, and otherwise
// takes nothing. This is the method most callers want.
//
// Allowed reports whether the tokens were taken; Remaining is the tokens left
// afterwards (negative while s is in debt, see Debit; never below −Burst);
// RetryAfter, when denied, is how long until n tokens are available (Never if
// n exceeds the burst); ResetAfter is how long until s is full again.
//
// n ≤ 0 takes nothing and checks without consuming: it is allowed unless s
// is in debt (Remaining < 0), as envoyproxy/ratelimit treats hits_addend 0.
//
// Time (now, Unix ns) may go backwards between calls: a call sees the state
// as of its own now, so an earlier now sees no more tokens than a later one
// would, and no call mints tokens (the window algorithms treat an instant
// before the state's window as the window's start).
func (l Limit) AllowN(s *State, now, n int64) Result {
	now = clampTime(now)
	switch l.alg {
	case TokenBucket: // the zero Limit's algorithm, and DenyAll's
		if l.quota == 0 {
			if l.deny {
				return l.denyResult(now, n)
			}
			return unlimitedResult
		}
		return l.tbAllowN(s, now, n)
	case GCRA:
		return l.gcraAllowN(s, now, n)
	case SlidingWindow:
		return l.swAllowN(s, now, n)
	default:
		return l.fwAllowN(s, now, n)
	}
}

// TakeUpTo takes min(n, available) tokens from s at now and returns how many
// it took (0 when n ≤ 0 or s is empty or in debt). The allocator grants
// leases with it.
func (l Limit) TakeUpTo(s *State, now, n int64) int64 {
	if n <= 0 {
		return 0
	}
	now = clampTime(now)
	switch l.alg {
	case TokenBucket: // the zero Limit's algorithm, and DenyAll's
		if l.quota == 0 {
			if l.deny {
				return 0
			}
			return n
		}
		return l.tbTakeUpTo(s, now, n)
	case GCRA:
		return l.gcraTakeUpTo(s, now, n)
	case SlidingWindow:
		return l.swTakeUpTo(s, now, n)
	default:
		return l.fwTakeUpTo(s, now, n)
	}
}

// GiveBack returns n unspent tokens to s at now, capped so that s is at most
// full (burst, or an empty window). For the window algorithms it lowers the
// count, never below 0; tokens taken in a window that has since ended are no
// longer counted and cannot be given back (SlidingWindow gives back from the
// current window first, then from the previous one). n ≤ 0 does nothing.
func (l Limit) GiveBack(s *State, now, n int64) {
	if n <= 0 || l.quota == 0 {
		return
	}
	n = min64(n, 2*l.burst) // more can never be outstanding
	now = clampTime(now)
	switch l.alg {
	case TokenBucket:
		l.tbGiveBack(s, now, n)
	case GCRA:
		l.gcraGiveBack(s, now, n)
	case SlidingWindow:
		l.swGiveBack(s, now, n)
	default:
		l.fwGiveBack(s, now, n)
	}
}

// Debit forcibly takes n tokens that were already admitted (for example by
// an agent's fallback bucket), going into debt if needed. The debt is
// bounded: Remaining never drops below −Burst (a window's count never
// exceeds twice its quota); tokens beyond the floor are forgiven. A state
// already below the floor is left as it is. n ≤ 0 does nothing.
func (l Limit) Debit(s *State, now, n int64) {
	if n <= 0 || l.quota == 0 {
		return
	}
	n = min64(n, 2*l.burst)
	now = clampTime(now)
	switch l.alg {
	case TokenBucket:
		l.tbDebit(s, now, n)
	case GCRA:
		l.gcraDebit(s, now, n)
	case SlidingWindow:
		l.swDebit(s, now, n)
	default:
		l.fwDebit(s, now, n)
	}
}

// Drain empties s at now, without going into debt: afterwards no token is
// available, and s refills no sooner than a full state emptied at now
// would (for the window algorithms, the current window has counted at
// least the quota). A state that is already that empty, or in debt, is left
// as it is, so draining twice is draining once.
func (l Limit) Drain(s *State, now int64) {
	if l.quota == 0 {
		return
	}
	now = clampTime(now)
	switch l.alg {
	case TokenBucket:
		l.tbDrain(s, now)
	case GCRA:
		l.gcraDrain(s, now)
	case SlidingWindow:
		l.swDrain(s, now)
	default:
		l.fwDrain(s, now)
	}
}

// Peek reports s at now without changing it: Remaining is the tokens
// available (negative in debt), Allowed is Remaining ≥ 1, RetryAfter (when
// not Allowed) is how long until one token is available, and ResetAfter is
// how long until s is full again.
func (l Limit) Peek(s State, now int64) Result {
	if l.quota == 0 {
		if l.deny {
			return l.denyResult(clampTime(now), 1)
		}
		return unlimitedResult
	}
	now = clampTime(now)
	switch l.alg {
	case TokenBucket:
		return l.tbPeek(s, now)
	case GCRA:
		return l.gcraPeek(s, now)
	case SlidingWindow:
		return l.swPeek(s, now)
	default:
		return l.fwPeek(s, now)
	}
}
