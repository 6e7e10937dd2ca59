package bucket

import (
	"sync"
	"time"
)

// A Limiter is one Limit and its State behind a mutex: a goroutine-safe
// limiter for a single key, comparable to golang.org/x/time/rate.Limiter.
// Most callers want Allow or AllowN. Code that manages many keys should keep
// States in its own sharded structure and call the Limit methods directly.
//
// The zero Limiter is unlimited (it holds the zero Limit).
type Limiter struct {
	mu    sync.Mutex // guards state
	limit Limit      // immutable after NewLimiter
	state State
}

// NewLimiter returns a Limiter for l, starting full.
func NewLimiter(l Limit) *Limiter { return &Limiter{limit: l} }

// Limit returns the limiter's Limit.
func (lim *Limiter) Limit() Limit { return lim.limit }

// AllowN takes n tokens at t if all n are available; see Limit.AllowN.
func (lim *Limiter) AllowN(t time.Time, n int64) Result {
	now := t.UnixNano()
	lim.mu.Lock()
	r := lim.limit.AllowN(&lim.state, now, n)
	lim.mu.Unlock()
	return r
}

// Allow is AllowN(time.Now(), 1).Allowed.
func (lim *Limiter) Allow() bool { return lim.AllowN(time.Now(), 1).Allowed }

// TakeUpTo takes up to n tokens at t and returns how many; see
// Limit.TakeUpTo.
func (lim *Limiter) TakeUpTo(t time.Time, n int64) int64 {
	now := t.UnixNano()
	lim.mu.Lock()
	g := lim.limit.TakeUpTo(&lim.state, now, n)
	lim.mu.Unlock()
	return g
}

// GiveBack returns n unspent tokens at t; see Limit.GiveBack.
func (lim *Limiter) GiveBack(t time.Time, n int64) {
	now := t.UnixNano()
	lim.mu.Lock()
	lim.limit.GiveBack(&lim.state, now, n)
	lim.mu.Unlock()
}

// Peek reports the limiter at t without changing it; see Limit.Peek.
func (lim *Limiter) Peek(t time.Time) Result {
	now := t.UnixNano()
	lim.mu.Lock()
	s := lim.state
	lim.mu.Unlock()
	return lim.limit.Peek(s, now)
}
