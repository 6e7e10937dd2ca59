// Package integrations tests allot behind the proxies users already run:
// real nginx and Caddy processes in front of an upstream, asking a real
// gateway's forward-auth endpoint, and a Caddy built with the allot module.
//
// The programs come from Debian (.ci/run installs them). A test skips when
// one is missing, except in CI (CI=true), where it fails.
package integrations

import (
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	testproc.RemoveBuilds()
	os.Exit(code)
}

// requireProgram returns the path of a program the test needs, skipping
// the test without it (failing it in CI).
func requireProgram(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} { // nginx is in sbin, often not on a user's PATH
		if _, err := os.Stat(dir + "/" + name); err == nil {
			return dir + "/" + name
		}
	}
	msg := name + " is not installed (apt-get install " + name + ")"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg + "; CI must run this test (.ci/run installs it)")
	}
	t.Skip(msg)
	return ""
}

// The rule every proxy test exhausts: 5 requests a minute per API key.
const (
	keyQuota  = 5
	rulesYAML = `domain: integ
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 5}
`
)

// gatewayConfig is the gateway's extraction: one descriptor, the API key;
// the proxies connect from 127.0.0.1 and are trusted for X-Forwarded-For.
func gatewayConfig(upstream, rulesFile string) string {
	return fmt.Sprintf(`upstream: %s
rules: [%s]
domain: integ
api_key: {headers: [X-API-Key]}
client_ip: {trusted_proxies: [127.0.0.1]}
descriptors:
  - [api_key]
`, upstream, rulesFile)
}

// countingUpstream is the service behind the proxy: it counts the
// requests that reached it, by API key.
type countingUpstream struct {
	mu    sync.Mutex
	byKey map[string]int
}

func (u *countingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.byKey[r.Header.Get("X-API-Key")]++
	u.mu.Unlock()
	io.WriteString(w, "upstream ok\n")
}

func (u *countingUpstream) seen(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.byKey[key]
}

// env is a running gateway (standalone, rulesYAML, gatewayConfig and the
// extra config lines startEnv was given) with its check endpoints, and the
// counting upstream.
type env struct {
	dir      string
	gw       *testproc.Gateway
	up       *countingUpstream
	upstream string // host:port
}

func startEnv(t *testing.T, extraConfig ...string) *env {
	t.Helper()
	bins := testproc.Build(t)
	e := &env{dir: t.TempDir(), up: &countingUpstream{byKey: map[string]int{}}}
	srv := testproc.Serve(t, e.up)
	e.upstream = srv
	rules := testproc.WriteFile(t, e.dir, "rules.yaml", rulesYAML)
	e.gw = testproc.StartGateway(t, bins.Gateway, e.dir, "gateway", gatewayConfig("http://"+srv, rules)+strings.Join(extraConfig, ""), nil,
		"-check-addr", "127.0.0.1:0")
	testproc.Eventually(t, 30*time.Second, "the gateway's rules", e.gw.Ready)
	if e.gw.Check == "" {
		t.Fatal("the gateway serves no check endpoints")
	}
	return e
}

// waitHTTP waits until something answers HTTP at url.
func waitHTTP(t *testing.T, p *testproc.Proc, url string) {
	t.Helper()
	c := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	testproc.Eventually(t, 30*time.Second, p.Name+" listening", func() bool {
		if !p.Running() {
			t.Fatalf("%s exited: %v\n%s", p.Name, p.ExitErr(), testproc.Tail(p.Output(), 30))
		}
		resp, err := c.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return true
	})
}

type answer struct {
	code int
	h    http.Header
	body string
}

func getWithKey(t *testing.T, url, key string) answer {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-Key", key)
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// exhaust sends keyQuota+2 requests with one key through the proxy at
// url and checks the contract: keyQuota 200s (with the RateLimit fields
// when fieldsOnAllowed), then 429s with Retry-After, the RateLimit fields,
// no-store and the JSON body; the upstream saw exactly the allowed ones.
func exhaust(t *testing.T, e *env, url, key string, fieldsOnAllowed bool) {
	t.Helper()
	for i := 1; i <= keyQuota; i++ {
		a := getWithKey(t, url, key)
		if a.code != 200 || a.body != "upstream ok\n" {
			t.Fatalf("request %d: %d %q, want the upstream's 200", i, a.code, a.body)
		}
		if fieldsOnAllowed {
			if got, want := a.h.Get("RateLimit"), `"per_key";r=`+strconv.Itoa(keyQuota-i)+`;t=`; !strings.HasPrefix(got, want) {
				t.Fatalf("request %d: RateLimit %q, want %s…", i, got, want)
			}
			if got := a.h.Get("RateLimit-Policy"); got != `"per_key";q=5;w=60` {
				t.Fatalf("request %d: RateLimit-Policy %q", i, got)
			}
		}
	}
	for i := keyQuota + 1; i <= keyQuota+2; i++ {
		a := getWithKey(t, url, key)
		if a.code != http.StatusTooManyRequests {
			t.Fatalf("request %d: %d %q, want 429", i, a.code, a.body)
		}
		// 5/minute: the next token in 12 s.
		ra, err := strconv.Atoi(a.h.Get("Retry-After"))
		if err != nil || ra < 1 || ra > 12 {
			t.Fatalf("request %d: Retry-After %q, want 1..12", i, a.h.Get("Retry-After"))
		}
		if got, want := a.h.Get("RateLimit"), `"per_key";r=0;t=`+strconv.Itoa(ra); got != want {
			t.Fatalf("request %d: RateLimit %q, want %q", i, got, want)
		}
		if got := a.h.Get("RateLimit-Policy"); got != `"per_key";q=5;w=60` {
			t.Fatalf("request %d: RateLimit-Policy %q", i, got)
		}
		if a.h.Get("Cache-Control") != "no-store" || !strings.HasPrefix(a.h.Get("Content-Type"), "application/json") {
			t.Fatalf("request %d: headers %v", i, a.h)
		}
		if a.body != `{"error":"rate_limited","message":"API rate limit exceeded for this key."}` {
			t.Fatalf("request %d: body %q", i, a.body)
		}
	}
	if n := e.up.seen(key); n != keyQuota {
		t.Fatalf("the upstream saw %d requests with the key, want %d (denied requests must not reach it)", n, keyQuota)
	}
	// Another key is not affected.
	if a := getWithKey(t, url, key+"-other"); a.code != 200 {
		t.Fatalf("another key: %d", a.code)
	}
}

// TestJSONOnCheckAddr: the gateway binary answers envoyproxy/ratelimit's
// POST /json on -check-addr, and stops cleanly on SIGTERM.
func TestJSONOnCheckAddr(t *testing.T) {
	e := startEnv(t)
	const body = `{"domain":"integ","descriptors":[{"entries":[{"key":"api_key","value":"k_json"}]}]}`
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	post := func(body string) (int, http.Header, string) {
		resp, err := c.Post("http://"+e.gw.Check+"/json", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b)
	}
	for i := 1; i <= keyQuota; i++ {
		if code, h, b := post(body); code != 200 || !strings.Contains(b, `"overallCode":"OK"`) || h.Get("RateLimit-Policy") != `"per_key";q=5;w=60` {
			t.Fatalf("call %d: %d %v %s", i, code, h, b)
		}
	}
	code, h, b := post(body)
	if code != 429 || !strings.Contains(b, `"overallCode":"OVER_LIMIT"`) || h.Get("Retry-After") == "" || !strings.HasPrefix(h.Get("RateLimit"), `"per_key";r=0;t=`) {
		t.Fatalf("over the limit: %d %v %s", code, h, b)
	}
	if code, _, b := post("{"); code != 400 || !strings.Contains(b, `"error":"bad_request"`) {
		t.Fatalf("malformed: %d %s", code, b)
	}
	if err := e.gw.Proc.Signal(syscall.SIGTERM, 30*time.Second); err != nil {
		t.Fatalf("SIGTERM: %v (want a clean exit)", err)
	}
	if _, err := c.Post("http://"+e.gw.Check+"/json", "application/json", strings.NewReader(body)); err == nil {
		t.Fatal("the check address still answers after shutdown")
	}
}
