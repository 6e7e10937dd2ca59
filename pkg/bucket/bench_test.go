package bucket

import (
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// The single-key allow loop, ours and golang.org/x/time/rate's, with the same
// parameters (100/s, burst 100) and time advancing 1ms per call, so about one
// call in ten is allowed once the burst is spent.
const (
	benchRate  = 100
	benchBurst = 100
	benchStep  = int64(time.Millisecond)
)

// BenchmarkTokenBucket is Limit.AllowN on a State: what the agent and the
// allocator call, under their own locks.
func BenchmarkTokenBucket(b *testing.B) {
	l := mustLimit(b, TokenBucket, benchRate, time.Second, benchBurst)
	var st State
	now := base
	allowed := 0
	b.ReportAllocs()
	for b.Loop() {
		now += benchStep
		if l.AllowN(&st, now, 1).Allowed {
			allowed++
		}
	}
	b.ReportMetric(float64(allowed)/float64(b.N), "allowed/op")
}

// BenchmarkXTimeRate is the baseline: x/time/rate's Limiter.AllowN(t, 1).
func BenchmarkXTimeRate(b *testing.B) {
	lim := rate.NewLimiter(benchRate, benchBurst)
	t0 := time.Unix(0, base)
	now := int64(0)
	allowed := 0
	b.ReportAllocs()
	for b.Loop() {
		now += benchStep
		if lim.AllowN(t0.Add(time.Duration(now)), 1) {
			allowed++
		}
	}
	b.ReportMetric(float64(allowed)/float64(b.N), "allowed/op")
}

// BenchmarkLimiter is our mutex wrapper, the fair comparison with
// x/time/rate (which also takes a mutex per call).
func BenchmarkLimiter(b *testing.B) {
	lim := NewLimiter(mustLimit(b, TokenBucket, benchRate, time.Second, benchBurst))
	t0 := time.Unix(0, base)
	now := int64(0)
	allowed := 0
	b.ReportAllocs()
	for b.Loop() {
		now += benchStep
		if lim.AllowN(t0.Add(time.Duration(now)), 1).Allowed {
			allowed++
		}
	}
	b.ReportMetric(float64(allowed)/float64(b.N), "allowed/op")
}

// The parallel variants share one limiter between goroutines; the clock is a
// shared atomic advancing 1ms per call, so instants arrive slightly out of
// order, as they do in a real server.
func BenchmarkLimiterParallel(b *testing.B) {
	lim := NewLimiter(mustLimit(b, TokenBucket, benchRate, time.Second, benchBurst))
	t0 := time.Unix(0, base)
	var clock atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			lim.AllowN(t0.Add(time.Duration(clock.Add(benchStep))), 1)
		}
	})
}

func BenchmarkXTimeRateParallel(b *testing.B) {
	lim := rate.NewLimiter(benchRate, benchBurst)
	t0 := time.Unix(0, base)
	var clock atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			lim.AllowN(t0.Add(time.Duration(clock.Add(benchStep))), 1)
		}
	})
}

// BenchmarkAlgorithms runs the allow loop for each algorithm, with an integer
// (10ms) and a fractional (3/s: 333,333,333⅓ ns) refill period.
func BenchmarkAlgorithms(b *testing.B) {
	for alg := TokenBucket; alg <= FixedWindow; alg++ {
		for _, quota := range []int64{benchRate, 3} {
			l := mustLimit(b, alg, quota, time.Second, quota)
			name := alg.String() + "/" + map[int64]string{benchRate: "100_per_s", 3: "3_per_s"}[quota]
			b.Run(name, func(b *testing.B) {
				var st State
				now := base
				b.ReportAllocs()
				for b.Loop() {
					now += benchStep
					l.AllowN(&st, now, 1)
				}
			})
		}
	}
}

// BenchmarkLeaseOps is the allocator's per-key work for one Acquire:
// GiveBack, Debit, TakeUpTo.
func BenchmarkLeaseOps(b *testing.B) {
	for alg := TokenBucket; alg <= FixedWindow; alg++ {
		l := mustLimit(b, alg, 1000, time.Second, 1000)
		b.Run(alg.String(), func(b *testing.B) {
			var st State
			now := base
			b.ReportAllocs()
			for b.Loop() {
				now += benchStep
				l.GiveBack(&st, now, 3)
				l.Debit(&st, now, 2)
				l.TakeUpTo(&st, now, 5)
			}
		})
	}
}
