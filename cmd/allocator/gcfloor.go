package main

import (
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"time"
)

// gcFloor keeps the garbage collector's heap goal at or above a floor
// while the live heap is small. Go's default (GOGC=100) starts a cycle
// whenever the heap doubles, so a node with a few MB live and tens of MB/s
// of short-lived garbage (decoded requests, Raft entries) collects several
// times a second; each cycle has two stop-the-world pauses, and on a busy
// machine a pause lasts until every thread is scheduled again. With a floor of F bytes the
// goal is at least F, so the cycles are F/garbage-rate apart. A heap larger
// than the floor is collected exactly as GOGC says; GOMEMLIMIT, when set,
// still bounds everything.
//
// Every interval it reads the live heap and sets the GC percent to
// gcPercentFor(live, floor, base), base being the GOGC in effect at start.
// It does nothing when GOGC is off.
type gcFloor struct {
	stop chan struct{}
	done chan struct{}
	once sync.Once
}

// gcMinHeap is the floor cmd/allocator runs with: a few tens of MB more
// than a small node's live heap, nothing for a large one (5M keys are
// ~500 MB live).
const gcMinHeap = 64 << 20

// maxFloorPercent caps the percent gcFloor sets (a 1 MB heap with a 64 MB
// floor needs 6300).
const maxFloorPercent = 10000

// gcPercentFor returns the GC percent that puts the heap goal, about
// live·(1 + percent/100), at floor or above, and never below base. A
// negative base (GOGC=off) is returned as is.
func gcPercentFor(live, floor uint64, base int) int {
	if base < 0 || live >= floor {
		return base
	}
	live = max(live, 1)
	// Smallest p with live + live·p/100 ≥ floor, rounded up.
	p := (floor - live) * 100
	pct := p / live
	if p%live != 0 {
		pct++
	}
	if pct > maxFloorPercent {
		return max(base, maxFloorPercent)
	}
	return max(base, int(pct))
}

// startGCFloor starts the controller; floor 0 returns nil (nothing runs).
// Stop it with stop, which restores the base percent.
func startGCFloor(floor uint64, interval time.Duration) *gcFloor {
	if floor == 0 {
		return nil
	}
	samples := []metrics.Sample{{Name: "/gc/gogc:percent"}, {Name: "/gc/heap/live:bytes"}}
	metrics.Read(samples)
	if samples[0].Value.Kind() != metrics.KindUint64 || samples[1].Value.Kind() != metrics.KindUint64 {
		return nil // an older runtime without these metrics
	}
	base := int(int64(samples[0].Value.Uint64())) // GOGC=off reads as -1
	if base < 0 {
		return nil
	}
	g := &gcFloor{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(g.done)
		defer debug.SetGCPercent(base)
		t := time.NewTicker(interval)
		defer t.Stop()
		set := base
		for {
			metrics.Read(samples)
			if p := gcPercentFor(samples[1].Value.Uint64(), floor, base); p != set {
				debug.SetGCPercent(p)
				set = p
			}
			select {
			case <-g.stop:
				return
			case <-t.C:
			}
		}
	}()
	return g
}

// Stop ends the controller and waits for it. Safe on nil and twice.
func (g *gcFloor) Stop() {
	if g == nil {
		return
	}
	g.once.Do(func() { close(g.stop) })
	<-g.done
}
