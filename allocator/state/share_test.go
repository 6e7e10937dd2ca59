package state

import (
	"math"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/bucket"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// shareKA is a KeyAcquire on big=x (100/s) asking for the share.
func shareKA(want int64, demand float64) *allotv1.KeyAcquire {
	k := ka("big", "x", want, 0, 0, 0)
	k.Demand, k.WantShare = demand, true
	return k
}

// sharesAt applies one batch at now in which each agent asks for the share
// reporting its demand, and returns the shares answered (NaN: none).
func sharesAt(t tb, s *State, now int64, ids map[string]uint64, demands map[string]float64, agents ...string) []float64 {
	t.Helper()
	reqs := make([]*allotv1.AcquireRequest, len(agents))
	for i, a := range agents {
		ids[a]++
		reqs[i] = &allotv1.AcquireRequest{AgentId: a, RequestId: ids[a], Keys: []*allotv1.KeyAcquire{shareKA(1, demands[a])}}
	}
	res := s.Apply(acquireCmd(now, reqs...)).(*AcquireBatchResult)
	out := make([]float64, len(agents))
	for i := range agents {
		if res.Errs[i] != nil {
			t.Fatalf("Acquire(%s): %v", agents[i], res.Errs[i])
		}
		g := res.Responses[i].GetGrants()[0]
		out[i] = math.NaN()
		if g.Share != nil {
			out[i] = g.GetShare()
		}
	}
	return out
}

// TestRateShare: the share is the max-min fair share of the rate over the
// live leases' demands, at most what the other unexpired leases' issued
// shares leave; agents reporting no demand split what remains; a lease
// no longer live does not count in the demands; a call that does not ask
// gets none.
// Each step's batch is applied twice at its instant: the first records the
// demands the second's shares are computed from.
func TestRateShare(t *testing.T) {
	s := newTestState(t)
	ids := map[string]uint64{}
	for i, tc := range []struct {
		dt      time.Duration
		demands map[string]float64
		want    map[string]float64
	}{
		{0, map[string]float64{"a": 60, "b": 60, "c": 10}, map[string]float64{"a": 45, "b": 45, "c": 10}},
		// d reports no demand: nothing remains for it.
		{100 * time.Millisecond, map[string]float64{"a": 60, "b": 60, "c": 10, "d": 0},
			map[string]float64{"a": 45, "b": 45, "c": 10, "d": 0}},
		// a, b and d report none: they split what c leaves.
		{200 * time.Millisecond, map[string]float64{"a": 0, "b": 0, "c": 10, "d": 0},
			map[string]float64{"a": 30, "b": 30, "c": 10, "d": 30}},
		// a's and b's fair shares are 45, but d's lease still counts on
		// the 30 it was issued: each is answered what the others' issued
		// shares leave (shares.go).
		{300 * time.Millisecond, map[string]float64{"a": 200, "b": 60, "c": 10},
			map[string]float64{"a": 30, "b": 30, "c": 10}},
		// d's next grant issues it 0 (nothing remains), which frees the
		// room for a's and b's.
		{400 * time.Millisecond, map[string]float64{"a": 200, "b": 60, "c": 10, "d": 0},
			map[string]float64{"a": 45, "b": 45, "c": 10, "d": 0}},
		// b's lease (TTL 10 s, renewed at 400 ms) is no longer live 3.1 s
		// later (claimLiveIntervals: 2 s): a's fair share is 90; d's, of a
		// key it reported no demand for (TTL 60 s), is live: it splits
		// nothing with a and c. But b's lease has not expired and was
		// issued 45: a is answered the 45 that leaves.
		{3500 * time.Millisecond, map[string]float64{"a": 200, "c": 10}, map[string]float64{"a": 45, "c": 10}},
		// Once b's lease has expired, a is answered its fair share.
		{10500 * time.Millisecond, map[string]float64{"a": 200, "c": 10}, map[string]float64{"a": 90, "c": 10}},
	} {
		var agents []string
		for _, a := range propAgents {
			if _, ok := tc.demands[a]; ok {
				agents = append(agents, a)
			}
		}
		sharesAt(t, s, at(tc.dt), ids, tc.demands, agents...)
		got := sharesAt(t, s, at(tc.dt), ids, tc.demands, agents...)
		for j, a := range agents {
			if got[j] != tc.want[a] {
				t.Errorf("step %d: %s's share = %v, want %v", i, a, got[j], tc.want[a])
			}
		}
	}
	// Not asked: no share.
	ids["a"]++
	g := mustAcquire(t, s, at(10600*time.Millisecond), "a", ids["a"], ka("big", "x", 1, 0, 0, 0)).GetGrants()[0]
	if g.Share != nil {
		t.Errorf("share %v answered without want_share", g.GetShare())
	}
}

// TestRateShareCompact: a key's want_share travels through a compact
// entry, and its share through the packed grants the allocator answers.
func TestRateShareCompact(t *testing.T) {
	cfg := testConfig()
	cfg.PackedGrants = true
	s := New(cfg)
	putRules(t, s, t0, testRules)
	reqs := []*allotv1.AcquireRequest{
		{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{shareKA(5, 80)}},
		{AgentId: "b", RequestId: 1, Keys: []*allotv1.KeyAcquire{shareKA(5, 80)}},
		{AgentId: "c", RequestId: 1, Keys: []*allotv1.KeyAcquire{ka("big", "x", 5, 0, 0, 0)}},
	}
	if _, err := s.ApplyCompact(compactEntry(at(0), reqs...)); err != nil {
		t.Fatal(err)
	}
	for _, r := range reqs {
		r.RequestId++
	}
	res, err := s.ApplyCompact(compactEntry(at(0), reqs...))
	if err != nil {
		t.Fatal(err)
	}
	// c (demand 5, not asking) counts: a and b split 95.
	for i, want := range []float64{47.5, 47.5, math.NaN()} {
		gs, err := allotv1.GrantsOf(res.Responses[i])
		if err != nil {
			t.Fatal(err)
		}
		switch g := gs[0]; {
		case math.IsNaN(want) && g.Share != nil:
			t.Errorf("call %d: share %v, want none", i, g.GetShare())
		case !math.IsNaN(want) && g.GetShare() != want:
			t.Errorf("call %d: share %v (set %v), want %v", i, g.GetShare(), g.Share != nil, want)
		}
	}
}

// TestRateSharesSumToAtMostRate: for any leases, the shares rateShare
// computes at one instant for every live lease sum to at most the rate,
// none is negative, and an agent reporting a demand is given at most it.
func TestRateSharesSumToAtMostRate(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		c := New(testConfig()).st
		now := at(time.Hour)
		rate := rapid.Int64Range(0, 2_000_000).Draw(t, "rate")
		n := rapid.IntRange(1, 12).Draw(t, "leases")
		leases := make([]lease, n)
		for i := range leases {
			d := float32(0)
			if rapid.Bool().Draw(t, "demanding") {
				d = roundDemand(rapid.Float64Range(0, 3000).Draw(t, "demand"))
			}
			leases[i] = lease{agent: uint32(i + 1), demand: d,
				expiry: now + int64(rapid.Int64Range(-5, 70).Draw(t, "expiry s"))*int64(time.Second)}
		}
		live := now - claimLiveIntervals*int64(c.cfg.RefreshInterval) + int64(c.cfg.LeaseTTL)
		sum := int64(0)
		for _, l := range leases {
			if l.expiry < live || l.expiry <= now {
				continue
			}
			sh := c.rateShare(leases, l.agent, l.demand, rate, now)
			if sh < 0 {
				t.Fatalf("agent %d: share %d < 0", l.agent, sh)
			}
			if m := demandMilli(float64(l.demand)); m > 0 && sh > m {
				t.Fatalf("agent %d: share %d above its demand %d", l.agent, sh, m)
			}
			sum += sh
		}
		if sum > rate {
			t.Fatalf("the live leases' shares sum to %d, over the rate %d", sum, rate)
		}
	})
}

// TestRateSharesThroughApply: after any history of calls, a batch in
// which every agent asks again at one instant, each reporting the demand
// its lease records, answers shares summing to at most R (the first batch
// at that instant makes every lease live with the demands the second
// reports).
func TestRateSharesThroughApply(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := newTestState(t)
		ids := map[string]uint64{}
		now := at(0)
		for range rapid.IntRange(0, 20).Draw(t, "calls") {
			now += int64(rapid.Int64Range(0, 3000).Draw(t, "dt ms")) * int64(time.Millisecond)
			a := rapid.SampledFrom(propAgents).Draw(t, "agent")
			ids[a]++
			k := shareKA(rapid.Int64Range(0, 30).Draw(t, "want"), float64(rapid.IntRange(0, 90).Draw(t, "demand")))
			k.WantShare = rapid.Bool().Draw(t, "ask")
			if _, err := acquire(s, now, a, ids[a], k); err != nil {
				t.Fatal(err)
			}
		}
		d := map[string]float64{}
		for _, a := range propAgents {
			d[a] = float64(rapid.IntRange(0, 90).Draw(t, "final demand"))
		}
		now += int64(time.Second)
		sharesAt(t, s, now, ids, d, propAgents...)
		sum := 0.0
		for i, sh := range sharesAt(t, s, now, ids, d, propAgents...) {
			if math.IsNaN(sh) || sh < 0 {
				t.Fatalf("%s: share %v", propAgents[i], sh)
			}
			sum += sh
		}
		if sum > 100 {
			t.Fatalf("the shares at one instant sum to %v, over R = 100", sum)
		}
	})
}

func TestRateMilli(t *testing.T) {
	for _, tc := range []struct {
		l    bucket.Limit
		want int64
	}{
		{mustLimit(t, 100, time.Second), 100_000},
		{mustLimit(t, 30, time.Minute), 500},
		{mustLimit(t, 1, time.Hour), 0}, // 0.28 milli-tokens/s rounds down
		{mustLimit(t, 7, 3*time.Second), 2333},
	} {
		if got := rateMilli(tc.l); got != tc.want {
			t.Errorf("rateMilli(%v) = %d, want %d", tc.l, got, tc.want)
		}
	}
}

func mustLimit(t *testing.T, quota int64, window time.Duration) bucket.Limit {
	t.Helper()
	l, err := bucket.NewLimit(bucket.TokenBucket, quota, window, quota)
	if err != nil {
		t.Fatal(err)
	}
	return l
}
