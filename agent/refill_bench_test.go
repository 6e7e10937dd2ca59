package agent

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// BenchmarkRefillTick measures the refill loop's own cost: one 50 ms tick
// of a driven agent holding 2000 keys, 200 of them checked between ticks,
// against the fake allocator called directly (no gRPC), so the scans, the
// batches and the answers applied are most of what it measures. ns/op is
// per tick; cpu-ns/op is the process's CPU time per tick.
func BenchmarkRefillTick(b *testing.B) {
	clock := newFakeClock()
	fake := newFake(b, clock.now, testRules)
	cfg := drivenConfig(b, "bench", clock, &directClient{f: fake}, testRules)
	cfg.Rand = rand.New(rand.NewPCG(1, 1))
	a := newAgent(b, cfg)
	const keys, active = 2000, 200
	descs := make([][]Descriptor, keys)
	for i := range descs {
		descs[i] = []Descriptor{desc("api_key", fmt.Sprintf("k%04d", i))}
	}
	ctx := context.Background()
	step := func(i int) {
		for j := range active {
			if _, err := a.Check(ctx, "test", descs[(i*active/4+j)%keys], 1); err != nil {
				b.Fatal(err)
			}
		}
		clock.advance(50 * time.Millisecond)
		if err := a.refill(ctx); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 200 { // every key seen and leased
		step(i)
	}
	b.ReportAllocs()
	reportCPU(b)
	b.ResetTimer()
	for i := range b.N {
		step(i)
	}
}
