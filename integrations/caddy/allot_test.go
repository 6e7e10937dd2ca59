package allotcaddy

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/allot/allot/agent/httplimit"
)

// exampleCaddyfile is an allot block with every option.
const exampleCaddyfile = `allot {
		allocators 10.0.0.1:7420 10.0.0.2:7420
		domain public-api
		api_key_headers Authorization X-API-Key
		trusted_proxies 10.0.0.0/8
		routes /v1/search /v1/items/{id}
		route_default other
		tier_key k_free_demo free
		tier_default free
		max_value_bytes 128
		descriptors tier api_key
		descriptors plan=header:X-Plan edge=value:eu ip=client_ip
	}`

func TestCaddyfile(t *testing.T) {
	d := caddyfile.NewTestDispenser(exampleCaddyfile)
	var h Handler
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	want := Handler{
		Allocators: []string{"10.0.0.1:7420", "10.0.0.2:7420"},
		Config: httplimit.Config{
			Domain:        "public-api",
			APIKey:        httplimit.APIKeyConfig{Headers: []string{"Authorization", "X-API-Key"}},
			ClientIP:      httplimit.ClientIPConfig{TrustedProxies: []string{"10.0.0.0/8"}},
			Routes:        httplimit.RoutesConfig{Paths: []string{"/v1/search", "/v1/items/{id}"}, Default: "other"},
			Tier:          httplimit.TierConfig{Keys: map[string]string{"k_free_demo": "free"}, Default: "free"},
			MaxValueBytes: 128,
			Descriptors: []httplimit.DescriptorConfig{
				{{Source: "tier"}, {Source: "api_key"}},
				{{Key: "plan", Source: httplimit.SourceHeader, Header: "X-Plan"}, {Key: "edge", Source: httplimit.SourceStatic, Value: "eu"}, {Key: "ip", Source: "client_ip"}},
			},
		},
	}
	if !reflect.DeepEqual(h, want) {
		t.Fatalf("got  %+v\nwant %+v", h, want)
	}
	if err := h.Validate(); err != nil {
		t.Fatal(err)
	}
	if err := h.Config.Validate(); err != nil {
		t.Fatalf("the parsed extraction does not validate: %v", err)
	}

	// The JSON config is the same handler.
	b, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	var back Handler
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, want) {
		t.Fatalf("JSON %s\nback %+v", b, back)
	}
	if !strings.Contains(string(b), `"allocators":["10.0.0.1:7420","10.0.0.2:7420"]`) || !strings.Contains(string(b), `"domain":"public-api"`) {
		t.Fatalf("JSON %s", b)
	}
}

// caddyfileErrorTests are allot blocks UnmarshalCaddyfile refuses, with
// a part of the error.
var caddyfileErrorTests = []struct{ in, want string }{
	{"allot extra", "wrong argument count"},
	{"allot {\n bogus x\n}", "unknown allot option"},
	{"allot {\n domain a b\n}", "takes one value"},
	{"allot {\n tier_key k\n}", "tier_key takes"},
	{"allot {\n max_value_bytes many\n}", "not an integer"},
	{"allot {\n descriptors\n}", "at least one entry"},
	{"allot {\n descriptors =api_key\n}", "empty key"},
}

func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range caddyfileErrorTests {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.in, err, tc.want)
		}
	}
	for _, tc := range []struct {
		h    Handler
		want string
	}{
		{Handler{}, "give allocators"},
		{Handler{Allocators: []string{"a:1"}, Rules: []string{"r.yaml"}}, "not both"},
		{Handler{Allocators: []string{"a:1"}}, "no descriptors"},
	} {
		if err := tc.h.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v, want %q", tc.h, err, tc.want)
		}
	}
}

// Caddy loads the module's JSON strictly; the documented entry forms of
// the gateway's config file are accepted there.
func TestJSONConfigTakesTheEntryForms(t *testing.T) {
	src := `{"domain":"d","descriptors":[["api_key"],[{"generic_key":"all"}],[{"key":"plan","header":"X-Plan"}],[{"key":"edge","value":"eu"}]]}`
	var h Handler
	if err := caddy.StrictUnmarshalJSON([]byte(src), &h); err != nil {
		t.Fatal(err)
	}
	if err := h.Config.Validate(); err != nil {
		t.Fatal(err)
	}
	if d := h.Config.Descriptors; len(d) != 4 || d[1][0].Key != "generic_key" || d[2][0].Header != "X-Plan" || d[3][0].Value != "eu" {
		t.Fatalf("%+v", d)
	}
	if err := caddy.StrictUnmarshalJSON([]byte(`{"domain":"d","descriptors":[[{"key":"a","bogus":"b"}]]}`), &h); err == nil {
		t.Fatal("an unknown entry key was accepted")
	}
}

// FuzzCaddyfile feeds arbitrary Caddyfile text to the allot block's
// parser: it never panics, what it accepts is validated with errors
// (never a panic), and it is the same handler once through the module's
// JSON.
func FuzzCaddyfile(f *testing.F) {
	f.Add(exampleCaddyfile)
	for _, tc := range caddyfileErrorTests {
		f.Add(tc.in)
	}
	f.Add("allot {\n rules r.yaml\n agent_id a\n forwarded_header X-Real-IP\n tier_header X-Tier\n descriptors method k=route \"\" =\n}")
	f.Add("allot {\n descriptors k=header: k=value: header:X value:v k==x\n max_value_bytes 99999999999999999999\n}")
	f.Add("allot {\n routes \"/a/{x\" \"/a/{x...}/b\"\n trusted_proxies 10.0.0.0/33\n tier_key a b\n tier_key a c\n}")
	f.Add("allot\nallot {\n}\n{\n}")
	f.Fuzz(func(t *testing.T, src string) {
		tokens, err := caddyfile.Tokenize([]byte(src), "Caddyfile")
		if err != nil {
			return
		}
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
			return
		}
		_ = h.Validate()
		_ = h.Config.Validate()
		if !utf8.ValidString(src) { // JSON replaces invalid UTF-8
			return
		}
		b, err := json.Marshal(h)
		if err != nil {
			t.Fatal(err)
		}
		var back Handler
		if err := caddy.StrictUnmarshalJSON(b, &back); err != nil {
			t.Fatalf("JSON %s: %v", b, err)
		}
		if !reflect.DeepEqual(back, h) {
			t.Fatalf("JSON %s\nback %+v\nwant %+v", b, back, h)
		}
	})
}
