package allocator

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// benchBatch builds an encoded Acquire entry (a compact one, or an
// AcquireBatch Command) of reqs requests × keys keys over a keyspace of
// 100k keys, starting at request id base.
func benchBatch(compact bool, reqs, keys int, base uint64, now int64) []byte {
	ab := &allotv1.AcquireBatch{}
	n := int(base) * reqs * keys
	for r := range reqs {
		req := &allotv1.AcquireRequest{AgentId: "bench-" + strconv.Itoa(r), RequestId: base}
		for range keys {
			n = (n + 7919) % 100000
			req.Keys = append(req.Keys, &allotv1.KeyAcquire{Domain: "test",
				Entries: []*allotv1.Entry{{Key: "user", Value: strconv.Itoa(n)}}, Want: 5, Demand: 5})
		}
		ab.Requests = append(ab.Requests, req)
	}
	if compact {
		recs := make([][]byte, len(ab.Requests))
		for i, r := range ab.Requests {
			recs[i] = state.AppendAcquireRecord(nil, r)
		}
		return state.AppendAcquireEntry(nil, now, recs)
	}
	data, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Acquire{Acquire: ab}})
	return data
}

// BenchmarkFSMApplyAcquire measures one replica's cost of applying an
// Acquire entry (decode + state machine), per key, for both encodings.
func BenchmarkFSMApplyAcquire(b *testing.B) {
	for _, shape := range []struct {
		compact    bool
		reqs, keys int
	}{{true, 1, 100}, {false, 1, 100}, {true, 4, 100}, {false, 4, 100}, {true, 20, 1000}, {false, 20, 1000}} {
		enc := "protobuf"
		if shape.compact {
			enc = "compact"
		}
		b.Run(fmt.Sprintf("%s/%dx%d", enc, shape.reqs, shape.keys), func(b *testing.B) {
			st := state.New(state.DefaultConfig())
			f := &fsm{st: st}
			put, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: 1, Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
				Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(testRules)}}}}})
			f.Apply(&raft.Log{Type: raft.LogCommand, Data: put})
			const pre = 64
			entries := make([][]byte, pre)
			for i := range entries {
				entries[i] = benchBatch(shape.compact, shape.reqs, shape.keys, uint64(i+1), int64(i+2)*1e6)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if i%pre == 0 && i > 0 {
					b.StopTimer()
					// Fresh request ids past the previous round.
					for j := range entries {
						entries[j] = benchBatch(shape.compact, shape.reqs, shape.keys, uint64(i+j+1), int64(i+j+2)*1e6)
					}
					b.StartTimer()
				}
				f.Apply(&raft.Log{Type: raft.LogCommand, Data: entries[i%pre]})
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*shape.reqs*shape.keys), "ns/key")
		})
	}
}

// BenchmarkBatcherOverhead measures the batcher's own cost per call with a
// propose that answers at once.
func BenchmarkBatcherOverhead(b *testing.B) {
	fr := &fakeRaft{}
	bt := newBatcher(fr.propose, func() int64 { return 1 }, 20000, 2<<20, 1)
	bt.start()
	defer bt.close()
	req := &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "x", 1)}}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := bt.submit(context.Background(), req); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkFSMSecondOfAcquireLoad replays, in virtual time, one second of
// bench/acquire's workload per iteration on one replica: 200 Acquire
// entries of 100 keys each (16 agents walking a 100k keyspace, 20,000
// key-grants/s), with the leader's Expires in between. It reports the
// Expires' apply time per second (expire-ns/op) and the longest single
// Expire seen (expire-max-ns): while one runs, every entry behind it waits
// (docs/performance.md#reading-the-figures). It also reports the Acquire
// entries' apply time per key (acquire-ns/key), wall time on one thread.
//
//   - once-a-second: one unbounded Expire a second (the default before
//     ExpireMaxEntries), sweep included;
//   - default: the defaults, an Expire every ExpireInterval (100 ms) taking
//     at most ExpireMaxEntries due keys, the sweep once a second;
//   - random-keys: the defaults, each call's keys drawn at random from the
//     keyspace. An agent walking the keyspace in order, as bench/acquire's
//     clients do, meets the entries in the order they were first
//     allocated, which caches well until the entries move (compaction,
//     growth); keys drawn at random have no such order, as real calls do
//     not.
func BenchmarkFSMSecondOfAcquireLoad(b *testing.B) {
	def := DefaultConfig()
	b.Run("once-a-second", func(b *testing.B) {
		benchSecondOfAcquireLoad(b, time.Second, -1, time.Second, false)
	})
	b.Run("default", func(b *testing.B) {
		benchSecondOfAcquireLoad(b, def.ExpireInterval, def.ExpireMaxEntries, def.SweepInterval, false)
	})
	b.Run("random-keys", func(b *testing.B) {
		benchSecondOfAcquireLoad(b, def.ExpireInterval, def.ExpireMaxEntries, def.SweepInterval, true)
	})
}

func benchSecondOfAcquireLoad(b *testing.B, expireEvery time.Duration, maxEntries int, sweepEvery time.Duration, random bool) {
	st := state.New(state.DefaultConfig())
	f := &fsm{st: st}
	put, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: 1, Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
		Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(testRules)}}}}})
	f.Apply(&raft.Log{Type: raft.LogCommand, Data: put})
	const agents, keysPerCall, callsPerSec, keyspace = 16, 100, 200, 100000
	next := make([]int, agents)
	ids := make([]uint64, agents)
	for a := range next {
		next[a] = a * 7919 % keyspace
	}
	now := int64(1e9)
	call := 0
	rng := rand.New(rand.NewPCG(1, 2))
	entry := func() []byte {
		a := call % agents
		call++
		ids[a]++
		req := &allotv1.AcquireRequest{AgentId: "bench-" + strconv.Itoa(a), RequestId: ids[a]}
		for range keysPerCall {
			if random {
				next[a] = rng.IntN(keyspace)
			} else {
				next[a] = (next[a] + 1) % keyspace
			}
			req.Keys = append(req.Keys, &allotv1.KeyAcquire{Domain: "test",
				Entries: []*allotv1.Entry{{Key: "user", Value: strconv.Itoa(next[a])}}, Want: 5, Demand: 5})
		}
		data, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: now,
			Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{Requests: []*allotv1.AcquireRequest{req}}}})
		return data
	}
	perExpire := int(time.Second / expireEvery)
	sweepEach := max(int(sweepEvery/expireEvery), 1)
	expires := 0
	var acquire time.Duration
	second := func() (total, worst time.Duration) {
		for range perExpire {
			for range callsPerSec / perExpire {
				now += int64(time.Second / callsPerSec)
				data := entry()
				start := time.Now()
				f.Apply(&raft.Log{Type: raft.LogCommand, Data: data})
				acquire += time.Since(start)
			}
			budget, _ := expirePace(maxEntries, expireEvery, st.Stats().ExpireBacklog)
			cmd := expireCommand(st, now, budget, expires%sweepEach == 0)
			expires++
			exp, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Expire{Expire: cmd}})
			start := time.Now()
			f.Apply(&raft.Log{Type: raft.LogCommand, Data: exp})
			d := time.Since(start)
			total += d
			worst = max(worst, d)
		}
		return total, worst
	}
	// Warm up past the longest lease, so that leases expire every second.
	for range 90 {
		second()
	}
	var total, worst time.Duration
	acquire = 0
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, w := second()
		total += d
		worst = max(worst, w)
	}
	b.ReportMetric(float64(acquire.Nanoseconds())/float64(b.N*callsPerSec*keysPerCall), "acquire-ns/key")
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "expire-ns/op")
	b.ReportMetric(float64(worst.Nanoseconds()), "expire-max-ns")
	b.ReportMetric(float64(st.Stats().ExpireBacklog), "backlog-end")
}

// BenchmarkBatcherPaced drives the batcher as bench/acquire's clients do,
// in wall time: 16 callers each sending a call of -keys keys every 80 ms,
// phased 5 ms apart (200 calls/s), against a Raft that takes 3 ms to
// commit an entry, for one second per iteration. It reports the calls per
// entry and the mean queue wait, with the default fill and with none.
func BenchmarkBatcherPaced(b *testing.B) {
	def := DefaultConfig()
	for _, keys := range []int{100, 1000} {
		for _, fill := range []bool{false, true} {
			name := fmt.Sprintf("keys=%d/fill=%v", keys, fill)
			b.Run(name, func(b *testing.B) {
				var entries atomic.Int64
				propose := func([]byte) (any, error) {
					entries.Add(1)
					time.Sleep(3 * time.Millisecond)
					return nil, errors.New("bench: not applied")
				}
				bt := newBatcher(propose, func() int64 { return 1 }, def.MaxBatchKeys, def.MaxBatchBytes, def.MaxInflightBatches)
				bt.linger = def.BatchLinger
				if fill {
					bt.fillKeys, bt.fillWait = def.BatchFillKeys, def.BatchFillWait
				}
				var waited atomic.Int64
				bt.queued = func(d time.Duration) { waited.Add(int64(d)) }
				bt.start()
				defer bt.close()
				ks := make([]*allotv1.KeyAcquire, keys)
				for i := range ks {
					ks[i] = key("user", strconv.Itoa(i), 1)
				}
				const callers, every = 16, 80 * time.Millisecond
				var calls atomic.Int64
				b.ResetTimer()
				for range b.N {
					start := time.Now()
					var wg sync.WaitGroup
					for c := range callers {
						wg.Add(1)
						go func() {
							defer wg.Done()
							req := &allotv1.AcquireRequest{AgentId: "a" + strconv.Itoa(c), Keys: ks}
							for at := start.Add(time.Duration(c) * every / callers); at.Before(start.Add(time.Second)); at = at.Add(every) {
								time.Sleep(time.Until(at))
								req.RequestId++
								_, _ = bt.submit(context.Background(), req)
								calls.Add(1)
							}
						}()
					}
					wg.Wait()
				}
				b.ReportMetric(float64(calls.Load())/float64(entries.Load()), "calls/entry")
				b.ReportMetric(float64(waited.Load())/float64(calls.Load())/1e6, "queue-ms/call")
			})
		}
	}
}
