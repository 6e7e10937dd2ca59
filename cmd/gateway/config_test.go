package main

import (
	"io"
	"net/url"
	"strings"
	"testing"

	"github.com/allot/allot/gateway"
)

// exampleConfig is a config file with every descriptor form.
const exampleConfig = `
upstream: http://127.0.0.1:9000
allocators: [127.0.0.1:7420]
rules: [a.yaml]
domain: public-api
api_key: {headers: [X-API-Key]}
tier: {keys: {k1: gold}, default: free}
routes: {paths: [/v1/search], default: other}
descriptors:
  - [tier, api_key]
  - [{generic_key: all}]
`

func TestParseConfig(t *testing.T) {
	cfg, err := parseConfig("gw.yaml", []byte(exampleConfig))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Upstream != "http://127.0.0.1:9000" || cfg.Domain != "public-api" || len(cfg.Descriptors) != 2 || cfg.Tier.Keys["k1"] != "gold" {
		t.Fatalf("%+v", cfg)
	}
}

// configErrorTests are config files parseConfig refuses, with a part of
// the error.
var configErrorTests = []struct {
	src, want string
}{
	{"upstream: x\nbogus: 1\n", "gw.yaml:2: bogus: unknown key"},
	{"domain: d\ndescriptors:\n  - [api_key]\n  - [{key: a, nope: b}]\n", "gw.yaml:4: nope: unknown key in a descriptor entry"},
	{"domain: d\ntls:\n  cert: x\n", "gw.yaml:3: cert: unknown key"},
	{"descriptors: [[api_key]]\n", "gw.yaml: httplimit: domain: must be set"},
	{"domain: d\n---\ndomain: e\n", "gw.yaml:2: only one YAML document"},
	// YAML errors name their line when the decoder gives one, else only
	// the file.
	{"domain: d\n---\n[\n", "gw.yaml:3: did not find expected node content"},
	{"domain: \x01\n", "gw.yaml: control characters are not allowed"},
	{"domain: d\n---\ndomain: \xff\n", "gw.yaml: invalid leading UTF-8 octet"},
	{"domain: [\n", "gw.yaml"},
	// Extraction values the agent would refuse on every request stop
	// the gateway at start-up, naming the line and key.
	{"upstream: http://a\ndomain: \"public\\tapi\"\ndescriptors: [[{generic_key: all}]]\n", "gw.yaml:2: httplimit: domain: not valid text"},
	{"domain: d\ndescriptors:\n  - [api_key]\n  - [{generic_key: \"a\\u0085b\"}]\n", "gw.yaml:4: httplimit: descriptors[1][0].value: not valid text"},
	{"domain: d\ndescriptors:\n  - - api_key\n    - {key: \"e\\u0000\", value: x}\n", "gw.yaml:4: httplimit: descriptors[0][1].key: not valid text"},
	{"domain: d\ntier:\n  keys: {k: gold}\n  default: \"free\\t\"\ndescriptors: [[tier]]\n", "gw.yaml:4: httplimit: tier.default:"},
	{"domain: d\nroutes:\n  default: \"\\u009f\"\ndescriptors: [[route]]\n", "gw.yaml:3: httplimit: routes.default:"},
	{"domain: d\ndescriptors:\n  - [{key: edge, value: " + strings.Repeat("x", 5000) + "}]\n", "gw.yaml:3: httplimit: descriptors[0]: the domain, keys and constant values take"},
	{"domain: d\nclient_ip:\n  header: \"X Bad\"\n", "gw.yaml:3: httplimit: client_ip.header:"},
}

func TestParseConfigErrors(t *testing.T) {
	for _, tc := range configErrorTests {
		_, err := parseConfig("gw.yaml", []byte(tc.src))
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "gw.yaml:0") {
			t.Errorf("parseConfig(%q) = %v, want an error containing %q", tc.src, err, tc.want)
		}
	}
}

// FuzzParseConfig feeds arbitrary files to the config loader: it never
// panics, its errors name the file (and never line 0), and a config it
// accepts is one the gateway's own validation accepts; the Redis block's
// batched and promote parts are accepted or refused with an error.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(exampleConfig))
	for _, tc := range configErrorTests {
		f.Add([]byte(tc.src))
	}
	f.Add([]byte("upstream: https://api.internal:8443/base\nmax_request_body_bytes: -1\nrequest_body_timeout: 5s\n" +
		"tls: {cert_file: gw.crt, key_file: gw.key}\nupstream_tls: {ca_file: ca.pem, insecure_skip_verify: true}\n" +
		"domain: d\nclient_ip: {trusted_proxies: [10.0.0.0/8], header: X-Real-IP}\nforward_auth: {on_missing: deny}\n" +
		"descriptors: [[client_ip, method], [{key: plan, header: X-Plan}, {source: route, key: r}]]\n"))
	f.Add([]byte("redis: {addrs: [127.0.0.1:6379], timeout: 1s, breaker: {failures: 3, cooldown: 200ms}}\ndomain: shared\ndescriptors: [[api_key]]\n"))
	f.Add([]byte("redis:\n  mode: sentinel\n  master_name: m\n  batched: {max_batch: 64, horizon: 50ms, hold: 250ms}\n" +
		"  promote: {threshold: 5000, shards: 8, ttl: 30s}\ndomain: d\n"))
	f.Add([]byte("redis: {mode: bogus, pool_size: -1, batched: {max_batch: -1}, promote: {threshold: -1}}\n"))
	f.Add([]byte("max_request_body_bytes: -2\ndomain: d\n"))
	f.Add([]byte("domain: \"\\x01\"\n"))
	f.Fuzz(func(t *testing.T, src []byte) {
		cfg, err := parseConfig("fuzz.yaml", src)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "fuzz.yaml") || strings.HasPrefix(err.Error(), "fuzz.yaml:0:") {
				t.Fatalf("error %q does not name the file, or names line 0", err)
			}
			return
		}
		gc := gateway.DefaultConfig()
		gc.Upstream = &url.URL{Scheme: "http", Host: "127.0.0.1:9000"}
		gc.Extraction, gc.Redis = cfg.Config, cfg.Redis
		gc.MaxRequestBodyBytes, gc.RequestBodyTimeout = cfg.bodyLimit(), cfg.bodyTimeout()
		if err := gc.Validate(); err != nil {
			t.Fatalf("accepted config refused by the gateway: %v", err)
		}
		if cfg.Redis != nil {
			_, _, _ = cfg.Redis.BatchConfig()
			_, _, _ = cfg.Redis.PromoterConfig()
		}
		_, _ = parseUpstream(cfg.Upstream)
	})
}

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{"-allocators", " a:1, ,b:2", "-dev"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if len(o.allocators) != 2 || o.allocators[1] != "b:2" || !o.dev || o.listen != "127.0.0.1:8080" ||
		o.rlsAddr != "127.0.0.1:8081" || o.httpAddr != "127.0.0.1:9090" {
		t.Fatalf("%+v", o)
	}
	if _, err := parseFlags([]string{"extra"}, io.Discard); err == nil {
		t.Fatal("extra arguments accepted")
	}
	if o, err := parseFlags([]string{"-log-level", "loud"}, io.Discard); err != nil {
		t.Fatal(err)
	} else if _, err := o.log.Logger(io.Discard); err == nil {
		t.Fatal("bad level accepted")
	}
	o, err = parseFlags([]string{"-tls-cert", "c.pem", "-tls-ca", "ca.pem"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := o.tls.Options(); err == nil {
		t.Fatal("-tls-cert without -tls-key accepted")
	}
}

func TestParseUpstream(t *testing.T) {
	for _, bad := range []string{"", "127.0.0.1:9000", "ftp://x", "http://"} {
		if _, err := parseUpstream(bad); err == nil {
			t.Errorf("parseUpstream(%q) accepted", bad)
		}
	}
	if u, err := parseUpstream("https://api.internal:8443/base"); err != nil || u.Host != "api.internal:8443" {
		t.Fatalf("%v %v", u, err)
	}
}

func TestDevExtractionIsValid(t *testing.T) {
	if err := devExtraction().Validate(); err != nil {
		t.Fatal(err)
	}
}
