package agent

import (
	"testing"
	"time"
)

// runClock starts c's goroutine and stops it when the test ends.
func runClock(t *testing.T, c *coarseClock) {
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { defer close(done); c.run(stop) }()
	t.Cleanup(func() { close(stop); <-done })
}

// burst is checks' reads back to back for a window: far more than
// clockBusy a tick.
func burst(c *coarseClock) {
	for end := time.Now().Add(clockWindow); time.Now().Before(end); {
		for range 100 {
			c.load()
		}
	}
}

// TestCoarseClockParks: with no check reading it, the clock's goroutine
// parks; the refill loop's reads (fresh) do not wake it but are current;
// a check's read is current, frequent reads wake it, and it ticks again.
func TestCoarseClockParks(t *testing.T) {
	c := newCoarseClock()
	runClock(t, c)

	waitFor(t, 10*time.Second, "the clock to park", c.parked.Load)
	time.Sleep(20 * time.Millisecond)
	if got, now := c.fresh(), time.Now().UnixNano(); got < now-int64(5*time.Millisecond) {
		t.Fatalf("fresh while parked: %v behind the time", time.Duration(now-got))
	}
	if !c.parked.Load() {
		t.Fatal("fresh woke the clock")
	}
	time.Sleep(20 * time.Millisecond)
	if got, now := c.load(), time.Now().UnixNano(); got < now-int64(5*time.Millisecond) {
		t.Fatalf("a check's read while parked: %v behind the time", time.Duration(now-got))
	}
	if !c.parked.Load() {
		t.Fatal("one check's read woke the clock")
	}
	waitFor(t, 10*time.Second, "a burst of reads to wake the clock", func() bool {
		burst(c)
		return !c.parked.Load()
	})
	// Ticking again: the time advances while the checks read at the
	// busy rate, with no update of their own.
	first := c.load()
	waitFor(t, 10*time.Second, "the clock to tick", func() bool {
		burst(c)
		return c.load() > first+int64(2*clockTick)
	})
	// And it parks again once the reads stop.
	waitFor(t, 10*time.Second, "the clock to park again", c.parked.Load)
}

// TestCoarseClockLightReads: checks reading the clock less often than
// clockBusy times a tick park a ticking clock and do not wake a parked
// one, and each of their reads is current.
func TestCoarseClockLightReads(t *testing.T) {
	c := newCoarseClock()
	runClock(t, c)
	waitFor(t, 10*time.Second, "a burst of reads to wake the clock", func() bool {
		burst(c)
		return !c.parked.Load()
	})
	pace := time.NewTicker(2 * clockTick) // one read per two ticks
	defer pace.Stop()
	light := func() {
		<-pace.C
		if got, now := c.load(), time.Now().UnixNano(); c.parked.Load() && got < now-int64(5*time.Millisecond) {
			t.Fatalf("a check's read while parked: %v behind the time", time.Duration(now-got))
		}
	}
	waitFor(t, 10*time.Second, "light reads to park the clock", func() bool {
		light()
		return c.parked.Load()
	})
	for range 30 {
		light()
		if !c.parked.Load() {
			t.Fatal("light reads woke the clock")
		}
	}
}

// TestCoarseClockNeverBack: concurrent readers waking the clock and its
// goroutine never move it backwards.
func TestCoarseClockNeverBack(t *testing.T) {
	c := newCoarseClock()
	runClock(t, c)
	errs := make(chan string, 4)
	for range 4 {
		go func() {
			last := int64(0)
			for i := range 20000 {
				if i%4000 == 0 {
					time.Sleep(3 * clockIdle / 2) // let it park
				}
				now := c.load()
				if now < last {
					errs <- "the clock went back"
					return
				}
				last = now
			}
			errs <- ""
		}()
	}
	for range 4 {
		if e := <-errs; e != "" {
			t.Fatal(e)
		}
	}
}
