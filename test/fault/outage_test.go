package fault

import (
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// TestFullClusterOutageNoSecondBurst: a gateway drives two keys (R = 20/s,
// B = 100: five seconds of refill) at 2.5× their rate; all three allocators are killed with SIGKILL and restarted 6 s
// later. During the outage the gateway's fallback bucket admits at the
// key's rate while the allocator's bucket refills to its burst; on recovery
// what the fallback admitted is charged against that refill
// (outage_charged), so the keys are not handed a second burst. Over the
// whole run (fresh keys: the bucket starts full) each key admits at most
// the limiter's B + R·T, plus 1%.
//
// Regression: the refill was handed out again on recovery, on top of what
// the fallback buckets admitted meanwhile (+1 burst and more; 222 admitted
// in the first second at R = B = 100).
func TestFullClusterOutageNoSecondBurst(t *testing.T) { runOutage(t, 1) }

// runOutage runs the outage with groups data groups: two keys, or one in
// every data group.
func runOutage(t *testing.T, groups int) {
	checkLeaks(t)
	const rate, burst = 20.0, 100
	e := newEnv(t, envConfig{groups: groups, faultRules: `domain: fault
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: second, requests_per_unit: 20, burst: 100}
`})
	e.gateway("gw-a", e.c.GRPCAddrs())
	const perKey = 2.5 * rate
	nKeys := 2
	if groups > 1 {
		nKeys = groups
	}
	e.startLoad(float64(nKeys)*perKey, nKeys)
	e.waitLeasing()
	e.runFor(2 * time.Second)

	killed := time.Now()
	for _, n := range e.c.Nodes {
		n.Proc.Kill()
	}
	g := e.gws[0]
	testproc.Eventually(t, 10*time.Second, "gw-a failing open", func() bool { return g.Metric(mFallback) == 1 })
	if left := 6*time.Second - time.Since(killed); left > 0 {
		e.runFor(left)
	}
	okBefore := e.sample(mCallsOK)
	restarted := time.Now()
	for _, n := range e.c.Nodes {
		n.Proc.Start(t)
	}
	e.c.WaitReady(t, 60*time.Second)
	rec := e.waitRecovered([]int{0}, okBefore, restarted, recoveryBound)
	recovered := time.Now()
	e.runFor(3 * time.Second)
	e.load.Stop()
	t.Logf("outage %v; restart → leasing again %v", restarted.Sub(killed).Round(time.Millisecond), rec.Round(time.Millisecond))

	rs := e.load.Results()
	first, last := testproc.Span(rs)
	span := time.Duration(last - first)
	ceiling := burst + rate*span.Seconds()
	tally := testproc.Count(rs, nil)
	if tally.FiveXX != 0 || tally.Transport != 0 || tally.Other != 0 {
		t.Errorf("%d × 5xx, %d other codes, %d transport errors; want none", tally.FiveXX, tally.Other, tally.Transport)
	}
	for k, key := range e.keys {
		ok := testproc.Count(rs, func(r testproc.Request) bool { return r.Key == k }).OK
		around := testproc.Count(rs, func(r testproc.Request) bool {
			return r.Key == k && r.Start >= recovered.Add(-time.Second).UnixNano() && r.Start < recovered.Add(time.Second).UnixNano()
		}).OK
		t.Logf("key %s: admitted %d in %.1fs (%d in the 2 s around leasing again); B+R·T = %.0f, over-admission %+.0f (%+.1f%%)",
			key, ok, span.Seconds(), around, ceiling, float64(ok)-ceiling, 100*(float64(ok)-ceiling)/ceiling)
		if float64(ok) > 1.01*ceiling {
			t.Errorf("key %s: admitted %d > (B + R·T)·1.01 = %.1f over the outage", key, ok, 1.01*ceiling)
		}
	}
}
