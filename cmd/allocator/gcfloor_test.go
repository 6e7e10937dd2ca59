package main

import (
	"runtime/debug"
	"testing"
	"time"
)

func TestGCPercentFor(t *testing.T) {
	const mib = 1 << 20
	for i, c := range []struct {
		live, floor uint64
		base, want  int
	}{
		{8 * mib, 64 * mib, 100, 700},          // goal 8·(1+7) = 64 MiB
		{10 * mib, 64 * mib, 100, 540},         // 10·6.4 = 64: 540 exactly
		{10*mib + 1, 64 * mib, 100, 540},       // rounded up
		{40 * mib, 64 * mib, 100, 100},         // the base already reaches the floor
		{64 * mib, 64 * mib, 100, 100},         // at the floor
		{500 * mib, 64 * mib, 100, 100},        // above it: GOGC alone
		{8 * mib, 64 * mib, 800, 800},          // never below the base
		{0, 64 * mib, 100, maxFloorPercent},    // empty heap: capped
		{1024, 64 * mib, 100, maxFloorPercent}, // tiny heap: capped
		{8 * mib, 64 * mib, -1, -1},            // GOGC=off stays off
	} {
		if got := gcPercentFor(c.live, c.floor, c.base); got != c.want {
			t.Errorf("case %d: gcPercentFor(%d, %d, %d) = %d, want %d", i, c.live, c.floor, c.base, got, c.want)
		}
	}
}

// TestGCFloorRestores checks that the controller raises the percent while
// the heap is below the floor and restores the base when stopped.
func TestGCFloorRestores(t *testing.T) {
	base := debug.SetGCPercent(100)
	defer debug.SetGCPercent(base)
	g := startGCFloor(1<<40, 5*time.Millisecond) // a floor no test heap reaches
	if g == nil {
		t.Fatal("startGCFloor returned nil with GOGC=100")
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		p := debug.SetGCPercent(maxFloorPercent) // read (and keep what it set)
		if p == maxFloorPercent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("GC percent %d, want %d while the heap is below the floor", p, maxFloorPercent)
		}
		debug.SetGCPercent(p)
		time.Sleep(time.Millisecond)
	}
	g.Stop()
	g.Stop() // twice is safe
	if p := debug.SetGCPercent(100); p != 100 {
		t.Fatalf("after Stop the GC percent is %d, want the base 100", p)
	}
	var nilFloor *gcFloor
	nilFloor.Stop()
	if startGCFloor(0, time.Second) != nil {
		t.Fatal("a zero floor started a controller")
	}
}
