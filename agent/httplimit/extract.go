package httplimit

import (
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"path"
	"strings"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/internal/descconf"
	"github.com/allot/allot/pkg/rules"
)

// ErrBadRequest is wrapped by extraction errors caused by the request
// itself (a value over the limits, or not rules.ValidText: invalid UTF-8 or
// control characters); the middleware answers 400.
var ErrBadRequest = errors.New("httplimit: bad request")

// BadRequestError says which part of the request was unusable. Its Message
// is fixed text (it never echoes request bytes) suitable for the response.
type BadRequestError struct {
	Message string
}

func (e *BadRequestError) Error() string { return "httplimit: bad request: " + e.Message }

// Unwrap makes errors.Is(err, ErrBadRequest) hold.
func (e *BadRequestError) Unwrap() error { return ErrBadRequest }

// Extractor turns requests into descriptors as a Config declares. It is
// immutable and safe for concurrent use; build it with NewExtractor.
type Extractor struct {
	domain        string
	descs         [][]entrySpec
	totalEntries  int
	apiKeyHeaders []string // canonical
	trusted       []netip.Prefix
	fwdHeader     string // canonical
	exact         map[string]string
	templates     []template
	routeDefault  string
	tierHeader    string // canonical; "" = none
	tierKeys      map[string]string
	tierDefault   string
	maxValue      int
	denyMissing   bool // forward_auth.on_missing: deny
}

type entrySpec struct {
	key    string
	src    Source
	header string // canonical, for SourceHeader
	value  string // for SourceStatic
}

var bounds = descconf.Bounds{MaxDescriptors: MaxDescriptors, MaxEntries: MaxEntries, DefaultMaxValue: DefaultMaxValueBytes}

// NewExtractor validates cfg and compiles it.
func NewExtractor(cfg Config) (*Extractor, error) {
	x := &Extractor{
		domain:       cfg.Domain,
		routeDefault: cfg.Routes.Default,
		tierKeys:     cfg.Tier.Keys,
		tierDefault:  cfg.Tier.Default,
		exact:        map[string]string{},
	}
	switch cfg.ForwardAuth.OnMissing {
	case "", OnMissingAllow:
	case OnMissingDeny:
		x.denyMissing = true
	default:
		return nil, fieldErrorf("forward_auth.on_missing", "%q: want allow or deny", cfg.ForwardAuth.OnMissing)
	}
	dc, err := descconf.Compile("httplimit", bounds, cfg.Domain, cfg.MaxValueBytes, cfg.Descriptors,
		func(e EntryConfig) (entrySpec, error) {
			if err := e.validate(); err != nil {
				return entrySpec{}, err
			}
			return entrySpec{key: e.Key, src: e.Source, header: http.CanonicalHeaderKey(e.Header), value: e.Value}, nil
		})
	if err != nil {
		return nil, err
	}
	x.maxValue, x.descs, x.totalEntries = dc.MaxValue, dc.Descs, dc.Total
	if err := x.checkValues(cfg); err != nil {
		return nil, err
	}
	hs := cfg.APIKey.Headers
	if len(hs) == 0 {
		hs = []string{"Authorization", "X-API-Key"}
	}
	if x.apiKeyHeaders, err = canonicalHeaders(hs); err != nil {
		return nil, fieldErrorf("api_key.headers", "%v", err)
	}
	for _, s := range cfg.ClientIP.TrustedProxies {
		p, err := parsePrefix(strings.TrimSpace(s))
		if err != nil {
			return nil, fieldErrorf("client_ip.trusted_proxies", "%q: not a CIDR or address", s)
		}
		x.trusted = append(x.trusted, p)
	}
	x.fwdHeader = "X-Forwarded-For"
	if h := cfg.ClientIP.Header; h != "" {
		if !validHeaderName(h) {
			return nil, fieldErrorf("client_ip.header", "%q is not a valid header name", h)
		}
		x.fwdHeader = http.CanonicalHeaderKey(h)
	}
	if len(cfg.Routes.Paths) > maxRoutes {
		return nil, fieldErrorf("routes.paths", "%d patterns, at most %d", len(cfg.Routes.Paths), maxRoutes)
	}
	for _, p := range cfg.Routes.Paths {
		if !strings.Contains(p, "{") {
			if !strings.HasPrefix(p, "/") {
				return nil, fieldErrorf("routes.paths", "%q must start with /", p)
			}
			if _, dup := x.exact[path.Clean(p)]; dup {
				return nil, fieldErrorf("routes.paths", "%q listed twice", p)
			}
			x.exact[path.Clean(p)] = p
			continue
		}
		t, err := compileTemplate(p)
		if err != nil {
			return nil, fieldErrorf("routes.paths", "%v", err)
		}
		x.templates = append(x.templates, t)
	}
	if h := cfg.Tier.Header; h != "" {
		if !validHeaderName(h) {
			return nil, fieldErrorf("tier.header", "%q is not a valid header name", h)
		}
		x.tierHeader = http.CanonicalHeaderKey(h)
	}
	return x, nil
}

// checkValues checks the text the configuration itself puts into
// descriptors, which the agent would otherwise refuse on every request: the
// domain, entry keys, constant values, route patterns and default, tier
// values and the API keys of tier.keys must be valid text (rules.ValidText).
// Values standing in for extracted ones (routes.default, tiers, tier.keys'
// API keys) are bounded by max_value_bytes like the values they stand for, and a
// descriptor's fixed part (the domain, its keys and constant values, 2 bytes
// per entry) by agent.MaxKeyBytes.
func (x *Extractor) checkValues(cfg Config) error {
	if !rules.ValidText(cfg.Domain) {
		return fieldErrorf("domain", "%s", notText)
	}
	for i, d := range cfg.Descriptors {
		size := len(cfg.Domain)
		for j, e := range d {
			at := fmt.Sprintf("descriptors[%d][%d]", i, j)
			if !rules.ValidText(e.Key) {
				return fieldErrorf(at+".key", "%s", notText)
			}
			if !rules.ValidText(e.Value) {
				return fieldErrorf(at+".value", "%s", notText)
			}
			size += len(x.descs[i][j].key) + len(e.Value) + 2
		}
		if size > agent.MaxKeyBytes {
			return fieldErrorf(fmt.Sprintf("descriptors[%d]", i), "the domain, keys and constant values take %d bytes, at most %d", size, agent.MaxKeyBytes)
		}
	}
	for _, p := range cfg.Routes.Paths {
		if !rules.ValidText(p) {
			return fieldErrorf("routes.paths", "%q: %s", p, notText)
		}
	}
	values := []struct{ field, v string }{{"routes.default", cfg.Routes.Default}, {"tier.default", cfg.Tier.Default}}
	for k, v := range cfg.Tier.Keys {
		// The API key is not echoed: the message names its tier.
		if !rules.ValidText(k) || len(k) > x.maxValue {
			return fieldErrorf("tier.keys", "the API key of tier %q is not valid text or is longer than max_value_bytes (%d)", v, x.maxValue)
		}
		values = append(values, struct{ field, v string }{"tier.keys", v})
	}
	for _, v := range values {
		if !rules.ValidText(v.v) {
			return fieldErrorf(v.field, "%q: %s", v.v, notText)
		}
		if len(v.v) > x.maxValue {
			return fieldErrorf(v.field, "%d bytes, longer than max_value_bytes (%d)", len(v.v), x.maxValue)
		}
	}
	return nil
}

const notText = "not valid text (invalid UTF-8 or control characters)"

// Domain returns the configured domain.
func (x *Extractor) Domain() string { return x.domain }

// Extract returns the request's descriptors (allocating). Descriptors whose
// sources are missing are left out; the result may be empty.
func (x *Extractor) Extract(r *http.Request) ([]agent.Descriptor, error) {
	descs := make([]agent.Descriptor, 0, len(x.descs))
	entries := make([]rules.Entry, 0, x.totalEntries)
	descs, _, err := x.extract(r, descs, entries)
	return descs, err
}

// value states of a lazily computed source
const (
	unknown uint8 = iota
	missing
	present
)

type sourceVals struct {
	state [7]uint8
	val   [7]string
}

func srcIndex(s Source) int {
	switch s {
	case SourceAPIKey:
		return 0
	case SourceClientIP:
		return 1
	case SourceRoute:
		return 2
	case SourceTier:
		return 3
	case SourceMethod:
		return 4
	}
	return 5
}

// extract appends descriptors to descs, their entries to entries (which
// must have capacity for totalEntries so that sub-slices stay valid).
func (x *Extractor) extract(r *http.Request, descs []agent.Descriptor, entries []rules.Entry) ([]agent.Descriptor, []rules.Entry, error) {
	var sv sourceVals
	for _, d := range x.descs {
		start := len(entries)
		ok := true
		for _, e := range d {
			var v string
			var have bool
			var err error
			switch e.src {
			case SourceStatic:
				v, have = e.value, true
			case SourceHeader:
				v, have, err = x.header(r, e.header)
			default:
				i := srcIndex(e.src)
				if sv.state[i] == unknown {
					var val string
					var h bool
					val, h, err = x.source(r, e.src, &sv)
					if err != nil {
						return descs, entries, err
					}
					sv.val[i] = val
					sv.state[i] = missing
					if h {
						sv.state[i] = present
					}
				}
				v, have = sv.val[i], sv.state[i] == present
			}
			if err != nil {
				return descs, entries, err
			}
			if !have {
				ok = false
				break
			}
			entries = append(entries, rules.Entry{Key: e.key, Value: v})
		}
		if !ok {
			entries = entries[:start]
			continue
		}
		descs = append(descs, agent.Descriptor{Entries: entries[start:len(entries):len(entries)]})
	}
	return descs, entries, nil
}

func (x *Extractor) source(r *http.Request, s Source, sv *sourceVals) (string, bool, error) {
	switch s {
	case SourceAPIKey:
		return x.apiKey(r)
	case SourceClientIP:
		v, ok := x.clientIP(r)
		return v, ok, nil
	case SourceRoute:
		if r.URL == nil || r.URL.Path == "/" && noForwardedURI(r) { // a forward-auth check that names no URI
			return x.routeDefault, x.routeDefault != "", nil
		}
		v, ok := x.route(r.URL.Path)
		return v, ok, nil
	case SourceMethod:
		return r.Method, r.Method != "", nil
	case SourceTier:
		if x.tierHeader != "" {
			v, ok, err := x.header(r, x.tierHeader)
			if err != nil || ok {
				return v, ok, err
			}
		}
		if len(x.tierKeys) > 0 {
			i := srcIndex(SourceAPIKey)
			if sv.state[i] == unknown {
				v, ok, err := x.apiKey(r)
				if err != nil {
					return "", false, err
				}
				sv.val[i], sv.state[i] = v, missing
				if ok {
					sv.state[i] = present
				}
			}
			if sv.state[i] == present {
				if t, ok := x.tierKeys[sv.val[i]]; ok {
					return t, true, nil
				}
			}
		}
		return x.tierDefault, x.tierDefault != "", nil
	}
	return "", false, nil
}

// header returns the first value of a canonical header, bounded.
func (x *Extractor) header(r *http.Request, h string) (string, bool, error) {
	vs := r.Header[h]
	if len(vs) == 0 {
		return "", false, nil
	}
	v := strings.TrimSpace(vs[0])
	if len(v) > x.maxValue {
		return "", false, &BadRequestError{Message: "header " + h + " is too long"}
	}
	if !rules.ValidText(v) {
		return "", false, &BadRequestError{Message: "header " + h + " is not valid UTF-8 text"}
	}
	return v, v != "", nil
}

// apiKey returns the API key from the first configured header that has one.
func (x *Extractor) apiKey(r *http.Request) (string, bool, error) {
	for _, h := range x.apiKeyHeaders {
		vs := r.Header[h]
		if len(vs) == 0 {
			continue
		}
		v := vs[0]
		if h == "Authorization" {
			var ok bool
			if v, ok = bearer(v); !ok {
				continue
			}
		} else {
			v = strings.TrimSpace(v)
		}
		if v == "" {
			continue
		}
		if len(v) > x.maxValue {
			return "", false, &BadRequestError{Message: "API key is too long"}
		}
		if !rules.ValidText(v) {
			return "", false, &BadRequestError{Message: "API key is not valid UTF-8 text"}
		}
		return v, true, nil
	}
	return "", false, nil
}

// bearer extracts the token of "Bearer <token>" (scheme case-insensitive).
func bearer(v string) (string, bool) {
	const scheme = "bearer"
	v = strings.TrimLeft(v, " \t")
	if len(v) <= len(scheme) || !strings.EqualFold(v[:len(scheme)], scheme) || (v[len(scheme)] != ' ' && v[len(scheme)] != '\t') {
		return "", false
	}
	return strings.TrimSpace(v[len(scheme):]), true
}

func (x *Extractor) trustedAddr(a netip.Addr) bool {
	for _, p := range x.trusted {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// clientIP returns the client address: the peer when it is not a trusted
// proxy; otherwise the rightmost untrusted address of the forwarding header
// (walking at most MaxForwardedHops addresses). When every address is
// trusted, the leftmost examined is the client; an unparseable address ends
// the walk and the nearest parsed address (a trusted proxy) is used.
func (x *Extractor) clientIP(r *http.Request) (string, bool) {
	peer, host, ok := parseHost(r.RemoteAddr)
	if !ok {
		return "", false
	}
	client, clientHost := peer, host
	if len(x.trusted) > 0 && x.trustedAddr(peer) {
		vals := r.Header[x.fwdHeader]
		hops := 0
	walk:
		for i := len(vals) - 1; i >= 0; i-- {
			s := vals[i]
			for len(s) > 0 {
				if hops >= MaxForwardedHops {
					break walk
				}
				var part string
				if j := strings.LastIndexByte(s, ','); j >= 0 {
					part, s = s[j+1:], s[:j]
				} else {
					part, s = s, ""
				}
				part = strings.TrimSpace(part)
				if part == "" {
					continue
				}
				hops++
				a, h, ok := parseHost(part)
				if !ok {
					break walk
				}
				client, clientHost = a, h
				if !x.trustedAddr(a) {
					break walk
				}
			}
		}
	}
	return addrString(client, clientHost), true
}

// parseHost parses "ip", "ip:port", "[ipv6]:port" or "[ipv6]", returning
// the address unmapped (::ffff:1.2.3.4 → 1.2.3.4) and without zone, and the
// host text it came from.
func parseHost(s string) (netip.Addr, string, bool) {
	host := s
	if i := strings.LastIndexByte(s, ':'); i >= 0 && strings.Count(s, ":") == 1 {
		host = s[:i] // ipv4:port
	} else if len(s) > 0 && s[0] == '[' {
		end := strings.IndexByte(s, ']')
		if end < 0 {
			return netip.Addr{}, "", false
		}
		host = s[1:end]
		if tail := s[end+1:]; tail != "" && tail[0] != ':' {
			return netip.Addr{}, "", false
		}
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}, "", false
	}
	return a.Unmap().WithZone(""), host, true
}

// addrString returns a's canonical text, reusing host when it already is
// that text (no allocation in the common case).
func addrString(a netip.Addr, host string) string {
	var buf [64]byte
	if b := a.AppendTo(buf[:0]); string(b) == host {
		return host
	}
	return a.String()
}

// route returns the route value of p.
func (x *Extractor) route(p string) (string, bool) {
	if p == "" {
		p = "/"
	}
	p = path.Clean(p) // allocation-free when p is already clean
	if v, ok := x.exact[p]; ok {
		return v, true
	}
	for i := range x.templates {
		if x.templates[i].match(p) {
			return x.templates[i].pattern, true
		}
	}
	return x.routeDefault, x.routeDefault != ""
}

// template is a compiled path pattern such as /v1/items/{id} or
// /files/{rest...}: literal segments, "{name}" (one non-empty segment) and
// a final "{name...}" (the rest, possibly empty).
type template struct {
	pattern string
	segs    []tseg
	rest    bool // ends with {name...}
}

type tseg struct {
	lit      string
	wildcard bool
}

func compileTemplate(p string) (template, error) {
	if !strings.HasPrefix(p, "/") {
		return template{}, fmt.Errorf("%q must start with /", p)
	}
	t := template{pattern: p}
	parts := strings.Split(p[1:], "/")
	for i, s := range parts {
		switch {
		case strings.HasPrefix(s, "{") && strings.HasSuffix(s, "...}"):
			if i != len(parts)-1 || len(s) < 5 {
				return template{}, fmt.Errorf("%q: {name...} must be the last segment and named", p)
			}
			t.rest = true
		case strings.HasPrefix(s, "{") && strings.HasSuffix(s, "}"):
			if len(s) < 3 || strings.ContainsAny(s[1:len(s)-1], "{}") {
				return template{}, fmt.Errorf("%q: bad wildcard segment %q", p, s)
			}
			t.segs = append(t.segs, tseg{wildcard: true})
		case strings.ContainsAny(s, "{}"):
			return template{}, fmt.Errorf("%q: a wildcard must be a whole segment", p)
		default:
			t.segs = append(t.segs, tseg{lit: s})
		}
	}
	return t, nil
}

// match reports whether the clean path p matches, without allocating.
func (t *template) match(p string) bool {
	if len(p) == 0 || p[0] != '/' {
		return false
	}
	rest, done := p[1:], false
	for _, s := range t.segs {
		if done {
			return false // the path has fewer segments than the pattern
		}
		var seg string
		if j := strings.IndexByte(rest, '/'); j >= 0 {
			seg, rest = rest[:j], rest[j+1:]
		} else {
			seg, done = rest, true
		}
		if s.wildcard {
			if seg == "" {
				return false
			}
		} else if seg != s.lit {
			return false
		}
	}
	return t.rest || done
}
