package rulespb

import (
	"testing"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const testRules = `
domain: ext
descriptors:
  - key: b
    rate_limit:
      unit: Week
      requests_per_unit: 7
      burst: 3
      algorithm: gcra
      backend: redis
      failure_mode: closed
      shards: 4
      routing: consistent_hash
  - key: ldap
    rate_limit:
      unlimited: true
  - key: remote_address
    value: 10.0.0.1
    rate_limit:
      unit: minute
      requests_per_unit: 0
`

func match(t *testing.T, key, value string) *rules.Rule {
	t.Helper()
	set, err := rules.Compile(1, []rules.File{{Name: "ext.yaml", Source: []byte(testRules)}})
	if err != nil {
		t.Fatalf("Compile: %v", err)
	}
	r := set.Match("ext", []rules.Entry{{Key: key, Value: value}})
	if r == nil {
		t.Fatalf("no rule for %s=%s", key, value)
	}
	return r
}

func TestLimitFields(t *testing.T) {
	p := Limit(match(t, "b", "1"))
	if p.Unit != "week" || p.WindowSeconds != 7*86400 || p.Algorithm != "gcra" || p.Backend != "redis" ||
		p.FailureMode != "closed" || p.Routing != "consistent_hash" || p.Shards != 4 || p.Burst != 3 || p.RulePath != "b" ||
		p.RequestsPerUnit != 7 || p.Unlimited {
		t.Errorf("Limit() = %v", p)
	}
}

// TestLimitUnlimited pins the wire form of an unlimited rule: unlimited
// set, the name, path and mode fields kept, and no rate (no "unknown" unit,
// no algorithm, no shards).
func TestLimitUnlimited(t *testing.T) {
	r := match(t, "ldap", "x")
	if !r.Unlimited {
		t.Fatalf("rule %+v: want unlimited", r)
	}
	got := Limit(r)
	want := &allotv1.Limit{Name: "ldap", Unlimited: true, RulePath: "ldap", FailureMode: "open", Backend: "lease", Routing: "spread"}
	if got.String() != want.String() {
		t.Errorf("Limit(unlimited) = %v, want %v", got, want)
	}
	if !got.Unlimited || got.Unit != "" {
		t.Errorf("Limit() = %v", got)
	}
}

// TestLimitDenyAll: requests_per_unit 0 blocks; on the wire it is a limit of
// 0 per unit, never unlimited.
func TestLimitDenyAll(t *testing.T) {
	p := Limit(match(t, "remote_address", "10.0.0.1"))
	if p.GetRequestsPerUnit() != 0 || p.GetUnlimited() || p.GetUnit() != "minute" || p.GetWindowSeconds() != 60 {
		t.Fatalf("Limit = %v", p)
	}
}

func TestLimitNil(t *testing.T) {
	if Limit(nil) != nil {
		t.Error("Limit(nil) != nil")
	}
}
