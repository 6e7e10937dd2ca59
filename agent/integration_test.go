package agent

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allot/allot/allocator"
	"github.com/allot/allot/pkg/rules"
)

// startAllocator runs a single-node allocator (bootstrap, bolt stores in a
// temp dir, loopback ports) with the test rules.
func startAllocator(t *testing.T, dataDir string, bootstrap bool) *allocator.Server {
	t.Helper()
	cfg := allocator.DefaultConfig()
	cfg.NodeID = "n1"
	cfg.DataDir = dataDir
	cfg.GRPCAddr = "127.0.0.1:0"
	cfg.RaftAddr = "127.0.0.1:0"
	cfg.HTTPAddr = ""
	cfg.Bootstrap = bootstrap
	cfg.InitialRules = []rules.File{{Name: "test.yaml", Source: []byte(testRules)}}
	cfg.Logger = slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	srv, err := allocator.New(cfg)
	if err != nil {
		t.Fatalf("allocator.New: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := srv.WaitReady(ctx); err != nil {
		t.Fatalf("allocator not ready: %v", err)
	}
	return srv
}

func stopAllocator(t *testing.T, srv *allocator.Server) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Errorf("allocator shutdown: %v", err)
	}
}

// TestAgentsShareKeyRealAllocator: three agents check one key (100/s,
// burst 10) as fast as they can against a real single-node allocator. Over
// the run the total admitted stays within burst + R·T plus the documented
// cold-start bound (each agent's first-sight fallback burst: ⌈burst/N⌉
// with N still unknown, so up to burst each) plus the debt floor (burst).
func TestAgentsShareKeyRealAllocator(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a real allocator")
	}
	srv := startAllocator(t, t.TempDir(), true)
	defer stopAllocator(t, srv)

	const agents = 3
	const ratePerSec, burst = 100.0, 10
	as := make([]*Agent, agents)
	for i := range as {
		cfg := DefaultConfig()
		cfg.Allocators = []string{srv.GRPCAddr()}
		cfg.RefillInterval = 5 * time.Millisecond
		cfg.ScanInterval = 20 * time.Millisecond
		cfg.CallTimeout = time.Second
		cfg.Logger = testLogger(t)
		a, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		as[i] = a
		waitFor(t, 20*time.Second, "agent ready", a.Ready)
	}
	defer func() {
		for _, a := range as {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if err := a.Close(ctx); err != nil {
				t.Errorf("agent close: %v", err)
			}
			cancel()
		}
	}()

	d := []Descriptor{desc("rate", "shared")}
	var admitted, leased atomic.Int64
	start := time.Now()
	const run = 2 * time.Second
	var wg sync.WaitGroup
	for _, a := range as {
		wg.Go(func() {
			for time.Since(start) < run {
				got, err := a.Check(context.Background(), "test", d, 1)
				if err != nil {
					t.Error(err)
					return
				}
				if got.Allowed {
					admitted.Add(1)
					if got.Source == SourceLease {
						leased.Add(1)
					}
				}
				time.Sleep(100 * time.Microsecond)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	bound := int64(burst + ratePerSec*elapsed + agents*burst + burst)
	t.Logf("admitted %d (%d from leases) in %.2fs; bound %d (R·T = %.0f)", admitted.Load(), leased.Load(), elapsed, bound, ratePerSec*elapsed)
	if admitted.Load() > bound {
		t.Fatalf("admitted %d > bound %d", admitted.Load(), bound)
	}
	if leased.Load() == 0 {
		t.Fatalf("no check was decided from a lease")
	}
}

// TestAllocatorRestartRecovery: the real allocator stops mid-traffic; the
// agent keeps answering from its fallback and resumes leasing when the
// allocator restarts from its data directory on the same address.
func TestAllocatorRestartRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a real allocator")
	}
	dir := t.TempDir()
	srv := startAllocator(t, dir, true)
	addr := srv.GRPCAddr()
	cfg := fastConfig(addr)
	cfg.CallTimeout = time.Second
	cfg.Logger = testLogger(t)
	a := newAgent(t, cfg)
	waitFor(t, 20*time.Second, "agent ready", a.Ready)

	d := []Descriptor{desc("tier", "free", "route", "/r", "user", "u")}
	sourceOf := func() Source {
		got, err := a.Check(context.Background(), "test", d, 1)
		if err != nil || !got.Allowed {
			t.Fatalf("check: %+v %v", got, err)
		}
		return got.Source
	}
	waitFor(t, 20*time.Second, "a leased decision", func() bool { return sourceOf() == SourceLease })
	stopAllocator(t, srv)
	waitFor(t, 20*time.Second, "the breaker to open", a.breakerOpen.Load)
	keyOf(t, a, d[0]).expiry.Store(0) // end the lease now rather than in seconds
	if s := sourceOf(); s != SourceFallback {
		t.Fatalf("during the outage: source %v, want fallback", s)
	}

	srv2 := restartAllocatorAt(t, dir, addr)
	defer stopAllocator(t, srv2)
	waitFor(t, 30*time.Second, "the breaker to close", func() bool { return !a.breakerOpen.Load() })
	waitFor(t, 20*time.Second, "a leased decision after recovery", func() bool { return sourceOf() == SourceLease })
}

// restartAllocatorAt restarts the node from dataDir on gRPC address addr.
func restartAllocatorAt(t *testing.T, dataDir, addr string) *allocator.Server {
	t.Helper()
	cfg := allocator.DefaultConfig()
	cfg.NodeID = "n1"
	cfg.DataDir = dataDir
	cfg.GRPCAddr = addr
	cfg.RaftAddr = "127.0.0.1:0"
	cfg.HTTPAddr = ""
	cfg.Logger = slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var srv *allocator.Server
	waitFor(t, 10*time.Second, "the old address to be free", func() bool {
		var err error
		srv, err = allocator.New(cfg)
		return err == nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := srv.WaitReady(ctx); err != nil {
		t.Fatalf("restarted allocator not ready: %v", err)
	}
	return srv
}
