package agent

import (
	"sync/atomic"
	"time"
)

// coarseClock is a Unix-nanosecond clock that an owned goroutine advances
// every millisecond while checks read it often, so that a check reads one
// atomic instead of the system clock. It is derived from the monotonic
// clock (start + elapsed), so a wall-clock step never moves it backwards.
//
// The goroutine ticks only while it pays: a tick costs at least a goroutine
// switch and the timer (about half a microsecond when the process is busy,
// tens of microseconds when it has to wake a thread: a 1 ms ticker is
// about 2% of a core on a loaded machine, bench/idle), a reader that
// computes the time itself about 30 ns (precise). So the goroutine counts
// the checks' reads and parks after clockIdle with fewer than clockBusy a
// tick; while it is parked, checks compute the time themselves and count
// their reads, and one that finds clockBusy a tick over clockWindow wakes
// it. An agent with no or light traffic then costs
// no wakeups. The refill loop reads the clock with fresh, which neither
// counts as a check's read nor wakes it.
type coarseClock struct {
	now atomic.Int64
	// reads counts the checks' reads since the goroutine's last tick
	// (ticking) or since window (parked), up to clockCount: past it a
	// read is one atomic load.
	reads  atomic.Int32
	window atomic.Int64 // parked: the start of the window reads counts in
	parked atomic.Bool  // the goroutine is parked: readers compute the time
	kick   chan struct{}
	start  time.Time
}

const (
	clockTick = time.Millisecond
	// clockBusy is the checks' reads per tick at which ticking is cheaper
	// than each check computing the time: one tick in a busy process
	// against clockBusy reads of precise. An RLS server with one caller
	// reads the clock about 10 times a millisecond and measured less CPU
	// per check without the ticks; with 64 callers about 23 times, and
	// ticking is not worse (docs/performance.md).
	clockBusy = 16
	// clockCount is how far the reads are counted between ticks: enough
	// to tell clockBusy a tick over ticks up to one tick late.
	clockCount = 2 * clockBusy
	// clockWindow is the time the reads are averaged over, ticking and
	// parked.
	clockWindow = 10 * clockTick
	// clockIdle: the goroutine parks after this long of ticks with fewer
	// than clockBusy reads a tick.
	clockIdle = 100 * time.Millisecond
)

func newCoarseClock() *coarseClock {
	c := &coarseClock{start: time.Now(), kick: make(chan struct{}, 1)}
	c.now.Store(c.start.UnixNano())
	return c
}

// load is a check's read of the clock.
func (c *coarseClock) load() int64 {
	if c.reads.Load() < clockCount || c.parked.Load() {
		return c.count()
	}
	return c.now.Load()
}

// count is a check's read that is counted: the tick's time while the
// goroutine ticks, else the time itself; the first read past a parked
// window closes it and wakes the goroutine if the window had clockBusy
// reads a tick.
func (c *coarseClock) count() int64 {
	n := c.reads.Add(1)
	if !c.parked.Load() {
		return c.now.Load()
	}
	t := c.update()
	w := c.window.Load()
	if t-w < int64(clockWindow) || !c.window.CompareAndSwap(w, t) {
		return t
	}
	// Reads counted by others since the Add above are lost: the count
	// is an estimate.
	c.reads.Store(0)
	if int64(n)*int64(clockTick) >= clockBusy*(t-w) {
		c.wake()
	}
	return t
}

// fresh reads the clock without counting as a check's read: the time
// itself while the goroutine is parked.
func (c *coarseClock) fresh() int64 {
	if c.parked.Load() {
		return c.update()
	}
	return c.now.Load()
}

// wake restarts the parked goroutine.
func (c *coarseClock) wake() {
	if c.parked.CompareAndSwap(true, false) {
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
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
	// The reads are summed over clockWindow and taken per time, not per
	// tick: ticks come late when the goroutine waits for a CPU, and
	// readers that waited for one read in a burst.
	window := c.update()
	sum, busy := int64(0), window // busy: the end of the last window with clockBusy reads a tick
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		now := c.update()
		sum += int64(c.reads.Swap(0))
		if now-window >= int64(clockWindow) {
			if sum*int64(clockTick) >= clockBusy*(now-window) {
				busy = now
			}
			window, sum = now, 0
		}
		if now-busy < int64(clockIdle) {
			continue
		}
		// Park. A check that reads the clock before parked is set
		// reads a time at most one tick old; from then on checks
		// compute the time, counting in a window that starts now.
		t.Stop()
		c.window.Store(c.update())
		c.parked.Store(true)
		c.reads.Store(0)
		select {
		case <-stop:
			return
		case <-c.kick:
		}
		window = c.update()
		sum, busy = 0, window
		t.Reset(clockTick)
	}
}
