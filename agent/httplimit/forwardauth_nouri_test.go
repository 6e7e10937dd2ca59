package httplimit

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// TestForwardAuthWithoutURIGivesHooksAURL: a forward-auth check that names
// no URI (no X-Forwarded-Uri, no X-Original-Uri) reaches the Middleware's
// hooks with a usable r.URL, and the extractor still takes the route from
// routes.default, even when "/" is a route of its own.
func TestForwardAuthWithoutURIGivesHooksAURL(t *testing.T) {
	func() {
		defer func() {
			if p := recover(); p != nil {
				t.Errorf("panic from a header-less forward-auth check: %v", p)
			}
		}()
		var path string
		fa := &ForwardAuth{Middleware: &Middleware{
			Checker: &fakeChecker{d: allowedDecision()},
			Domain:  "d",
			Descriptors: func(r *http.Request) ([]agent.Descriptor, error) {
				path = r.URL.Path
				return []agent.Descriptor{{Entries: []rules.Entry{{Key: "path", Value: r.URL.Path}}}}, nil
			},
		}}
		fa.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/forward-auth", nil))
		if path != "/" {
			t.Errorf("hook saw path %q, want /", path)
		}
	}()

	y := strings.Replace(forwardYAML, `paths: [/v1/search,`, `paths: [/, /v1/search,`, 1)
	if y == forwardYAML {
		t.Fatal("the test's rules did not change")
	}
	fc := &fakeChecker{d: allowedDecision()}
	fa := newForwardAuth(t, fc, y)
	if rec := serve(fa, req("GET", "/forward-auth/", "X-API-Key", "k_free_demo")); rec.Code != 200 {
		t.Fatalf("no URI: %d", rec.Code)
	}
	if len(fc.descs) != 3 || fc.descs[1].Entries[1].Value != "other" {
		t.Fatalf("no URI: descriptors %v, want the default route", fc.descs)
	}
	fc = &fakeChecker{d: allowedDecision()}
	fa = newForwardAuth(t, fc, y)
	if rec := serve(fa, req("GET", "/forward-auth/", "X-Forwarded-Uri", "/", "X-API-Key", "k_free_demo")); rec.Code != 200 {
		t.Fatalf("URI /: %d", rec.Code)
	}
	if len(fc.descs) != 3 || fc.descs[1].Entries[1].Value != "/" {
		t.Fatalf("URI /: descriptors %v, want the route /", fc.descs)
	}
}
