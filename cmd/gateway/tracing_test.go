package main

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"

	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// collector is an OTLP/gRPC trace collector that records span names.
type collector struct {
	coltracepb.UnimplementedTraceServiceServer
	addr string

	mu    sync.Mutex
	spans []string // guarded by mu
}

func (c *collector) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				c.spans = append(c.spans, s.GetName())
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func (c *collector) names() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.spans)
}

func (c *collector) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.spans = nil
}

func startCollector(t *testing.T) *collector {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &collector{addr: ln.Addr().String()}
	srv := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(srv, c)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return c
}

// TestTracing: with the OTEL_* variables pointing at an OTLP collector,
// `gateway -dev` without -otel exports nothing; with -otel it exports the
// spans of an RLS check, a POST /json check and the agent's Acquire
// (client and server side), and shuts down cleanly on SIGTERM; `allocator
// -otel` exports the span of an admin RPC.
func TestTracing(t *testing.T) {
	gw, alloc := binaries(t)
	col := startCollector(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+col.addr)
	t.Setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
	t.Setenv("OTEL_TRACES_SAMPLER", "always_on")

	checks := func(t *testing.T, a addrs) {
		t.Helper()
		if r := get(t, "http://"+a.proxy+"/v1/search", "X-API-Key", "k_free_demo"); r.code != 200 {
			t.Fatalf("proxy: %d %s", r.code, r.body)
		}
		resp, err := client.Post("http://"+a.check+"/json", "application/json",
			strings.NewReader(`{"domain":"public-api","descriptors":[{"entries":[{"key":"api_key","value":"k_free_demo"}]}]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("POST /json: %d", resp.StatusCode)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err = rlsv3.NewRateLimitServiceClient(dialGRPC(t, a.rls)).ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{
			Domain: "public-api", Descriptors: []*rlcommon.RateLimitDescriptor{{Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "api_key", Value: "k_free_demo"}}}}})
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		// The first Acquire of the key is in flight or done: wait for it.
		eventually(t, 10*time.Second, "the key's first Acquire", func() bool {
			return metric(t, a.http, "allot_agent_acquire_keys_total") >= 1
		})
	}
	devArgs := []string{"-dev", "-listen", "127.0.0.1:0", "-rls-addr", "127.0.0.1:0", "-http-addr", "127.0.0.1:0"}

	t.Run("off", func(t *testing.T) {
		p, a := startGateway(t, gw, devArgs...)
		checks(t, a)
		if err := p.signal(t, syscall.SIGTERM, 20*time.Second); err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.err)
		}
		if n := col.names(); len(n) != 0 {
			t.Errorf("without -otel the collector received spans: %q", n)
		}
	})

	t.Run("on", func(t *testing.T) {
		col.reset()
		p, a := startGateway(t, gw, append([]string{"-otel"}, devArgs...)...)
		checks(t, a)
		if err := p.signal(t, syscall.SIGTERM, 20*time.Second); err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.err)
		}
		// Shutdown flushed the batch: every span is there once the process
		// has exited.
		got := col.names()
		for _, want := range []string{
			"envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", // the RLS server
			"POST /json",                 // the check listener
			"allot.v1.Allocator/Acquire", // the agent's client and the embedded allocator's server
		} {
			if !slices.Contains(got, want) {
				t.Errorf("no %q span; got %q", want, got)
			}
		}
		if n := countOf(got, "allot.v1.Allocator/Acquire"); n < 2 {
			t.Errorf("%d Acquire spans, want a client and a server span at least", n)
		}
	})

	t.Run("allocator", func(t *testing.T) {
		col.reset()
		grpcAddr := testproc.FreeAddr(t)
		p := startProc(t, "allocator", alloc, "-otel", "-node-id", "a", "-data-dir", filepath.Join(t.TempDir(), "data"),
			"-grpc-addr", grpcAddr, "-raft-addr", testproc.FreeAddr(t), "-http-addr", "", "-bootstrap", "-log-level", "warn")
		adm := allotv1.NewAdminClient(dialGRPC(t, grpcAddr))
		eventually(t, 30*time.Second, "ClusterStatus", func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_, err := adm.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
			return err == nil
		})
		if err := p.signal(t, syscall.SIGTERM, 20*time.Second); err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, p.err)
		}
		if got := col.names(); !slices.Contains(got, "allot.v1.Admin/ClusterStatus") {
			t.Errorf("no admin RPC span; got %q", got)
		}
	})
}

func countOf(s []string, v string) (n int) {
	for _, e := range s {
		if e == v {
			n++
		}
	}
	return n
}
