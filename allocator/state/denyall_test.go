package state

import (
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestDenyAllRule: a rule with requests_per_unit: 0 (Envoy's way to block a
// key) grants nothing and answers EXHAUSTED until the window boundary; an
// admin Check is OVER_LIMIT. It is never treated as unlimited.
func TestDenyAllRule(t *testing.T) {
	s := New(testConfig())
	putRules(t, s, t0, `domain: test
descriptors:
  - key: blocked
    rate_limit:
      unit: minute
      requests_per_unit: 0
`)
	resp := mustAcquire(t, s, t0, "a1", 1, ka("blocked", "x", 10, 0, 0, 3))
	g := resp.Grants[0]
	if g.Status != allotv1.KeyStatus_KEY_STATUS_EXHAUSTED || g.Granted != 0 {
		t.Fatalf("grant %v: want EXHAUSTED with nothing granted", g)
	}
	if g.RetryAfterMs <= 0 || g.RetryAfterMs > time.Minute.Milliseconds() {
		t.Fatalf("retry_after_ms %d, want within the minute window", g.RetryAfterMs)
	}
	res := s.Apply(&allotv1.Command{NowUnixNanos: t0, Cmd: &allotv1.Command_Check{Check: &allotv1.CheckRequest{
		Domain: "test", Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "blocked", Value: "x"}}}}}}})
	cr, ok := res.(*allotv1.CheckResponse)
	if !ok || cr.OverallCode != allotv1.Code_CODE_OVER_LIMIT {
		t.Fatalf("Check = %v, want OVER_LIMIT", res)
	}
}
