package breaker

import (
	"sync"
	"sync/atomic"
)

// State is a Shared breaker's state.
type State int32

// The states of a Shared breaker.
const (
	Closed   State = iota // calls go through
	Open                  // calls fail at once until a probe is due
	HalfOpen              // one probe is out; the other calls fail at once
)

// Shared is a Breaker for concurrent callers, with one probe at a time:
// while the probe is out (HalfOpen) the other calls are refused, its
// success closes the breaker and its failure reopens it.
//
// The closed path without failures is one atomic load in Allow and one in
// Success; the mutex is taken only on failures and transitions.
type Shared struct {
	state atomic.Int32 // a State
	dirty atomic.Bool  // closed with failures counted: a success must reset them

	mu sync.Mutex // guards b and serialises transitions
	b  *Breaker

	// OnChange, when set, is called on every transition, with the mutex
	// held (it must not call back into the breaker). Set it before use.
	OnChange func(from, to State)
}

// NewShared returns a closed Shared breaker; it panics on a config
// Validate rejects.
func NewShared(cfg Config) *Shared { return &Shared{b: New(cfg)} }

// Allow reports whether a call may proceed at now, and whether it is the
// probe (which must be reported with Success, Failure or Abandon).
func (s *Shared) Allow(now int64) (ok, probe bool) {
	if State(s.state.Load()) == Closed {
		return true, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch State(s.state.Load()) {
	case Closed:
		return true, false
	case Open:
		if s.b.Allow(now) {
			s.set(HalfOpen)
			return true, true
		}
	}
	return false, false // open, or half-open with the probe out
}

// Success records a successful call. The probe's success closes the
// breaker; a call that started before the breaker opened does not.
func (s *Shared) Success(probe bool) {
	if !probe && !s.dirty.Load() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if probe || State(s.state.Load()) == Closed {
		s.b.Success()
		s.dirty.Store(false)
		s.set(Closed)
	}
}

// Failure records a failed call at now. The probe's failure reopens the
// breaker for another cooldown; a call that started before the breaker
// opened changes nothing.
func (s *Shared) Failure(now int64, probe bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case probe:
		s.b.Failure(now)
		s.set(Open)
	case State(s.state.Load()) == Closed:
		s.dirty.Store(true)
		if s.b.Failure(now) {
			s.set(Open)
		}
	}
}

// Abandon releases a probe whose call ended without telling anything about
// the callee (the caller's context was cancelled): the breaker reopens as
// it was, so the next call probes again at once.
func (s *Shared) Abandon() {
	s.mu.Lock()
	if State(s.state.Load()) == HalfOpen {
		s.set(Open)
	}
	s.mu.Unlock()
}

// State returns the current state.
func (s *Shared) State() State { return State(s.state.Load()) }

// set changes the state; s.mu is held.
func (s *Shared) set(to State) {
	from := State(s.state.Swap(int32(to)))
	if from != to && s.OnChange != nil {
		s.OnChange(from, to)
	}
}
