package state

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// memKeys is the key count of TestMemoryPerKey: 500k, or ALLOT_MEMKEYS.
func memKeys(t *testing.T) int {
	if v := os.Getenv("ALLOT_MEMKEYS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1000 {
			t.Fatalf("ALLOT_MEMKEYS=%q: want an integer ≥ 1000", v)
		}
		return n
	}
	if testing.Short() {
		return 100_000
	}
	return 500_000
}

// fillKeys tracks n keys of ~24-byte canonical form ("test:big=" + 15
// bytes) through Apply, 1000 keys per Acquire from 10 agents. Every
// leaseEvery-th key is leased (want 1); the others are charged 1 token, so
// they are tracked (not full) without a lease. leaseEvery 0 leases none.
func fillKeys(t testing.TB, s *State, n, leaseEvery int) {
	fillKeysN(t, s, n, leaseEvery, 1)
}

// fillKeysN is fillKeys with perKey agents leasing each leased key: each
// batch of 1000 keys is sent by perKey different agents in turn.
func fillKeysN(t testing.TB, s *State, n, leaseEvery, perKey int) {
	ids := map[string]uint64{}
	keys := make([]*allotv1.KeyAcquire, 0, 1000)
	for i := 0; i < n; {
		keys = keys[:0]
		first := i
		for j := 0; j < 1000 && i < n; j, i = j+1, i+1 {
			k := &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: fmt.Sprintf("user-%010d", i)}}}
			if leaseEvery > 0 && i%leaseEvery == 0 {
				k.Want, k.Demand = 1, 0.1
			} else {
				k.Charged = 1
			}
			keys = append(keys, k)
		}
		for a := range perKey {
			agent := fmt.Sprint("agent-", (first/1000+a*3)%10)
			ids[agent]++
			res := s.Apply(acquireCmd(at(0), &allotv1.AcquireRequest{AgentId: agent, RequestId: ids[agent], Keys: keys})).(*AcquireBatchResult)
			if res.Errs[0] != nil {
				t.Fatalf("fill: %v", res.Errs[0])
			}
		}
	}
}

func heapInUse() uint64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestMemoryPerKey measures the heap the state uses per tracked key
// (runtime.MemStats.HeapAlloc after GC, minus the empty state's), with no
// leases, with 10% of keys leased, with every key leased (the long tail:
// an agent that saw a key leases it) and with every key leased by two
// agents. It asserts ≤ 100 B/key for the first three; set
// ALLOT_MEMKEYS=5000000 for the 5M figures.
func TestMemoryPerKey(t *testing.T) {
	n := memKeys(t)
	for _, tc := range []struct {
		name       string
		leaseEvery int
		perKey     int
		limit      float64 // 0: report only
	}{
		{"no leases", 0, 1, 100},
		{"10% leased", 10, 1, 100},
		{"all leased", 1, 1, 100},
		{"all leased by 2 agents", 1, 2, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestState(t)
			base := heapInUse()
			fillKeysN(t, s, n, tc.leaseEvery, tc.perKey)
			used := heapInUse() - base
			st := s.Stats()
			if st.Keys != uint64(n) {
				t.Fatalf("tracked %d keys, want %d", st.Keys, n)
			}
			if want := uint64(0); tc.leaseEvery > 0 {
				want = uint64((n + tc.leaseEvery - 1) / tc.leaseEvery * tc.perKey)
				if st.Leases != want {
					t.Fatalf("%d leases, want %d", st.Leases, want)
				}
			}
			per := float64(used) / float64(n)
			t.Logf("%d keys, %s: %.1f B/key (table capacity %d, %d leases, arena %d B live + %d B free)",
				n, tc.name, per, s.st.tab.capa, st.Leases, s.st.ar.live, s.st.ar.idle)
			if tc.limit > 0 && per > tc.limit {
				t.Errorf("%.1f B/key, want ≤ %.0f", per, tc.limit)
			}
			runtime.KeepAlive(s)
		})
	}
}
