package httplimit

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// devYAML is the gateway's -dev descriptor configuration.
const devYAML = `
domain: public-api
api_key:
  headers: [Authorization, X-API-Key]
tier:
  keys: {k_free_demo: free, k_premium_demo: premium, k_live_abc123: premium}
  default: free
routes:
  paths: [/v1/search, "/v1/items/{id}", "/files/{path...}"]
  default: other
descriptors:
  - [tier, api_key]
  - [tier, route, api_key]
  - [api_key]
`

func mustExtractor(t testing.TB, y string) *Extractor {
	t.Helper()
	var cfg Config
	dec := yaml.NewDecoder(strings.NewReader(y))
	dec.KnownFields(true)
	if err := dec.Decode(&cfg); err != nil {
		t.Fatal(err)
	}
	x, err := NewExtractor(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return x
}

func req(method, target string, hdr ...string) *http.Request {
	r := httptest.NewRequest(method, target, nil)
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	return r
}

func entries(kv ...string) []rules.Entry {
	var out []rules.Entry
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, rules.Entry{Key: kv[i], Value: kv[i+1]})
	}
	return out
}

func descs(ds ...[]rules.Entry) []agent.Descriptor {
	out := []agent.Descriptor{}
	for _, d := range ds {
		out = append(out, agent.Descriptor{Entries: d})
	}
	return out
}

func TestExtractDevConfig(t *testing.T) {
	x := mustExtractor(t, devYAML)
	tests := []struct {
		name string
		r    *http.Request
		want []agent.Descriptor
	}{
		{"free key on search", req("GET", "/v1/search", "X-API-Key", "k_free_demo"), descs(
			entries("tier", "free", "api_key", "k_free_demo"),
			entries("tier", "free", "route", "/v1/search", "api_key", "k_free_demo"),
			entries("api_key", "k_free_demo"))},
		{"bearer premium", req("GET", "/v1/search?q=1", "Authorization", "Bearer  k_premium_demo "), descs(
			entries("tier", "premium", "api_key", "k_premium_demo"),
			entries("tier", "premium", "route", "/v1/search", "api_key", "k_premium_demo"),
			entries("api_key", "k_premium_demo"))},
		{"bearer wins over X-API-Key", req("GET", "/x", "Authorization", "bearer a", "X-API-Key", "b"), descs(
			entries("tier", "free", "api_key", "a"),
			entries("tier", "free", "route", "other", "api_key", "a"),
			entries("api_key", "a"))},
		{"basic auth ignored", req("GET", "/v1/items/42", "Authorization", "Basic Zm9vOmJhcg==", "X-API-Key", "k"), descs(
			entries("tier", "free", "api_key", "k"),
			entries("tier", "free", "route", "/v1/items/{id}", "api_key", "k"),
			entries("api_key", "k"))},
		{"no key: every descriptor skipped", req("GET", "/v1/search"), descs()},
		{"empty bearer", req("GET", "/v1/search", "Authorization", "Bearer "), descs()},
		{"uncleaned path", req("GET", "/v1//search/", "X-API-Key", "k"), descs(
			entries("tier", "free", "api_key", "k"),
			entries("tier", "free", "route", "/v1/search", "api_key", "k"),
			entries("api_key", "k"))},
		{"rest template", req("GET", "/files/a/b/c", "X-API-Key", "k"), descs(
			entries("tier", "free", "api_key", "k"),
			entries("tier", "free", "route", "/files/{path...}", "api_key", "k"),
			entries("api_key", "k"))},
	}
	for _, tc := range tests {
		got, err := x.Extract(tc.r)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s:\n got %v\nwant %v", tc.name, got, tc.want)
		}
	}
}

func TestExtractSourcesAndSkipping(t *testing.T) {
	x := mustExtractor(t, `
domain: d
tier: {header: X-Tier}
client_ip: {trusted_proxies: [10.0.0.0/8]}
descriptors:
  - [{generic_key: all}]
  - [{key: plan, header: x-plan}, method]
  - [tier, client_ip]
  - [{source: client_ip, key: ip}, {key: edge, value: eu}]
  - [route]
`)
	r := req("POST", "/p", "X-Plan", "gold", "X-Forwarded-For", "203.0.113.9")
	r.RemoteAddr = "10.1.2.3:4567"
	got, err := x.Extract(r)
	if err != nil {
		t.Fatal(err)
	}
	want := descs(
		entries("generic_key", "all"),
		entries("plan", "gold", "method", "POST"),
		// no tier header and no default: [tier, client_ip] skipped
		entries("ip", "203.0.113.9", "edge", "eu"),
		// no routes and no default: [route] skipped
	)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("\n got %v\nwant %v", got, want)
	}
	r.Header.Set("X-Tier", "gold")
	got, _ = x.Extract(r)
	if len(got) != 4 || !reflect.DeepEqual(got[2].Entries, entries("tier", "gold", "remote_address", "203.0.113.9")) {
		t.Fatalf("with a tier header: %v", got)
	}
}

func TestClientIP(t *testing.T) {
	x := mustExtractor(t, `
domain: d
client_ip: {trusted_proxies: [10.0.0.0/8, "2001:db8::/32", 192.0.2.1]}
descriptors: [[client_ip]]
`)
	long := strings.Repeat("10.0.0.1, ", MaxForwardedHops+5) + "10.0.0.2"
	tests := []struct {
		name   string
		remote string
		xff    []string
		want   string
	}{
		{"untrusted peer ignores XFF", "198.51.100.7:1234", []string{"1.1.1.1"}, "198.51.100.7"},
		{"trusted peer, one hop", "10.0.0.1:1", []string{"203.0.113.5"}, "203.0.113.5"},
		{"walk from the right skipping proxies", "10.0.0.1:1", []string{"1.1.1.1, 203.0.113.5, 10.9.9.9"}, "203.0.113.5"},
		{"spoofed left part ignored", "192.0.2.1:1", []string{"6.6.6.6,203.0.113.5"}, "203.0.113.5"},
		{"several header lines", "10.0.0.1:1", []string{"5.5.5.5", "203.0.113.5, 10.0.0.3"}, "203.0.113.5"},
		{"all trusted: leftmost", "10.0.0.1:1", []string{"10.0.0.7, 10.0.0.8"}, "10.0.0.7"},
		{"no XFF: the proxy", "10.0.0.1:1", nil, "10.0.0.1"},
		{"garbage ends the walk", "10.0.0.1:1", []string{"203.0.113.5, bogus, 10.0.0.4"}, "10.0.0.4"},
		{"ipv6 peer", "[2001:db8::1]:443", []string{"[2001:db9::5]:80"}, "2001:db9::5"},
		{"mapped ipv4", "[::ffff:198.51.100.7]:1", nil, "198.51.100.7"},
		{"hop bound", "10.0.0.1:1", []string{"203.0.113.5, " + long}, "10.0.0.1"},
		{"empty elements", "10.0.0.1:1", []string{" , 203.0.113.5 ,, "}, "203.0.113.5"},
	}
	for _, tc := range tests {
		r := req("GET", "/")
		r.RemoteAddr = tc.remote
		for _, v := range tc.xff {
			r.Header.Add("X-Forwarded-For", v)
		}
		got, err := x.Extract(r)
		if err != nil || len(got) != 1 || got[0].Entries[0].Value != tc.want {
			t.Errorf("%s: got %v, %v; want %s", tc.name, got, err, tc.want)
		}
	}
	r := req("GET", "/")
	r.RemoteAddr = "not an address"
	if got, _ := x.Extract(r); len(got) != 0 {
		t.Errorf("unparseable RemoteAddr: got %v, want the descriptor skipped", got)
	}
}

func TestRouteTemplates(t *testing.T) {
	x := mustExtractor(t, `
domain: d
routes:
  paths: [/, /v1/search, "/v1/items/{id}", "/v1/items/{id}/tags/{tag}", "/v2/{rest...}", "/{any}"]
descriptors: [[route]]
`)
	tests := map[string]string{
		"/":                    "/",
		"/v1/search":           "/v1/search",
		"/v1/search/":          "/v1/search",
		"/v1/./search":         "/v1/search",
		"/v1/items/7":          "/v1/items/{id}",
		"/v1/items/7/tags/x":   "/v1/items/{id}/tags/{tag}",
		"/v1/items/7/tags":     "",
		"/v1/items":            "",
		"/v2":                  "/v2/{rest...}",
		"/v2/a/b":              "/v2/{rest...}",
		"/v3":                  "/{any}",
		"/v3/x":                "",
		"/v1/items/7/tags/x/y": "",
	}
	for p, want := range tests {
		got, ok := x.route(p)
		if got != want || ok != (want != "") {
			t.Errorf("route(%q) = %q, %v; want %q", p, got, ok, want)
		}
	}
	if a := testing.AllocsPerRun(100, func() { x.route("/v1/items/7/tags/x") }); a != 0 {
		t.Errorf("route allocates %v times, want 0", a)
	}
}

func TestExtractBounds(t *testing.T) {
	x := mustExtractor(t, devYAML)
	long := strings.Repeat("k", DefaultMaxValueBytes+1)
	for _, r := range []*http.Request{
		req("GET", "/v1/search", "X-API-Key", long),
		req("GET", "/v1/search", "Authorization", "Bearer "+long),
	} {
		_, err := x.Extract(r)
		var bre *BadRequestError
		if !errors.Is(err, ErrBadRequest) || !errors.As(err, &bre) || strings.Contains(bre.Message, "kkk") {
			t.Errorf("err = %v, want a BadRequestError that does not echo the value", err)
		}
	}
}

func TestExtractRejectsInvalidText(t *testing.T) {
	x := mustExtractor(t, devYAML)
	for _, v := range []string{"k\xff", "k\x00", "k\r\nX-Evil: 1", "k\x7f", "\xc0\xaf"} {
		for _, r := range []*http.Request{
			req("GET", "/v1/search", "X-API-Key", v),
			req("GET", "/v1/search", "Authorization", "Bearer "+v),
		} {
			_, err := x.Extract(r)
			var bre *BadRequestError
			if !errors.As(err, &bre) || !strings.Contains(bre.Message, "not valid UTF-8 text") || strings.Contains(bre.Message, v) {
				t.Errorf("%q: err = %v, want a BadRequestError that does not echo the value", v, err)
			}
		}
	}
	// Valid multi-byte UTF-8 is a key like any other.
	ds, err := x.Extract(req("GET", "/v1/search", "X-API-Key", "clé-ключ-日本-🔑"))
	if err != nil || len(ds) == 0 {
		t.Fatalf("multi-byte key: %v, %d descriptors", err, len(ds))
	}
}

func TestConfigErrors(t *testing.T) {
	bad := map[string]string{
		"unknown entry key":     "domain: d\ndescriptors: [[{key: a, bogus: b}]]",
		"unknown source name":   "domain: d\ndescriptors: [[nope]]",
		"bad source in mapping": "domain: d\ndescriptors: [[{key: a, source: nope}]]",
		"header without key":    "domain: d\ndescriptors: [[{header: X-A}]]",
		"empty descriptor":      "domain: d\ndescriptors: [[]]",
		"no domain":             "descriptors: [[api_key]]",
		"bad cidr":              "client_ip: {trusted_proxies: [10.0.0.0/33]}",
		"bad template":          "routes: {paths: [\"/a/{x\"]}",
		"rest not last":         "routes: {paths: [\"/a/{x...}/b\"]}",
		"relative path":         "routes: {paths: [a/b]}",
		"duplicate path":        "routes: {paths: [/a, /a/]}",
		"bad header name":       "api_key: {headers: [\"X Bad\"]}",
		"unknown top-level":     "domain: d\nbogus: 1",
		"static with header":    "domain: d\ndescriptors: [[{source: api_key, header: X-A}]]",
	}
	bad["too many descriptors"] = "domain: d\ndescriptors: [" + strings.Repeat("[api_key],", MaxDescriptors) + "[api_key]]"
	bad["too many entries"] = "domain: d\ndescriptors: [[" + strings.Repeat("api_key,", MaxEntries) + "api_key]]"
	for name, y := range bad {
		var cfg Config
		dec := yaml.NewDecoder(strings.NewReader(y))
		dec.KnownFields(true)
		err := dec.Decode(&cfg)
		if err == nil {
			_, err = NewExtractor(cfg)
		}
		if err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// Entry errors name the line.
	var cfg Config
	err := yaml.Unmarshal([]byte("domain: d\ndescriptors:\n  - [api_key]\n  - [{key: a, bogus: b}]\n"), &cfg)
	if err == nil || !strings.Contains(err.Error(), "line 4") {
		t.Errorf("err = %v, want it to name line 4", err)
	}
}

// FuzzDescriptors feeds arbitrary request parts to the extractor: it must
// never panic, and its output stays within the configured bounds.
func FuzzDescriptors(f *testing.F) {
	f.Add("/v1/search", "k_free_demo", "Bearer abc", "1.2.3.4, 10.0.0.1", "10.0.0.9:1234", "gold")
	f.Add("//..//v1/items/%2F/x", "", "bearer\t", ",,,[::1]:80,::ffff:10.0.0.1", "[::1]", "")
	f.Add("/v1/search", "k\xff", "Bearer k\xff", "10.0.0.1", "10.0.0.2:1", "t\x00")
	f.Add("/v1/search", "k\r\nX: y", "Bearer \xc0\xaf", "", "", "ключ🔑")
	f.Add("/files/"+strings.Repeat("a/", 100), strings.Repeat("x", 300), "Bearer", "garbage", "", strings.Repeat("t", 300))
	x := mustExtractor(f, devYAML+`
client_ip: {trusted_proxies: [10.0.0.0/8, "::1"]}
`)
	y := mustExtractor(f, `
domain: d
tier: {header: X-Tier, default: t}
client_ip: {trusted_proxies: [0.0.0.0/0, "::/0"]}
routes: {paths: ["/{a}/{b...}"]}
descriptors: [[client_ip, tier], [route, method], [{key: h, header: X-H}]]
`)
	f.Fuzz(func(t *testing.T, path, apiKey, auth, xff, remote, tier string) {
		r := &http.Request{Method: "GET", Header: http.Header{}, RemoteAddr: remote}
		r.URL = &url.URL{Path: path}
		r.Header["X-Api-Key"] = []string{apiKey}
		r.Header["Authorization"] = []string{auth}
		r.Header["X-Forwarded-For"] = []string{xff, xff}
		r.Header["X-Tier"] = []string{tier}
		r.Header["X-H"] = []string{tier}
		for _, ex := range []*Extractor{x, y} {
			ds, err := ex.Extract(r)
			if err != nil {
				if !errors.Is(err, ErrBadRequest) {
					t.Fatalf("unexpected error kind: %v", err)
				}
				continue
			}
			if len(ds) > MaxDescriptors {
				t.Fatalf("%d descriptors", len(ds))
			}
			for _, d := range ds {
				if len(d.Entries) == 0 || len(d.Entries) > MaxEntries {
					t.Fatalf("descriptor with %d entries", len(d.Entries))
				}
				for _, e := range d.Entries {
					if e.Key == "" || e.Value == "" || len(e.Value) > DefaultMaxValueBytes && e.Key != "route" {
						t.Fatalf("bad entry %+v", e)
					}
					if !rules.ValidText(e.Value) {
						t.Fatalf("entry %q: value %q is not valid text", e.Key, e.Value)
					}
				}
			}
		}
	})
}

// The text a configuration puts into descriptors (the domain, keys,
// constant values, route patterns and default, tiers) is checked at
// start-up, naming the field: the agent would refuse it on every request.
func TestNewExtractorRefusesValuesTheAgentRefuses(t *testing.T) {
	long := strings.Repeat("x", 5000)
	for _, tc := range []struct{ yaml, field string }{
		{"domain: \"public\\tapi\"\ndescriptors: [[{generic_key: all}]]", "domain"},
		{"domain: \"d\\x85\"", "domain"},
		{"domain: d\ndescriptors: [[{generic_key: \"a\\u0085b\"}]]", "descriptors[0][0].value"},
		{"domain: d\ndescriptors: [[api_key], [api_key, {key: \"e\\u0000\", value: x}]]", "descriptors[1][1].key"},
		{"domain: d\ndescriptors: [[{key: \"h\\n\", header: X-H}]]", "descriptors[0][0].key"},
		{"domain: d\ndescriptors: [[{source: tier, key: \"t\\x7f\"}]]", "descriptors[0][0].key"},
		{"domain: d\ndescriptors: [[{key: edge, value: " + long + "}]]", "descriptors[0]"},
		{"domain: d\ntier: {default: \"free\\t\"}\ndescriptors: [[tier]]", "tier.default"},
		{"domain: d\ntier: {default: " + long + "}\ndescriptors: [[tier]]", "tier.default"},
		{"domain: d\ntier: {keys: {k1: \"gold\\r\"}}\ndescriptors: [[tier]]", "tier.keys"},
		{"domain: d\ntier: {keys: {\"k\\u0001\": gold}}\ndescriptors: [[tier]]", "tier.keys"},
		{"domain: d\nroutes: {default: \"\\u009f\"}\ndescriptors: [[route]]", "routes.default"},
		{"domain: d\nmax_value_bytes: 4\nroutes: {default: other}\ndescriptors: [[route]]", "routes.default"},
		{"domain: d\nroutes: {paths: [\"/a\\tb\"]}\ndescriptors: [[route]]", "routes.paths"},
	} {
		var cfg Config
		if err := yaml.Unmarshal([]byte(tc.yaml), &cfg); err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		_, err := NewExtractor(cfg)
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Field != tc.field {
			t.Errorf("%.60q: NewExtractor error %v, want a FieldError for %s", tc.yaml, err, tc.field)
		}
	}
	// At the bounds: accepted.
	var cfg Config
	ok := "domain: d\ntier: {default: " + strings.Repeat("t", DefaultMaxValueBytes) + "}\ndescriptors: [[tier], [{key: edge, value: " + strings.Repeat("v", 4000) + "}]]"
	if err := yaml.Unmarshal([]byte(ok), &cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := NewExtractor(cfg); err != nil {
		t.Fatalf("config at the bounds refused: %v", err)
	}
}

// The JSON config (the Caddy module's) takes every entry form the YAML
// one does, strictly: unknown keys and non-string values are refused.
func TestEntryConfigJSONTakesTheYAMLForms(t *testing.T) {
	for _, tc := range []struct{ yml, js string }{
		{`[[{key: plan, header: X-Plan}]]`, `[[{"key":"plan","header":"X-Plan"}]]`},
		{`[[{generic_key: all}]]`, `[[{"generic_key":"all"}]]`},
		{`[[api_key, {source: client_ip, key: ip}]]`, `[["api_key",{"source":"client_ip","key":"ip"}]]`},
		{`[[{key: edge, value: eu}]]`, `[[{"key":"edge","value":"eu"}]]`},
		{`[[tier, route, method]]`, `[["tier","route","method"]]`},
	} {
		var y, j Config
		if err := yaml.Unmarshal([]byte("domain: d\ndescriptors: "+tc.yml), &y); err != nil {
			t.Fatalf("YAML %s: %v", tc.yml, err)
		}
		dec := json.NewDecoder(strings.NewReader(`{"domain":"d","descriptors":` + tc.js + `}`))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&j); err != nil {
			t.Errorf("JSON %s: %v", tc.js, err)
			continue
		}
		if !reflect.DeepEqual(y, j) {
			t.Errorf("JSON %s = %+v, YAML %s = %+v", tc.js, j.Descriptors, tc.yml, y.Descriptors)
		}
		if err := j.Validate(); err != nil {
			t.Errorf("JSON %s: %v", tc.js, err)
		}
	}
	for _, bad := range []string{`[["nope"]]`, `[[{"key":"a","bogus":"b"}]]`, `[[{"key":"a","value":1}]]`, `[[7]]`} {
		var c Config
		if err := json.Unmarshal([]byte(`{"domain":"d","descriptors":`+bad+`}`), &c); err == nil {
			t.Errorf("JSON %s accepted: %+v", bad, c.Descriptors)
		}
	}
}

// FuzzConfigJSON feeds arbitrary JSON to the Config decoder as the Caddy
// module loads it (strictly): it never panics, what it accepts validates
// or is refused with an error, encodes back to JSON that decodes to the
// same config, and a valid config extracts from a request.
func FuzzConfigJSON(f *testing.F) {
	for _, d := range []string{
		`[[{"key":"plan","header":"X-Plan"}]]`, `[[{"generic_key":"all"}]]`,
		`[["api_key",{"source":"client_ip","key":"ip"}]]`, `[[{"key":"edge","value":"eu"}]]`,
		`[["tier","route","method"]]`, `[["nope"]]`, `[[{"key":"a","bogus":"b"}]]`,
		`[[{"key":"a","value":1}]]`, `[[7]]`, `[[{"generic_key":"all","key":"k","source":"header"}]]`,
		`[[null]]`, `[[{}]]`, `[[""]]`,
	} {
		f.Add([]byte(`{"domain":"d","descriptors":` + d + `}`))
	}
	f.Add([]byte(`{"domain":"public-api","api_key":{"headers":["Authorization","X-API-Key"]},` +
		`"client_ip":{"trusted_proxies":["10.0.0.0/8","::1"],"header":"X-Real-IP"},` +
		`"routes":{"paths":["/v1/search","/v1/items/{id}","/files/{path...}"],"default":"other"},` +
		`"tier":{"header":"X-Tier","keys":{"k_free_demo":"free"},"default":"free"},` +
		`"max_value_bytes":64,"forward_auth":{"on_missing":"deny"},"descriptors":[["tier","route","api_key"]]}`))
	decode := func(b []byte) (Config, error) {
		var c Config
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		return c, dec.Decode(&c)
	}
	f.Fuzz(func(t *testing.T, src []byte) {
		c, err := decode(src)
		if err != nil {
			return
		}
		out, err := json.Marshal(c)
		if err != nil {
			t.Fatalf("%+v does not encode: %v", c, err)
		}
		back, err := decode(out)
		if err != nil {
			t.Fatalf("%s does not decode: %v", out, err)
		}
		if again, _ := json.Marshal(back); !bytes.Equal(again, out) {
			t.Fatalf("JSON round trip:\n%s\n%s", out, again)
		}
		x, err := NewExtractor(c)
		if err != nil {
			return
		}
		r := req("GET", "/v1/items/1", "X-API-Key", "k_free_demo", "X-Tier", "gold", "X-Plan", "p")
		r.RemoteAddr = "10.0.0.1:1234"
		_, _ = x.Extract(r)
	})
}
