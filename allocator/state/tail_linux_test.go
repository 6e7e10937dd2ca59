package state

import (
	"fmt"
	"runtime"
	"slices"
	"syscall"
	"testing"
	"time"
	"unsafe"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// threadCPU returns the calling thread's CPU time.
func threadCPU() time.Duration {
	var ts syscall.Timespec
	const clockThreadCPUTime = 3 // CLOCK_THREAD_CPUTIME_ID
	syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0)
	return time.Duration(ts.Nano())
}

// BenchmarkApplyFleetTail measures the tail of a replica's apply time as
// a fleet's cold keys arrive: entries of 20 calls × 100 keys, 85% of them
// first uses of keys never seen (one token charged, no lease) and the rest
// renewals of 10k leased keys, applied until the state tracks 4.5M keys
// (no Expire: the keys stay). Each entry's time is the applying thread's
// CPU time (GC assists included, the GC's own workers not), which the
// machine's load moves less than the wall clock. Each op is one such fill.
func BenchmarkApplyFleetTail(b *testing.B) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const calls, perReq, hot, target = 20, 100, 10_000, 4_500_000
	var all []time.Duration
	var total time.Duration
	for range b.N {
		cfg := testConfig()
		cfg.PackedGrants = true
		s := New(cfg)
		putRules(b, s, t0, testRules)
		ids := make([]uint64, calls)
		now := at(0)
		next, cold := 0, 0
		keys := make([]*allotv1.KeyAcquire, perReq)
		for i := range keys {
			keys[i] = &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big"}}}
		}
		recs := make([][]byte, calls)
		for cold < target {
			for a := range calls {
				ids[a]++
				fillCall(keys, true, &cold, &next, hot)
				req := &allotv1.AcquireRequest{AgentId: fmt.Sprint("agent-", a), RequestId: ids[a],
					PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
				recs[a] = AppendAcquireRecord(recs[a][:0], req)
			}
			now += int64(time.Millisecond)
			data := AppendAcquireEntry(nil, now, recs)
			c0 := threadCPU()
			if _, err := s.ApplyCompact(data); err != nil {
				b.Fatal(err)
			}
			d := threadCPU() - c0
			all = append(all, d)
			total += d
		}
	}
	slices.Sort(all)
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	b.ReportMetric(ms(all[len(all)/2]), "p50-ms")
	b.ReportMetric(ms(all[len(all)*99/100]), "p99-ms")
	b.ReportMetric(ms(all[len(all)*999/1000]), "p99.9-ms")
	b.ReportMetric(ms(all[len(all)-1]), "max-ms")
	b.ReportMetric(float64(total)/float64(len(all)*calls*perReq), "cpu-ns/key")
}

// BenchmarkApplyFleetSteady measures a replica's apply CPU per key at
// fleet shape once the table is large: entries of 2 calls × 1000 keys (as
// bench/acquire -mode fleet's entries hold), 85% of them charges of cold
// keys and the rest renewals of 10k leased keys, applied to a state that
// already tracks 4.5M keys, the cold keys revisited (as bench/acquire's
// walk over 5M keys revisits them). The table is far larger than the
// cache, so this is the cost of its misses. Each op applies 300 entries;
// the metric is the applying thread's CPU time per key.
func BenchmarkApplyFleetSteady(b *testing.B) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const calls, perReq, hot, target, batch = 2, 1000, 10_000, 4_500_000, 300
	cfg := testConfig()
	cfg.PackedGrants = true
	s := New(cfg)
	putRules(b, s, t0, testRules)
	ids := make([]uint64, calls)
	now := at(0)
	next, cold := 0, 0
	keys := make([]*allotv1.KeyAcquire, perReq)
	for i := range keys {
		keys[i] = &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big"}}}
	}
	entry := func() []byte {
		recs := make([][]byte, calls)
		for a := range calls {
			ids[a]++
			fillCall(keys, true, &cold, &next, hot)
			req := &allotv1.AcquireRequest{AgentId: fmt.Sprint("agent-", a), RequestId: ids[a],
				PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
			recs[a] = AppendAcquireRecord(nil, req)
		}
		now += int64(time.Millisecond)
		return AppendAcquireEntry(nil, now, recs)
	}
	for cold < target {
		if _, err := s.ApplyCompact(entry()); err != nil {
			b.Fatal(err)
		}
	}
	cold = 0
	ents := make([][]byte, batch)
	var total time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		for j := range ents {
			ents[j] = entry()
		}
		runtime.GC()
		b.StartTimer()
		for _, e := range ents {
			c0 := threadCPU()
			if _, err := s.ApplyCompact(e); err != nil {
				b.Fatal(err)
			}
			total += threadCPU() - c0
		}
	}
	b.ReportMetric(float64(total)/float64(b.N*batch*calls*perReq), "cpu-ns/key")
}
