package agent

import (
	"testing"
	"time"
)

// TestThrottledAcquireIsNotAFailure: an overload refusal (ResourceExhausted,
// refused before any work) neither opens the breaker nor loses the batch:
// after the back-off the same request id is sent again and its charge is
// applied exactly once.
func TestThrottledAcquireIsNotAFailure(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "t1")
	check(t, s.Agent, d) // fallback, charged 1
	s.fake.with(func(f *fakeAllocator) { f.throttleNext = 5 })
	s.step()
	first := s.fake.lastAcquire()
	if first == nil {
		t.Fatal("no Acquire sent")
	}
	for range 4 { // every retry is refused, the breaker stays closed
		s.clock.advance(1100 * time.Millisecond) // past the jittered back-off (≤ 1 s)
		s.step()
		if s.breakerOpen.Load() {
			t.Fatal("breaker opened on overload refusals")
		}
		if got := s.fake.lastAcquire(); got.RequestId != first.RequestId {
			t.Fatalf("retry sent request id %d, want %d (the same batch)", got.RequestId, first.RequestId)
		}
	}
	s.clock.advance(1100 * time.Millisecond) // past the jittered back-off (≤ 1 s)
	s.step()                                 // accepted now
	if b := s.fake.booksOf("test:api_key=t1"); b.charged != 1 {
		t.Fatalf("charged %d, want exactly 1", b.charged)
	}
	if got := check(t, s.Agent, d); got.Source != SourceLease {
		t.Fatalf("after the throttle: %+v, want a lease", got)
	}
}
