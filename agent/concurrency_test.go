package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// hammer runs g goroutines that each make per checks of descs at once and
// returns how many were allowed.
func hammer(t *testing.T, a *Agent, g, per int, descs ...Descriptor) int64 {
	t.Helper()
	var admitted atomic.Int64
	start := make(chan struct{})
	var wg sync.WaitGroup
	for range g {
		wg.Go(func() {
			<-start
			for range per {
				d, err := a.Check(context.Background(), "test", descs, 1)
				if err != nil {
					t.Error(err)
					return
				}
				if d.Allowed {
					admitted.Add(1)
				}
			}
		})
	}
	close(start)
	wg.Wait()
	return admitted.Load()
}

// TestConcurrentExactBurstLocal: 100 goroutines against limit 50 burst 50
// at one instant admit exactly 50 (the per-key mutex loses no update).
func TestConcurrentExactBurstLocal(t *testing.T) {
	clock := newFakeClock()
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules), Now: clock.now})
	if n := hammer(t, a, 100, 1, desc("api_key", "hot")); n != 50 {
		t.Fatalf("admitted %d, want exactly 50", n)
	}
}

// TestConcurrentExactBurstLeased: the same through a lease: one fallback
// admission, then a grant of the other 49; 100 goroutines admit exactly
// the 49 (the CAS loses no update, and the re-based fallback adds none).
func TestConcurrentExactBurstLeased(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "hot")
	check(t, s.Agent, d)
	ks := keyOf(t, s.Agent, d)
	ks.Demand.Rate = 1000
	s.step()
	if b := ks.balance.Load(); b != 49 {
		t.Fatalf("balance %d, want 49", b)
	}
	if n := hammer(t, s.Agent, 100, 1, d); n != 49 {
		t.Fatalf("admitted %d, want exactly 49", n)
	}
}

// TestConcurrentBooksBalance runs checks on many goroutines while the real
// refill loop grants, charges and returns, then closes the agent: every
// admitted token must be on the allocator's books, as granted (and not
// returned) or charged: nothing admitted is lost, nothing counted twice.
func TestConcurrentBooksBalance(t *testing.T) {
	clock := newFakeClock()
	fake := newFake(t, clock.now, testRules)
	srv := serveFake(t, fake)
	cfg := DefaultConfig()
	cfg.Allocators = []string{srv.addr}
	cfg.Rules = mustCompile(t, 0, testRules)
	cfg.RefillInterval = time.Millisecond
	cfg.ScanInterval = time.Millisecond
	cfg.CallTimeout = 5 * time.Second
	cfg.Now = func() int64 { return clock.now() }
	a := newAgent(t, cfg)
	big := desc("tier", "free", "route", "/x", "user", "u")
	var admitted atomic.Int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 8 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				got, err := a.Check(context.Background(), "test", []Descriptor{big}, 1)
				if err != nil {
					t.Error(err)
					return
				}
				if got.Allowed {
					admitted.Add(1)
				}
			}
		})
	}
	// Let time pass on the fake clock so demand, leases and expiry move.
	waitFor(t, 10*time.Second, "leased decisions", func() bool {
		clock.advance(10 * time.Millisecond)
		return keyOf(t, a, big) != nil && keyOf(t, a, big).balance.Load() > 0 && admitted.Load() > 20000
	})
	close(stop)
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	b := fake.booksOf("test:tier=free,route=/x,user=u")
	if got := b.granted - b.returned + b.charged; got != admitted.Load() {
		t.Fatalf("books: granted %d − returned %d + charged %d = %d, admitted %d",
			b.granted, b.returned, b.charged, got, admitted.Load())
	}
	t.Logf("admitted %d: granted %d, returned %d, charged %d", admitted.Load(), b.granted, b.returned, b.charged)
}
