package rules

import (
	"reflect"
	"strings"
	"testing"
)

const scopeYAML = `domain: api
scope: global
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: route
    rate_limit:
      unit: second
      requests_per_unit: 50
      global_fallback: static
      static_fraction: {us-east: 0.5, eu-west: 0.3, "*": 0.1}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 10, scope: regional}
  - key: login
    rate_limit: {unit: minute, requests_per_unit: 10, global_fallback: static, static_fraction: 0.25}
  - key: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: free
    rate_limit: {unlimited: true}
`

// scopeJSON is scopeYAML's first two rules as JSON (a subset of YAML).
const scopeJSON = `{"domain": "api", "scope": "global", "descriptors": [
 {"key": "tenant", "rate_limit": {"unit": "second", "requests_per_unit": 100}},
 {"key": "route", "rate_limit": {"unit": "second", "requests_per_unit": 50,
   "global_fallback": "static", "static_fraction": {"us-east": 0.5, "eu-west": 0.3, "*": 0.1}}}]}`

func TestScopeParsed(t *testing.T) {
	for _, src := range []struct{ name, text string }{{"api.yaml", scopeYAML}, {"api.json", scopeJSON}} {
		s := compileOne(t, src.name, src.text)
		tenant := s.Match("api", E("tenant=a"))
		if tenant.Scope != ScopeGlobal || tenant.GlobalFallback != FallbackFairShare || tenant.StaticFractions != nil {
			t.Errorf("%s: tenant: scope %v fallback %v fractions %v", src.name, tenant.Scope, tenant.GlobalFallback, tenant.StaticFractions)
		}
		route := s.Match("api", E("route=x"))
		want := []RegionFraction{{"*", 0.1}, {"eu-west", 0.3}, {"us-east", 0.5}}
		if route.Scope != ScopeGlobal || route.GlobalFallback != FallbackStatic || !reflect.DeepEqual(route.StaticFractions, want) {
			t.Errorf("%s: route: scope %v fallback %v fractions %v", src.name, route.Scope, route.GlobalFallback, route.StaticFractions)
		}
		for region, f := range map[string]float64{"us-east": 0.5, "eu-west": 0.3, "ap-south": 0.1} {
			if got := route.StaticFraction(region); got != f {
				t.Errorf("%s: StaticFraction(%s) = %v, want %v", src.name, region, got, f)
			}
		}
		if src.name == "api.json" {
			continue
		}
		if r := s.Match("api", E("ip=1")); r.Scope != ScopeRegional || r.GlobalFallback != FallbackFairShare {
			t.Errorf("ip: scope %v fallback %v", r.Scope, r.GlobalFallback)
		}
		login := s.Match("api", E("login=u"))
		if login.Scope != ScopeGlobal || login.StaticFraction("anywhere") != 0.25 {
			t.Errorf("login: scope %v fraction %v", login.Scope, login.StaticFraction("anywhere"))
		}
		if r := s.Match("api", E("blocked=1")); !r.DenyAll || r.Scope != ScopeGlobal {
			t.Errorf("blocked: deny %v scope %v", r.DenyAll, r.Scope)
		}
		if r := s.Match("api", E("free=1")); !r.Unlimited || r.Scope != ScopeRegional {
			t.Errorf("free: unlimited %v scope %v", r.Unlimited, r.Scope)
		}
	}
}

// TestScopeDefaults: without the fields every rule is regional, and a rule
// without static fractions admits nothing of its own under StaticFraction.
func TestScopeDefaults(t *testing.T) {
	s := compileOne(t, "d.yaml", "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
	r := s.Match("d", E("a=1"))
	if r.Scope != ScopeRegional || r.GlobalFallback != FallbackFairShare || r.StaticFraction("x") != 0 {
		t.Errorf("defaults: %v %v %v", r.Scope, r.GlobalFallback, r.StaticFraction("x"))
	}
	// A domain's fallback is inherited by its rules and dropped by a rule
	// that changes its scope or fallback.
	s = compileOne(t, "e.yaml", `domain: e
scope: global
global_fallback: static
static_fraction: 0.4
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 1, scope: regional}
  - key: c
    rate_limit: {unit: second, requests_per_unit: 1, global_fallback: fair_share}
  - key: d
    rate_limit: {unit: second, requests_per_unit: 1, static_fraction: {x: 1}}
`)
	if r := s.Match("e", E("a=1")); r.GlobalFallback != FallbackStatic || r.StaticFraction("y") != 0.4 {
		t.Errorf("a: %v %v", r.GlobalFallback, r.StaticFractions)
	}
	if r := s.Match("e", E("b=1")); r.Scope != ScopeRegional || r.GlobalFallback != FallbackFairShare || r.StaticFractions != nil {
		t.Errorf("b: %v %v %v", r.Scope, r.GlobalFallback, r.StaticFractions)
	}
	if r := s.Match("e", E("c=1")); r.Scope != ScopeGlobal || r.GlobalFallback != FallbackFairShare || r.StaticFractions != nil {
		t.Errorf("c: %v %v %v", r.Scope, r.GlobalFallback, r.StaticFractions)
	}
	if r := s.Match("e", E("d=1")); r.StaticFraction("x") != 1 || r.StaticFraction("y") != 0 {
		t.Errorf("d: %v", r.StaticFractions)
	}
}

func TestScopeWarnsOverbooked(t *testing.T) {
	s := compileOne(t, "d.yaml", "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, scope: global, global_fallback: static, static_fraction: {a: 0.7, b: 0.6}}\n")
	if w := s.Warnings(); len(w) != 1 || !strings.Contains(w[0], "d.yaml:4: static_fraction of the named regions sums to 1.3 > 1") {
		t.Errorf("Warnings = %q", w)
	}
}

// Every scope error names file, line and key.
func TestScopeErrors(t *testing.T) {
	const head = "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n"
	cases := []errCase{
		{"unknown scope", head + "      scope: planet\n", 7, "scope", "unknown scope 'planet' (want regional or global)"},
		{"scope is a list", head + "      scope: [global]\n", 7, "scope", "must be a string, not a list"},
		{"unknown fallback", head + "      scope: global\n      global_fallback: zero\n", 8, "global_fallback", "unknown global_fallback 'zero'"},
		{"fallback without global", head + "      global_fallback: static\n      static_fraction: 0.5\n", 7, "global_fallback", "applies only with scope: global"},
		{"fallback with regional", head + "      scope: regional\n      global_fallback: fair_share\n", 8, "global_fallback", "applies only with scope: global"},
		{"fraction without static", head + "      scope: global\n      static_fraction: 0.5\n", 8, "static_fraction", "applies only with global_fallback: static"},
		{"fraction with fair share", head + "      scope: global\n      global_fallback: fair_share\n      static_fraction: 0.5\n", 9, "static_fraction", "applies only with global_fallback: static"},
		{"static without fraction", head + "      scope: global\n      global_fallback: static\n", 8, "global_fallback", "needs static_fraction"},
		{"fraction zero", head + "      scope: global\n      global_fallback: static\n      static_fraction: 0\n", 9, "static_fraction", "must be in (0, 1], got 0"},
		{"fraction negative", head + "      scope: global\n      global_fallback: static\n      static_fraction: -0.5\n", 9, "static_fraction", "must be in (0, 1], got -0.5"},
		{"fraction above one", head + "      scope: global\n      global_fallback: static\n      static_fraction: {us: 1.5}\n", 9, "static_fraction", "must be in (0, 1], got 1.5"},
		{"fraction NaN", head + "      scope: global\n      global_fallback: static\n      static_fraction: .nan\n", 9, "static_fraction", "must be a number in (0, 1]"},
		{"fraction text", head + "      scope: global\n      global_fallback: static\n      static_fraction: half\n", 9, "static_fraction", "must be a number in (0, 1], not half"},
		{"fraction quoted", head + "      scope: global\n      global_fallback: static\n      static_fraction: \"0.5\"\n", 9, "static_fraction", `not "0.5"`},
		{"fraction list", head + "      scope: global\n      global_fallback: static\n      static_fraction: [0.5]\n", 9, "static_fraction", "or a mapping of region to number, not a list"},
		{"fraction empty mapping", head + "      scope: global\n      global_fallback: static\n      static_fraction: {}\n", 9, "static_fraction", "names no region"},
		{"fraction region twice", head + "      scope: global\n      global_fallback: static\n      static_fraction:\n        us: 0.5\n        us: 0.2\n", 11, "static_fraction", "region 'us' is given twice"},
		{"fraction region empty", head + "      scope: global\n      global_fallback: static\n      static_fraction: {\"\": 0.5}\n", 9, "static_fraction", "region name must be a non-empty string"},
		{"fraction region control", head + "      scope: global\n      global_fallback: static\n      static_fraction: {\"a\\tb\": 0.5}\n", 9, "static_fraction", "control characters"},
		{"global on redis", head + "      scope: global\n      backend: redis\n", 8, "backend", "scope: global needs backend lease, got backend redis"},
		{"global domain on local", "domain: d\nscope: global\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, backend: local}\n", 5, "backend", "the domain has scope: global; give this rule scope: regional"},
		{"scope with unlimited", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      scope: global\n", 6, "scope", "should not specify scope when unlimited"},
		{"scope beside rate_limit", "domain: d\ndescriptors:\n  - key: a\n    scope: global\n    rate_limit: {unit: second, requests_per_unit: 1}\n", 4, "scope", "extensions go inside rate_limit"},
		{"domain fallback without scope", "domain: d\nglobal_fallback: static\nstatic_fraction: 0.5\n", 2, "global_fallback", "applies only with scope: global"},
		{"domain unknown scope", "domain: d\nscope: world\n", 2, "scope", "unknown scope 'world'"},
		{"domain static without fraction", "domain: d\nscope: global\nglobal_fallback: static\n", 3, "global_fallback", "needs static_fraction"},
	}
	checkErrors(t, cases)
}

func TestScopeEnumNames(t *testing.T) {
	for i, n := range scopeNames {
		if s, err := ParseScope(strings.ToUpper(n)); err != nil || s != Scope(i) || s.String() != n {
			t.Errorf("scope %q: %v %v", n, s, err)
		}
	}
	for i, n := range globalFallbackNames {
		if f, err := ParseGlobalFallback(n); err != nil || f != GlobalFallback(i) || f.String() != n {
			t.Errorf("global_fallback %q: %v %v", n, f, err)
		}
	}
	if Scope(7).String() != "scope(7)" || GlobalFallback(7).String() != "global_fallback(7)" {
		t.Error("out-of-range enum strings")
	}
	if _, err := ParseScope("x"); err == nil {
		t.Error("ParseScope(x) succeeded")
	}
	if _, err := ParseGlobalFallback("x"); err == nil {
		t.Error("ParseGlobalFallback(x) succeeded")
	}
}
