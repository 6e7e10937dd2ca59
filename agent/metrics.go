package agent

import (
	"errors"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

const (
	numSources = int(SourceRedis) + 1
	numStripes = 16 // 1<<4: stripeFor takes the top 4 bits
)

// metrics holds the agent's Prometheus metrics. Per-check counters are
// striped (a check increments a random stripe) and summed at scrape time by
// a custom collector, so parallel checks do not contend on one cache line.
// No metric has a per-key label.
type metrics struct {
	stripes [numStripes]stripe

	fallback       prometheus.Gauge
	toOpen         prometheus.Counter
	toClosed       prometheus.Counter
	callsOK        prometheus.Counter
	callsFailed    prometheus.Counter
	callsRejected  prometheus.Counter
	callSeconds    prometheus.Histogram
	keysSent       prometheus.Counter
	granted        prometheus.Counter
	charged        prometheus.Counter
	paid           prometheus.Counter
	returned       prometheus.Counter
	keys           prometheus.Gauge
	fallbackKeys   prometheus.Gauge
	rulesVersion   prometheus.Gauge
	reloadsOK      prometheus.Counter
	reloadsFailed  prometheus.Counter
	redisErrors    prometheus.Counter
	decisionsDesc  *prometheus.Desc
	shadowDesc     *prometheus.Desc
	registeredWith prometheus.Registerer
	collectors     []prometheus.Collector
}

type stripe struct {
	decisions [numSources][2]atomic.Uint64 // [source][allowed]
	shadow    atomic.Uint64
	_         [128 - (numSources*2+1)*8]byte
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		decisionsDesc: prometheus.NewDesc("allot_agent_decisions_total",
			"Checks decided, by the source of the reported limit and the result.",
			[]string{"source", "result"}, nil),
		shadowDesc: prometheus.NewDesc("allot_agent_shadow_denials_total",
			"Descriptors over a limit whose rule is in shadow mode (counted, not enforced).", nil, nil),
	}
	transitions := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_agent_breaker_transitions_total",
		Help: "Circuit breaker transitions to the fallback (open) and back (closed).",
	}, []string{"to"})
	m.toOpen = transitions.WithLabelValues("open")
	m.toClosed = transitions.WithLabelValues("closed")
	calls := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_agent_acquire_calls_total",
		Help: "Acquire calls by result: ok, failed (transport, counts towards the breaker), rejected (answered with an error).",
	}, []string{"result"})
	m.callsOK = calls.WithLabelValues("ok")
	m.callsFailed = calls.WithLabelValues("failed")
	m.callsRejected = calls.WithLabelValues("rejected")
	tokens := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_agent_tokens_total",
		Help: "Tokens granted by the allocator, charged to it for fallback admissions, paid for fallback admissions out of a grant, and returned to it.",
	}, []string{"kind"})
	m.granted = tokens.WithLabelValues("granted")
	m.charged = tokens.WithLabelValues("charged")
	m.paid = tokens.WithLabelValues("paid")
	m.returned = tokens.WithLabelValues("returned")
	reloads := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_agent_rules_reloads_total",
		Help: "Rule set reloads by result (error: the new set was rejected and the old one kept).",
	}, []string{"result"})
	m.reloadsOK = reloads.WithLabelValues("ok")
	m.reloadsFailed = reloads.WithLabelValues("error")
	m.fallback = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_agent_fallback",
		Help: "1 while the allocator is unreachable (circuit breaker open) and keys are decided by fallback buckets.",
	})
	m.callSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "allot_agent_acquire_seconds",
		Help:    "Acquire call latency.",
		Buckets: []float64{.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1},
	})
	m.keysSent = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "allot_agent_acquire_keys_total",
		Help: "Keys sent in Acquire calls.",
	})
	m.keys = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_agent_keys",
		Help: "Budget keys tracked by the agent.",
	})
	m.fallbackKeys = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_agent_fallback_keys",
		Help: "Keys decided by their fallback bucket since the previous scan.",
	})
	m.rulesVersion = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_agent_rules_version",
		Help: "Version of the rule set in use.",
	})
	m.redisErrors = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "allot_agent_redis_errors_total",
		Help: "Checks the Redis backend could not decide (the rule's failure mode applied).",
	})
	m.collectors = []prometheus.Collector{stripedCollector{m}, transitions, calls, tokens, reloads,
		m.fallback, m.callSeconds, m.keysSent, m.keys, m.fallbackKeys, m.rulesVersion, m.redisErrors}
	if reg != nil {
		for i, c := range m.collectors {
			if err := reg.Register(c); err != nil {
				for _, done := range m.collectors[:i] {
					reg.Unregister(done)
				}
				return nil, errors.Join(errors.New("agent: registering metrics"), err)
			}
		}
		m.registeredWith = reg
	}
	return m, nil
}

// unregister removes the metrics from the Registerer (on Close), so a new
// agent can register in the same process.
func (m *metrics) unregister() {
	if m.registeredWith == nil {
		return
	}
	for _, c := range m.collectors {
		m.registeredWith.Unregister(c)
	}
	m.registeredWith = nil
}

// stripeFor picks a stripe from hint, the address of a variable on the
// caller's stack: stable for a goroutine, different between goroutines,
// and free to compute. The address is hashed (Fibonacci hashing) because
// stacks are power-of-two sized and aligned, so its low bits repeat.
func (m *metrics) stripeFor(hint uintptr) *stripe {
	return &m.stripes[(uint64(hint)*0x9E3779B97F4A7C15)>>(64-4)]
}

func (m *metrics) decision(hint uintptr, src Source, allowed bool) {
	i := 0
	if allowed {
		i = 1
	}
	m.stripeFor(hint).decisions[src][i].Add(1)
}

func (m *metrics) shadow(hint uintptr) { m.stripeFor(hint).shadow.Add(1) }
func (m *metrics) redisError()         { m.redisErrors.Inc() }

// decisions sums the stripes; for tests and the collector.
func (m *metrics) decisions(src Source, allowed bool) uint64 {
	i := 0
	if allowed {
		i = 1
	}
	var n uint64
	for s := range m.stripes {
		n += m.stripes[s].decisions[src][i].Load()
	}
	return n
}

func (m *metrics) shadows() uint64 {
	var n uint64
	for s := range m.stripes {
		n += m.stripes[s].shadow.Load()
	}
	return n
}

type stripedCollector struct{ m *metrics }

func (c stripedCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.m.decisionsDesc
	ch <- c.m.shadowDesc
}

func (c stripedCollector) Collect(ch chan<- prometheus.Metric) {
	for src := Source(0); int(src) < numSources; src++ {
		for _, allowed := range []bool{true, false} {
			result := "denied"
			if allowed {
				result = "allowed"
			}
			ch <- prometheus.MustNewConstMetric(c.m.decisionsDesc, prometheus.CounterValue,
				float64(c.m.decisions(src, allowed)), src.String(), result)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.m.shadowDesc, prometheus.CounterValue, float64(c.m.shadows()))
}
