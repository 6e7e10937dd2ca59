package rulespb

import (
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

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

// TestScopeTravelsAsSource: the rules travel between allotctl, the
// allocator's replicas and the agents as their YAML source in RuleFile, so
// scope, global_fallback and static_fraction survive the wire unchanged.
func TestScopeTravelsAsSource(t *testing.T) {
	const src = `domain: g
scope: global
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 10, global_fallback: static, static_fraction: {eu: 0.5, "*": 0.25}}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 10, scope: regional}
`
	before, err := rules.Compile(1, []rules.File{{Name: "g.yaml", Source: []byte(src)}})
	if err != nil {
		t.Fatal(err)
	}
	set := &allotv1.RuleSet{Version: 1}
	for _, f := range before.Files() {
		set.Files = append(set.Files, &allotv1.RuleFile{Name: f.Name, Domain: f.Domain, Yaml: f.Source})
	}
	wire, err := proto.Marshal(set)
	if err != nil {
		t.Fatal(err)
	}
	var got allotv1.RuleSet
	if err := proto.Unmarshal(wire, &got); err != nil {
		t.Fatal(err)
	}
	var files []rules.File
	for _, f := range got.GetFiles() {
		files = append(files, rules.File{Name: f.GetName(), Domain: f.GetDomain(), Source: f.GetYaml()})
	}
	after, err := rules.Compile(got.GetVersion(), files)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range before.Rules() {
		a := after.Rules()[i]
		if r.Scope != a.Scope || r.GlobalFallback != a.GlobalFallback || !slices.Equal(r.StaticFractions, a.StaticFractions) {
			t.Errorf("rule %s: %v %v %v, after the wire %v %v %v", r.Path, r.Scope, r.GlobalFallback, r.StaticFractions,
				a.Scope, a.GlobalFallback, a.StaticFractions)
		}
	}
	if a := after.Match("g", []rules.Entry{{Key: "a", Value: "x"}}); a.Scope != rules.ScopeGlobal || a.StaticFraction("eu") != 0.5 || a.StaticFraction("us") != 0.25 {
		t.Errorf("a after the wire: %v %v", a.Scope, a.StaticFractions)
	}
}
