package agent

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/internal/stripe"
	"github.com/allot/allot/pkg/rules"
)

const numSources = int(SourceStatic) + 1

// The per-check counters, striped (internal/stripe): the decisions by
// source and result, then the shadow denials.
const (
	ctrShadow   = 2 * numSources // after the decisions: decisionCounter(src, allowed)
	numCounters = ctrShadow + 1
)

func decisionCounter(src Source, allowed bool) int {
	if allowed {
		return 2*int(src) + 1
	}
	return 2 * int(src)
}

// metrics holds the agent's Prometheus metrics. Per-check counters are
// striped (a check increments its goroutine's stripe) and summed at scrape
// time by a custom collector, so parallel checks do not contend on one
// cache line. No metric has a per-key label.
type metrics struct {
	counters *stripe.Counters // numCounters
	sampled  [stripe.N]sampleArm

	fallback         prometheus.Gauge
	toOpen           prometheus.Counter
	toClosed         prometheus.Counter
	callsOK          prometheus.Counter
	callsFailed      prometheus.Counter
	callsRejected    prometheus.Counter
	callsThrottled   prometheus.Counter
	keysRefused      prometheus.Counter
	outageForgiven   prometheus.Counter
	keysMoved        prometheus.Counter
	callSeconds      prometheus.Histogram
	keysSent         prometheus.Counter
	granted          prometheus.Counter
	charged          prometheus.Counter
	paid             prometheus.Counter
	returned         prometheus.Counter
	keys             prometheus.Gauge
	fallbackKeys     prometheus.Gauge
	rulesVersion     prometheus.Gauge
	reloadsOK        prometheus.Counter
	reloadsFailed    prometheus.Counter
	rulesStale       prometheus.Counter
	redisErrors      prometheus.Counter
	checkSeconds     prometheus.Histogram
	staticPromotions prometheus.Counter
	staticKeys       prometheus.Gauge
	staticHotKeys    prometheus.Gauge
	staticSlots      prometheus.Gauge
	decisionsDesc    *prometheus.Desc
	shadowDesc       *prometheus.Desc
	ruleDesc         *prometheus.Desc

	// Per-rule decision counters, keyed by (domain, rule name) so they stay
	// monotonic across rule reloads; ruleIdx maps the current set's rule
	// IDs to them.
	ruleIdx        atomic.Pointer[ruleIndex]
	ruleMu         sync.Mutex // guards ruleCounters
	ruleCounters   map[[2]string]*ruleCounter
	registeredWith prometheus.Registerer
	collectors     []prometheus.Collector
}

// checkSampleBits: one check in 2^6 = 64 is timed for
// allot_agent_check_seconds. Timing every check would cost more than the
// check (time.Now is tens of nanoseconds).
const checkSampleBits = 6

// The checks to time are picked without a draw of their own (a call to
// the runtime's generator costs about as much as the rest of the
// bookkeeping): every check ends with one striped counter increment
// (decision or oneCheck), which returns the stripe's new count; a
// mixing of that count, whose top bits are zero one time in 64, arms the
// stripe (arm), and the next check on it is timed (sampleCheck). Counts
// that arm are spread like random ones, so the timed checks do not follow
// a pattern in the requests.

// sampleArm is one stripe's flag: the next check on it is timed. Padded
// to its own cache lines: every check reads it.
type sampleArm struct {
	armed atomic.Bool
	_     [127]byte
}

// sampleCheck reports whether this check, on hint's stripe, is timed,
// disarming the stripe.
func (m *metrics) sampleCheck(hint uintptr) bool {
	s := &m.sampled[stripe.Index(hint)]
	return s.armed.Load() && s.armed.CompareAndSwap(true, false)
}

// arm arms hint's stripe one time in 64, given a count a check's counter
// increment returned there.
func (m *metrics) arm(hint uintptr, count uint64) {
	if mum(count^identK1, identK2)>>(64-checkSampleBits) == 0 {
		m.sampled[stripe.Index(hint)].armed.Store(true)
	}
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		counters: stripe.New(numCounters),
		decisionsDesc: prometheus.NewDesc("allot_agent_decisions_total",
			"Checks decided, by the source of the reported limit and the result.",
			[]string{"source", "result"}, nil),
		shadowDesc: prometheus.NewDesc("allot_agent_shadow_denials_total",
			"Descriptors over a limit whose rule is in shadow mode (counted, not enforced).", nil, nil),
		ruleDesc: prometheus.NewDesc("allot_agent_rule_decisions_total",
			"Descriptors decided, by domain, rule (policy name; empty when no rule matched) and result: allowed (lease, local or Redis), fallback (allowed by the fallback bucket), denied, shadow_denied (over a shadow-mode limit, allowed), unlimited. Domains the rules do not name are reported as _other.",
			[]string{"domain", "rule", "result"}, nil),
		ruleCounters: map[[2]string]*ruleCounter{},
	}
	transitions := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_agent_breaker_transitions_total",
		Help: "Circuit breaker transitions to the fallback (open) and back (closed).",
	}, []string{"to"})
	m.toOpen = transitions.WithLabelValues("open")
	m.toClosed = transitions.WithLabelValues("closed")
	calls := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_agent_acquire_calls_total",
		Help: "Acquire calls by result: ok, failed (transport, counts towards the breaker), rejected (answered with an error), throttled (the allocator was overloaded; retried later, not a failure).",
	}, []string{"result"})
	m.callsOK = calls.WithLabelValues("ok")
	m.callsFailed = calls.WithLabelValues("failed")
	m.callsRejected = calls.WithLabelValues("rejected")
	m.callsThrottled = calls.WithLabelValues("throttled")
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
	m.rulesStale = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "allot_agent_rules_stale_total",
		Help: "Rule watches re-established because Acquire answers carried a newer committed rules version than the watch delivered.",
	})
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
	m.keysRefused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "allot_agent_keys_refused_total",
		Help: "Keys refused on their own, by the encoder (not valid UTF-8: never sent again) or by the allocator (InvalidArgument: asked again later); meanwhile they are out of every batch and decided by their fallback bucket.",
	})
	m.outageForgiven = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "allot_agent_outage_forgiven_tokens_total",
		Help: "Outage charges (fallback admissions while the allocator was unreachable) never reported: their idle keys were forgotten because the key table held more than MaxOutageKeys keys.",
	})
	m.keysMoved = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "allot_agent_keys_moved_total",
		Help: "Keys answered MOVED (their slot is served by another allocator group, or is being moved): sent again to the owner; meanwhile decided from their lease and fallback bucket.",
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
	m.checkSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "allot_agent_check_seconds",
		Help: "Check latency (Agent.Check and CheckStatuses), sampled: one check in 64 is timed.",
		Buckets: []float64{100e-9, 250e-9, 500e-9, 1e-6, 2.5e-6, 5e-6, 10e-6, 25e-6, 100e-6,
			250e-6, 1e-3, 5e-3, 25e-3},
	})
	m.staticPromotions = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "allot_agent_static_promotions_total",
		Help: "Keys decided from static shares whose share ran low, sent to the allocator to be leased (KeyAcquire.promote). Static decisions are allot_agent_decisions_total{source=\"static\"}.",
	})
	m.staticKeys = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_agent_static_keys",
		Help: "Keys decided from static shares (no lease, not in the hot-key set), at the latest scan.",
	})
	m.staticHotKeys = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_agent_static_hot_keys",
		Help: "Keys in the agent's copy of the allocator's hot-key set (decided by leases, not static shares).",
	})
	m.staticSlots = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "allot_agent_static_slots",
		Help: "The static shares of each eligible rule (N) the latest answer gave this agent; 0: it holds no slot.",
	})
	m.collectors = []prometheus.Collector{stripedCollector{m}, transitions, calls, tokens, reloads,
		m.fallback, m.callSeconds, m.keysSent, m.keysRefused, m.outageForgiven, m.keysMoved, m.keys, m.fallbackKeys, m.rulesVersion, m.redisErrors, m.checkSeconds, m.rulesStale,
		m.staticPromotions, m.staticKeys, m.staticHotKeys, m.staticSlots}
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

// hint, in the methods below, is the address of a variable on the
// checking goroutine's stack: it picks the stripe (stripe.Index).

// decision counts a check's decision, the last count of a check on the
// slow path, and arms the stripe for sampling from the count.
func (m *metrics) decision(hint uintptr, src Source, allowed bool) {
	m.arm(hint, m.counters.Add(hint, decisionCounter(src, allowed), 1))
}

func (m *metrics) shadow(hint uintptr) { m.counters.Add(hint, ctrShadow, 1) }
func (m *metrics) redisError()         { m.redisErrors.Inc() }

// decisions sums the stripes; for tests and the collector. Allowed lease
// and static decisions include the one-descriptor checks that oneCheck
// counted in their rule's counter.
func (m *metrics) decisions(src Source, allowed bool) uint64 {
	n := m.counters.Sum(decisionCounter(src, allowed))
	slot := -1
	switch {
	case src == SourceLease && allowed:
		slot = ruleLeaseCheck
	case src == SourceStatic && allowed:
		slot = ruleStaticCheck
	}
	if slot >= 0 {
		m.ruleMu.Lock()
		for _, rc := range m.ruleCounters {
			n += rc.sum(slot)
		}
		m.ruleMu.Unlock()
	}
	return n
}

func (m *metrics) shadows() uint64 { return m.counters.Sum(ctrShadow) }

type stripedCollector struct{ m *metrics }

func (c stripedCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.m.decisionsDesc
	ch <- c.m.shadowDesc
	ch <- c.m.ruleDesc
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
	c.m.ruleMu.Lock()
	defer c.m.ruleMu.Unlock()
	for k, rc := range c.m.ruleCounters {
		for res := range ruleResults {
			// A rule's results, and a domain's unlimited count, are
			// exposed at 0 from the rule set's load: an alert on their
			// increase sees the first event.
			if n := rc.result(res); n > 0 || (k[1] != "") == (res != ruleUnlimited) {
				ch <- prometheus.MustNewConstMetric(c.m.ruleDesc, prometheus.CounterValue, float64(n), k[0], k[1], ruleResultNames[res])
			}
		}
	}
}

// Per-rule results.
const (
	ruleAllowed = iota
	ruleFallback
	ruleDenied
	ruleShadowDenied
	ruleUnlimited
	ruleResults
	// ruleLeaseCheck and ruleStaticCheck, not exposed as results of their
	// own: a check of one descriptor allowed from the lease or from a
	// static share (see oneCheck), counted once for both its rule's
	// allowed result and the allowed decisions of that source.
	ruleLeaseCheck  = ruleResults
	ruleStaticCheck = ruleResults + 1
	ruleSlots       = ruleResults + 2
)

var ruleResultNames = [ruleResults]string{"allowed", "fallback", "denied", "shadow_denied", "unlimited"}

// otherDomain labels decisions for domains the rules do not name, so a
// request cannot create series.
const otherDomain = "_other"

// ruleCounter counts one (domain, rule)'s decisions, striped like the
// decision counters.
type ruleCounter struct {
	c [stripe.N][ruleSlots]atomic.Uint64
}

// result sums the stripes of one exposed result.
func (rc *ruleCounter) result(res int) uint64 {
	n := rc.sum(res)
	if res == ruleAllowed {
		n += rc.sum(ruleLeaseCheck) + rc.sum(ruleStaticCheck)
	}
	return n
}

func (rc *ruleCounter) sum(res int) uint64 {
	var n uint64
	for s := range rc.c {
		n += rc.c[s][res].Load()
	}
	return n
}

// ruleIndex maps one rule set's rule IDs (and domains, for descriptors no
// rule matched) to their counters.
type ruleIndex struct {
	set      *rules.Set
	byID     []*ruleCounter
	byDomain map[string]*ruleCounter // rule ""
	other    *ruleCounter
}

func (m *metrics) counter(domain, rule string) *ruleCounter {
	k := [2]string{domain, rule}
	rc := m.ruleCounters[k]
	if rc == nil {
		rc = &ruleCounter{}
		m.ruleCounters[k] = rc
	}
	return rc
}

// setRules builds the counter index for s. The counters are bounded by the
// rules ever loaded (names from configuration, never from requests).
func (m *metrics) setRules(s *rules.Set) {
	m.ruleMu.Lock()
	defer m.ruleMu.Unlock()
	ri := &ruleIndex{set: s, byDomain: map[string]*ruleCounter{}, other: m.counter(otherDomain, "")}
	for _, r := range s.Rules() {
		for len(ri.byID) <= r.ID {
			ri.byID = append(ri.byID, nil)
		}
		ri.byID[r.ID] = m.counter(r.Domain, r.Name)
	}
	for _, d := range s.Domains() {
		ri.byDomain[d] = m.counter(d, "")
	}
	m.ruleIdx.Store(ri)
}

// ruleIndexFor returns the counter index of set, or nil while a reload is
// switching sets (those few decisions go uncounted per rule).
func (m *metrics) ruleIndexFor(set *rules.Set) *ruleIndex {
	if ri := m.ruleIdx.Load(); ri != nil && ri.set == set {
		return ri
	}
	return nil
}

// ruleDecision counts one descriptor's status under rule r.
func (m *metrics) ruleDecision(hint uintptr, ri *ruleIndex, r *rules.Rule, st *Status) {
	if ri == nil || r.ID >= len(ri.byID) || ri.byID[r.ID] == nil {
		return
	}
	res := ruleAllowed
	switch {
	case st.Shadow:
		res = ruleShadowDenied
	case !st.Allowed:
		res = ruleDenied
	case st.Source == SourceFallback:
		res = ruleFallback
	}
	ri.byID[r.ID].c[stripe.Index(hint)][res].Add(1)
}

// oneCheck counts a check of one descriptor allowed by rule r from the
// lease (slot ruleLeaseCheck) or a static share (ruleStaticCheck): one
// allowed result of r and one allowed decision of that source, in one
// increment (the collector adds it to both), and returns the stripe's new
// count, for the caller to arm sampling with. It returns 0, counting
// nothing, when r has no counter (a reload is switching sets); the caller
// then counts the two apart.
func (m *metrics) oneCheck(hint uintptr, ri *ruleIndex, r *rules.Rule, slot int) uint64 {
	if ri == nil || r.ID >= len(ri.byID) || ri.byID[r.ID] == nil {
		return 0
	}
	return ri.byID[r.ID].c[stripe.Index(hint)][slot].Add(1)
}

// unlimitedDecision counts a descriptor no rule limits: r is nil (no match)
// or an unlimited rule.
func (m *metrics) unlimitedDecision(hint uintptr, ri *ruleIndex, domain string, r *rules.Rule) {
	if ri == nil {
		return
	}
	var rc *ruleCounter
	if r != nil && r.ID < len(ri.byID) {
		rc = ri.byID[r.ID]
	} else if rc = ri.byDomain[domain]; rc == nil {
		rc = ri.other
	}
	if rc != nil {
		rc.c[stripe.Index(hint)][ruleUnlimited].Add(1)
	}
}
