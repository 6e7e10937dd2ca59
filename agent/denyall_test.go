package agent

import (
	"testing"
	"time"
)

// TestDenyAllRuleBlocks: requests_per_unit: 0 blocks the key (it is not
// mistaken for unlimited), from the fallback path as from the local one.
func TestDenyAllRuleBlocks(t *testing.T) {
	const yaml = `domain: test
descriptors:
  - key: blocked
    rate_limit:
      name: block
      unit: minute
      requests_per_unit: 0
`
	clock := newFakeClock()
	a := newAgent(t, Config{Rules: mustCompile(t, 1, yaml), Now: clock.now})
	for i := range 3 {
		got := check(t, a, desc("blocked", "x"))
		if got.Allowed || got.Policy != "block" || got.Remaining != 0 || got.RetryAfter <= 0 || got.RetryAfter > time.Minute {
			t.Fatalf("check %d: %+v, want denied by block with a retry within the minute", i, got)
		}
	}
}
