package agent

import (
	"testing"
	"time"
)

// TestColdStartInFlightAdmissionsPaidFromGrant pins the cold-start
// over-admission found through the gateway's design-card test: fallback
// admissions made while the first Acquire was in flight were charged only
// after the grant had already taken those tokens from the global budget, so
// a burst of 10 admitted 11. The grant now pays for them.
func TestColdStartInFlightAdmissionsPaidFromGrant(t *testing.T) {
	s := newStepped(t)
	d := desc("small", "k1") // 3 per hour, burst 3: no refill during the test

	admitted := 0
	try := func() {
		if got := check(t, s.Agent, d); got.Allowed {
			admitted++
		}
	}
	try() // first sight: fallback, charged 1

	// Hold the next Acquire in flight and keep admitting meanwhile.
	block, entered := make(chan struct{}), make(chan struct{}, 1)
	s.fake.with(func(f *fakeAllocator) { f.block, f.entered = block, entered })
	done := make(chan struct{})
	go func() { defer close(done); s.step() }()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the refill's Acquire never reached the allocator")
	}
	try() // from the fallback while the call is in flight
	s.fake.with(func(f *fakeAllocator) { f.block, f.entered = nil, nil })
	close(block)
	<-done

	// Spend whatever is left, across a few refill ticks.
	for range 3 {
		for range 5 {
			try()
		}
		s.step()
	}
	if admitted > 3 {
		t.Fatalf("admitted %d through a burst of 3 (no refill), want ≤ 3", admitted)
	}
	b := s.fake.booksOf("test:small=k1")
	ks := keyOf(t, s.Agent, d)
	if owed := ks.charged.Load(); b.granted+b.charged+owed-b.returned-ks.balance.Load() != int64(admitted) {
		t.Fatalf("books: granted %d + charged %d + owed %d − returned %d − balance %d ≠ admitted %d",
			b.granted, b.charged, owed, b.returned, ks.balance.Load(), admitted)
	}
}
