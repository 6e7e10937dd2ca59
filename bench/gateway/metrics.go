package main

import (
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// hist is a cumulative Prometheus histogram: upper bounds and the count of
// observations at or below each (the +Inf bucket is the total).
type hist struct {
	bounds []float64
	cum    []uint64
	total  uint64
}

func histFrom(h *dto.Histogram) hist {
	var out hist
	for _, b := range h.GetBucket() {
		out.bounds = append(out.bounds, b.GetUpperBound())
		out.cum = append(out.cum, b.GetCumulativeCount())
	}
	out.total = h.GetSampleCount()
	return out
}

func (h hist) count() uint64 { return h.total }

// plus returns h + sign·o, bucket by bucket (sign −1: the difference of
// two readings of the same histogram). An empty side takes the other's
// bounds.
func (h hist) plus(o hist, sign int) hist {
	if len(h.bounds) == 0 {
		h = hist{bounds: o.bounds, cum: make([]uint64, len(o.cum))}
	}
	out := hist{bounds: h.bounds, cum: make([]uint64, len(h.cum))}
	for i := range h.cum {
		var v uint64
		if i < len(o.cum) {
			v = o.cum[i]
		}
		if sign < 0 {
			out.cum[i] = h.cum[i] - v
		} else {
			out.cum[i] = h.cum[i] + v
		}
	}
	if sign < 0 {
		out.total = h.total - o.total
	} else {
		out.total = h.total + o.total
	}
	return out
}

// quantile is PromQL's histogram_quantile: linear interpolation inside the
// bucket that holds rank q·total; the lowest bucket starts at 0; a rank in
// the +Inf bucket answers the highest finite bound.
func (h hist) quantile(q float64) time.Duration {
	if h.total == 0 {
		return 0
	}
	rank := q * float64(h.total)
	lower, below := 0.0, uint64(0)
	for i, ub := range h.bounds {
		if float64(h.cum[i]) >= rank {
			in := h.cum[i] - below
			v := ub
			if in > 0 {
				v = lower + (ub-lower)*(rank-float64(below))/float64(in)
			}
			return time.Duration(v * 1e9).Round(10 * time.Nanosecond)
		}
		lower, below = ub, h.cum[i]
	}
	return time.Duration(lower * 1e9)
}

// agentReading is one reading of the agent's metrics, or the difference
// between two.
type agentReading struct {
	checks, acquire hist
	calls           map[string]float64 // allot_agent_acquire_calls_total by result
	tokens          map[string]float64 // allot_agent_tokens_total by kind
	decisions       map[string]float64 // allot_agent_rule_decisions_total by result, over domains and rules
	maxFallback     float64            // largest allot_agent_fallback seen during a run
}

func gatherAgent(reg *prometheus.Registry) (agentReading, error) {
	r := agentReading{calls: map[string]float64{}, tokens: map[string]float64{}, decisions: map[string]float64{}}
	mfs, err := reg.Gather()
	if err != nil {
		return r, fmt.Errorf("gather agent metrics: %w", err)
	}
	label := func(m *dto.Metric, name string) string {
		for _, l := range m.GetLabel() {
			if l.GetName() == name {
				return l.GetValue()
			}
		}
		return ""
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch mf.GetName() {
			case "allot_agent_check_seconds":
				r.checks = histFrom(m.GetHistogram())
			case "allot_agent_acquire_seconds":
				r.acquire = histFrom(m.GetHistogram())
			case "allot_agent_acquire_calls_total":
				r.calls[label(m, "result")] += m.GetCounter().GetValue()
			case "allot_agent_tokens_total":
				r.tokens[label(m, "kind")] += m.GetCounter().GetValue()
			case "allot_agent_rule_decisions_total":
				r.decisions[label(m, "result")] += m.GetCounter().GetValue()
			case "allot_agent_fallback":
				r.maxFallback = m.GetGauge().GetValue()
			}
		}
	}
	return r, nil
}

func subMap(a, b map[string]float64, sign float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		out[k] += sign * v
	}
	return out
}

// sub is r − before (counters and histograms).
func (r agentReading) sub(before agentReading) agentReading {
	return agentReading{
		checks:    r.checks.plus(before.checks, -1),
		acquire:   r.acquire.plus(before.acquire, -1),
		calls:     subMap(r.calls, before.calls, -1),
		tokens:    subMap(r.tokens, before.tokens, -1),
		decisions: subMap(r.decisions, before.decisions, -1),
	}
}

// pollFallback samples allot_agent_fallback every 100 ms until the returned
// function is called, which stops the poller and reports the largest value.
func pollFallback(reg *prometheus.Registry) func() float64 {
	var (
		mu   sync.Mutex // guards peak
		peak float64
	)
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
			}
			if r, err := gatherAgent(reg); err == nil {
				mu.Lock()
				peak = math.Max(peak, r.maxFallback)
				mu.Unlock()
			}
		}
	}()
	return func() float64 {
		close(quit)
		<-done
		mu.Lock()
		defer mu.Unlock()
		return peak
	}
}

func (r agentReading) String() string {
	return fmt.Sprintf("check p50 %v p99 %v (n=%d) | acquire ok %.0f throttled %.0f failed %.0f rejected %.0f, p50 %v p99 %v | fallback-decided %.0f, fallback gauge max %.0f | tokens granted %.0f charged %.0f paid %.0f returned %.0f",
		r.checks.quantile(0.5), r.checks.quantile(0.99), r.checks.count(),
		r.calls["ok"], r.calls["throttled"], r.calls["failed"], r.calls["rejected"],
		r.acquire.quantile(0.5).Round(10*time.Microsecond), r.acquire.quantile(0.99).Round(10*time.Microsecond),
		r.decisions["fallback"], r.maxFallback,
		r.tokens["granted"], r.tokens["charged"], r.tokens["paid"], r.tokens["returned"])
}

// agentStats adds up a target's readings over the rounds.
type agentStats struct{ agentReading }

func (s *agentStats) add(d agentReading) {
	if s.calls == nil {
		s.agentReading = agentReading{calls: map[string]float64{}, tokens: map[string]float64{}, decisions: map[string]float64{}}
	}
	s.checks = s.checks.plus(d.checks, 1)
	s.acquire = s.acquire.plus(d.acquire, 1)
	s.calls = subMap(s.calls, d.calls, 1)
	s.tokens = subMap(s.tokens, d.tokens, 1)
	s.decisions = subMap(s.decisions, d.decisions, 1)
	s.maxFallback = math.Max(s.maxFallback, d.maxFallback)
}
