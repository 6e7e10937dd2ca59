package allocator

import (
	"context"
	"fmt"
	"strconv"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/internal/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// benchBatch builds an encoded AcquireBatch of reqs requests × keys keys
// over a keyspace of 100k keys, starting at request id base.
func benchBatch(reqs, keys int, base uint64, now int64) []byte {
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
	data, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Acquire{Acquire: ab}})
	return data
}

// BenchmarkFSMApplyAcquire measures one replica's cost of applying an
// Acquire entry (decode + state machine), per key.
func BenchmarkFSMApplyAcquire(b *testing.B) {
	for _, shape := range []struct{ reqs, keys int }{{1, 100}, {4, 100}, {20, 1000}} {
		b.Run(fmt.Sprintf("%dx%d", shape.reqs, shape.keys), func(b *testing.B) {
			st := state.New(state.DefaultConfig())
			f := &fsm{st: st}
			put, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: 1, Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
				Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(testRules)}}}}})
			f.Apply(&raft.Log{Type: raft.LogCommand, Data: put})
			const pre = 64
			entries := make([][]byte, pre)
			for i := range entries {
				entries[i] = benchBatch(shape.reqs, shape.keys, uint64(i+1), int64(i+2)*1e6)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if i%pre == 0 && i > 0 {
					b.StopTimer()
					// Fresh request ids past the previous round.
					for j := range entries {
						entries[j] = benchBatch(shape.reqs, shape.keys, uint64(i+j+1), int64(i+j+2)*1e6)
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
