package httplimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"sort"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Limits on the extraction configuration and on request values.
const (
	// MaxDescriptors is the most descriptors a Config may declare.
	MaxDescriptors = 16
	// MaxEntries is the most entries one configured descriptor may have.
	MaxEntries = 8
	// DefaultMaxValueBytes bounds one extracted value (API key, tier,
	// header). A longer value makes the request a 400.
	DefaultMaxValueBytes = 256
	// MaxForwardedHops bounds the X-Forwarded-For walk: at most this many
	// addresses are examined from the right.
	MaxForwardedHops = 32
	// maxRoutes bounds the configured route patterns.
	maxRoutes = 1024
)

// Config declares how descriptors are extracted from an HTTP request. It is
// YAML- and JSON-loadable (the gateway's config file embeds it, the Caddy
// module takes it as JSON); NewExtractor validates it. The zero Config
// extracts nothing.
//
// Example (the gateway's -dev configuration):
//
//	domain: public-api
//	api_key: {headers: [Authorization, X-API-Key]}
//	tier:
//	  keys: {k_free_demo: free, k_premium_demo: premium}
//	  default: free
//	routes:
//	  paths: [/v1/search]
//	  default: other
//	descriptors:
//	  - [tier, api_key]
//	  - [tier, route, api_key]
//	  - [api_key]
type Config struct {
	// Domain is the rules domain the descriptors are checked in.
	Domain string `yaml:"domain" json:"domain,omitempty"`
	// APIKey says where the API key is found.
	APIKey APIKeyConfig `yaml:"api_key" json:"api_key,omitempty"`
	// ClientIP says how the client address is derived.
	ClientIP ClientIPConfig `yaml:"client_ip" json:"client_ip,omitempty"`
	// Routes maps request paths to route values.
	Routes RoutesConfig `yaml:"routes" json:"routes,omitempty"`
	// Tier says how the tier is derived.
	Tier TierConfig `yaml:"tier" json:"tier,omitempty"`
	// Descriptors are sent for every request, in order; a descriptor with
	// an entry whose source is missing from the request is skipped, as
	// Envoy does.
	Descriptors []DescriptorConfig `yaml:"descriptors" json:"descriptors,omitempty"`
	// MaxValueBytes bounds every extracted value; 0 means
	// DefaultMaxValueBytes. A request with a longer value gets a 400.
	MaxValueBytes int `yaml:"max_value_bytes" json:"max_value_bytes,omitempty"`
	// ForwardAuth configures the forward-auth endpoint (ForwardAuth).
	ForwardAuth ForwardAuthConfig `yaml:"forward_auth" json:"forward_auth,omitempty"`
}

// ForwardAuthConfig configures the forward-auth endpoint.
type ForwardAuthConfig struct {
	// OnMissing is the answer to a check from which no descriptor can be
	// extracted (no API key, say): OnMissingAllow (200, the default) or
	// OnMissingDeny (403).
	OnMissing string `yaml:"on_missing" json:"on_missing,omitempty"`
}

// The on_missing policies.
const (
	OnMissingAllow = "allow"
	OnMissingDeny  = "deny"
)

// APIKeyConfig locates the API key.
type APIKeyConfig struct {
	// Headers are tried in order; the first present and non-empty wins.
	// "Authorization" is parsed as "Bearer <key>" (other schemes are
	// ignored); any other header's whole value is the key. Empty means
	// [Authorization, X-API-Key].
	Headers []string `yaml:"headers" json:"headers,omitempty"`
}

// ClientIPConfig derives the client address.
type ClientIPConfig struct {
	// TrustedProxies are the CIDRs (or single addresses) of proxies whose
	// forwarding header is believed. When the connection's peer is not one
	// of them, the peer address is the client. Otherwise the forwarding
	// header is walked from the right, skipping trusted proxies; the first
	// untrusted address is the client.
	TrustedProxies []string `yaml:"trusted_proxies" json:"trusted_proxies,omitempty"`
	// Header is the forwarding header; empty means X-Forwarded-For.
	Header string `yaml:"header" json:"header,omitempty"`
}

// RoutesConfig maps request paths to route values.
type RoutesConfig struct {
	// Paths are exact paths ("/v1/search") or templates
	// ("/v1/items/{id}", "/files/{path...}"). The route value is the
	// pattern itself. Exact paths win over templates; templates are tried
	// in order. Paths are compared after path.Clean.
	Paths []string `yaml:"paths" json:"paths,omitempty"`
	// Default is the route value of a path that matches no pattern (a
	// catch-all). Empty: such a request has no route, and descriptors that
	// need one are skipped.
	Default string `yaml:"default" json:"default,omitempty"`
}

// TierConfig derives the tier.
type TierConfig struct {
	// Header, when set, is a request header carrying the tier. Only set it
	// when a trusted component in front of the gateway sets (and strips)
	// that header: clients could otherwise choose their own tier.
	Header string `yaml:"header" json:"header,omitempty"`
	// Keys maps API keys to tiers, consulted when Header is unset or absent.
	Keys map[string]string `yaml:"keys" json:"keys,omitempty"`
	// Default is the tier of a request whose tier is not otherwise known
	// (including requests without an API key). Empty: no tier, and
	// descriptors that need one are skipped.
	Default string `yaml:"default" json:"default,omitempty"`
}

// DescriptorConfig is one descriptor: an ordered list of entries.
type DescriptorConfig []EntryConfig

// Source names where an entry's value comes from.
type Source string

// The sources of entry values.
const (
	SourceAPIKey   Source = "api_key"   // the API key (APIKeyConfig); default key "api_key"
	SourceClientIP Source = "client_ip" // the client address; default key "remote_address" (Envoy's)
	SourceRoute    Source = "route"     // the matched route pattern; default key "route"
	SourceTier     Source = "tier"      // the tier; default key "tier"
	SourceMethod   Source = "method"    // the request method; default key "method"
	SourceHeader   Source = "header"    // a request header (Header); key required
	SourceStatic   Source = "static"    // a constant (Value), as Envoy's generic_key
)

var defaultKeys = map[Source]string{
	SourceAPIKey:   "api_key",
	SourceClientIP: "remote_address",
	SourceRoute:    "route",
	SourceTier:     "tier",
	SourceMethod:   "method",
}

// EntryConfig is one descriptor entry. In YAML and JSON it is either a bare
// source name (api_key, client_ip, route, tier, method), or a mapping:
//
//	{source: client_ip, key: ip}        # a source under another key
//	{key: plan, header: X-Plan}         # a request header
//	{generic_key: all}                  # Envoy's generic_key: key "generic_key", constant value
//	{key: edge, value: eu-west}         # any constant entry
type EntryConfig struct {
	Key    string `yaml:"key" json:"key,omitempty"`
	Source Source `yaml:"source" json:"source,omitempty"`
	Header string `yaml:"header" json:"header,omitempty"` // SourceHeader
	Value  string `yaml:"value" json:"value,omitempty"`   // SourceStatic
}

// UnmarshalYAML accepts the bare-name and mapping forms, rejecting unknown
// keys with their line.
func (e *EntryConfig) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		out, err := bareEntry(n.Value)
		if err != nil {
			return fmt.Errorf("line %d: %w", n.Line, err)
		}
		*e = out
		return nil
	case yaml.MappingNode:
	default:
		return fmt.Errorf("line %d: a descriptor entry must be a source name or a mapping", n.Line)
	}
	var out EntryConfig
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if v.Kind != yaml.ScalarNode {
			return fmt.Errorf("line %d: %s: must be a string", v.Line, k.Value)
		}
		if err := out.set(k.Value, v.Value); err != nil {
			return fmt.Errorf("line %d: %w", k.Line, err)
		}
	}
	*e = out.inferSource()
	return nil
}

// UnmarshalJSON accepts the forms UnmarshalYAML does: a bare source name
// ("api_key") or an object ({"key": "plan", "header": "X-Plan"},
// {"generic_key": "all"}, {"key": "edge", "value": "eu"}), rejecting
// unknown keys. A generic_key is applied after the other keys.
func (e *EntryConfig) UnmarshalJSON(b []byte) error {
	var name string
	if json.Unmarshal(b, &name) == nil {
		out, err := bareEntry(name)
		if err != nil {
			return err
		}
		*e = out
		return nil
	}
	var m map[string]string
	if err := json.Unmarshal(b, &m); err != nil {
		return errors.New("a descriptor entry must be a source name or an object of strings")
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return keys[i] != "generic_key" && (keys[j] == "generic_key" || keys[i] < keys[j])
	})
	var out EntryConfig
	for _, k := range keys {
		if err := out.set(k, m[k]); err != nil {
			return err
		}
	}
	*e = out.inferSource()
	return nil
}

// bareEntry is the entry of a bare source name.
func bareEntry(name string) (EntryConfig, error) {
	s := Source(name)
	if _, ok := defaultKeys[s]; !ok {
		return EntryConfig{}, fmt.Errorf("%q: unknown entry source (want api_key, client_ip, route, tier, method, or a mapping)", name)
	}
	return EntryConfig{Source: s}, nil
}

// set sets the field of one key of the mapping form.
func (e *EntryConfig) set(k, v string) error {
	switch k {
	case "key":
		e.Key = v
	case "source":
		e.Source = Source(v)
	case "header":
		e.Header = v
	case "value":
		e.Value = v
	case "generic_key":
		e.Key, e.Value, e.Source = "generic_key", v, SourceStatic
	default:
		return fmt.Errorf("%s: unknown key in a descriptor entry", k)
	}
	return nil
}

// inferSource returns e with the source a header or value implies when
// none is given.
func (e EntryConfig) inferSource() EntryConfig {
	if e.Source == "" {
		switch {
		case e.Header != "":
			e.Source = SourceHeader
		case e.Value != "":
			e.Source = SourceStatic
		}
	}
	return e
}

// validate checks one entry and fills its default key.
func (e *EntryConfig) validate() error {
	switch e.Source {
	case SourceAPIKey, SourceClientIP, SourceRoute, SourceTier, SourceMethod:
		if e.Key == "" {
			e.Key = defaultKeys[e.Source]
		}
		if e.Header != "" || e.Value != "" {
			return fmt.Errorf("source %s takes no header or value", e.Source)
		}
	case SourceHeader:
		if e.Key == "" || e.Header == "" {
			return errors.New("a header entry needs key and header")
		}
		if !validHeaderName(e.Header) {
			return fmt.Errorf("%q is not a valid header name", e.Header)
		}
	case SourceStatic:
		if e.Key == "" || e.Value == "" {
			return errors.New("a constant entry needs key and value")
		}
	case "":
		return errors.New("entry has no source (give source, header, value or generic_key)")
	default:
		return fmt.Errorf("unknown source %q", e.Source)
	}
	return nil
}

func validHeaderName(h string) bool {
	if h == "" {
		return false
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// FieldError is a configuration error of one field. Field is the field's
// path in the configuration: "domain", "tier.default",
// "descriptors[0][1].value". The gateway's config loader turns it into the
// file's line.
type FieldError struct {
	Field string
	Msg   string
}

// Error returns "httplimit: field: msg".
func (e *FieldError) Error() string { return "httplimit: " + e.Field + ": " + e.Msg }

func fieldErrorf(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// Validate reports the first problem with c, prefixed "httplimit: ".
func (c Config) Validate() error {
	_, err := NewExtractor(c)
	return err
}

func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, err
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

func canonicalHeaders(hs []string) ([]string, error) {
	out := make([]string, 0, len(hs))
	for _, h := range hs {
		if !validHeaderName(h) {
			return nil, fmt.Errorf("%q is not a valid header name", h)
		}
		out = append(out, http.CanonicalHeaderKey(h))
	}
	return out, nil
}
