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
		s := newFleetState(b)
		f := newFleetFeed(calls, perReq, hot)
		for f.cold < target {
			data := f.entry()
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
	s := newFleetState(b)
	f := newFleetFeed(calls, perReq, hot)
	for f.cold < target {
		if _, err := s.ApplyCompact(f.entry()); err != nil {
			b.Fatal(err)
		}
	}
	f.cold = 0
	ents := make([][]byte, batch)
	var total time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		for j := range ents {
			ents[j] = f.entry()
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

// newFleetState returns a state with the test rules and packed grants,
// for the fleet-shape benchmarks.
func newFleetState(b *testing.B) *State {
	cfg := testConfig()
	cfg.PackedGrants = true
	s := New(cfg)
	putRules(b, s, t0, testRules)
	return s
}

// fleetFeed makes compact Acquire entries of fleet shape (fillCall's
// keys), one call from each of its agents an entry, a millisecond apart.
type fleetFeed struct {
	hot        int
	next, cold int
	now        int64
	ids        []uint64
	keys       []*allotv1.KeyAcquire
	recs       [][]byte
}

func newFleetFeed(calls, perReq, hot int) *fleetFeed {
	f := &fleetFeed{hot: hot, now: at(0), ids: make([]uint64, calls),
		keys: make([]*allotv1.KeyAcquire, perReq), recs: make([][]byte, calls)}
	for i := range f.keys {
		f.keys[i] = &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big"}}}
	}
	return f
}

// entry returns the next entry (a fresh slice: the caller may keep it).
func (f *fleetFeed) entry() []byte {
	for a := range f.ids {
		f.ids[a]++
		fillCall(f.keys, true, &f.cold, &f.next, f.hot)
		req := &allotv1.AcquireRequest{AgentId: fmt.Sprint("agent-", a), RequestId: f.ids[a],
			PackedKeys: allotv1.AppendPackedKeys(nil, f.keys)}
		f.recs[a] = AppendAcquireRecord(f.recs[a][:0], req)
	}
	f.now += int64(time.Millisecond)
	return AppendAcquireEntry(nil, f.now, f.recs)
}
