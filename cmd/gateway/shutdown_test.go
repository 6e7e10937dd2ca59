package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

var rlsService = rlsv3.RateLimitService_ServiceDesc.ServiceName

func dialGRPC(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// serving reports whether the gRPC health service answers SERVING for
// every one of the gateway's service names ("" and the RLS service).
func serving(hc healthpb.HealthClient) (bool, error) {
	for _, svc := range []string{"", rlsService} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		cancel()
		if err != nil {
			return false, err
		}
		if r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return false, nil
		}
	}
	return true, nil
}

const drainRules = `
domain: drain
descriptors:
  - key: generic_key
    value: all
    rate_limit: {name: roomy, unit: second, requests_per_unit: 100000, burst: 100000}
`

// TestReadinessNeedsAllocatorRules: with -allocators, an allocator that
// has no rules yet (version 0) leaves the gateway not ready, on /readyz
// and in the gRPC health service; the first rule set (version 1) makes it
// ready on both.
func TestReadinessNeedsAllocatorRules(t *testing.T) {
	gw, alloc := binaries(t)
	dir := t.TempDir()
	grpcAddr := testproc.FreeAddr(t)
	startProc(t, "allocator", alloc, "-node-id", "a", "-data-dir", filepath.Join(dir, "data"), "-grpc-addr", grpcAddr,
		"-raft-addr", testproc.FreeAddr(t), "-http-addr", "", "-bootstrap", "-log-level", "warn") // no -rules: version 0
	cfg := writeFile(t, dir, "gateway.yaml", fmt.Sprintf("upstream: %s\ndomain: drain\ndescriptors: [[{generic_key: all}]]\n", backend(t)))
	p, a := startGateway(t, gw, "-config", cfg, "-allocators", grpcAddr, "-listen", "127.0.0.1:0",
		"-rls-addr", "127.0.0.1:0", "-http-addr", "127.0.0.1:0")

	// The agent hears from the allocator (an empty rule set, version 0)
	// and the gateway still says no.
	var last reply
	eventually(t, 60*time.Second, "/readyz to say the allocators have no rules", func() bool {
		r, err := tryGet("http://" + a.http + "/readyz")
		last = r
		return err == nil && r.code == 503 && strings.Contains(r.body, "version 0")
	})
	hc := healthpb.NewHealthClient(dialGRPC(t, a.rls))
	if ok, err := serving(hc); ok || err != nil {
		t.Errorf("gRPC health with no rules: serving %v, %v; want NOT_SERVING", ok, err)
	}
	if metric(t, a.http, "allot_agent_rules_version") != 0 {
		t.Errorf("agent rules version %v, want 0", metric(t, a.http, "allot_agent_rules_version"))
	}

	// The first rule set.
	admin := allotv1.NewAdminClient(dialGRPC(t, grpcAddr))
	eventually(t, 30*time.Second, "PutRules to succeed", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := admin.PutRules(ctx, &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "drain.yaml", Yaml: []byte(drainRules)}}})
		return err == nil
	})
	eventually(t, 30*time.Second, "/readyz 200 with rules version 1", func() bool {
		r, err := tryGet("http://" + a.http + "/readyz")
		last = r
		return err == nil && r.code == 200
	})
	eventually(t, 10*time.Second, "gRPC health SERVING", func() bool {
		ok, err := serving(hc)
		return ok && err == nil
	})
	if r := get(t, "http://"+a.proxy+"/x"); r.code != 200 || r.h.Get("RateLimit-Policy") == "" {
		t.Errorf("request once ready: %d, RateLimit-Policy %q", r.code, r.h.Get("RateLimit-Policy"))
	}
	if err := p.signal(t, syscall.SIGTERM, 30*time.Second); err != nil {
		t.Fatalf("exit after SIGTERM: %v (last /readyz %d %q)", err, last.code, last.body)
	}
}

// TestSIGTERMDrainsInFlight: requests the proxy already accepted when
// SIGTERM arrives finish with the upstream's answer (no 5xx, no reset),
// while /readyz says 503 and new connections are refused; RLS calls
// racing the signal get an answer or Unavailable, nothing else; a gRPC
// health Watch stream sees NOT_SERVING and ends instead of holding the
// shutdown; the process exits 0.
func TestSIGTERMDrainsInFlight(t *testing.T) {
	gw, _ := binaries(t)
	dir := t.TempDir()

	// The upstream holds every request until released.
	var arrived atomic.Int64
	release := make(chan struct{})
	var releaseOnce sync.Once
	releaseAll := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(releaseAll)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	up := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		select {
		case <-release:
			io.WriteString(w, "done")
		case <-r.Context().Done():
		}
	})}
	go up.Serve(ln)
	t.Cleanup(func() { up.Close() })

	rulesFile := writeFile(t, dir, "rules.yaml", drainRules)
	cfg := writeFile(t, dir, "gateway.yaml", fmt.Sprintf("upstream: http://%s\nrules: [%s]\ndomain: drain\ndescriptors: [[{generic_key: all}]]\n",
		ln.Addr(), rulesFile))
	p, a := startGateway(t, gw, "-config", cfg, "-listen", "127.0.0.1:0", "-rls-addr", "127.0.0.1:0",
		"-http-addr", "127.0.0.1:0", "-shutdown-timeout", "60s")
	eventually(t, 30*time.Second, "/readyz 200 (standalone)", func() bool {
		r, err := tryGet("http://" + a.http + "/readyz")
		return err == nil && r.code == 200
	})
	rlsConn := dialGRPC(t, a.rls)
	hc := healthpb.NewHealthClient(rlsConn)
	eventually(t, 10*time.Second, "gRPC health SERVING (standalone)", func() bool {
		ok, err := serving(hc)
		return ok && err == nil
	})
	watchCtx, cancelWatch := context.WithCancel(context.Background())
	defer cancelWatch()
	watch, err := hc.Watch(watchCtx, &healthpb.HealthCheckRequest{Service: rlsService})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := watch.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health Watch first message: %v, %v", r, err)
	}
	watchEnd := make(chan []healthpb.HealthCheckResponse_ServingStatus, 1)
	go func() {
		var seen []healthpb.HealthCheckResponse_ServingStatus
		for {
			r, err := watch.Recv()
			if err != nil {
				watchEnd <- seen
				return
			}
			seen = append(seen, r.GetStatus())
		}
	}()

	// In flight: n requests held by the upstream.
	const n = 16
	type result struct {
		code int
		body string
		err  error
	}
	results := make(chan result, n)
	for range n {
		go func() {
			r, err := tryGet("http://" + a.proxy + "/held")
			results <- result{r.code, r.body, err}
		}()
	}
	eventually(t, 30*time.Second, fmt.Sprintf("%d requests at the upstream", n), func() bool { return arrived.Load() == n })

	// RLS calls racing the signal.
	rlsClient := rlsv3.NewRateLimitServiceClient(rlsConn)
	var rlsOK, rlsUnavailable atomic.Int64
	var rlsOther sync.Map
	stopRLS := make(chan struct{})
	rlsDone := make(chan struct{})
	go func() {
		defer close(rlsDone)
		pace := time.NewTicker(2 * time.Millisecond) // a steady stream, not a spin once refused
		defer pace.Stop()
		for {
			select {
			case <-stopRLS:
				return
			case <-pace.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err := rlsClient.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "drain",
				Descriptors: []*rlcommon.RateLimitDescriptor{{Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "generic_key", Value: "all"}}}}})
			cancel()
			switch status.Code(err) {
			case codes.OK:
				rlsOK.Add(1)
			case codes.Unavailable:
				rlsUnavailable.Add(1)
			default:
				rlsOther.Store(err.Error(), true)
			}
		}
	}()
	eventually(t, 10*time.Second, "RLS answers", func() bool { return rlsOK.Load() > 0 })

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, "/readyz 503 while draining", func() bool {
		r, err := tryGet("http://" + a.http + "/readyz")
		return err == nil && r.code == 503 && strings.Contains(r.body, "shutting down")
	})
	eventually(t, 20*time.Second, "the proxy to refuse new connections", func() bool {
		c, err := net.DialTimeout("tcp", a.proxy, time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	select {
	case <-p.done:
		t.Fatalf("the gateway exited with %d requests in flight: %v", n, p.waitErr)
	default:
	}
	select {
	case seen := <-watchEnd:
		if len(seen) == 0 || seen[len(seen)-1] != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Errorf("health Watch saw %v before it ended, want NOT_SERVING last", seen)
		}
	case <-time.After(20 * time.Second):
		t.Error("the health Watch stream did not end at shutdown")
	}

	releaseAll()
	for range n {
		r := <-results
		if r.err != nil || r.code != 200 || r.body != "done" {
			t.Errorf("in-flight request: %d %q %v; want 200 \"done\"", r.code, r.body, r.err)
		}
	}
	select {
	case <-p.done:
		if p.waitErr != nil {
			t.Errorf("exit status after SIGTERM: %v", p.waitErr)
		}
	case <-time.After(30 * time.Second): // well before -shutdown-timeout 60s
		t.Fatal("the gateway did not exit once its requests were done")
	}
	close(stopRLS)
	<-rlsDone
	rlsOther.Range(func(k, _ any) bool {
		t.Errorf("RLS call during shutdown: %v (want OK or Unavailable)", k)
		return true
	})
	t.Logf("RLS during shutdown: %d OK, %d Unavailable", rlsOK.Load(), rlsUnavailable.Load())
}
