package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/rules"
)

const testRules = `
domain: test
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 2}
`

func testConfig(t *testing.T, upstream string) Config {
	t.Helper()
	set, err := rules.Compile(1, []rules.File{{Name: "test.yaml", Source: []byte(testRules)}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Listen, cfg.RLSAddr, cfg.HTTPAddr, cfg.CheckAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	if cfg.Upstream, err = url.Parse(upstream); err != nil {
		t.Fatal(err)
	}
	cfg.Extraction = httplimit.Config{
		Domain:      "test",
		APIKey:      httplimit.APIKeyConfig{Headers: []string{"X-API-Key"}},
		Descriptors: []httplimit.DescriptorConfig{{{Source: httplimit.SourceAPIKey}}},
	}
	cfg.Agent.Rules = set
	cfg.Logger = slog.New(slog.DiscardHandler)
	return cfg
}

// startReady starts a gateway with cfg, shut down when the test ends, and
// waits until it is ready.
func startReady(t *testing.T, cfg Config) *Gateway {
	t.Helper()
	g, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Shutdown(context.Background()) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := g.WaitReady(ctx, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	return g
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"no listener", func(c *Config) { c.Listen = "" }, "Listen is required"},
		{"no upstream", func(c *Config) { c.Upstream = nil }, "upstream"},
		{"ftp upstream", func(c *Config) { c.Upstream = &url.URL{Scheme: "ftp", Host: "h"} }, "upstream"},
		{"bad extraction", func(c *Config) { c.Extraction.Descriptors = []httplimit.DescriptorConfig{{{Source: "nope"}}} }, "gateway: "},
		{"negative timeout", func(c *Config) { c.ShutdownTimeout = -1 }, "ShutdownTimeout"},
	} {
		cfg := testConfig(t, "http://127.0.0.1:9")
		if err := cfg.Validate(); err != nil {
			t.Fatalf("%s: base config: %v", tc.name, err)
		}
		tc.edit(&cfg)
		err := cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want an error with %q", tc.name, err, tc.want)
		}
		if _, err := Start(cfg); err == nil {
			t.Errorf("%s: Start accepted the config", tc.name)
		}
	}
}

// TestStartServesTheLimitedProxy: a standalone gateway proxies, adds its
// RateLimit fields (dropping the upstream's), denies past the limit,
// serves /readyz and /metrics, and shuts down twice without error.
func TestStartServesTheLimitedProxy(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("RateLimit", `"upstream";r=1`)
		io.WriteString(w, "up")
	}))
	defer up.Close()
	g := startReady(t, testConfig(t, up.URL))
	a := g.Addrs()
	if a.Proxy == "" || a.RLS == "" || a.HTTP == "" {
		t.Fatalf("Addrs() = %+v", a)
	}
	codes := []int{}
	for range 3 {
		req, _ := http.NewRequest(http.MethodGet, "http://"+a.Proxy+"/x", nil)
		req.Header.Set("X-API-Key", "k1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		codes = append(codes, resp.StatusCode)
		if resp.StatusCode == http.StatusOK && strings.Contains(resp.Header.Get("RateLimit"), "upstream") {
			t.Errorf("the upstream's RateLimit field was kept: %q", resp.Header.Get("RateLimit"))
		}
	}
	if codes[0] != 200 || codes[1] != 200 || codes[2] != http.StatusTooManyRequests {
		t.Errorf("codes = %v, want [200 200 429]", codes)
	}
	for _, path := range []string{"/readyz", "/metrics"} {
		resp, err := http.Get("http://" + a.HTTP + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || (path == "/metrics" && !strings.Contains(string(body), "allot_gateway_requests_total")) {
			t.Errorf("GET %s = %d", path, resp.StatusCode)
		}
	}
	if err := g.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := g.Shutdown(context.Background()); err != nil {
		t.Fatalf("second Shutdown: %v", err)
	}
	if ok, why := g.Ready(); ok || why != "shutting down" {
		t.Errorf("Ready() after Shutdown = %v, %q", ok, why)
	}
}

// TestCheckListenerPaths: the check listener answers /forward-auth as it
// answers /forward-auth/ and the paths under it (no redirect, which nginx
// auth_request turns into a 500), and any other path with a JSON 404.
func TestCheckListenerPaths(t *testing.T) {
	g := startReady(t, testConfig(t, "http://127.0.0.1:9"))
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for _, tc := range []struct {
		method, path string
		code         int
		json         bool
	}{
		{"GET", "/forward-auth", 200, false},
		{"GET", "/forward-auth/", 200, false},
		{"POST", "/forward-auth/any/path", 200, false},
		{"GET", "/forward-auth?x=1", 200, false},
		{"GET", "/forward-authx", 404, true},
		{"GET", "/", 404, true},
		{"GET", "/nope", 404, true},
		{"POST", "/json/", 404, true},
		{"GET", "//forward-auth", 404, true},
		{"GET", "/json", 405, true},
	} {
		req, _ := http.NewRequest(tc.method, "http://"+g.Addrs().Check+tc.path, nil)
		req.Header.Set("X-API-Key", "k-"+tc.path)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		isJSON := resp.Header.Get("Content-Type") == "application/json" && json.Valid(body)
		if resp.StatusCode != tc.code || isJSON != tc.json {
			t.Errorf("%s %s: %d %q %q, want %d (JSON body: %v)", tc.method, tc.path, resp.StatusCode,
				resp.Header.Get("Content-Type"), body, tc.code, tc.json)
		}
	}
}

// TestShutdownReportsCheckDrainCut: a check request still in its handler
// when ctx ends makes Shutdown return an error naming the check listener,
// as the proxy's does.
func TestShutdownReportsCheckDrainCut(t *testing.T) {
	g := startReady(t, testConfig(t, "http://127.0.0.1:9"))
	conn, err := net.Dial("tcp", g.Addrs().Check)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// The JSON handler reads the body: the server answers 100 Continue
	// once the handler runs, and the handler then waits for a body that
	// never comes.
	if _, err := io.WriteString(conn, "POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.Contains(line, "100 Continue") {
		t.Fatalf("read %q, %v: want 100 Continue", line, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err = g.Shutdown(ctx)
	if err == nil || !strings.Contains(err.Error(), "check shutdown: ") || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown() = %v, want a check shutdown error", err)
	}
}

// TestRLSRequestSizeBound pins the RLS port's receive bound: it took
// requests of up to 1 MiB, whose protobuf decoding alone allocates tens
// of MiB before a request's counts are checked. A request over
// RLSMaxRequestBytes (64 KiB by default) is refused with
// ResourceExhausted, a raised bound takes it, and Validate refuses a
// negative one.
func TestRLSRequestSizeBound(t *testing.T) {
	big := &rlsv3.RateLimitRequest{Domain: "test"}
	for i := range agent.MaxDescriptors { // a valid request of ~70 KiB
		big.Descriptors = append(big.Descriptors, &rlcommon.RateLimitDescriptor{Entries: []*rlcommon.RateLimitDescriptor_Entry{
			{Key: "api_key", Value: fmt.Sprintf("%04d%s", i, strings.Repeat("k", 1100))}}})
	}
	small := &rlsv3.RateLimitRequest{Domain: "test", Descriptors: big.Descriptors[:1]}
	if n := proto.Size(big); n <= DefaultRLSMaxRequestBytes || n > 2*DefaultRLSMaxRequestBytes {
		t.Fatalf("the big request is %d bytes, want just over %d", n, DefaultRLSMaxRequestBytes)
	}
	for _, tc := range []struct {
		bound   int
		bigCode codes.Code
	}{{0, codes.ResourceExhausted}, {2 * DefaultRLSMaxRequestBytes, codes.OK}} {
		cfg := testConfig(t, "http://127.0.0.1:9")
		cfg.RLSMaxRequestBytes = tc.bound
		g, err := Start(cfg)
		if err != nil {
			t.Fatal(err)
		}
		cc, err := grpc.NewClient(g.Addrs().RLS, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		c := rlsv3.NewRateLimitServiceClient(cc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		for _, r := range []struct {
			name string
			req  *rlsv3.RateLimitRequest
			want codes.Code
		}{{"small", small, codes.OK}, {"big", big, tc.bigCode}} {
			resp, err := c.ShouldRateLimit(ctx, r.req)
			if status.Code(err) != r.want || (err == nil && resp.GetOverallCode() != rlsv3.RateLimitResponse_OK) {
				t.Errorf("bound %d, %s request (%d bytes): %v %v, want %v", tc.bound, r.name, proto.Size(r.req), resp.GetOverallCode(), err, r.want)
			}
		}
		cancel()
		cc.Close()
		if err := g.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	cfg := testConfig(t, "http://127.0.0.1:9")
	cfg.RLSMaxRequestBytes = -1
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "RLSMaxRequestBytes") {
		t.Fatalf("Validate with RLSMaxRequestBytes -1: %v", err)
	}
}
