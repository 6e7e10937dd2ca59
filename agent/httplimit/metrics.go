package httplimit

import (
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/internal/stripe"
)

type result int

const (
	resultAllowed      result = iota // a limit matched and allowed
	resultUnlimited                  // no limit applied
	resultDenied                     // 429
	resultShadow                     // a shadow-mode limit would have denied; forwarded
	resultBadRequest                 // 400
	resultError                      // limiter error; forwarded (fail open)
	resultNoDescriptor               // forward-auth only: no descriptor could be extracted
	numResults
)

var resultNames = [numResults]string{"allowed", "unlimited", "denied", "shadow_denied", "bad_request", "limiter_error", "no_descriptor"}

// Metrics counts the middleware's decisions in
// allot_gateway_requests_total{result}, result being allowed, unlimited,
// denied, shadow_denied, bad_request or limiter_error. Labels are bounded:
// no per-key or per-path label.
//
// The counters are striped (internal/stripe) and summed when scraped, so
// requests on different cores do not contend on one cache line (one shared
// counter per result cost every request a cache-line transfer between the
// cores).
type Metrics struct {
	n       *stripe.Counters // by result
	desc    *prometheus.Desc
	results result // the results reported: the first results of resultNames
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	return newMetrics(reg, "allot_gateway_requests_total", "HTTP requests seen by the rate limit middleware, by result.", resultNoDescriptor)
}

// NewForwardAuthMetrics creates the forward-auth endpoint's counters,
// allot_forward_auth_requests_total{result}, with the results of NewMetrics
// plus no_descriptor (a check with no extractable descriptor, answered by
// the on_missing policy), and registers them with reg (nil: not
// registered).
func NewForwardAuthMetrics(reg prometheus.Registerer) (*Metrics, error) {
	return newMetrics(reg, "allot_forward_auth_requests_total", "Forward-auth checks, by result.", numResults)
}

func newMetrics(reg prometheus.Registerer, name, help string, results result) (*Metrics, error) {
	m := &Metrics{n: stripe.New(int(numResults)), desc: prometheus.NewDesc(name, help, []string{"result"}, nil), results: results}
	if reg != nil {
		if err := reg.Register(m); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) { ch <- m.desc }

// Collect implements prometheus.Collector: the stripes' sums.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for r := range m.results {
		ch <- prometheus.MustNewConstMetric(m.desc, prometheus.CounterValue, float64(m.count(result(r))), resultNames[r])
	}
}

// count sums result r over the stripes.
func (m *Metrics) count(r result) uint64 { return m.n.Sum(int(r)) }

func (m *Metrics) inc(r result) {
	if m == nil {
		return
	}
	var hint byte // the stripe is picked by this goroutine's stack address
	m.n.Add(uintptr(unsafe.Pointer(&hint)), int(r), 1)
}
