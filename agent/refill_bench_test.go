package agent

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// BenchmarkRefillTick measures the refill loop's own cost: one 50 ms tick
// of a driven agent holding 2000 keys, 200 of them checked between ticks,
// against the fake allocator called directly (no gRPC), so the scans, the
// batches and the answers applied are most of what it measures. ns/op is
// per tick; cpu-ns/op is the process's CPU time per tick.
func BenchmarkRefillTick(b *testing.B) { benchRefillTick(b, nil) }

// BenchmarkRefillTickGroups4 is BenchmarkRefillTick with a topology of 4
// groups (one call per group and tick, the keys split by slot), all
// served by the one fake.
func BenchmarkRefillTickGroups4(b *testing.B) {
	t := &allotv1.Topology{Version: 1}
	for g, r := range []string{"0-255", "256-511", "512-767", "768-1023"} {
		t.Groups = append(t.Groups, &allotv1.GroupRoute{Id: uint32(g + 1), LeaderAddr: "client-0", Slots: r})
	}
	benchRefillTick(b, t)
}

func benchRefillTick(b *testing.B, topo *allotv1.Topology) {
	clock := newFakeClock()
	fake := newFake(b, clock.now, testRules)
	cfg := drivenConfig(b, "bench", clock, &directClient{f: fake}, testRules)
	cfg.Rand = rand.New(rand.NewPCG(1, 1))
	a := newAgent(b, cfg)
	a.noteTopology(topo)
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
