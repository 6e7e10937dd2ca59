// Package breaker is a consecutive-failure circuit breaker. The agent's
// refill loop guards its calls to the allocators with a Breaker, and the
// Redis backend its calls to Redis with a Shared one.
//
// Closed, calls go through and Failure counts consecutive failures; the
// Threshold-th opens the breaker. Open, calls are refused without I/O until
// a probe is due, Cooldown after the opening; a failed probe reopens it and
// doubles the wait, up to MaxCooldown; a successful call closes it.
//
// Every operation takes the time (Unix nanoseconds) as an argument: the
// breaker reads no clock and starts no goroutine, and the clock may go
// backwards (a probe is then due at once).
package breaker

import (
	"errors"
	"time"
)

// Config configures a breaker.
type Config struct {
	// Threshold is the number of consecutive failures that opens the
	// breaker (≥ 1).
	Threshold int
	// Cooldown is the wait from the opening to the first probe (> 0).
	Cooldown time.Duration
	// MaxCooldown bounds the wait as failed probes double it. At most
	// Cooldown (or zero): the wait stays Cooldown.
	MaxCooldown time.Duration
	// Jitter, when set, draws each wait from the doubled one (for example
	// "equal jitter", d/2 + uniform(0, d/2)). nil: the wait as is.
	Jitter func(time.Duration) time.Duration
}

// Validate reports a threshold below 1 or a cooldown that is not positive.
func (c Config) Validate() error {
	if c.Threshold < 1 {
		return errors.New("breaker: threshold must be ≥ 1")
	}
	if c.Cooldown <= 0 {
		return errors.New("breaker: cooldown must be > 0")
	}
	return nil
}

// Breaker is the breaker's state machine, for one owner: it is not safe
// for concurrent use (Shared is). The zero value is not usable; use New.
type Breaker struct {
	cfg      Config
	failures int           // consecutive failures
	open     bool          // refusing calls until next
	wait     time.Duration // the current wait between probes, while open
	openedAt int64         // the last opening or failed probe
	next     int64         // when the next probe is due, while open
}

// New returns a closed breaker. It panics on a config Validate rejects:
// the callers validate their own configuration first.
func New(cfg Config) *Breaker {
	if err := cfg.Validate(); err != nil {
		panic(err)
	}
	return &Breaker{cfg: cfg}
}

// Allow reports whether a call may go out at now: the breaker is closed,
// or it is open and a probe is due.
func (b *Breaker) Allow(now int64) bool {
	return !b.open || now >= b.next || now < b.openedAt
}

// Success records a successful call: the failure count restarts and an
// open breaker closes. It reports whether it closed the breaker.
func (b *Breaker) Success() (closed bool) {
	b.failures = 0
	if !b.open {
		return false
	}
	b.open, b.wait, b.next = false, 0, 0
	return true
}

// Failure records a failed call at now. The Threshold-th consecutive
// failure opens the breaker (the first probe is due Cooldown later); a
// failure while open doubles the wait, up to MaxCooldown, from now. It
// reports whether this failure opened the breaker.
func (b *Breaker) Failure(now int64) (opened bool) {
	b.failures++
	switch {
	case !b.open && b.failures >= b.cfg.Threshold:
		b.open, b.wait = true, b.cfg.Cooldown
		opened = true
	case b.open:
		b.wait = max(min(2*b.wait, b.cfg.MaxCooldown), b.cfg.Cooldown)
	default:
		return false
	}
	b.openedAt = now
	w := b.wait
	if b.cfg.Jitter != nil {
		w = b.cfg.Jitter(w)
	}
	b.next = now + int64(w)
	return opened
}

// Open reports whether the breaker is open.
func (b *Breaker) Open() bool { return b.open }

// Failures returns the number of consecutive failures.
func (b *Breaker) Failures() int { return b.failures }

// NextProbe returns when the next probe is due (Unix nanoseconds), 0 while
// closed.
func (b *Breaker) NextProbe() int64 { return b.next }
