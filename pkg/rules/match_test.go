package rules

import (
	"fmt"
	"strings"
	"testing"
)

func compileOne(t testing.TB, name, src string) *Set {
	t.Helper()
	s, err := Compile(1, []File{{Name: name, Source: []byte(src)}})
	if err != nil {
		t.Fatalf("Compile(%s) = %v", name, err)
	}
	return s
}

// E builds a descriptor from "k=v" or "k" ("k" alone means value "") strings.
func E(kvs ...string) []Entry {
	out := make([]Entry, len(kvs))
	for i, kv := range kvs {
		k, v, _ := strings.Cut(kv, "=")
		out[i] = Entry{Key: k, Value: v}
	}
	return out
}

type matchCase struct {
	desc []Entry
	want string // rule Name, "" = no rule
}

func runMatches(t *testing.T, s *Set, domain string, cases []matchCase) {
	t.Helper()
	for i, c := range cases {
		r := s.Match(domain, c.desc)
		got := ""
		if r != nil {
			got = r.Name
		}
		if got != c.want {
			_, trace := s.MatchTrace(domain, c.desc)
			t.Errorf("case %d: Match(%s, %v) = %q, want %q\n  trace: %s", i, domain, c.desc, got, c.want, strings.Join(trace, "\n         "))
		}
		// MatchTrace must agree with Match.
		if tr, _ := s.MatchTrace(domain, c.desc); tr != r {
			t.Errorf("case %d: MatchTrace disagrees with Match", i)
		}
	}
}

// Envoy's documented matching behaviour (envoyproxy/ratelimit README,
// examples 1–7), restated as tests.

func TestEnvoyExactValues(t *testing.T) {
	s := compileOne(t, "mongo.yaml", `
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit: {name: users, unit: second, requests_per_unit: 500}
  - key: database
    value: default
    rate_limit: {name: default, unit: second, requests_per_unit: 500}
`)
	runMatches(t, s, "mongo_cps", []matchCase{
		{E("database=users"), "users"},
		{E("database=default"), "default"},
		{E("database=other"), ""},
		{E("database"), ""},
		{E("db=users"), ""},
	})
	if s.Match("other_domain", E("database=users")) != nil {
		t.Error("a rule matched in an unknown domain")
	}
}

func TestEnvoyNestedAndKeyOnly(t *testing.T) {
	s := compileOne(t, "messaging.yaml", `
domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit: {name: marketing_per_number, unit: day, requests_per_unit: 5}
  - key: to_number
    rate_limit: {name: per_number, unit: day, requests_per_unit: 100}
`)
	runMatches(t, s, "messaging", []matchCase{
		{E("message_type=marketing", "to_number=2061111111"), "marketing_per_number"},
		{E("message_type=marketing", "to_number=2062222222"), "marketing_per_number"},
		{E("to_number=2061111111"), "per_number"},
		{E("message_type=marketing"), ""}, // placeholder level: no limit at depth 1
		{E("message_type=transactional", "to_number=2061111111"), ""},
	})
	// Key-only: every value has its own budget.
	r := s.Match("messaging", E("to_number=1"))
	k1 := string(AppendKey(nil, r, "messaging", E("to_number=1")))
	k2 := string(AppendKey(nil, r, "messaging", E("to_number=2")))
	if k1 == k2 || k1 != "messaging:to_number=1" {
		t.Errorf("key-only budget keys %q, %q", k1, k2)
	}
}

func TestEnvoyExactBeatsKeyOnly(t *testing.T) {
	s := compileOne(t, "edge.yaml", `
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit: {name: per_ip, unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {name: one_ip, unit: second, requests_per_unit: 1}
`)
	runMatches(t, s, "edge_proxy_per_ip", []matchCase{
		{E("remote_address=50.0.0.1"), "per_ip"},
		{E("remote_address=50.0.0.5"), "one_ip"},
		{E("remote_address="), "per_ip"},
	})
}

func TestEnvoyDepthRule(t *testing.T) {
	s := compileOne(t, "ex4.yaml", `
domain: example4
descriptors:
  - key: key
    value: value
    rate_limit: {name: shallow, unit: second, requests_per_unit: 300}
  - key: other
    value: value
    descriptors:
      - key: subkey
        rate_limit: {name: deep, unit: second, requests_per_unit: 300}
`)
	runMatches(t, s, "example4", []matchCase{
		{E("key=value"), "shallow"},
		{E("key=value", "subkey=subvalue"), ""}, // more entries than the config path
		{E("other=value", "subkey=subvalue"), "deep"},
		{E("other=value"), ""},                               // fewer entries: no limit at depth 1
		{E("other=value", "subkey=subvalue", "extra=1"), ""}, // deeper than the tree
		{E(), ""},                          // empty descriptor
		{E("other=value", "nosuch=x"), ""}, // unknown key at depth 2
		{E("key=value", "key=value"), ""},  // shallow has no children
		{[]Entry{{Key: "other", Value: "value"}, {Key: "subkey"}}, "deep"}, // empty value, key-only
	})
}

func TestEnvoyUnlimited(t *testing.T) {
	s := compileOne(t, "internal.yaml", `
domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true
  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100
`)
	r := s.Match("internal", E("ldap=x"))
	if r == nil || !r.Unlimited || !r.Limit.IsZero() || r.RequestsPerUnit != 0 || r.Unit != UnitUnknown {
		t.Fatalf("ldap rule = %+v, want unlimited with zero Limit", r)
	}
	if r := s.Match("internal", E("azure=x")); r == nil || r.Unlimited || r.RequestsPerUnit != 100 {
		t.Fatalf("azure rule = %+v", r)
	}
}

func TestEnvoyShadowMode(t *testing.T) {
	s := compileOne(t, "ex6.yaml", `
domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit: {unit: second, requests_per_unit: 10}
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit: {unit: second, requests_per_unit: 20}
`)
	a := s.Match("example6", E("service=auth-service", "user=user-a"))
	b := s.Match("example6", E("service=auth-service", "user=user-b"))
	if a == nil || !a.ShadowMode || a.RequestsPerUnit != 10 {
		t.Errorf("user-a = %+v, want shadow 10/s", a)
	}
	if b == nil || b.ShadowMode || b.RequestsPerUnit != 20 {
		t.Errorf("user-b = %+v, want enforced 20/s", b)
	}
	if a.Name != "service/user=user-a" || a.HasName {
		t.Errorf("unnamed rule Name = %q HasName=%v, want the path", a.Name, a.HasName)
	}
}

func TestEnvoyReplaces(t *testing.T) {
	s := compileOne(t, "ex7.yaml", `
domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
`)
	d1 := E("key_1=value_1", "user=bkthomps")
	d2 := E("key_2=value_2", "user=bkthomps")
	for _, c := range []struct {
		descs [][]Entry
		want  []string
	}{
		{[][]Entry{d1}, []string{"specific_limit"}},
		{[][]Entry{d2}, []string{"key_2=value_2/user=bkthomps"}},
		{[][]Entry{d1, d2}, []string{"", "key_2=value_2/user=bkthomps"}},
		{[][]Entry{d2, d1}, []string{"key_2=value_2/user=bkthomps", ""}},
		{[][]Entry{d1, d1}, []string{"specific_limit", "specific_limit"}}, // nothing replaces it
		{[][]Entry{d1, E("nope=1"), d2}, []string{"", "", "key_2=value_2/user=bkthomps"}},
		{nil, []string{}},
	} {
		got := names(s.MatchAll("example7", c.descs, nil))
		if fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("MatchAll(%v) = %q, want %q", c.descs, got, c.want)
		}
	}
}

// A replaced rule's own replaces still apply (Envoy collects every replaces
// before dropping anything), and replacing works across shadow rules.
func TestReplacesChainAndMutual(t *testing.T) {
	s := compileOne(t, "chain.yaml", `
domain: d
descriptors:
  - key: a
    rate_limit: {name: A, unit: second, requests_per_unit: 1, replaces: [{name: B}]}
  - key: b
    rate_limit: {name: B, unit: second, requests_per_unit: 1, replaces: [{name: C}]}
  - key: c
    rate_limit: {name: C, unit: second, requests_per_unit: 1}
  - key: x
    rate_limit: {name: X, unit: second, requests_per_unit: 1, replaces: [{name: Y}]}
  - key: y
    shadow_mode: true
    rate_limit: {name: Y, unit: second, requests_per_unit: 1, replaces: [{name: X}]}
`)
	got := names(s.MatchAll("d", [][]Entry{E("a=1"), E("b=1"), E("c=1")}, nil))
	if fmt.Sprint(got) != fmt.Sprint([]string{"A", "", ""}) {
		t.Errorf("chain: %q", got)
	}
	got = names(s.MatchAll("d", [][]Entry{E("x=1"), E("y=1")}, nil))
	if fmt.Sprint(got) != fmt.Sprint([]string{"", ""}) {
		t.Errorf("mutual: %q", got)
	}
}

func TestMatchAllManyDescriptors(t *testing.T) {
	s := compileOne(t, "chain.yaml", `
domain: d
descriptors:
  - key: a
    rate_limit: {name: A, unit: second, requests_per_unit: 1, replaces: [{name: B}]}
  - key: b
    rate_limit: {name: B, unit: second, requests_per_unit: 1}
`)
	var descs [][]Entry
	for i := 0; i < 100; i++ {
		descs = append(descs, E("b=1"))
	}
	descs = append(descs, E("a=1"))
	got := s.MatchAll("d", descs, nil)
	for i, r := range got[:100] {
		if r != nil {
			t.Fatalf("descriptor %d not replaced", i)
		}
	}
	if got[100] == nil || got[100].Name != "A" {
		t.Fatalf("last = %v", got[100])
	}
}

func TestWildcards(t *testing.T) {
	s := compileOne(t, "wild.yaml", `
domain: w
descriptors:
  - key: path
    value: /api/v1/*
    rate_limit: {name: v1, unit: second, requests_per_unit: 1}
  - key: path
    value: /api/*            # later in load order: /api/v1/x matches v1 first
    rate_limit: {name: api, unit: second, requests_per_unit: 1}
  - key: path
    value: /api/health       # exact beats wildcard
    rate_limit: {name: health, unit: second, requests_per_unit: 1}
  - key: path
    rate_limit: {name: any_path, unit: second, requests_per_unit: 1}
  - key: host
    value: "*.example.com"   # left-hand wildcard
    rate_limit: {name: subdomain, unit: second, requests_per_unit: 1}
  - key: mid
    value: bar*b
    rate_limit: {name: mid, unit: second, requests_per_unit: 1}
  - key: multi
    value: svc*ep*rpc
    rate_limit: {name: multi, unit: second, requests_per_unit: 1}
  - key: all
    value: "*"
    rate_limit: {name: all, unit: second, requests_per_unit: 1}
  - key: tenant
    value: t*
    descriptors:
      - key: res
        value: "*v2"
        rate_limit: {name: nested, unit: second, requests_per_unit: 1}
`)
	runMatches(t, s, "w", []matchCase{
		{E("path=/api/v1/users"), "v1"},
		{E("path=/api/v1/"), "v1"}, // * matches zero bytes
		{E("path=/api/v2/users"), "api"},
		{E("path=/api/health"), "health"},
		{E("path=/other"), "any_path"},
		{E("host=www.example.com"), "subdomain"},
		{E("host=.example.com"), "subdomain"},
		{E("host=example.com"), ""},
		{E("mid=barb"), "mid"},
		{E("mid=bar-xyz-b"), "mid"},
		{E("mid=bar"), ""},
		{E("mid=xbarb"), ""},
		{E("multi=svc-a-ep-b-rpc"), "multi"},
		{E("multi=svceprpc"), "multi"},
		{E("multi=svc-rpc-ep"), ""},
		{E("multi=svcep"), ""},
		{E("all="), "all"},
		{E("all=anything"), "all"},
		{E("tenant=t1", "res=api-v2"), "nested"},
		{E("tenant=x1", "res=api-v2"), ""},
		{E("tenant=t1", "res=api-v3"), ""},
	})
	// Without share_threshold each matching value has its own budget.
	r := s.Match("w", E("path=/api/v2/a"))
	if string(AppendKey(nil, r, "w", E("path=/api/v2/a"))) == string(AppendKey(nil, r, "w", E("path=/api/v2/b"))) {
		t.Error("wildcard values without share_threshold share a budget")
	}
}

func TestShareThreshold(t *testing.T) {
	s := compileOne(t, "share.yaml", `
domain: s
descriptors:
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {name: files, unit: minute, requests_per_unit: 100}
  - key: file
    value: test1
    rate_limit: {name: test1, unit: minute, requests_per_unit: 50}
  - key: file
    value: test*
    share_threshold: true
    rate_limit: {name: tests, unit: minute, requests_per_unit: 100}
  - key: user
    value: user/*
    share_threshold: true
    descriptors:
      - key: resource
        value: res/*
        descriptors:
          - key: action
            rate_limit: {name: nested, unit: minute, requests_per_unit: 150}
`)
	key := func(d []Entry) string { return string(AppendKey(nil, s.Match("s", d), "s", d)) }
	if a, b := key(E("files=files/a.pdf")), key(E("files=files/b.csv")); a != b || a != "s:files=files/*" {
		t.Errorf("shared keys %q, %q; want both s:files=files/*", a, b)
	}
	if got := key(E("file=test1")); got != "s:file=test1" {
		t.Errorf("exact beats shared wildcard: %q", got)
	}
	if got := key(E("file=test2")); got != "s:file=test*" {
		t.Errorf("shared wildcard: %q", got)
	}
	// Shared at depth 1 only: depth 2 (no share) and 3 (key-only) keep values.
	if got := key(E("user=user/1", "resource=res/a", "action=read")); got != "s:user=user/*,resource=res/a,action=read" {
		t.Errorf("nested share key %q", got)
	}
	r := s.Match("s", E("files=files/x"))
	if !r.ShareThreshold {
		t.Error("ShareThreshold not set")
	}
	d := E("files=files/x")
	if KeyHash(r, "s", d) != KeyHash(r, "s", E("files=files/y")) {
		t.Error("KeyHash differs for values sharing a budget")
	}
	// With r == nil the values are used as is.
	if got := string(AppendKey(nil, nil, "s", d)); got != "s:files=files/x" {
		t.Errorf("AppendKey(nil rule) = %q", got)
	}
}

func TestNilSet(t *testing.T) {
	var s *Set
	if s.Match("d", E("a=b")) != nil || s.Version() != 0 || s.Rules() != nil || s.Domains() != nil || s.Files() != nil || s.HasDomain("d") {
		t.Error("nil Set is not empty")
	}
	out := s.MatchAll("d", [][]Entry{E("a=b"), E("c=d")}, nil)
	if len(out) != 2 || out[0] != nil || out[1] != nil {
		t.Errorf("nil Set MatchAll = %v", out)
	}
	if r, tr := s.MatchTrace("d", E("a=b")); r != nil || len(tr) == 0 {
		t.Errorf("nil Set MatchTrace = %v, %v", r, tr)
	}
}

func TestMatchTrace(t *testing.T) {
	s := mustCompileExample(t)
	r, tr := s.MatchTrace("public-api", E("tier=free", "route=/v1/search", "api_key=k_x"))
	want := []string{
		"tier=free: exact value match",
		"route=/v1/search: exact value match",
		"api_key=k_x: key-only match (each value has its own budget)",
	}
	if r == nil || r.Name != "free_search" || len(tr) != 4 {
		t.Fatalf("trace = %q", tr)
	}
	for i, w := range want {
		if tr[i] != w {
			t.Errorf("line %d = %q, want %q", i, tr[i], w)
		}
	}
	if !strings.Contains(tr[3], `"free_search"`) || !strings.Contains(tr[3], "30 per minute, burst 10") {
		t.Errorf("rule line = %q", tr[3])
	}
	_, tr = s.MatchTrace("public-api", E("tier=free", "route=/v1/other", "api_key=k_x"))
	if last := tr[len(tr)-1]; last != "no rule at depth 2" {
		t.Errorf("trace for /v1/other ends %q", last)
	}
	_, tr = s.MatchTrace("public-api", E("tier=free", "api_key=k_x"))
	if !strings.Contains(tr[1], `no descriptor with key "api_key" at depth 2`) {
		t.Errorf("trace = %q", tr)
	}
	_, tr = s.MatchTrace("nope", E("a=b"))
	if !strings.Contains(tr[0], "unknown domain") {
		t.Errorf("trace = %q", tr)
	}
}

func TestUnitsAndExtensions(t *testing.T) {
	s := compileOne(t, "ext.yaml", `
domain: ext
descriptors:
  - key: a
    rate_limit: {unit: SECOND, requests_per_unit: 10}
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
  - key: c
    rate_limit: {unit: month, requests_per_unit: 1}
  - key: d
    rate_limit: {unit: year, requests_per_unit: 1, algorithm: fixed_window}
  - key: e
    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 20, algorithm: sliding_window}
  - key: f
    quota_mode: true
    detailed_metric: yes
    value_to_metric: true
    metadata: {name: service_1}
    rate_limit: {unit: hour, requests_per_unit: 1000}
`)
	get := func(k string) *Rule { return s.Match("ext", E(k+"=1")) }
	a := get("a")
	if a.Unit != UnitSecond || a.Burst != 10 || a.Algorithm.String() != "token_bucket" || a.Backend != BackendLease ||
		a.FailureMode != FailOpen || a.Shards != 1 || a.Routing != RoutingSpread || a.UnitMultiplier != 1 {
		t.Errorf("defaults: %+v", a)
	}
	b := get("b")
	if b.Unit != UnitWeek || b.Window.Hours() != 7*24 || b.Burst != 3 || b.Algorithm.String() != "gcra" || b.Backend != BackendRedis ||
		b.FailureMode != FailClosed || b.Shards != 4 || b.Routing != RoutingConsistentHash {
		t.Errorf("extensions: %+v", b)
	}
	if c := get("c"); c.Window.Hours() != 30*24 {
		t.Errorf("month = %v", c.Window)
	}
	if d := get("d"); d.Window.Hours() != 365*24 || d.Limit.Algorithm().String() != "fixed_window" {
		t.Errorf("year = %+v", d)
	}
	if e := get("e"); e.Window.Minutes() != 5 || e.UnitMultiplier != 5 || e.Limit.Window().Minutes() != 5 || e.Limit.Quota() != 20 {
		t.Errorf("unit_multiplier = %+v", e)
	}
	f := get("f")
	if f.Unit != UnitHour || !f.QuotaMode || !f.ShadowMode || !f.DetailedMetric || !f.ValueToMetric || f.RequestsPerUnit != 1000 {
		t.Errorf("f = %+v", f)
	}
}

func TestRuleIDsAndMetadata(t *testing.T) {
	s, err := Compile(7, []File{
		{Name: "b.yaml", Source: []byte("domain: b\ndescriptors:\n  - key: x\n    rate_limit: {unit: second, requests_per_unit: 1}\n")},
		{Name: "a.yaml", Domain: "a", Source: []byte("domain: a\ndescriptors:\n  - key: y\n    descriptors:\n      - key: z\n        rate_limit: {unit: second, requests_per_unit: 1}\n")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if s.Version() != 7 || fmt.Sprint(s.Domains()) != "[a b]" || len(s.Files()) != 2 || s.Files()[0].Domain != "b" {
		t.Errorf("Version=%d Domains=%v Files=%v", s.Version(), s.Domains(), s.Files())
	}
	for i, r := range s.Rules() {
		if r.ID != i {
			t.Errorf("rule %d has ID %d", i, r.ID)
		}
	}
	r := s.Match("a", E("y=1", "z=2"))
	if r == nil || r.File != "a.yaml" || r.Line != 5 || r.Domain != "a" || r.Depth != 2 {
		t.Errorf("rule = %+v", r)
	}
}

func TestYAMLFeatures(t *testing.T) {
	// Anchors, aliases and merge keys; YAML 1.1 booleans; numbers as values.
	s := compileOne(t, "anchors.yaml", `
domain: anchors
descriptors:
  - key: a
    value: 200
    shadow_mode: on
    rate_limit: &lim
      unit: minute
      requests_per_unit: 10.0
  - key: b
    value: true
    rate_limit: *lim
  - key: c
    rate_limit:
      <<: *lim
      requests_per_unit: 20
`)
	if r := s.Match("anchors", E("a=200")); r == nil || !r.ShadowMode || r.RequestsPerUnit != 10 {
		t.Errorf("a = %+v", r)
	}
	if r := s.Match("anchors", E("b=true")); r == nil || r.RequestsPerUnit != 10 || r.Unit != UnitMinute {
		t.Errorf("b = %+v", r)
	}
	if r := s.Match("anchors", E("c=x")); r == nil || r.RequestsPerUnit != 20 || r.Unit != UnitMinute {
		t.Errorf("c = %+v", r)
	}
}

func TestWarnings(t *testing.T) {
	s := compileOne(t, "warn.yaml", `
domain: w
descriptors:
  - key: a
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: nobody}]}
`)
	w := strings.Join(s.Warnings(), "\n")
	if !strings.Contains(w, "warn.yaml:4: share_threshold has no effect") || !strings.Contains(w, "replaces names 'nobody'") {
		t.Errorf("warnings = %q", w)
	}
}
