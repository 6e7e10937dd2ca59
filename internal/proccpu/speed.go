package proccpu

import (
	"runtime"
	"syscall"
	"time"
)

// Speed runs a fixed piece of work on one locked thread until it has used
// cpu of that thread's CPU time, and returns how many units it did per
// CPU-millisecond. On a shared machine a CPU-second is not a fixed amount
// of work: a core whose sibling hardware thread, or whose host, is busy
// runs the same code slower, and every figure in CPU per operation moves
// with it while the load average does not. A benchmark that samples Speed
// beside its measurement tells a change in the code from a change in the
// machine. A unit is 256 dependent steps of a xorshift, each adding a
// word read from a 16 MiB table at the position it gives (mostly cache
// misses, as the allocator's key table probes are).
func Speed(cpu time.Duration) (float64, time.Duration, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	t0, err := threadCPU()
	if err != nil {
		return 0, 0, err
	}
	x, units := uint64(0x9e3779b97f4a7c15), 0
	for {
		for range 16 {
			x = speedUnit(x)
		}
		units += 16
		t, err := threadCPU()
		if err != nil {
			return 0, 0, err
		}
		if d := t - t0; d >= cpu {
			speedSink = x
			return float64(units) / (float64(d) / float64(time.Millisecond)), d, nil
		}
	}
}

var (
	speedTable = func() []uint64 {
		t := make([]uint64, 1<<21)
		x := uint64(1)
		for i := range t {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			t[i] = x
		}
		return t
	}()
	speedSink uint64
)

func speedUnit(x uint64) uint64 {
	const mask = 1<<21 - 1
	for range 256 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		x += speedTable[x&mask]
	}
	return x
}

// threadCPU is the calling thread's CPU time (getrusage RUSAGE_THREAD).
func threadCPU() (time.Duration, error) {
	const rusageThread = 1
	var ru syscall.Rusage
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}
