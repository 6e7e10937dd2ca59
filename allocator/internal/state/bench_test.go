package state

import (
	"bytes"
	"fmt"
	"io"
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// BenchmarkApplyAcquire measures key-grants per second through Apply: each
// op is one AcquireBatch of 10 agents × 100 keys (1000 key-grants, as the
// batcher would commit), over a working set of 100k leased keys whose
// agents keep renewing. key-grants/s = 1000 / (ns/op) × 1e9.
func BenchmarkApplyAcquire(b *testing.B) {
	s := newTestState(b)
	const agents, perReq, keySpace = 10, 100, 100_000
	names := make([][]*allotv1.Entry, keySpace)
	for i := range names {
		names[i] = []*allotv1.Entry{{Key: "big", Value: fmt.Sprintf("user-%010d", i)}}
	}
	ids := make([]uint64, agents)
	now := at(0)
	next := 0
	batch := func() *allotv1.Command {
		reqs := make([]*allotv1.AcquireRequest, agents)
		for a := range agents {
			ids[a]++
			req := &allotv1.AcquireRequest{AgentId: fmt.Sprint("agent-", a), RequestId: ids[a], Keys: make([]*allotv1.KeyAcquire, perReq)}
			for k := range perReq {
				req.Keys[k] = &allotv1.KeyAcquire{Domain: "test", Entries: names[next%keySpace], Want: 5, Held: 1, Demand: 5}
				next++
			}
			reqs[a] = req
		}
		now += int64(10 * time.Millisecond)
		return acquireCmd(now, reqs...)
	}
	for range keySpace / (agents * perReq) {
		s.Apply(batch())
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		cmd := batch()
		b.StartTimer()
		s.Apply(cmd)
	}
	b.ReportMetric(float64(agents*perReq)*float64(b.N)/b.Elapsed().Seconds(), "key-grants/s")
}

// BenchmarkSnapshotCapture measures Snapshot (the part under the lock) at
// 1M tracked keys, 10% of them leased, and Persist's throughput.
func BenchmarkSnapshotCapture(b *testing.B) {
	s := newTestState(b)
	fillKeys(b, s, 1_000_000, 10)
	b.Run("capture", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			snap, _ := s.Snapshot()
			snap.Release()
		}
	})
	b.Run("persist", func(b *testing.B) {
		b.ReportAllocs()
		var n int64
		for range b.N {
			snap, _ := s.Snapshot()
			cw := &countWriter{}
			if err := snap.Persist(cw); err != nil {
				b.Fatal(err)
			}
			n = cw.n
			snap.Release()
		}
		b.SetBytes(n)
	})
	b.Run("restore", func(b *testing.B) {
		var buf bytes.Buffer
		snap, _ := s.Snapshot()
		if err := snap.Persist(&buf); err != nil {
			b.Fatal(err)
		}
		snap.Release()
		b.SetBytes(int64(buf.Len()))
		b.ReportAllocs()
		for range b.N {
			r := New(testConfig())
			if err := r.Restore(bytes.NewReader(buf.Bytes())); err != nil {
				b.Fatal(err)
			}
		}
	})
}

type countWriter struct{ n int64 }

func (w *countWriter) Write(p []byte) (int, error) { w.n += int64(len(p)); return len(p), nil }

var _ io.Writer = (*countWriter)(nil)

// BenchmarkExpire measures one Expire at 1M tracked keys (10% leased, the
// leases renewed and not yet due): the sweep of one segment (1/64 of the
// table) plus the expiry heap check.
func BenchmarkExpire(b *testing.B) {
	cfg := testConfig()
	cfg.SweepSegments = 64
	s := New(cfg)
	putRules(b, s, t0, testRules)
	fillKeys(b, s, 1_000_000, 10)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		expire(s, at(time.Duration(i)*time.Microsecond))
	}
}
