package agent

import (
	"testing"
	"time"
)

// TestCoarseClockParks: with no check reading it, the clock's goroutine
// parks; the refill loop's reads (fresh) do not wake it but are current;
// a check's read is current and wakes it, and it ticks again.
func TestCoarseClockParks(t *testing.T) {
	c := newCoarseClock()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { defer close(done); c.run(stop) }()
	defer func() { close(stop); <-done }()

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
	if c.parked.Load() {
		t.Fatal("a check's read left the clock parked")
	}
	// Ticking again: the time advances with no further reads but the
	// checks' own.
	first := c.load()
	waitFor(t, 10*time.Second, "the clock to tick", func() bool { return c.load() > first+int64(2*clockTick) })
	// And it parks again once the reads stop.
	waitFor(t, 10*time.Second, "the clock to park again", c.parked.Load)
}

// TestCoarseClockNeverBack: concurrent readers waking the clock and its
// goroutine never move it backwards.
func TestCoarseClockNeverBack(t *testing.T) {
	c := newCoarseClock()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { defer close(done); c.run(stop) }()
	defer func() { close(stop); <-done }()
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
