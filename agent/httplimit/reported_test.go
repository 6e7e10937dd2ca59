package httplimit

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/allot/allot/agent/internal/agenttest"
	"github.com/allot/allot/pkg/sfv/sfvtest"
)

// agentHandler is a Middleware over a frozen agent (agenttest.Frozen) with
// the rules yaml, in front of a handler
// that answers 200; descriptors come from the X-API-Key header (key
// api_key) and, when route is set, from the route (every path is "any").
func agentHandler(t *testing.T, yaml string, route bool) http.Handler {
	t.Helper()
	a := agenttest.Frozen(t, yaml)
	xc := Config{Domain: "d", APIKey: APIKeyConfig{Headers: []string{"X-API-Key"}},
		Descriptors: []DescriptorConfig{{{Source: SourceAPIKey}}}}
	if route {
		xc.Routes = RoutesConfig{Default: "any"}
		xc.Descriptors = append(xc.Descriptors, DescriptorConfig{{Source: SourceRoute}})
	}
	x, err := NewExtractor(xc)
	if err != nil {
		t.Fatal(err)
	}
	m := &Middleware{Checker: a, Extractor: x}
	return m.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
}

// TestEnforcedPolicyAdvertisedBesideShadow pins allowed responses with no
// RateLimit fields: a shadow-mode limit with fewer tokens left than the
// enforced one was the reported limit, and the middleware, which never
// advertises a shadow-mode rule, then wrote neither field. The enforced
// limit is advertised, before and after the shadow limit would deny.
func TestEnforcedPolicyAdvertisedBesideShadow(t *testing.T) {
	h := agentHandler(t, `
domain: d
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 100}
  - key: route
    shadow_mode: true
    rate_limit: {name: trial_route, unit: minute, requests_per_unit: 2}
`, true)
	for i := 1; i <= 4; i++ {
		w := serve(h, req("GET", "/x", "X-API-Key", "k1"))
		pol, rl := w.Header().Get(HeaderRateLimitPolicy), w.Header().Get(HeaderRateLimit)
		if w.Code != http.StatusOK || pol != `"per_key";q=100;w=60` || rl != fmt.Sprintf(`"per_key";r=%d;t=1`, 100-i) {
			t.Fatalf("request %d: %d RateLimit-Policy %q RateLimit %q, want 200 with per_key's fields, r=%d", i, w.Code, pol, rl, 100-i)
		}
	}
}

// TestRetryAfterIsTheLongestWait pins a 429 whose Retry-After (and t) was
// the first denying limit's, 30 s of per_key, while route_daily, also
// exhausted, admits nothing for 8 h: a client that retried on time was
// denied again. The 429 reports the longest wait and its policy.
func TestRetryAfterIsTheLongestWait(t *testing.T) {
	h := agentHandler(t, `
domain: d
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 2}
  - key: route
    rate_limit: {name: route_daily, unit: day, requests_per_unit: 3}
`, true)
	for i, key := range []string{"k1", "k1", "k2"} {
		if w := serve(h, req("GET", "/x", "X-API-Key", key)); w.Code != http.StatusOK {
			t.Fatalf("request %d: %d, want 200", i+1, w.Code)
		}
	}
	wantDenied(t, "k1, both limits exhausted", serve(h, req("GET", "/x", "X-API-Key", "k1")),
		"28800", `"route_daily";q=3;w=86400`, `"route_daily";r=0;t=28800`)
}

// wantDenied fails unless w is a 429 with exactly these Retry-After,
// RateLimit-Policy and RateLimit values, the fields valid Structured
// Fields Lists.
func wantDenied(t *testing.T, what string, w *httptest.ResponseRecorder, retryAfter, policy, rateLimit string) {
	t.Helper()
	hd := w.Header()
	if w.Code != http.StatusTooManyRequests || hd.Get("Retry-After") != retryAfter ||
		hd.Get(HeaderRateLimitPolicy) != policy || hd.Get(HeaderRateLimit) != rateLimit {
		t.Fatalf("%s: %d Retry-After %q RateLimit-Policy %q RateLimit %q, want 429 with %q, %q and %q",
			what, w.Code, hd.Get("Retry-After"), hd.Get(HeaderRateLimitPolicy), hd.Get(HeaderRateLimit), retryAfter, policy, rateLimit)
	}
	for _, f := range []string{HeaderRateLimitPolicy, HeaderRateLimit} {
		if _, err := sfvtest.ParseList(hd.Get(f)); err != nil {
			t.Fatalf("%s: %s %q: %v", what, f, hd.Get(f), err)
		}
	}
}

// TestDenyAllHasBothFields pins a 429 of a deny-all rule
// (requests_per_unit: 0) without RateLimit-Policy and RateLimit: the
// fields were written only for a quota above 0. Draft 10's q is a
// non-negative Integer: the denial carries q=0 and r=0, with t equal to
// Retry-After (the next window boundary).
func TestDenyAllHasBothFields(t *testing.T) {
	h := agentHandler(t, `
domain: d
descriptors:
  - key: api_key
    value: banned
    rate_limit: {name: blocked, unit: hour, requests_per_unit: 0}
`, false)
	wantDenied(t, "a blocked key", serve(h, req("GET", "/x", "X-API-Key", "banned")),
		"3600", `"blocked";q=0;w=3600`, `"blocked";r=0;t=3600`)
}
