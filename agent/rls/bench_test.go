package rls

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"testing"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/internal/proccpu"
	"github.com/allot/allot/pkg/rules"
)

const benchRules = `
domain: bench
descriptors:
  - key: tier
    value: free
    descriptors:
      - key: api_key
        rate_limit: {name: per_key, unit: second, requests_per_unit: 1000000000, burst: 1000000000}
`

// BenchmarkGRPC: ShouldRateLimit and grpc.health.v1 Check on one gRPC
// server over loopback TCP (client and server in this process), from 64
// goroutines on one connection; the RLS calls cycle 64 API keys under a
// standalone agent. cpu-ns/op is the process's CPU time per call, client
// included: the difference between the two is what the RLS path adds to
// a gRPC round trip. bench/gateway -mode rls measures the server alone.
func BenchmarkGRPC(b *testing.B) {
	set, err := rules.Compile(1, []rules.File{{Name: "bench.yaml", Source: []byte(benchRules)}})
	if err != nil {
		b.Fatal(err)
	}
	cfg := agent.DefaultConfig()
	cfg.Rules = set
	cfg.Logger = nil
	a, err := agent.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close(context.Background())
	srv, err := New(a, Options{})
	if err != nil {
		b.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	g := grpc.NewServer(ServerOptions()...)
	srv.Register(g)
	healthpb.RegisterHealthServer(g, health.NewServer())
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	defer func() { g.Stop(); <-done }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	rl, hc := rlsv3.NewRateLimitServiceClient(cc), healthpb.NewHealthClient(cc)
	reqs := make([]*rlsv3.RateLimitRequest, 64)
	for i := range reqs {
		reqs[i] = &rlsv3.RateLimitRequest{Domain: "bench", Descriptors: []*rlcommon.RateLimitDescriptor{
			desc("tier", "free", "api_key", fmt.Sprintf("k_bench_%02d", i))}}
	}
	ctx := context.Background()
	calls := []struct {
		name string
		call func(i int) error
	}{
		{"rls", func(i int) error {
			resp, err := rl.ShouldRateLimit(ctx, reqs[i%len(reqs)])
			if err == nil && resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
				err = fmt.Errorf("%v, want OK", resp.GetOverallCode())
			}
			return err
		}},
		{"health", func(int) error {
			_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
			return err
		}},
	}
	for _, c := range calls {
		b.Run(c.name, func(b *testing.B) {
			var next atomic.Int64
			b.SetParallelism(32) // 64 goroutines on 2 cores
			b.ReportAllocs()
			c0, err := proccpu.Self()
			if err != nil {
				b.Fatal(err)
			}
			b.RunParallel(func(pb *testing.PB) {
				i := int(next.Add(1))
				for pb.Next() {
					if err := c.call(i); err != nil {
						b.Error(err)
						return
					}
					i++
				}
			})
			if c1, err := proccpu.Self(); err == nil {
				b.ReportMetric(float64(c1-c0)/float64(b.N), "cpu-ns/op")
			}
		})
	}
}
