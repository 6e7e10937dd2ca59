package agent

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/allot/allot/pkg/rules"
)

// benchAgent is an agent in production clock mode (the coarse clock, no
// hook) against the fake allocator, with the refill loop stepped by hand so
// the benchmark measures checks only. Its keys get real grants of 1e9
// tokens (the "deep" rule is 1e9/s, so a lease that size is what the
// allocator grants a key with that demand).
func benchAgent(b *testing.B) *Agent {
	b.Helper()
	fake := newFake(b, func() int64 { return time.Now().UnixNano() }, testRules)
	fake.ttl = time.Hour
	srv := serveFake(b, fake)
	cfg := DefaultConfig()
	cfg.Allocators = []string{srv.addr}
	cfg.Rules = mustCompile(b, 1, testRules)
	cfg.Logger = nil
	cfg.CallTimeout = 10 * time.Second // a loaded machine must not fail the setup
	cfg.manual = true
	a, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = a.Close(ctx)
	})
	return a
}

// leaseKeys leases every descriptor (3-level, the "deep" rule).
func leaseKeys(b *testing.B, a *Agent, descs []Descriptor) {
	b.Helper()
	for _, d := range descs {
		if _, err := a.Check(context.Background(), "test", []Descriptor{d}, 1); err != nil {
			b.Fatal(err)
		}
		keyOf(b, a, d).Demand.Rate = 1e9
	}
	for range 10 { // a call that failed is retried by the next tick
		a.refillOnce(context.Background())
		if a.rf.unacked == nil {
			break
		}
	}
	for _, d := range descs {
		if ks := keyOf(b, a, d); ks.balance.Load() < 1e8 {
			b.Fatalf("key %v: balance %d, want a large lease", d.Entries, ks.balance.Load())
		}
	}
}

func deepDesc(i int) Descriptor {
	return desc("tier", "free", "route", "/v1/search", "user", fmt.Sprintf("user-%04d", i))
}

func assertLeased(b *testing.B, a *Agent, d Descriptor) {
	b.Helper()
	got, err := a.Check(context.Background(), "test", []Descriptor{d}, 1)
	if err != nil || !got.Allowed || got.Source != SourceLease {
		b.Fatalf("last check: %+v %v, want allowed from the lease", got, err)
	}
}

// BenchmarkCheckLeased: one key with a live lease (3-level descriptor),
// checked again and again, so through the request memo: identity hash,
// memo probe, shard read lock and CAS. BenchmarkCheckLeasedNoMemo is the
// same check with the rule match, key hash and table lookup done every time.
func BenchmarkCheckLeased(b *testing.B) { benchCheckLeased(b, true) }

// BenchmarkCheckLeasedNoMemo is BenchmarkCheckLeased without the request
// memo: what a check costs when the memo misses (plus the probe).
func BenchmarkCheckLeasedNoMemo(b *testing.B) { benchCheckLeased(b, false) }

func benchCheckLeased(b *testing.B, memo bool) {
	a := benchAgent(b)
	if !memo {
		a.memo = nil
	}
	d := deepDesc(0)
	leaseKeys(b, a, []Descriptor{d})
	descs := []Descriptor{d}
	ctx := context.Background()
	b.ReportAllocs()
	reportCPU(b)
	for b.Loop() {
		if _, err := a.Check(ctx, "test", descs, 1); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	assertLeased(b, a, d)
}

// BenchmarkCheckLeasedParallel: every goroutine checks its own leased keys.
func BenchmarkCheckLeasedParallel(b *testing.B) {
	a := benchAgent(b)
	const perG, maxG = 16, 64
	all := make([]Descriptor, perG*maxG)
	for i := range all {
		all[i] = deepDesc(i)
	}
	leaseKeys(b, a, all)
	var next atomic.Int64
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		g := int(next.Add(1)-1) % maxG
		mine := make([][]Descriptor, perG)
		for i := range mine {
			mine[i] = []Descriptor{all[g*perG+i]}
		}
		i := 0
		for pb.Next() {
			if _, err := a.Check(ctx, "test", mine[i%perG], 1); err != nil {
				b.Error(err)
				return
			}
			i++
		}
	})
	b.StopTimer()
	assertLeased(b, a, all[0])
}

// BenchmarkCheckLeasedParallelHotKey: every goroutine checks the same
// leased key: the balance's cache line bounces between cores.
func BenchmarkCheckLeasedParallelHotKey(b *testing.B) {
	a := benchAgent(b)
	d := deepDesc(0)
	leaseKeys(b, a, []Descriptor{d})
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		descs := []Descriptor{d}
		for pb.Next() {
			if _, err := a.Check(ctx, "test", descs, 1); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	assertLeased(b, a, d)
}

// BenchmarkCheckFallback: a key decided by its fallback bucket (per-key
// mutex), as before its first grant or while the allocator is down.
func BenchmarkCheckFallback(b *testing.B) {
	a := newAgent(b, Config{Rules: mustCompile(b, 1, testRules), Logger: nil})
	descs := []Descriptor{deepDesc(0)}
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := a.Check(ctx, "test", descs, 1); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCheckStatuses3: three descriptors with statuses (the RLS path).
func BenchmarkCheckStatuses3(b *testing.B) {
	a := benchAgent(b)
	descs := []Descriptor{deepDesc(0), deepDesc(1), deepDesc(2)}
	leaseKeys(b, a, descs)
	ctx := context.Background()
	out := make([]Status, 0, 3)
	b.ReportAllocs()
	reportCPU(b)
	for b.Loop() {
		var err error
		if _, out, err = a.CheckStatuses(ctx, "test", descs, 1, out); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkBaselineXTimeRate: golang.org/x/time/rate's Limiter.AllowN, one
// limiter, no rule match or key lookup: the floor of an in-process check.
func BenchmarkBaselineXTimeRate(b *testing.B) {
	lim := rate.NewLimiter(rate.Inf, 1)
	b.ReportAllocs()
	reportCPU(b)
	for b.Loop() {
		lim.AllowN(time.Now(), 1)
	}
}

// BenchmarkBaselineXTimeRateParallel: the same limiter shared by every
// goroutine (one mutex).
func BenchmarkBaselineXTimeRateParallel(b *testing.B) {
	lim := rate.NewLimiter(1e12, 1e12)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			lim.AllowN(time.Now(), 1)
		}
	})
}

// BenchmarkKeyHash: the agent's private key hash against rules.KeyHash
// (render the canonical key, xxhash it) for a 3-level descriptor.
func BenchmarkKeyHash(b *testing.B) {
	set := mustCompile(b, 1, testRules)
	d := deepDesc(7)
	r := set.Match("test", d.Entries)
	tab := newKeyTable()
	b.Run("agent", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			tab.keyHash(r, "test", d.Entries)
		}
	})
	b.Run("rules.KeyHash", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			rules.KeyHash(r, "test", d.Entries)
		}
	})
}
