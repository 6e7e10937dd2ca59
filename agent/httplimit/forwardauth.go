package httplimit

import (
	"context"
	"net/http"
	"net/url"
	"strings"
)

// Forwarded request headers read by ForwardAuth.
const (
	HeaderForwardedMethod = "X-Forwarded-Method"
	HeaderForwardedURI    = "X-Forwarded-Uri"
	HeaderOriginalURI     = "X-Original-Uri" // nginx's customary name
)

// maxForwardedURI bounds X-Forwarded-Uri / X-Original-URI.
const maxForwardedURI = 8 << 10

// ForbiddenBody is the body of the 403 that on_missing: deny answers.
const ForbiddenBody = `{"error":"forbidden","message":"The request carries no rate limit key."}`

// ForwardAuth answers the authorization subrequests of nginx
// auth_request, Caddy forward_auth and Traefik ForwardAuth: a proxy in
// front of the service sends it a copy of each client request's headers,
// and forwards the client request only on a 2xx.
//
// The descriptors are extracted exactly as the proxy mode extracts them
// (Middleware.Extractor), from the forwarded request: the method from
// X-Forwarded-Method (else the subrequest's own), the route from the path
// of X-Forwarded-Uri, else X-Original-URI (neither: the route is
// routes.default), the client address from X-Forwarded-For when the
// connection's peer (the proxy) is in client_ip.trusted_proxies, and every
// other source from the copied headers.
//
//   - Allowed: 200 with the RateLimit and RateLimit-Policy fields, no body.
//   - Denied: the proxy mode's 429 (Middleware.OnDenied, by default
//     WriteDenied): Retry-After, the fields, Cache-Control: no-store, the
//     JSON DeniedBody.
//   - No descriptor: forward_auth.on_missing, allow (200, the default) or
//     deny (403 with ForbiddenBody), counted as result="no_descriptor".
//   - A value over the bounds, or an unparseable forwarded URI: 400 JSON.
//   - A limiter error: 200 (fail open), as the proxy mode forwards.
//
// Use NewForwardAuthMetrics for Middleware.Metrics, so forward-auth checks
// are counted apart from proxied requests. The Middleware must not be
// modified after first use.
type ForwardAuth struct {
	Middleware *Middleware
}

// ServeHTTP answers one check, for any path.
func (f *ForwardAuth) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m := f.Middleware
	fr, err := forwardedRequest(r, m.maxValue())
	if err != nil {
		m.badRequest(w, r, err)
		return
	}
	m.serve(w, fr, http.HandlerFunc(writeAllowed), http.HandlerFunc(f.missing))
}

func (m *Middleware) maxValue() int {
	if m.Extractor != nil {
		return m.Extractor.maxValue
	}
	return DefaultMaxValueBytes
}

// writeAllowed answers an allowed check: 200, the fields already set.
func writeAllowed(w http.ResponseWriter, _ *http.Request) {
	h := w.Header()
	h["Cache-Control"] = []string{"no-store"}
	h["Content-Length"] = []string{"0"}
	w.WriteHeader(http.StatusOK)
}

// missing answers a check with no descriptor by the on_missing policy.
func (f *ForwardAuth) missing(w http.ResponseWriter, r *http.Request) {
	m := f.Middleware
	m.Metrics.inc(resultNoDescriptor)
	if m.Extractor == nil || !m.Extractor.denyMissing {
		writeAllowed(w, r)
		return
	}
	h := w.Header()
	h["Cache-Control"] = []string{"no-store"}
	h["Content-Type"] = []string{"application/json"}
	w.WriteHeader(http.StatusForbidden)
	_, _ = w.Write([]byte(ForbiddenBody))
}

// forwardedRequest returns a shallow copy of r with the method and URL of
// the request it was sent for. When no forwarded URI is given, the URL is
// "/" (never nil: Middleware hooks may read r.URL.Path) and the request's
// context says so (noForwardedURI), so that the extractor still takes the
// route from routes.default rather than matching "/".
func forwardedRequest(r *http.Request, maxValue int) (*http.Request, error) {
	fr := new(http.Request)
	*fr = *r
	if vs := r.Header[HeaderForwardedMethod]; len(vs) > 0 {
		m := strings.TrimSpace(vs[0])
		if len(m) > maxValue || (m != "" && !validHeaderName(m)) { // a method is a token, as a field name
			return nil, &BadRequestError{Message: "X-Forwarded-Method is not a method"}
		}
		if m != "" {
			fr.Method = m
		}
	}
	uri := ""
	for _, h := range [...]string{HeaderForwardedURI, HeaderOriginalURI} {
		if vs := r.Header[h]; len(vs) > 0 && strings.TrimSpace(vs[0]) != "" {
			uri = strings.TrimSpace(vs[0])
			break
		}
	}
	if uri == "" {
		fr.URL = &url.URL{Path: "/"}
		return fr.WithContext(context.WithValue(r.Context(), noURIKey{}, true)), nil
	}
	if len(uri) > maxForwardedURI {
		return nil, &BadRequestError{Message: "the forwarded URI is too long"}
	}
	u, err := url.ParseRequestURI(uri)
	if err != nil {
		return nil, &BadRequestError{Message: "the forwarded URI is not a request URI"}
	}
	fr.URL = u
	return fr, nil
}

// noURIKey marks, in a forwarded request's context, a forward-auth check
// that names no URI (its URL is "/").
type noURIKey struct{}

// noForwardedURI reports whether r is a forward-auth check that names no
// URI.
func noForwardedURI(r *http.Request) bool {
	v, _ := r.Context().Value(noURIKey{}).(bool)
	return v
}
