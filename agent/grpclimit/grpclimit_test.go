package grpclimit

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/net/http2"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/internal/agenttest"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/sfv/sfvtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testRules = `
domain: grpc-test
descriptors:
  - key: api_key
    descriptors:
      - key: method
        value: /grpc.health.v1.Health/Check
        rate_limit: {unit: minute, requests_per_unit: 3, name: check_per_key}
      - key: method
        value: /grpc.health.v1.Health/Watch
        rate_limit: {unit: minute, requests_per_unit: 2, name: watch_per_key}
`

var testConfig = Config{
	Domain: "grpc-test",
	Descriptors: []DescriptorConfig{
		{{Source: SourceMetadata, Key: "api_key", Metadata: "X-API-Key"}, {Source: SourceMethod}},
	},
}

// countingHealth is the health service, counting the calls that reached it.
type countingHealth struct {
	*health.Server
	calls atomic.Int64
}

func (h *countingHealth) Check(ctx context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	h.calls.Add(1)
	return h.Server.Check(ctx, req)
}

func (h *countingHealth) Watch(req *healthpb.HealthCheckRequest, s healthpb.Health_WatchServer) error {
	h.calls.Add(1)
	// One update, then the stream ends (the test reads it and returns).
	return s.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING})
}

// start runs a real gRPC server on 127.0.0.1 with the interceptors over a
// standalone agent with a frozen clock, and returns a client connection
// and the service (to count the calls that got through).
func start(t *testing.T, cfg Config, c Checker) (healthpb.HealthClient, *countingHealth) {
	cc, svc := startAt(t, cfg, c)
	return healthpb.NewHealthClient(cc), svc
}

// startAt is start returning the client connection itself (its Target is
// the server's address).
func startAt(t *testing.T, cfg Config, c Checker) (*grpc.ClientConn, *countingHealth) {
	t.Helper()
	if c == nil {
		c = agenttest.Frozen(t, testRules)
	}
	lim, err := New(cfg, c)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.ChainUnaryInterceptor(lim.Unary()), grpc.ChainStreamInterceptor(lim.Stream()))
	svc := &countingHealth{Server: health.NewServer()}
	healthpb.RegisterHealthServer(g, svc)
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		g.Stop()
		<-done
	})
	return cc, svc
}

func withKey(key string) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	return metadata.AppendToOutgoingContext(ctx, "x-api-key", key), cancel
}

// checkFields parses the two fields strictly and checks name, quota,
// remaining and t.
func checkFields(t *testing.T, md metadata.MD, name string, q, r, tSec int64) {
	t.Helper()
	pol, rl := md.Get(MetadataRateLimitPolicy), md.Get(MetadataRateLimit)
	if len(pol) != 1 || len(rl) != 1 {
		t.Fatalf("fields: ratelimit-policy %q, ratelimit %q", pol, rl)
	}
	pp, err := sfvtest.ParseList(pol[0])
	if err != nil {
		t.Fatalf("ratelimit-policy %q: %v", pol[0], err)
	}
	rp, err := sfvtest.ParseList(rl[0])
	if err != nil {
		t.Fatalf("ratelimit %q: %v", rl[0], err)
	}
	param := func(it sfvtest.Item, k string) any { v, _ := it.Param(k); return v }
	if len(pp) != 1 || pp[0].Value != name || param(pp[0], "q") != q || param(pp[0], "w") != int64(60) {
		t.Fatalf("ratelimit-policy %q, want %q q=%d w=60", pol[0], name, q)
	}
	if len(rp) != 1 || rp[0].Value != name || param(rp[0], "r") != r || (tSec >= 0 && param(rp[0], "t") != tSec) {
		t.Fatalf("ratelimit %q, want %q r=%d t=%d", rl[0], name, r, tSec)
	}
}

func TestUnaryAllowedThenResourceExhausted(t *testing.T) {
	c, svc := start(t, testConfig, nil)
	ctx, cancel := withKey("k1")
	defer cancel()
	for i := 1; i <= 3; i++ {
		var hdr metadata.MD
		if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&hdr)); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		checkFields(t, hdr, "check_per_key", 3, int64(3-i), -1)
	}
	var trl metadata.MD
	_, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Trailer(&trl))
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted {
		t.Fatalf("4th call: %v, want ResourceExhausted", err)
	}
	// 3/minute: the next token in 20 s.
	checkFields(t, trl, "check_per_key", 3, 0, 20)
	if ra := trl.Get(MetadataRetryAfter); len(ra) != 1 || ra[0] != "20" {
		t.Fatalf("retry-after trailer %q, want 20", ra)
	}
	var ri *errdetails.RetryInfo
	for _, d := range st.Details() {
		if x, ok := d.(*errdetails.RetryInfo); ok {
			ri = x
		}
	}
	if ri == nil || ri.GetRetryDelay().AsDuration() != 20*time.Second {
		t.Fatalf("RetryInfo %v, want 20s", ri)
	}
	if n := svc.calls.Load(); n != 3 {
		t.Fatalf("the service saw %d calls, want 3 (the denied call must not reach it)", n)
	}
	// Another key has its own budget.
	ctx2, cancel2 := withKey("k2")
	defer cancel2()
	if _, err := c.Check(ctx2, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("other key: %v", err)
	}
}

func TestStreamCheckedWhenItOpens(t *testing.T) {
	c, svc := start(t, testConfig, nil)
	ctx, cancel := withKey("k1")
	defer cancel()
	for i := 1; i <= 2; i++ {
		s, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		hdr, err := s.Header()
		if err != nil {
			t.Fatal(err)
		}
		checkFields(t, hdr, "watch_per_key", 2, int64(2-i), -1)
	}
	s, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Recv()
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("3rd stream: %v, want ResourceExhausted", err)
	}
	checkFields(t, s.Trailer(), "watch_per_key", 2, 0, 30)
	if n := svc.calls.Load(); n != 2 {
		t.Fatalf("the service saw %d streams, want 2", n)
	}
}

func TestNoDescriptorRunsUnchecked(t *testing.T) {
	c, svc := start(t, testConfig, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for range 10 { // no x-api-key: no descriptor
		var hdr metadata.MD
		if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&hdr)); err != nil {
			t.Fatal(err)
		}
		if len(hdr.Get(MetadataRateLimit)) != 0 {
			t.Fatalf("unchecked call has fields %v", hdr)
		}
	}
	if svc.calls.Load() != 10 {
		t.Fatalf("service saw %d calls", svc.calls.Load())
	}
}

func TestOversizedMetadataIsInvalidArgument(t *testing.T) {
	c, svc := start(t, testConfig, nil)
	secret := "k_" + strings.Repeat("s", DefaultMaxValueBytes)
	ctx, cancel := withKey(secret)
	defer cancel()
	_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("%v, want InvalidArgument", err)
	}
	if strings.Contains(err.Error(), "sss") {
		t.Fatalf("the error echoes the value: %v", err)
	}
	if svc.calls.Load() != 0 {
		t.Fatal("an invalid call reached the service")
	}
}

// methodRules limit each method to one call a minute, whatever the api
// key, and each api key to 100.
const methodRules = `
domain: grpc-test
descriptors:
  - key: method
    rate_limit: {unit: minute, requests_per_unit: 1, name: per_method}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 100, name: per_key}
`

// rawCall makes a gRPC call of method (an empty request) over plain
// HTTP/2, with x-api-key set to key as given: unlike grpc-go's client it
// sends any bytes a header field may hold (obs-text, a tab), as other
// clients can. It returns the grpc-status.
func rawCall(t *testing.T, addr, method, key string) codes.Code {
	t.Helper()
	tr := &http2.Transport{AllowHTTP: true, DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+method, bytes.NewReader([]byte{0, 0, 0, 0, 0}))
	if err != nil {
		t.Fatal(err)
	}
	req.Header["Content-Type"] = []string{"application/grpc"}
	req.Header["Te"] = []string{"trailers"}
	req.Header["X-Api-Key"] = []string{key}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	v := resp.Trailer.Get("Grpc-Status")
	if v == "" {
		v = resp.Header.Get("Grpc-Status") // a trailers-only answer
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s: grpc-status %q", method, v)
	}
	return codes.Code(n)
}

// TestInvalidMetadataIsInvalidArgumentNotFailOpen pins a bypass: a
// metadata value the agent refuses (invalid UTF-8, a control character, a
// descriptor over agent.MaxKeyBytes) made Check fail with agent.ErrInvalid,
// which the interceptors took for a limiter error: the call ran unchecked,
// past every other limit on it (here one call a minute per method). Such
// calls fail with InvalidArgument, consume nothing and never reach the
// handler, unary and streaming alike.
func TestInvalidMetadataIsInvalidArgumentNotFailOpen(t *testing.T) {
	cfg := Config{Domain: "grpc-test", MaxValueBytes: 2 * agent.MaxKeyBytes, Descriptors: []DescriptorConfig{
		{{Source: SourceMethod}},
		{{Source: SourceMetadata, Key: "api_key", Metadata: "x-api-key"}},
	}}
	cc, svc := startAt(t, cfg, agenttest.Frozen(t, methodRules))
	c := healthpb.NewHealthClient(cc)
	const check, watch = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"
	for _, method := range []string{check, watch} {
		for _, key := range []string{"k\xff", "a\tb", "k\xc0\x80"} {
			if got := rawCall(t, cc.Target(), method, key); got != codes.InvalidArgument {
				t.Fatalf("%s with x-api-key %q: %v, want InvalidArgument", method, key, got)
			}
		}
	}
	// Valid text, but a descriptor longer than the agent takes.
	long := strings.Repeat("s", agent.MaxKeyBytes)
	ctx, cancel := withKey(long)
	defer cancel()
	_, err := c.Check(ctx, &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.InvalidArgument || strings.Contains(err.Error(), "sss") {
		t.Fatalf("Check with a %d-byte key: %v, want InvalidArgument not echoing the value", len(long), err)
	}
	s, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = s.Recv()
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Watch with a %d-byte key: %v, want InvalidArgument", len(long), err)
	}
	if n := svc.calls.Load(); n != 0 {
		t.Fatalf("the service saw %d calls with invalid metadata, want 0", n)
	}
	// Nothing was consumed: each method still has its one call, and then
	// none.
	for _, method := range []string{check, watch} {
		if got := rawCall(t, cc.Target(), method, "k"); got != codes.OK {
			t.Fatalf("%s, first valid call: %v, want OK", method, got)
		}
		if got := rawCall(t, cc.Target(), method, "k"); got != codes.ResourceExhausted {
			t.Fatalf("%s, second valid call: %v, want ResourceExhausted", method, got)
		}
	}
	if n := svc.calls.Load(); n != 2 {
		t.Fatalf("the service saw %d calls, want 2", n)
	}
}

type failingChecker struct{}

func (failingChecker) Check(context.Context, string, []agent.Descriptor, uint32) (agent.Decision, error) {
	return agent.Decision{}, errors.New("boom")
}

func TestLimiterErrorFailsOpen(t *testing.T) {
	c, svc := start(t, testConfig, failingChecker{})
	ctx, cancel := withKey("k1")
	defer cancel()
	for range 5 {
		if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if svc.calls.Load() != 5 {
		t.Fatalf("service saw %d calls, want 5", svc.calls.Load())
	}
}

func TestDescriptorsFromMethodAndMetadata(t *testing.T) {
	lim, err := New(Config{Domain: "d", Descriptors: []DescriptorConfig{
		{{Source: SourceService}, {Source: SourceStatic, Key: "edge", Value: "eu"}},
		{{Source: SourceMetadata, Key: "plan", Metadata: "x-plan"}, {Source: SourceMethod, Key: "m"}},
		{{Source: SourceMetadata, Key: "absent", Metadata: "x-absent"}},
	}}, failingChecker{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("x-plan", " gold "))
	got, err := lim.Descriptors(ctx, "/pkg.Svc/Do")
	if err != nil {
		t.Fatal(err)
	}
	want := [][]rules.Entry{
		{{Key: "service", Value: "pkg.Svc"}, {Key: "edge", Value: "eu"}},
		{{Key: "plan", Value: "gold"}, {Key: "m", Value: "/pkg.Svc/Do"}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d descriptors %v, want %d", len(got), got, len(want))
	}
	for i := range want {
		if len(got[i].Entries) != len(want[i]) {
			t.Fatalf("descriptor %d: %v, want %v", i, got[i].Entries, want[i])
		}
		for j := range want[i] {
			if got[i].Entries[j] != want[i][j] {
				t.Fatalf("descriptor %d entry %d: %v, want %v", i, j, got[i].Entries[j], want[i][j])
			}
		}
	}
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Descriptors: []DescriptorConfig{{{Source: SourceMethod}}}}, "domain"},
		{Config{Domain: "d", Descriptors: []DescriptorConfig{{}}}, "descriptors[0]"},
		{Config{Domain: "d", Descriptors: []DescriptorConfig{{{Source: "bogus"}}}}, "unknown source"},
		{Config{Domain: "d", Descriptors: []DescriptorConfig{{{Source: SourceMetadata, Key: "k"}}}}, "needs key and metadata"},
		{Config{Domain: "d", Descriptors: []DescriptorConfig{{{Source: SourceMetadata, Key: "k", Metadata: "grpc-timeout"}}}}, "not a usable metadata key"},
		{Config{Domain: "d", Descriptors: []DescriptorConfig{{{Source: SourceStatic, Key: "k"}}}}, "needs key and value"},
		{Config{Domain: "d", Descriptors: []DescriptorConfig{{{Source: SourceMethod, Value: "x"}}}}, "takes no metadata"},
		{Config{MaxValueBytes: -1}, "max_value_bytes"},
	} {
		_, err := New(tc.cfg, failingChecker{})
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "grpclimit: ") {
			t.Errorf("New(%+v) = %v, want an error containing %q", tc.cfg, err, tc.want)
		}
	}
	if _, err := New(Config{}, nil); err == nil {
		t.Error("New with a nil Checker succeeded")
	}
}
