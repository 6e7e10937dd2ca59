package agent

import (
	"syscall"
	"testing"
	"time"
)

// reportCPU makes b report the process's CPU time per operation
// ("cpu-ns/op") besides the wall time: on a machine shared with other
// work, ns/op includes the time the benchmark waited for a core, while CPU
// time barely moves with the load. Call it after setup; it reports when the
// benchmark ends (b.N is final by then).
func reportCPU(b *testing.B) {
	b.Helper()
	c0 := processCPU(b)
	b.Cleanup(func() {
		if b.N > 0 {
			b.ReportMetric(float64(processCPU(b)-c0)/float64(b.N), "cpu-ns/op")
		}
	})
}

// processCPU is the user+system CPU time this process has used.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
