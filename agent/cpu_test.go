package agent

import (
	"testing"

	"github.com/allot/allot/internal/proccpu"
)

// reportCPU makes b report the process's CPU time per operation
// ("cpu-ns/op") besides the wall time: on a machine shared with other
// work, ns/op includes the time the benchmark waited for a core, while CPU
// time barely moves with the load. Call it after setup; it reports when the
// benchmark ends (b.N is final by then).
func reportCPU(b *testing.B) {
	b.Helper()
	c0, err := proccpu.Self()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		c1, err := proccpu.Self()
		if err == nil && b.N > 0 {
			b.ReportMetric(float64(c1-c0)/float64(b.N), "cpu-ns/op")
		}
	})
}
