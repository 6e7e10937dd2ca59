package rules

import (
	"testing"
	"time"
)

// TestRequestsPerUnitZeroBlocks: envoyproxy/ratelimit's README blocks a key
// with requests_per_unit: 0. Such files load unchanged and the rule denies
// every request (it is not mistaken for unlimited).
func TestRequestsPerUnitZeroBlocks(t *testing.T) {
	set, err := Compile(1, []File{{Name: "block.yaml", Source: []byte(`domain: d
descriptors:
  - key: remote_address
    value: 10.0.0.1
    rate_limit:
      unit: minute
      requests_per_unit: 0
`)}})
	if err != nil {
		t.Fatalf("Compile: %v", err)
	}
	r := set.Match("d", []Entry{{Key: "remote_address", Value: "10.0.0.1"}})
	if r == nil || !r.DenyAll || r.Unlimited || r.Limit.IsZero() || !r.Limit.DeniesAll() {
		t.Fatalf("rule %+v: want DenyAll with a DenyAll limit", r)
	}
	if r.Window != time.Minute || r.RequestsPerUnit != 0 {
		t.Fatalf("window %v quota %d, want 1m and 0", r.Window, r.RequestsPerUnit)
	}
	if res := r.Limit.AllowN(nil, int64(90*time.Second), 1); res.Allowed || res.RetryAfter != 30*time.Second {
		t.Fatalf("AllowN = %+v, want denied, retry after 30s", res)
	}
}
