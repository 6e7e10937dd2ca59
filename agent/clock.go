package agent

import (
	"sync/atomic"
	"time"
)

// coarseClock is a Unix-nanosecond clock that an owned goroutine advances
// every millisecond, so that checks read one atomic instead of calling
// time.Now (about 70 ns on the target VMs). It is derived from the monotonic
// clock (start + elapsed), so a wall-clock step never moves it backwards.
//
// The goroutine parks when no check has read the clock for clockIdle: an
// agent with no traffic then costs no wakeups (a 1 ms ticker is about 2% of
// a core on a loaded machine, bench/idle). A check that finds it parked
// reads the time itself and wakes the goroutine. The refill loop reads the
// clock with fresh, which neither counts as a check's read nor wakes it.
type coarseClock struct {
	now    atomic.Int64
	seen   atomic.Bool // a check read the clock since the goroutine's last tick
	parked atomic.Bool // the goroutine is parked: readers compute the time
	kick   chan struct{}
	start  time.Time
}

const (
	clockTick = time.Millisecond
	// clockIdle: the goroutine parks after this long without a check's
	// read.
	clockIdle = 100 * time.Millisecond
)

func newCoarseClock() *coarseClock {
	c := &coarseClock{start: time.Now(), kick: make(chan struct{}, 1)}
	c.now.Store(c.start.UnixNano())
	return c
}

// load is a check's read of the clock.
func (c *coarseClock) load() int64 {
	if !c.seen.Load() {
		c.seen.Store(true)
		if c.parked.Load() {
			return c.wake()
		}
	}
	return c.now.Load()
}

// fresh reads the clock without counting as a check's read: the time
// itself while the goroutine is parked.
func (c *coarseClock) fresh() int64 {
	if c.parked.Load() {
		return c.update()
	}
	return c.now.Load()
}

// wake brings the clock up to date and restarts the parked goroutine.
func (c *coarseClock) wake() int64 {
	t := c.update()
	if c.parked.CompareAndSwap(true, false) {
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
	return t
}

// precise is the clock's time read now rather than at the last tick: the
// tick lags by a millisecond, and by more when the ticking goroutine waits
// for a CPU.
func (c *coarseClock) precise() int64 {
	return c.start.UnixNano() + int64(time.Since(c.start))
}

// update advances the clock to the current time (never back: readers
// may update it concurrently with the goroutine) and returns it.
func (c *coarseClock) update() int64 {
	t := c.precise()
	for {
		old := c.now.Load()
		if t <= old {
			return old
		}
		if c.now.CompareAndSwap(old, t) {
			return t
		}
	}
}

// run ticks until stop is closed. The caller owns the goroutine.
func (c *coarseClock) run(stop <-chan struct{}) {
	t := time.NewTicker(clockTick)
	defer t.Stop()
	idle := 0
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		c.update()
		if c.seen.Swap(false) {
			idle = 0
			continue
		}
		if idle++; time.Duration(idle)*clockTick < clockIdle {
			continue
		}
		// Park. A check that read the clock after the Swap above left
		// seen set: it read a time at most one tick old, and the next
		// one finds parked and wakes the goroutine.
		t.Stop()
		c.parked.Store(true)
		c.seen.Store(false)
		c.update()
		select {
		case <-stop:
			return
		case <-c.kick:
		}
		idle = 0
		c.update()
		t.Reset(clockTick)
	}
}
