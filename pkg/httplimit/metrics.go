package httplimit

import "github.com/prometheus/client_golang/prometheus"

type result int

const (
	resultAllowed    result = iota // a limit matched and allowed
	resultUnlimited                // no limit applied
	resultDenied                   // 429
	resultShadow                   // a shadow-mode limit would have denied; forwarded
	resultBadRequest               // 400
	resultError                    // limiter error; forwarded (fail open)
	numResults
)

var resultNames = [numResults]string{"allowed", "unlimited", "denied", "shadow_denied", "bad_request", "limiter_error"}

// Metrics counts the middleware's decisions in
// allot_gateway_requests_total{result}, result being allowed, unlimited,
// denied, shadow_denied, bad_request or limiter_error. Labels are bounded:
// no per-key or per-path label.
type Metrics struct {
	byResult [numResults]prometheus.Counter
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_gateway_requests_total",
		Help: "HTTP requests seen by the rate limit middleware, by result.",
	}, []string{"result"})
	if reg != nil {
		if err := reg.Register(vec); err != nil {
			return nil, err
		}
	}
	m := &Metrics{}
	for i := range m.byResult {
		m.byResult[i] = vec.WithLabelValues(resultNames[i])
	}
	return m, nil
}

func (m *Metrics) inc(r result) {
	if m != nil {
		m.byResult[r].Inc()
	}
}
