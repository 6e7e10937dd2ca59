package redislimit

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Stats are the backend's counters since New.
type Stats struct {
	Calls       uint64 // script calls sent to Redis (EVALSHA), failed ones included
	Errors      uint64 // calls that failed (timeouts, connection errors, Redis errors)
	FastFails   uint64 // calls refused by the open breaker, without I/O
	Allowed     uint64 // AllowN results allowed
	Denied      uint64 // AllowN results denied
	SecondTries uint64 // sharded checks that tried a second sub-key
	Promotions  uint64 // keys this backend promoted to sharded
}

// metrics holds the counters and, when a Registerer is configured, their
// Prometheus twins. No metric has a per-key label.
type metrics struct {
	calls, errors, fastFails, allowed, denied, second, promotions atomic.Uint64

	pCalls, pErrors, pFastFails, pAllowed, pDenied, pSecond, pPromotions prometheus.Counter
	pSeconds                                                             prometheus.Histogram
	pBreaker                                                             prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{}
	if reg == nil {
		return m, nil
	}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	checks := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_redis_checks_total", Help: "Checks decided by Redis, by result.",
	}, []string{"result"})
	m.pAllowed = checks.WithLabelValues("allowed")
	m.pDenied = checks.WithLabelValues("denied")
	m.pCalls = counter("allot_redis_calls_total", "Script calls sent to Redis.")
	m.pErrors = counter("allot_redis_errors_total", "Script calls that failed (timeout, connection, Redis error).")
	m.pFastFails = counter("allot_redis_breaker_rejects_total", "Calls failed fast by the open circuit breaker.")
	m.pSecond = counter("allot_redis_second_tries_total", "Sharded checks that tried a second sub-key.")
	m.pPromotions = counter("allot_redis_promotions_total", "Keys this agent promoted to sharded sub-keys.")
	m.pSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "allot_redis_call_seconds",
		Help:    "Latency of script calls to Redis.",
		Buckets: []float64{50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3},
	})
	m.pBreaker = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_redis_breaker_state", Help: "Circuit breaker: 0 closed, 1 open, 2 half-open.",
	})
	for _, c := range []prometheus.Collector{checks, m.pCalls, m.pErrors, m.pFastFails, m.pSecond, m.pPromotions, m.pSeconds, m.pBreaker} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func inc(a *atomic.Uint64, c prometheus.Counter) {
	a.Add(1)
	if c != nil {
		c.Inc()
	}
}

func (m *metrics) call(seconds float64) {
	inc(&m.calls, m.pCalls)
	if m.pSeconds != nil {
		m.pSeconds.Observe(seconds)
	}
}
func (m *metrics) failed()   { inc(&m.errors, m.pErrors) }
func (m *metrics) fastFail() { inc(&m.fastFails, m.pFastFails) }
func (m *metrics) decided(allowed bool) {
	if allowed {
		inc(&m.allowed, m.pAllowed)
	} else {
		inc(&m.denied, m.pDenied)
	}
}
func (m *metrics) secondTry() { inc(&m.second, m.pSecond) }
func (m *metrics) promoted()  { inc(&m.promotions, m.pPromotions) }
func (m *metrics) breaker(state int32) {
	if m.pBreaker != nil {
		m.pBreaker.Set(float64(state))
	}
}

func (m *metrics) stats() Stats {
	return Stats{
		Calls: m.calls.Load(), Errors: m.errors.Load(), FastFails: m.fastFails.Load(),
		Allowed: m.allowed.Load(), Denied: m.denied.Load(), SecondTries: m.second.Load(),
		Promotions: m.promotions.Load(),
	}
}
