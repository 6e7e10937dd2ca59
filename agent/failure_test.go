package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fastConfig is a config with short intervals for tests with real loops.
func fastConfig(addrs ...string) Config {
	cfg := DefaultConfig()
	cfg.Allocators = addrs
	cfg.RefillInterval = 2 * time.Millisecond
	cfg.ScanInterval = 10 * time.Millisecond
	cfg.CallTimeout = 100 * time.Millisecond
	cfg.FailureThreshold = 2
	cfg.ProbeBackoff = 10 * time.Millisecond
	cfg.MaxProbeBackoff = 50 * time.Millisecond
	return cfg
}

// TestAllocatorDownFallbackAndRecovery stops the allocator mid-traffic:
// checks never fail, the breaker opens, admission stays near R/N per agent,
// and leasing resumes when the allocator comes back on the same address.
func TestAllocatorDownFallbackAndRecovery(t *testing.T) {
	fake := newFake(t, func() int64 { return time.Now().UnixNano() }, testRules)
	srv := serveFake(t, fake)
	cfg := fastConfig(srv.addr)
	cfg.Rules = mustCompile(t, 0, testRules)
	a := newAgent(t, cfg)
	d := []Descriptor{desc("rate", "r")} // 100/s, burst 10

	var (
		mu       sync.Mutex
		bySource [numSources]int
		admitted atomic.Int64
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		checkUntil(t, a, stop, d, func(got Decision) bool {
			if got.Allowed {
				admitted.Add(1)
				mu.Lock()
				bySource[got.Source]++
				mu.Unlock()
			}
			time.Sleep(200 * time.Microsecond) // ~5k checks/s: far above 100/s
			return true
		})
	})
	defer func() { close(stop); wg.Wait() }()
	sourceCount := func(s Source) int {
		mu.Lock()
		defer mu.Unlock()
		return bySource[s]
	}

	waitFor(t, 10*time.Second, "lease decisions", func() bool { return sourceCount(SourceLease) > 0 })
	srv.stop()
	waitFor(t, 10*time.Second, "the breaker to open", a.breakerOpen.Load)

	// Outage: admissions over a measured interval stay within the
	// fallback's burst + R/N·T (+ what the lease still held). N is 1 here.
	start, n0 := time.Now(), admitted.Load()
	time.Sleep(300 * time.Millisecond)
	n1, elapsed := admitted.Load(), time.Since(start)
	bound := int64(10 + 10 + 100*elapsed.Seconds()*1.2 + 5)
	if got := n1 - n0; got > bound {
		t.Fatalf("admitted %d in %v of outage, bound %d", got, elapsed, bound)
	}
	fb := sourceCount(SourceFallback)

	srv.start()
	waitFor(t, 10*time.Second, "the breaker to close", func() bool { return !a.breakerOpen.Load() })
	leased := sourceCount(SourceLease)
	waitFor(t, 10*time.Second, "lease decisions after recovery", func() bool { return sourceCount(SourceLease) > leased })
	if fb == 0 {
		t.Fatalf("no fallback decisions during the outage")
	}
	if v := testutilGauge(a.met); v != 0 {
		t.Fatalf("fallback gauge %v after recovery", v)
	}
}

// TestDeadAllocatorAddsNoLatency: while the refill loop is stuck in a call
// the allocator never answers, checks on new, leased and fallback keys all
// complete: no check performs network I/O or waits on the loop.
func TestDeadAllocatorAddsNoLatency(t *testing.T) {
	fake := newFake(t, func() int64 { return time.Now().UnixNano() }, testRules)
	srv := serveFake(t, fake)
	cfg := fastConfig(srv.addr)
	cfg.Rules = mustCompile(t, 0, testRules)
	cfg.CallTimeout = time.Hour // the call hangs for as long as the test wants
	a := newAgent(t, cfg)
	leasedKey := desc("tier", "free", "route", "/y", "user", "u")
	check(t, a, leasedKey)
	waitFor(t, 10*time.Second, "a lease", func() bool {
		ks := keyOf(t, a, leasedKey)
		return ks != nil && ks.balance.Load() > 0
	})

	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	fake.with(func(f *fakeAllocator) { f.block, f.entered = release, entered })
	check(t, a, desc("api_key", "new")) // queues a key: the loop calls and hangs
	<-entered

	for i := range 1000 {
		for _, d := range []Descriptor{leasedKey, desc("api_key", "new"), desc("api_key", string(rune('A'+i%50)))} {
			if _, err := a.Check(context.Background(), "test", []Descriptor{d}, 1); err != nil {
				t.Fatal(err)
			}
		}
	}
	close(release)
}

// TestBlackHoleAllocator: an allocator that accepts connections and never
// answers opens the breaker (calls time out), and checks keep being
// answered from the fallback the whole time.
func TestBlackHoleAllocator(t *testing.T) {
	bh := newBlackHole(t)
	cfg := fastConfig(bh.addr())
	cfg.Rules = mustCompile(t, 0, testRules)
	cfg.CallTimeout = 20 * time.Millisecond
	a := newAgent(t, cfg)
	d := desc("api_key", "bh")
	var sawFallback bool
	waitFor(t, 10*time.Second, "the breaker to open", func() bool {
		got := check(t, a, d)
		sawFallback = sawFallback || got.Source == SourceFallback
		return a.breakerOpen.Load()
	})
	if !sawFallback {
		t.Fatalf("no fallback decision")
	}
	if a.Ready() {
		t.Fatalf("Ready with an allocator that never answered")
	}
}

// TestStandaloneReady: without allocators the agent is ready once it has
// rules.
func TestStandaloneReady(t *testing.T) {
	a := newAgent(t, Config{})
	if a.Ready() {
		t.Fatalf("ready without rules")
	}
	b := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	if !b.Ready() {
		t.Fatalf("not ready with rules")
	}
}
