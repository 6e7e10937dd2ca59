package agent

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// TestRuleDecisionMetrics: decisions are counted by domain, rule and result
// (issue #9), the counters survive a rule reload, and an unknown domain is
// folded into _other so requests cannot create series.
func TestRuleDecisionMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules), Registerer: reg})
	for range 5 {
		check(t, a, desc("small", "k")) // 3 allowed, 2 denied
	}
	if _, err := a.Check(t.Context(), "nosuchdomain", []Descriptor{desc("x", "y")}, 1); err != nil {
		t.Fatal(err)
	}
	a.setRules(mustCompile(t, 2, testRules), false)
	check(t, a, desc("small", "k")) // denied again: same counter after the reload

	got := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "allot_agent_rule_decisions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var l []string
			for _, lp := range m.GetLabel() {
				l = append(l, lp.GetName()+"="+lp.GetValue())
			}
			got[strings.Join(l, ",")] = m.GetCounter().GetValue()
		}
	}
	want := map[string]float64{
		"domain=test,result=allowed,rule=small": 3,
		"domain=test,result=denied,rule=small":  3,
		"domain=_other,result=unlimited,rule=":  1,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v (all: %v)", k, got[k], v, got)
		}
	}
	for k := range got {
		if strings.Contains(k, "nosuchdomain") {
			t.Errorf("series %s names a domain the rules do not", k)
		}
	}
}

// TestCheckLatencySampled: one check in 64 is timed for
// allot_agent_check_seconds, on the memo's fast path for a leased key and
// on the slow path alike.
func TestCheckLatencySampled(t *testing.T) {
	s := newStepped(t)
	leased := desc("tier", "free", "route", "/x", "user", "u")
	check(t, s.Agent, leased)
	keyOf(t, s.Agent, leased).Demand.Rate = 1e6
	s.step()
	if got := check(t, s.Agent, leased); got.Source != SourceLease {
		t.Fatalf("check: %+v, want from the lease", got)
	}
	timed := func() uint64 {
		var m dto.Metric
		if err := s.met.checkSeconds.Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount()
	}
	const n = 64 * 200
	for _, d := range []Descriptor{leased, desc("nomatch", "x")} { // the fast path, then the slow path
		before := timed()
		for range n {
			check(t, s.Agent, d)
		}
		// 200 expected; the binomial's standard deviation is 14.
		if got := timed() - before; got < 140 || got > 260 {
			t.Fatalf("%v: %d of %d checks timed, want about %d", d.Entries, got, n, n/64)
		}
	}
}

// TestStaticFastPathCounted: checks decided on the memo's fast path for a
// static key count as allowed static decisions and as allowed results of
// their rule, and one in 64 is timed, as on the slow path.
func TestStaticFastPathCounted(t *testing.T) {
	s := newStatic(t)
	// The fake's rules (version 1) replace the configured ones once: a
	// check during the switch is not counted by rule.
	waitFor(t, 10*time.Second, "the allocator's rules", func() bool { return s.rules.Load().Version() == 1 })
	d := desc("big", "x")
	var m dto.Metric
	if err := s.met.checkSeconds.Write(&m); err != nil {
		t.Fatal(err)
	}
	timed0 := m.GetHistogram().GetSampleCount()
	const n = 64 * 200
	for range n {
		if got := check(t, s.Agent, d); got.Source != SourceStatic || !got.Allowed {
			t.Fatalf("check: %+v, want allowed from the static share", got)
		}
	}
	if got := s.met.decisions(SourceStatic, true); got != n {
		t.Fatalf("static decisions %d, want %d", got, n)
	}
	s.met.ruleMu.Lock()
	rc := s.met.ruleCounters[[2]string{"test", "big"}]
	s.met.ruleMu.Unlock()
	if rc == nil || rc.result(ruleAllowed) != n || rc.sum(ruleStaticCheck) < n-1 {
		t.Fatalf("rule big: %d allowed, %d on the fast path; want %d, all but the first", rc.result(ruleAllowed), rc.sum(ruleStaticCheck), n)
	}
	if err := s.met.checkSeconds.Write(&m); err != nil {
		t.Fatal(err)
	}
	// 200 expected; the binomial's standard deviation is 14.
	if got := m.GetHistogram().GetSampleCount() - timed0; got < 140 || got > 260 {
		t.Fatalf("%d of %d checks timed, want about %d", got, n, n/64)
	}
}
