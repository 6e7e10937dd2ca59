package redislimit

import (
	"fmt"
	"math/rand"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/allot/allot/pkg/bucket"
)

// The benchmarks run one workload against a redis-server they start: a Zipf
// (s = 1.1) choice among 10000 budget keys, each limited to 100/s with a
// burst of 20, at the real clock. Each reports checks/s, p50/p99 check
// latency, Redis script calls per admitted request, the admitted share and
// over-admission (tokens admitted beyond burst + rate·elapsed, plus the
// hold for batched mode, summed over keys).
//
//	go test -run '^$' -bench Redis -benchtime 2s ./pkg/redislimit/

const (
	benchKeys  = 10_000
	benchRate  = 100
	benchBurst = 20
)

type benchMode struct {
	shards  int
	batched bool
}

func benchRedis(b *testing.B, m benchMode) {
	for _, par := range []int{0, 32} {
		name := "seq"
		if par > 0 {
			name = fmt.Sprintf("parallel%d", par*2)
		}
		b.Run(name, func(b *testing.B) { benchRedisRun(b, m, par) })
	}
}

func benchRedisRun(b *testing.B, m benchMode, par int) {
	srv := startRedis(b)
	// A generous timeout and breaker: this machine is shared, and a stalled
	// scheduler must not turn the run into a breaker test.
	be := newTestBackend(b, func(c *Config) {
		c.PoolSize = 128
		c.Timeout = 5 * time.Second
		c.BreakerFailures = 1000
	}, srv.addr())
	lim := mustLimit(b, bucket.TokenBucket, benchRate, time.Second, benchBurst)
	keys := make([]string, benchKeys)
	for i := range keys {
		keys[i] = fmt.Sprintf("bench:user=%d", i)
	}
	var bt *Batcher
	if m.batched {
		var err error
		if bt, err = NewBatcher(be, DefaultBatchConfig()); err != nil {
			b.Fatal(err)
		}
		defer bt.Close(bg)
	}
	admitted := make([]atomic.Int64, benchKeys)
	var total, errs atomic.Int64
	var firstErr atomic.Pointer[error]
	var mu sync.Mutex
	hist := hdrhistogram.New(1, int64(time.Second), 3)
	var seed atomic.Int64

	worker := func(next func() bool) {
		r := rand.New(rand.NewSource(seed.Add(1)))
		z := rand.NewZipf(r, 1.1, 1, benchKeys-1)
		h := hdrhistogram.New(1, int64(time.Second), 3)
		for next() {
			k := z.Uint64()
			start := time.Now()
			var res bucket.Result
			var err error
			if bt != nil {
				res, err = bt.AllowNAt(bg, keys[k], lim, m.shards, start.UnixNano(), 1)
			} else {
				res, err = be.AllowNAt(bg, keys[k], lim, m.shards, start.UnixNano(), 1)
			}
			_ = h.RecordValue(int64(time.Since(start)))
			if err != nil {
				if errs.Add(1) == 1 {
					firstErr.Store(&err)
				}
				continue
			}
			if res.Allowed {
				admitted[k].Add(1)
				total.Add(1)
			}
		}
		mu.Lock()
		hist.Merge(h)
		mu.Unlock()
	}

	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	if par == 0 {
		i := 0
		worker(func() bool { i++; return i <= b.N })
	} else {
		b.SetParallelism(par)
		b.RunParallel(func(pb *testing.PB) { worker(pb.Next) })
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if n := errs.Load(); n*100 > int64(b.N) {
		b.Fatalf("%d errors in %d checks, the first: %v", n, b.N, *firstErr.Load())
	}
	hold := time.Duration(0)
	if m.batched {
		hold = DefaultBatchConfig().Hold
	}
	bound := int64(benchBurst) + int64(float64(benchRate)*(elapsed+hold).Seconds())
	var over int64
	for i := range admitted {
		over += max(admitted[i].Load()-bound, 0)
	}
	calls := float64(be.Stats().Calls)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "checks/s")
	b.ReportMetric(float64(hist.ValueAtQuantile(50))/1e3, "p50-µs")
	b.ReportMetric(float64(hist.ValueAtQuantile(99))/1e3, "p99-µs")
	b.ReportMetric(calls/float64(max(total.Load(), 1)), "calls/admitted")
	b.ReportMetric(calls/float64(b.N), "calls/check")
	b.ReportMetric(100*float64(total.Load())/float64(b.N), "admitted-%")
	b.ReportMetric(float64(over), "over-admitted")
	b.ReportMetric(float64(errs.Load()), "errors")
}

// BenchmarkRedisEval: one EVALSHA per check (the canonical design).
func BenchmarkRedisEval(b *testing.B) { benchRedis(b, benchMode{shards: 1}) }

// BenchmarkRedisSharded: every key split into 4 sub-keys (one call per
// check, a second when the first sub-key is empty).
func BenchmarkRedisSharded(b *testing.B) { benchRedis(b, benchMode{shards: 4}) }

// BenchmarkRedisBatched: batched mode (Batcher with DefaultBatchConfig).
func BenchmarkRedisBatched(b *testing.B) { benchRedis(b, benchMode{shards: 1, batched: true}) }
