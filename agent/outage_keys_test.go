package agent

import (
	"strconv"
	"testing"
	"time"
)

// TestOutageKeyTableBounded: during an allocator outage every distinct key
// its fallback bucket admits owes an outage charge. Once the key table
// holds more than MaxOutageKeys keys, idle keys whose only debt is that
// charge are forgotten and the charge forgiven (counted), so a client
// sending a fresh made-up key per request cannot grow the table without
// bound while the allocator is down.
func TestOutageKeyTableBounded(t *testing.T) {
	const bound = 1000
	s := newSteppedWith(t, func(c *Config) {
		c.RefillInterval, c.ScanInterval = time.Millisecond, time.Millisecond
		c.MaxOutageKeys = bound
	})
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1 << 30 })
	check(t, s.Agent, desc("api_key", "warm"))
	for i := 0; i < s.cfg.FailureThreshold; i++ {
		s.step()
	}
	if !s.breakerOpen.Load() {
		t.Fatal("breaker closed")
	}
	const n = 5000
	for i := range n {
		if d := check(t, s.Agent, desc("api_key", "junk-"+strconv.Itoa(i))); !d.Allowed || d.Source != SourceFallback {
			t.Fatalf("junk key %d: allowed=%v source=%v, want a fallback admission", i, d.Allowed, d.Source)
		}
	}
	s.clock.advance(time.Millisecond)
	s.step()
	before := s.rf.tracked
	if before <= bound {
		t.Fatalf("%d keys tracked after %d fresh keys, want more than %d (the outage charges keep them until idle)", before, n, bound)
	}
	for range 20 {
		s.clock.advance(s.cfg.IdleTimeout)
		s.step()
	}
	forgiven := dtoCounter{}.read(s.met.outageForgiven)
	t.Logf("tracked keys: %d after the burst, %d after 20 idle timeouts (%v) with the allocator still down; %v tokens forgiven",
		before, s.rf.tracked, 20*s.cfg.IdleTimeout, forgiven)
	if s.rf.tracked > bound {
		t.Errorf("%d idle keys kept, want at most %d", s.rf.tracked, bound)
	}
	if forgiven < n-bound {
		t.Errorf("%v outage tokens forgiven, want at least %d", forgiven, n-bound)
	}
	if !s.breakerOpen.Load() {
		t.Fatal("breaker closed: the allocator was to stay down")
	}
}

// TestOutageKeysUnderBoundKept: under MaxOutageKeys an idle key that owes
// an outage charge is kept until the allocator is back and the charge is
// reported; nothing is forgiven.
func TestOutageKeysUnderBoundKept(t *testing.T) {
	s := newSteppedWith(t, func(c *Config) {
		c.RefillInterval, c.ScanInterval = time.Millisecond, time.Millisecond
		c.MaxOutageKeys = 1000
	})
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1 << 30 })
	check(t, s.Agent, desc("api_key", "warm"))
	for i := 0; i < s.cfg.FailureThreshold; i++ {
		s.step()
	}
	const n = 100
	for i := range n {
		check(t, s.Agent, desc("api_key", "k-"+strconv.Itoa(i)))
	}
	for range 5 {
		s.clock.advance(s.cfg.IdleTimeout)
		s.step()
	}
	if s.rf.tracked < n {
		t.Fatalf("%d keys tracked, want the %d owing outage charges kept", s.rf.tracked, n)
	}
	if f := (dtoCounter{}).read(s.met.outageForgiven); f != 0 {
		t.Fatalf("%v tokens forgiven under the bound", f)
	}
}
