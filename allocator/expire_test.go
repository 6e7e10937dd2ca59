package allocator

import (
	"fmt"
	"testing"
	"time"
)

func TestExpirePace(t *testing.T) {
	const base, iv = 4096, 100 * time.Millisecond
	for i, tc := range []struct {
		base    int
		backlog uint64
		budget  uint32
		wait    time.Duration
	}{
		{base, 0, base, iv},                                // nothing left: as configured
		{-1, 1 << 20, 0, iv},                               // no limit
		{base, 1000, base, iv},                             // a small backlog: the next Expire as usual
		{base, 5 * base, base, iv},                         // base entries per ExpireInterval drain it in expireDrain
		{base, 10 * base, base, iv / 2},                    // twice as often
		{base, 50 * base, base, iv / 10},                   // expireCatchUp times as often
		{base, 100 * base, 2 * base, iv / 10},              // past that, a larger budget
		{base, 1 << 40, 1 << 31, iv / 10},                  // capped
		{100, 10000, 200, iv / 10},                         // a small base under the same pace
		{base, 7 * base, base, 71428571 * time.Nanosecond}, // between
	} {
		budget, wait := expirePace(tc.base, iv, tc.backlog)
		if budget != tc.budget || wait != tc.wait {
			t.Errorf("step %d: expirePace(%d, %v, %d) = %d, %v; want %d, %v", i, tc.base, iv, tc.backlog, budget, wait, tc.budget, tc.wait)
		}
	}
}

// TestExpirePaceDrainsBacklog runs the leader's expiry pacing in virtual
// time against a model of the expiry wheel under a sustained expiry rate:
// rate entries fall due per second, all at once when their second ends (a
// budgeted Expire takes whole past seconds only), as under bench/acquire's
// load. At no Expire may more than a second's worth of entries be due for
// over a second; once the load stops, the backlog must drain within five
// seconds (the last second falls due one second after it, and what is due
// then shrinks by 1/e every expireDrain); and at 200,000 entries a second
// no Expire may take more than twice the configured budget (a budget
// raised to a fifth of the backlog took ~45,000 entries, ~30 ms of apply).
func TestExpirePaceDrainsBacklog(t *testing.T) {
	const base, iv = 4096, 100 * time.Millisecond
	for _, rate := range []uint64{20000, 200000, 1000000, 20000000} {
		t.Run(fmt.Sprint(rate), func(t *testing.T) {
			const loadSecs, drainSecs = 20, 6
			var (
				queued   = map[int64]uint64{} // per second: entries not yet taken
				backlog  uint64               // what the last Expire left
				maxTaken uint64
				expires  int
				now      = time.Duration(0)
				minWait  = time.Duration(1 << 62)
				sec      = int64(0) // seconds queued so far
				lastLoad = int64(loadSecs)
				drained  = time.Duration(-1)
			)
			for now < (loadSecs+drainSecs)*time.Second {
				// The load queues each second's entries ahead of time.
				for ; sec <= int64(now/time.Second)+1 && sec < lastLoad; sec++ {
					queued[sec] = rate
				}
				budget, wait := expirePace(base, iv, backlog)
				pastSec := int64(now/time.Second) - 1
				due := uint64(0)
				for s, n := range queued {
					if s <= pastSec {
						due += n
					}
				}
				if due > 0 { // else ExpireIdle: nothing committed
					expires++
					take := min(due, uint64(budget))
					maxTaken = max(maxTaken, take)
					left := take
					for s := int64(0); s <= pastSec && left > 0; s++ {
						n := min(queued[s], left)
						queued[s] -= n
						left -= n
						if queued[s] == 0 {
							delete(queued, s)
						}
					}
					backlog = 0
					if take == uint64(budget) {
						backlog = due - take
					}
					old := uint64(0) // left from seconds before the latest due one
					for s, n := range queued {
						if s < pastSec {
							old += n
						}
					}
					if old > rate {
						t.Fatalf("at %v: %d entries due over a second ago, more than a second's %d", now, old, rate)
					}
				}
				if now >= loadSecs*time.Second && backlog == 0 && len(queued) == 0 && drained < 0 {
					drained = now - loadSecs*time.Second
				}
				// expireWait: the next second's end when nothing is left due.
				next := wait
				if backlog == 0 {
					next = max(wait, time.Duration(pastSec+2)*time.Second-now)
				}
				minWait = min(minWait, next)
				now += next
			}
			t.Logf("rate %d/s: %d Expires in %ds, largest %d entries, shortest wait %v, drained %v after the load", rate, expires, loadSecs+drainSecs, maxTaken, minWait, drained)
			if drained < 0 || drained > 5*time.Second {
				t.Fatalf("backlog not drained within 5 s of the load's end (%v)", drained)
			}
			if minWait < iv/expireCatchUp {
				t.Fatalf("shortest wait %v, under ExpireInterval/expireCatchUp", minWait)
			}
			if rate <= 200000 && maxTaken > 2*base {
				t.Fatalf("an Expire took %d entries at %d/s; want ≤ %d", maxTaken, rate, 2*base)
			}
		})
	}
}
