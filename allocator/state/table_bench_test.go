package state

import (
	"testing"
	"time"

	"github.com/allot/allot/internal/proccpu"
)

// benchHash is a bijective mix of x: distinct, evenly spread hashes.
func benchHash(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	return x ^ x>>33
}

// BenchmarkTable measures the key table alone at sizes that do not fit in
// the cache. insert: each op fills an empty table with 4M keys (~128 MiB
// of slots), through every resize on the way. hit: each op looks up one
// of those keys; hit-touched: the same, with the keys touched 32 at a
// time first, as Apply does. miss: each op looks up an absent key. Each
// op's hash depends on the previous op's result, so that the lookups do
// not overlap in the CPU (in Apply, a key's lookup is separated from the
// next one by the rest of its work). cpu-ns/key is the process's CPU time
// per key.
func BenchmarkTable(b *testing.B) {
	const n = 4_000_000
	cpuPerKey := func(b *testing.B, keys int, run func()) {
		c0, _ := proccpu.Self()
		run()
		c1, _ := proccpu.Self()
		b.ReportMetric(float64((c1-c0)/time.Nanosecond)/float64(keys), "cpu-ns/key")
	}
	b.Run("insert", func(b *testing.B) {
		cpuPerKey(b, b.N*n, func() {
			for range b.N {
				c := newCore(testConfig())
				i := 0
				for k := range uint64(n) {
					h := benchHash(k<<1 | uint64(i)>>63) // i ≥ 0: the keys benchHash(2k)
					var found bool
					if i, found = c.tab.search(h); !found {
						i = c.tab.insertAt(c, h, 1, i)
					}
				}
			}
		})
	})
	c := newCore(testConfig())
	for k := range uint64(n) {
		c.tab.insert(c, benchHash(k<<1), 1)
	}
	b.Run("hit", func(b *testing.B) {
		cpuPerKey(b, b.N, func() {
			j := uint64(0)
			for range b.N {
				j = (j + uint64(c.tab.at(c.tab.find(benchHash(j<<1))).lim)) % n
			}
		})
	})
	b.Run("hit-touched", func(b *testing.B) {
		buf := make([]uint64, touchAhead)
		cpuPerKey(b, b.N, func() {
			j := uint64(0)
			for k := 0; k < b.N; k += touchAhead {
				hs := buf[:min(touchAhead, b.N-k)]
				for x := range hs {
					hs[x] = benchHash((j + uint64(x)) % n << 1)
				}
				c.tab.touch(hs)
				for _, h := range hs {
					j += uint64(c.tab.at(c.tab.find(h)).lim)
				}
			}
		})
	})
	b.Run("miss", func(b *testing.B) {
		cpuPerKey(b, b.N, func() {
			i := 0
			for k := range uint64(b.N) {
				var found bool
				if i, found = c.tab.search(benchHash(k<<1 | 1 | uint64(i)>>63)); found {
					b.Fatal("found an absent key")
				}
			}
		})
	})
}
