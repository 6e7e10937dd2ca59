package redislimit

import (
	"sync"
	"sync/atomic"
)

// breaker is a consecutive-failure circuit breaker.
//
// Closed: calls go through; failures counts consecutive failures, and the
// threshold-th opens the breaker. Open: calls fail at once, without I/O,
// until cooldown has passed since it opened; then the next call is the one
// probe (half-open) while the others keep failing fast. The probe's success
// closes the breaker; its failure reopens it for another cooldown.
//
// The closed path is two atomic loads and, on success after failures, one
// store; the mutex is only taken on transitions.
type breaker struct {
	threshold int32
	cooldown  int64 // ns

	state    atomic.Int32 // breakerClosed, breakerOpen, breakerHalfOpen
	failures atomic.Int32 // consecutive failures while closed

	mu       sync.Mutex // guards openedAt and serialises transitions
	openedAt int64

	onChange func(from, to int32) // called with mu held; nil = none
}

const (
	breakerClosed int32 = iota
	breakerOpen
	breakerHalfOpen
)

func newBreaker(threshold int, cooldown int64) *breaker {
	return &breaker{threshold: int32(threshold), cooldown: cooldown}
}

// allow reports whether a call may proceed at now, and whether it is the
// half-open probe (which must be reported with success or failure).
func (b *breaker) allow(now int64) (ok, probe bool) {
	if b.state.Load() == breakerClosed {
		return true, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch b.state.Load() {
	case breakerClosed:
		return true, false
	case breakerOpen:
		if now-b.openedAt >= b.cooldown || now < b.openedAt {
			b.set(breakerHalfOpen)
			return true, true
		}
	}
	return false, false // open, or half-open with the probe in flight
}

// success records a successful call.
func (b *breaker) success(probe bool) {
	if probe {
		b.mu.Lock()
		b.failures.Store(0)
		b.set(breakerClosed)
		b.mu.Unlock()
		return
	}
	if b.failures.Load() != 0 {
		b.failures.Store(0)
	}
}

// failure records a failed call at now.
func (b *breaker) failure(now int64, probe bool) {
	if !probe && b.failures.Add(1) < b.threshold {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if probe || b.state.Load() == breakerClosed {
		b.openedAt = now
		b.set(breakerOpen)
	}
}

// abandon releases a probe whose call ended without telling anything about
// Redis (the caller's context was cancelled): the breaker reopens with its
// old opening time, so the next call probes again at once.
func (b *breaker) abandon() {
	b.mu.Lock()
	if b.state.Load() == breakerHalfOpen {
		b.set(breakerOpen)
	}
	b.mu.Unlock()
}

// closed reports whether the breaker is closed.
func (b *breaker) closed() bool { return b.state.Load() == breakerClosed }

// set changes the state; b.mu is held.
func (b *breaker) set(to int32) {
	from := b.state.Swap(to)
	if from != to && b.onChange != nil {
		b.onChange(from, to)
	}
}
