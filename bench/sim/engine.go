package main

import (
	"math"
	"math/rand/v2"
	"time"
)

// epoch is virtual time zero, as Unix nanoseconds: every component of a
// simulation (agents, the allocator state, the Redis model) reads time only
// from the engine, never from the machine's clock.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()

// handler is an event's action. Recurring sources (request arrivals, refill
// ticks) implement it on a long-lived value so that scheduling them does not
// allocate; one-off events use funcEvent.
type handler interface{ fire(arg int64) }

type funcEvent func()

func (f funcEvent) fire(int64) { f() }

type event struct {
	at  int64  // virtual Unix nanoseconds
	seq uint64 // insertion order: ties run first-scheduled first
	h   handler
	arg int64
}

// engine is a discrete-event loop over a virtual clock. Events at the same
// instant run in the order they were scheduled, so a run is a function of
// its inputs and seed.
type engine struct {
	now int64
	seq uint64
	q   []event // binary min-heap on (at, seq)
}

func newEngine() *engine { return &engine{now: epoch} }

// since is the virtual time elapsed since epoch.
func (e *engine) since() time.Duration { return time.Duration(e.now - epoch) }

// at schedules h.fire(arg) at t (never in the past: t < now runs at now).
func (e *engine) at(t int64, h handler, arg int64) {
	if t < e.now {
		t = e.now
	}
	e.seq++
	e.q = append(e.q, event{at: t, seq: e.seq, h: h, arg: arg})
	e.up(len(e.q) - 1)
}

func (e *engine) after(d time.Duration, f func()) { e.at(e.now+int64(d), funcEvent(f), 0) }

func (e *engine) atFunc(t int64, f func()) { e.at(t, funcEvent(f), 0) }

func less(a, b *event) bool { return a.at < b.at || a.at == b.at && a.seq < b.seq }

func (e *engine) up(i int) {
	q := e.q
	for i > 0 {
		p := (i - 1) / 2
		if !less(&q[i], &q[p]) {
			break
		}
		q[i], q[p] = q[p], q[i]
		i = p
	}
}

func (e *engine) down(i int) {
	q := e.q
	n := len(q)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		m := l
		if r := l + 1; r < n && less(&q[r], &q[l]) {
			m = r
		}
		if !less(&q[m], &q[i]) {
			return
		}
		q[i], q[m] = q[m], q[i]
		i = m
	}
}

// step runs the earliest event if it is before until, and reports whether
// it ran one.
func (e *engine) step(until int64) bool {
	if len(e.q) == 0 || e.q[0].at >= until {
		return false
	}
	ev := e.q[0]
	last := len(e.q) - 1
	e.q[0] = e.q[last]
	e.q[last] = event{}
	e.q = e.q[:last]
	if last > 0 {
		e.down(0)
	}
	e.now = ev.at
	ev.h.fire(ev.arg)
	return true
}

// run processes every event before until, then sets the clock to until.
func (e *engine) run(until int64) {
	for e.step(until) {
	}
	if e.now < until {
		e.now = until
	}
}

// newRand returns an independent deterministic stream for one component:
// the run's seed and a stream name.
func newRand(seed uint64, stream string) *rand.Rand {
	h := uint64(14695981039346656037)
	for i := 0; i < len(stream); i++ {
		h ^= uint64(stream[i])
		h *= 1099511628211
	}
	return rand.New(rand.NewPCG(seed, h))
}

// logNormal is a latency distribution given by its median and 99th
// percentile.
type logNormal struct {
	mu, sigma float64
}

func newLogNormal(p50, p99 time.Duration) logNormal {
	if p99 < p50 {
		p99 = p50
	}
	mu := math.Log(float64(p50))
	return logNormal{mu: mu, sigma: (math.Log(float64(p99)) - mu) / 2.3263478740408408}
}

func (l logNormal) sample(r *rand.Rand) int64 {
	return int64(math.Exp(l.mu + l.sigma*r.NormFloat64()))
}

// expInterval is an exponential inter-arrival time at rate per second.
func expInterval(r *rand.Rand, rate float64) int64 {
	return int64(r.ExpFloat64() / rate * 1e9)
}
