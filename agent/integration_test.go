package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// startAllocator runs a single-node cmd/allocator process (bootstrap, bolt
// stores in dir, loopback ports) with the test rules.
func startAllocator(t *testing.T, dir string) *testproc.Node {
	t.Helper()
	bins := testproc.Build(t)
	rulesFile := testproc.WriteFile(t, dir, "test.yaml", testRules)
	c := testproc.StartCluster(t, testproc.ClusterConfig{Bin: bins.Allocator, Dir: dir, Size: 1, Rules: []string{rulesFile}})
	return c.Nodes[0]
}

// stopAllocator shuts the node down gracefully (SIGTERM).
func stopAllocator(t *testing.T, n *testproc.Node) {
	t.Helper()
	if err := n.Proc.Signal(syscall.SIGTERM, 10*time.Second); err != nil {
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
	srv := startAllocator(t, t.TempDir())
	defer stopAllocator(t, srv)

	const agents = 3
	const ratePerSec, burst = 100.0, 10
	as := make([]*Agent, agents)
	for i := range as {
		cfg := DefaultConfig()
		cfg.Allocators = []string{srv.GRPC}
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
	srv := startAllocator(t, t.TempDir())
	cfg := fastConfig(srv.GRPC)
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

	restartAllocator(t, srv)
	defer stopAllocator(t, srv)
	waitFor(t, 30*time.Second, "the breaker to close", func() bool { return !a.breakerOpen.Load() })
	waitFor(t, 20*time.Second, "a leased decision after recovery", func() bool { return sourceOf() == SourceLease })
}

// restartAllocator restarts the node from its data directory on the same
// addresses.
func restartAllocator(t *testing.T, n *testproc.Node) {
	t.Helper()
	n.Proc.Start(t)
	waitFor(t, 20*time.Second, "the restarted allocator to be ready", n.Ready)
}
