package httplimit

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

const forwardYAML = devYAML + `
client_ip: {trusted_proxies: [127.0.0.1]}
`

func newForwardAuth(t testing.TB, c Checker, y string) *ForwardAuth {
	t.Helper()
	m, err := NewForwardAuthMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return &ForwardAuth{Middleware: &Middleware{Checker: c, Extractor: mustExtractor(t, y), Metrics: m,
		Logger: slog.New(slog.DiscardHandler)}}
}

// TestForwardAuthExtractsAsTheProxy: a check carrying a request's method,
// URI and client address in the forwarded headers yields exactly the
// descriptors the proxy mode extracts from that request.
func TestForwardAuthExtractsAsTheProxy(t *testing.T) {
	y := devYAML + `
client_ip: {trusted_proxies: [127.0.0.1, 10.0.0.0/8]}
`
	y = strings.Replace(y, "descriptors:\n", "descriptors:\n  - [client_ip, method]\n  - [route, {key: plan, header: X-Plan}]\n", 1)
	direct := &fakeChecker{d: allowedDecision()}
	viaAuth := &fakeChecker{d: allowedDecision()}
	mw := &Middleware{Checker: direct, Extractor: mustExtractor(t, y), Logger: slog.New(slog.DiscardHandler)}
	fa := newForwardAuth(t, viaAuth, y)
	for _, tc := range []struct {
		method, target, client string
		hdr                    []string
	}{
		{"GET", "/v1/search?q=1", "203.0.113.7", []string{"X-API-Key", "k_free_demo"}},
		{"POST", "/v1/items/42", "2001:db8::1", []string{"Authorization", "Bearer k_premium_demo", "X-Plan", "gold"}},
		{"DELETE", "/v1//search/", "198.51.100.2", []string{"X-API-Key", "k_live_abc123"}},
		{"GET", "/elsewhere", "192.0.2.9", nil},
		{"PUT", "/files/a/b%20c", "192.0.2.10", []string{"X-API-Key", "k"}},
	} {
		// The proxy mode: the client connects directly.
		r := req(tc.method, tc.target, tc.hdr...)
		r.RemoteAddr = addrPort(tc.client)
		serve(mw.Wrap(&upstream{}), r)

		// Forward-auth: a proxy on 127.0.0.1 sends the headers, with the
		// client address appended to X-Forwarded-For.
		hdr := append([]string{"X-Forwarded-Method", tc.method, "X-Forwarded-Uri", tc.target,
			"X-Forwarded-For", tc.client}, tc.hdr...)
		ar := req("GET", "/forward-auth/anything", hdr...)
		ar.RemoteAddr = "127.0.0.1:40000"
		if rec := serve(fa, ar); rec.Code != http.StatusOK {
			t.Fatalf("%s %s: forward-auth answered %d", tc.method, tc.target, rec.Code)
		}
		if !reflect.DeepEqual(direct.descs, viaAuth.descs) {
			t.Fatalf("%s %s:\nproxy:        %v\nforward-auth: %v", tc.method, tc.target, direct.descs, viaAuth.descs)
		}
	}
}

func addrPort(ip string) string {
	if strings.Contains(ip, ":") {
		return "[" + ip + "]:5555"
	}
	return ip + ":5555"
}

func TestForwardAuthAllowedAndDenied(t *testing.T) {
	fc := &fakeChecker{d: allowedDecision()}
	fa := newForwardAuth(t, fc, forwardYAML)
	check := func() *http.Request {
		return req("GET", "/forward-auth/", "X-Forwarded-Uri", "/v1/search", "X-Forwarded-Method", "GET", "X-API-Key", "k_free_demo")
	}
	rec := serve(fa, check())
	if rec.Code != 200 || rec.Body.Len() != 0 || rec.Header().Get("Cache-Control") != "no-store" {
		t.Fatalf("allowed: %d %q %v", rec.Code, rec.Body, rec.Header())
	}
	if rec.Header().Get("RateLimit") != `"free_search";r=9;t=2` || rec.Header().Get("RateLimit-Policy") != `"free_search";q=30;w=60` {
		t.Fatalf("allowed fields: %v", rec.Header())
	}

	// Denied: byte for byte the proxy mode's 429.
	fc.d = deniedDecision()
	got := serve(fa, check())
	mw := &Middleware{Checker: fc, Extractor: mustExtractor(t, forwardYAML), Logger: slog.New(slog.DiscardHandler)}
	want := serve(mw.Wrap(&upstream{}), req("GET", "/v1/search", "X-API-Key", "k_free_demo"))
	if got.Code != http.StatusTooManyRequests || got.Code != want.Code || got.Body.String() != want.Body.String() ||
		!reflect.DeepEqual(got.Header(), want.Header()) {
		t.Fatalf("denied: %d %v %q, want %d %v %q", got.Code, got.Header(), got.Body, want.Code, want.Header(), want.Body)
	}
	if got.Header().Get("Retry-After") != "2" {
		t.Fatalf("Retry-After %q", got.Header().Get("Retry-After"))
	}
	m := fa.Middleware.Metrics
	if m.count(resultAllowed) != 1 || m.count(resultDenied) != 1 {
		t.Fatalf("metrics: allowed %d denied %d", m.count(resultAllowed), m.count(resultDenied))
	}

	// A limiter error lets the request through (fail open).
	fc.err = errors.New("boom")
	if rec := serve(fa, check()); rec.Code != 200 {
		t.Fatalf("limiter error: %d, want 200", rec.Code)
	}
}

func TestForwardAuthOnMissing(t *testing.T) {
	// [api_key] alone: a request without a key has no descriptor.
	const y = "domain: d\ndescriptors: [[api_key]]\n"
	for _, tc := range []struct {
		yaml string
		code int
	}{
		{y, 200},
		{y + "forward_auth: {on_missing: allow}\n", 200},
		{y + "forward_auth: {on_missing: deny}\n", 403},
	} {
		fc := &fakeChecker{d: allowedDecision()}
		fa := newForwardAuth(t, fc, tc.yaml)
		rec := serve(fa, req("GET", "/forward-auth/x", "X-Forwarded-Uri", "/v1/search"))
		if rec.Code != tc.code {
			t.Fatalf("%q: %d, want %d", tc.yaml, rec.Code, tc.code)
		}
		if tc.code == 403 && rec.Body.String() != ForbiddenBody {
			t.Fatalf("403 body %q", rec.Body)
		}
		if fc.calls != 0 {
			t.Fatal("the checker was asked without descriptors")
		}
		if n := fa.Middleware.Metrics.count(resultNoDescriptor); n != 1 {
			t.Fatalf("no_descriptor count %d, want 1", n)
		}
	}
	if _, err := NewExtractor(Config{ForwardAuth: ForwardAuthConfig{OnMissing: "maybe"}}); err == nil ||
		!strings.Contains(err.Error(), "forward_auth.on_missing") {
		t.Fatalf("on_missing: maybe: %v", err)
	}
}

func TestForwardAuthBadInput(t *testing.T) {
	secret := "k_" + strings.Repeat("s", DefaultMaxValueBytes)
	for _, hdr := range [][]string{
		{"X-Forwarded-Uri", "/v1/search", "X-API-Key", secret},
		{"X-Forwarded-Uri", "no-slash"},
		{"X-Forwarded-Uri", "/" + strings.Repeat("a", maxForwardedURI)},
		{"X-Forwarded-Uri", "/v1/search", "X-Forwarded-Method", "GE T"},
	} {
		fc := &fakeChecker{d: allowedDecision()}
		fa := newForwardAuth(t, fc, forwardYAML)
		rec := serve(fa, req("GET", "/forward-auth/", hdr...))
		if rec.Code != http.StatusBadRequest || !strings.HasPrefix(rec.Body.String(), `{"error":"bad_request"`) {
			t.Fatalf("%q: %d %q, want a 400 JSON answer", hdr[:2], rec.Code, rec.Body)
		}
		if strings.Contains(rec.Body.String(), "sss") {
			t.Fatalf("the answer echoes the key: %q", rec.Body)
		}
		if fc.calls != 0 {
			t.Fatal("a bad request was checked")
		}
	}
	// No forwarded URI: the route is routes.default.
	fc := &fakeChecker{d: allowedDecision()}
	fa := newForwardAuth(t, fc, forwardYAML)
	if rec := serve(fa, req("GET", "/forward-auth/", "X-API-Key", "k_free_demo")); rec.Code != 200 {
		t.Fatalf("no URI: %d", rec.Code)
	}
	if len(fc.descs) != 3 || fc.descs[1].Entries[1].Value != "other" {
		t.Fatalf("no URI: descriptors %v, want the default route", fc.descs)
	}
}

// FuzzForwardedRequest feeds arbitrary forwarded headers to forward-auth:
// the request is reconstructed or refused with a BadRequestError, never a
// panic, the subrequest itself is left as it was, and the answer is 200,
// or a 4xx with a JSON body.
func FuzzForwardedRequest(f *testing.F) {
	f.Add("GET", "/v1/search?q=1", "", "k_free_demo")
	f.Add("POST", "/v1/items/42", "/ignored", "Bearer k_premium_demo")
	f.Add("DELETE", "/v1//search/", "", "k_live_abc123")
	f.Add("PUT", "/files/a/b%20c", "", "k")
	f.Add("", "", "/v1/search", "k_free_demo")
	f.Add("GE T", "/v1/search", "", "")
	f.Add("GET", "no-slash", "", "")
	f.Add("GET", "/"+strings.Repeat("a", maxForwardedURI), "", "")
	f.Add("GET", "/v1/search", "", "k_"+strings.Repeat("s", DefaultMaxValueBytes))
	f.Add(" \t", " *", "http://host/x?y#z", "k\xff")
	f.Add("GET", "/%zz", "//host/../..", "")
	fa := newForwardAuth(f, &fakeChecker{d: allowedDecision()}, forwardYAML+"forward_auth: {on_missing: deny}\n")
	f.Fuzz(func(t *testing.T, method, fwdURI, origURI, apiKey string) {
		r := req("GET", "/forward-auth/check", "X-Forwarded-For", "203.0.113.7")
		r.RemoteAddr = "127.0.0.1:40000"
		r.Header[HeaderForwardedMethod] = []string{method}
		r.Header[HeaderForwardedURI] = []string{fwdURI}
		r.Header[HeaderOriginalURI] = []string{origURI}
		r.Header["X-Api-Key"] = []string{apiKey}
		fr, err := forwardedRequest(r, DefaultMaxValueBytes)
		if err != nil {
			var bre *BadRequestError
			if !errors.As(err, &bre) || fr != nil {
				t.Fatalf("err = %v (%T), request %v: want a BadRequestError and no request", err, err, fr)
			}
		} else if fr.Method == "" || fr.Header == nil {
			t.Fatalf("forwarded request with method %q, header %v", fr.Method, fr.Header)
		}
		if r.Method != "GET" || r.URL.Path != "/forward-auth/check" {
			t.Fatalf("the subrequest changed: %s %v", r.Method, r.URL)
		}
		rec := serve(fa, r)
		switch {
		case rec.Code == http.StatusOK:
		case rec.Code >= 400 && rec.Code < 500:
			if ct := rec.Header().Get("Content-Type"); ct != "application/json" || !json.Valid(rec.Body.Bytes()) {
				t.Fatalf("%d answered with %q: %q", rec.Code, ct, rec.Body)
			}
		default:
			t.Fatalf("answered %d %q", rec.Code, rec.Body)
		}
		if err != nil && rec.Code != http.StatusBadRequest {
			t.Fatalf("forwardedRequest error %v, answer %d", err, rec.Code)
		}
	})
}
