package state

import (
	"bytes"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/allot/allot/internal/proccpu"
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
// table) plus the expiry wheel check.
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

// BenchmarkExpireDue measures an Expire that ends 1000 leases (1000 keys
// leased by one agent one lease TTL earlier), over 100k other leased keys
// whose leases are far from due.
func BenchmarkExpireDue(b *testing.B) {
	cfg := DefaultConfig()
	cfg.LeaseTTL, cfg.MaxLeaseTTL, cfg.AgentTTL = time.Second, 24*time.Hour, 48*time.Hour
	s := New(cfg)
	putRules(b, s, t0, testRules)
	keys := make([]*allotv1.KeyAcquire, 1000)
	for i := range 100 { // background: no demand reported, so 24 h leases
		for k := range keys {
			keys[k] = &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: fmt.Sprint("bg-", i, "-", k)}}, Want: 1}
		}
		mustAcquire(b, s, at(0), fmt.Sprint("bg-", i%10), uint64(i/10+1), keys...)
	}
	now := at(0)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		b.StopTimer()
		for k := range keys {
			keys[k] = &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: fmt.Sprint("due-", i, "-", k)}},
				Want: 1, Demand: 1000} // busy: LeaseTTL
		}
		now += int64(time.Millisecond)
		g := mustAcquire(b, s, now, "due", uint64(i+1), keys...).Grants[0]
		// Expiries are kept to the expiry unit (11 ms with 24 h leases),
		// rounded up.
		now += int64(time.Duration(g.LeaseTtlMs)*time.Millisecond) + s.st.codec.unit
		b.StartTimer()
		expire(s, now)
		b.StopTimer()
		if st := s.Stats(); st.Leases != 100_000 {
			b.Fatalf("%d leases after Expire, want the 100000 background ones", st.Leases)
		}
		b.StartTimer()
	}
}

// BenchmarkExpireBudgeted measures a budgeted Expire (4096 keys, the
// allocator's default) working off a second in which 200,000 leased keys
// fall due, as at 200k key-grants/s: each op ends the leases of 4096 keys
// or more, whole wheel units of ~3,100 keys (a second's 64 hash
// prefixes), so about 6,250; keys/op is the keys it ends.
func BenchmarkExpireBudgeted(b *testing.B) {
	s := newTestState(b)
	const nKeys, batch = 200_000, 1000
	keys := make([][]*allotv1.KeyAcquire, nKeys/batch)
	for i := range keys {
		for k := range batch {
			keys[i] = append(keys[i], &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: fmt.Sprint("k-", i, "-", k)}},
				Want: 1, Demand: 1000}) // busy: LeaseTTL
		}
	}
	now, id := at(0), uint64(0)
	fill := func() {
		for _, ks := range keys {
			id++
			mustAcquire(b, s, now, "a", id, ks...)
		}
		now += int64(s.cfg.LeaseTTL) + int64(1500*time.Millisecond)
	}
	fill()
	b.ReportAllocs()
	b.ResetTimer()
	ended := uint64(0)
	for range b.N {
		before := s.Stats().Leases
		if before == 0 {
			b.StopTimer()
			now += int64(time.Second)
			fill()
			before = s.Stats().Leases
			b.StartTimer()
		}
		s.Apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{MaxEntries: 4096, SkipSweep: true}}})
		ended += before - s.Stats().Leases
	}
	b.ReportMetric(float64(ended)/float64(b.N), "keys/op")
}

// BenchmarkApplyCompactEntry measures a replica applying compact entries
// as the allocator commits them, with the allocator's state configuration
// (grants packed): each op is one entry of 10 calls × 100 packed keys.
// grants: every key a lease renewal over 100k leased keys; fleet: 85% of
// the keys first uses of keys never seen (one token charged, no lease) and
// the rest renewals, as bench/acquire -mode fleet sends them; shared:
// every key a lease renewal, over 10k keys each leased by all ten agents
// (bench/acquire's 16 clients each renew every key of its key space, so
// its keys carry a dozen leases or more); adds: every key a lease added,
// as in bench/acquire's first seconds, when its clients reach each key for
// the first time: the keys (b.N×100 of them, at least 100k) are tracked
// beforehand without a lease, and each agent passes each key once,
// starting a tenth of the keys after the agent before it, so a key gains
// its leases one by one up to ten. allocs/op
// divided by 1000 is the allocations per key; cpu-ns/key is the process's
// CPU time (GC included) over the applies, which moves less with the
// machine's load than the wall clock does.
func BenchmarkApplyCompactEntry(b *testing.B) {
	for _, mode := range []string{"grants", "fleet", "shared", "adds"} {
		b.Run(mode, func(b *testing.B) {
			cfg := testConfig()
			cfg.PackedGrants = true
			s := New(cfg)
			putRules(b, s, t0, testRules)
			const agents, perReq = 10, 100
			hot, warm := 100_000, 100_000/(agents*perReq)
			switch mode {
			case "shared":
				hot, warm = 10_000, 10_000/perReq
			case "adds":
				hot = max(100_000, b.N*perReq)
				hot += -hot % (agents * perReq)
				warm = 0
			}
			ids := make([]uint64, agents)
			now := at(0)
			next, cold, turn := 0, 0, 0
			keys := make([]*allotv1.KeyAcquire, perReq)
			for i := range keys {
				keys[i] = &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big"}}}
			}
			recs := make([][]byte, agents)
			entry := func(fleet bool) []byte {
				for a := range agents {
					ids[a]++
					switch mode {
					case "shared":
						// Every agent renews the entry's keys.
						next = turn * perReq % hot
					case "adds":
						next = a*(hot/agents) + turn*perReq
					}
					fillCall(keys, fleet, &cold, &next, hot)
					req := &allotv1.AcquireRequest{AgentId: fmt.Sprint("agent-", a), RequestId: ids[a],
						PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
					recs[a] = AppendAcquireRecord(recs[a][:0], req)
				}
				now += int64(10 * time.Millisecond)
				turn++
				return AppendAcquireEntry(nil, now, recs)
			}
			for range warm {
				if _, err := s.ApplyCompact(entry(false)); err != nil {
					b.Fatal(err)
				}
			}
			if mode == "adds" {
				trackKeys(b, s, hot, now)
			}
			b.ReportAllocs()
			b.ResetTimer()
			var cpu time.Duration
			for range b.N {
				b.StopTimer()
				data := entry(mode == "fleet")
				c0, _ := proccpu.Self()
				b.StartTimer()
				if _, err := s.ApplyCompact(data); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				c1, _ := proccpu.Self()
				cpu += c1 - c0
				b.StartTimer()
			}
			if st := s.Stats(); mode == "adds" && st.Leases != uint64(b.N*agents*perReq) {
				b.Fatalf("%d leases after %d entries of adds, want one a key-grant", st.Leases, b.N)
			}
			n := float64(b.N * agents * perReq)
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/n, "ns/key")
			b.ReportMetric(float64(cpu.Nanoseconds())/n, "cpu-ns/key")
		})
	}
}

// BenchmarkValidatePacked measures ValidateAcquire on a call of 1000
// packed keys as bench/acquire sends them (domain "bench", one entry
// user=i; grants: want and demand 5; fleet: 85% of the keys one token
// charged, the rest want 5, held 2, charged 3, demand 5). cpu-ns/key is
// the process's CPU time over the validations per key.
func BenchmarkValidatePacked(b *testing.B) {
	for _, mode := range []string{"grants", "fleet"} {
		b.Run(mode, func(b *testing.B) {
			keys := make([]*allotv1.KeyAcquire, 1000)
			for i := range keys {
				keys[i] = &allotv1.KeyAcquire{Domain: "bench", Entries: []*allotv1.Entry{{Key: "user", Value: fmt.Sprint(100_000 + i)}},
					Want: 5, Demand: 5}
				if mode == "fleet" {
					keys[i].Held, keys[i].Charged = 2, 3
					if i < 850 {
						keys[i] = &allotv1.KeyAcquire{Domain: "bench", Entries: []*allotv1.Entry{{Key: "user", Value: fmt.Sprint(1_000_000 + i)}},
							Charged: 1}
					}
				}
			}
			req := &allotv1.AcquireRequest{AgentId: "agent-0", RequestId: 1, PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
			b.ReportAllocs()
			c0, _ := proccpu.Self()
			for b.Loop() {
				if err := ValidateAcquire(req); err != nil {
					b.Fatal(err)
				}
			}
			c1, _ := proccpu.Self()
			n := float64(b.N * len(keys))
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/n, "ns/key")
			b.ReportMetric(float64((c1-c0).Nanoseconds())/n, "cpu-ns/key")
		})
	}
}

// fillCall sets keys for one call: with fleet, the first 85% are charges
// of 1 on new cold keys (numbered on from *cold); the rest, or all
// without fleet, renewals of the hot keys from *next on (mod hot).
func fillCall(keys []*allotv1.KeyAcquire, fleet bool, cold, next *int, hot int) {
	for k, ka := range keys {
		if fleet && k < len(keys)*85/100 {
			*cold++
			ka.Entries[0].Value = fmt.Sprintf("cold-%010d", *cold)
			ka.Want, ka.Held, ka.Demand, ka.Charged = 0, 0, 0, 1
			continue
		}
		ka.Entries[0].Value = fmt.Sprintf("user-%010d", *next%hot)
		ka.Want, ka.Held, ka.Demand, ka.Charged = 5, 1, 5, 0
		*next++
	}
}

// trackKeys tracks the keys "user-0000000000" to hot-1 of fillCall, each
// charged one token and leased by nobody, by an agent of its own.
func trackKeys(b *testing.B, s *State, hot int, now int64) {
	keys := make([]*allotv1.KeyAcquire, 0, 1000)
	for i, id := 0, uint64(1); i < hot; id++ {
		keys = keys[:0]
		for ; len(keys) < cap(keys) && i < hot; i++ {
			keys = append(keys, &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: fmt.Sprintf("user-%010d", i)}},
				Charged: 1})
		}
		req := &allotv1.AcquireRequest{AgentId: "tracker", RequestId: id, PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
		if _, err := s.ApplyCompact(AppendAcquireEntry(nil, now, [][]byte{AppendAcquireRecord(nil, req)})); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRulesUpdateStatic measures the apply of a rules update at 1M
// tracked keys (10% leased, the rest charged and not idle), with static
// shares off, on, and on with a new key before each update under a rule
// that is not eligible (a fixed window), so not hot: then every tracked
// key that is not idle is looked up in the hot-key set (hotAllTracked), on
// the apply path; with every tracked key hot there is nothing to look up.
func BenchmarkRulesUpdateStatic(b *testing.B) {
	for _, mode := range []string{"off", "on", "on-one-cold"} {
		b.Run("static="+mode, func(b *testing.B) {
			s := newTestState(b)
			fillKeys(b, s, 1_000_000, 10)
			if mode != "off" {
				setStatic(b, s, at(0), 16, staticTTL)
			}
			now := at(time.Millisecond)
			b.ResetTimer()
			for i := range b.N {
				now += int64(time.Millisecond)
				if mode == "on-one-cold" {
					b.StopTimer()
					mustAcquire(b, s, now, "cold", uint64(i+1), ka("fw", fmt.Sprint("x", i), 1, 0, 0, 0))
					b.StartTimer()
				}
				yaml := testRules
				if i%2 == 0 {
					yaml = testRulesAlt
				}
				putRules(b, s, now, yaml)
			}
		})
	}
}
