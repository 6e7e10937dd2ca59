package httplimit_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/rules"
)

// exampleRules lets every API key make 2 requests a minute, with a burst
// of 2.
const exampleRules = `
domain: example
descriptors:
  - key: api_key
    rate_limit:
      name: per_key
      unit: minute
      requests_per_unit: 2
      burst: 2
`

// The middleware puts an agent in front of a handler: each request's
// descriptors are checked, an allowed request is forwarded with the
// RateLimit fields set (t: seconds until the next token), and a denied one
// gets a 429 with Retry-After.
// Here the descriptor is the X-API-Key header; Middleware.Extractor builds
// descriptors from a declarative Config instead.
func ExampleMiddleware() {
	set, err := rules.Compile(1, []rules.File{{Name: "example.yaml", Source: []byte(exampleRules)}})
	if err != nil {
		log.Fatal(err)
	}
	cfg := agent.DefaultConfig()
	cfg.Rules = set
	a, err := agent.New(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close(context.Background())

	mw := &httplimit.Middleware{
		Checker: a,
		Domain:  "example",
		Descriptors: func(r *http.Request) ([]agent.Descriptor, error) {
			key := r.Header.Get("X-API-Key")
			if key == "" {
				return nil, nil // no descriptor: forwarded unchecked
			}
			return []agent.Descriptor{{Entries: []rules.Entry{{Key: "api_key", Value: key}}}}, nil
		},
	}
	upstream := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	h := mw.Wrap(upstream)

	for i := 1; i <= 3; i++ {
		r := httptest.NewRequest(http.MethodGet, "/v1/search", nil)
		r.Header.Set("X-API-Key", "k_123")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Printf("%d %s | RateLimit-Policy: %s | Retry-After: %q\n", w.Code, w.Header().Get("RateLimit"), w.Header().Get("RateLimit-Policy"), w.Header().Get("Retry-After"))
	}
	// Output:
	// 200 "per_key";r=1;t=30 | RateLimit-Policy: "per_key";q=2;w=60 | Retry-After: ""
	// 200 "per_key";r=0;t=30 | RateLimit-Policy: "per_key";q=2;w=60 | Retry-After: ""
	// 429 "per_key";r=0;t=30 | RateLimit-Policy: "per_key";q=2;w=60 | Retry-After: "30"
}
