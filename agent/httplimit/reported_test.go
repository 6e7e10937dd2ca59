package httplimit

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/allot/allot/agent/internal/agenttest"
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
