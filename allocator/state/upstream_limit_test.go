package state

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// copyRules is a region's copy of a scope: global rule with the given
// rate and burst (per second).
func copyRules(rpu, burst int) string {
	return fmt.Sprintf("domain: test\nscope: global\ndescriptors:\n  - key: g\n    rate_limit: {unit: second, requests_per_unit: %d, burst: %d}\n", rpu, burst)
}

func newCopyState(t tb, rpu, burst int) *State {
	cfg := testConfig()
	cfg.Regional = true
	s := New(cfg)
	putRules(t, s, t0, copyRules(rpu, burst))
	return s
}

// globalPerSecond is a global limit of rpu a second, burst burst.
func globalPerSecond(rpu uint32, burst int64) *GlobalLimit {
	return &GlobalLimit{RequestsPerUnit: rpu, Unit: rules.UnitSecond, Burst: burst, Algorithm: bucket.TokenBucket, RulesVersion: 9}
}

// grantUp commits a send and its grant of n tokens (carrying lim, nil for
// none) for the pool h, as the regional leader does.
func grantUp(t tb, s *State, now int64, seq uint64, h uint64, n int64, lim *GlobalLimit) {
	t.Helper()
	applyUpT(t, s, AppendUpstreamSend(nil, now, seq, []byte("r"), []UpstreamReturn{{Hash: h}}))
	applyUpT(t, s, AppendUpstreamGrant(nil, now, seq, []UpstreamGrant{{Hash: h, Granted: n, Share: 1, Limit: lim}}))
}

// The global cluster's limit of a scope: global key decides in a region,
// in both directions, once a grant recorded it: a region's copy that is
// tighter does not bound what the region sub-grants (the pool does), and
// one that is looser does not widen it (the global limit's bucket does).
// Before any grant carried a limit the region's copy applies. Answers and
// InspectKey show the limit in force.
func TestRegionalGlobalLimitInForce(t *testing.T) {
	key := ka("g", "x", 0, 0, 0, 0)
	want := func(n int64) *allotv1.KeyAcquire { return ka("g", "x", n, 0, 0, 0) }
	inspect := func(s *State, now int64) *allotv1.InspectKeyResponse {
		r, err := s.InspectKey(&allotv1.InspectKeyRequest{Domain: "test", Entries: key.Entries}, now)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	t.Run("tighter copy", func(t *testing.T) {
		s := newCopyState(t, 10, 10) // the region's copy: 10/s; the global cluster's: 100/s
		mustAcquire(t, s, at(0), "gw1", 1, want(1))
		h := s.Pools(at(0))[0].Hash
		// step 1: a grant without a limit (an older global cluster): the
		// copy still bounds the sub-grants.
		grantUp(t, s, at(time.Millisecond), 1, h, 80, nil)
		g := mustAcquire(t, s, at(2*time.Millisecond), "gw1", 2, want(50)).Grants[0]
		if g.Granted > 10 || g.Limit.GetRequestsPerUnit() != 10 {
			t.Fatalf("step 1: granted %d under limit %d/s, want ≤ 10 under the copy's 10/s", g.Granted, g.Limit.GetRequestsPerUnit())
		}
		// step 2: the next grant carries the global limit: the pool decides.
		grantUp(t, s, at(3*time.Millisecond), 2, h, 100, globalPerSecond(100, 100))
		p, _ := s.PoolOf(h, at(3*time.Millisecond))
		if p.Global == nil || *p.Global != *globalPerSecond(100, 100) {
			t.Fatalf("step 2: pool's global limit %+v, want 100/s burst 100", p.Global)
		}
		g = mustAcquire(t, s, at(4*time.Millisecond), "gw2", 1, want(40)).Grants[0]
		if g.Granted != 40 || g.Limit.GetRequestsPerUnit() != 100 || g.Limit.GetBurst() != 100 {
			t.Fatalf("step 2: granted %d under %d/s burst %d, want 40 (4 × the copy's burst) under the global 100/s burst 100",
				g.Granted, g.Limit.GetRequestsPerUnit(), g.Limit.GetBurst())
		}
		if r := inspect(s, at(4*time.Millisecond)); r.GetLimit().GetRequestsPerUnit() != 100 || r.GetLimit().GetName() == "" {
			t.Fatalf("step 3: InspectKey shows %v, want the limit in force, 100/s, named as the region's rule", r.GetLimit())
		}
		// step 4: the pool still bounds: a third gateway drains it.
		for i := range 12 {
			now := at(time.Duration(5+i*200) * time.Millisecond)
			p, _ = s.PoolOf(h, now)
			g = mustAcquire(t, s, now, "gw3", uint64(i+1), want(100)).Grants[0]
			if g.Granted > p.Available {
				t.Fatalf("step 4.%d: granted %d, the pool held %d", i, g.Granted, p.Available)
			}
		}
		if p, _ = s.PoolOf(h, at(3*time.Second)); p.Available != 0 {
			t.Fatalf("step 4: the pool holds %d after 2.4 s of wants of 100, want 0", p.Available)
		}
	})

	t.Run("looser copy", func(t *testing.T) {
		s := newCopyState(t, 1000, 1000) // the region's copy: 1000/s; the global cluster's: 20/s burst 20
		mustAcquire(t, s, at(0), "gw1", 1, want(1))
		h := s.Pools(at(0))[0].Hash
		grantUp(t, s, at(time.Millisecond), 1, h, 500, globalPerSecond(20, 20))
		// The pool holds 500, but the global limit's bucket gives at most
		// its burst now and its rate after.
		var total int64
		ids := map[string]uint64{}
		for i := range 20 { // 2 s, every 100 ms, two gateways
			now := at(time.Duration(2+i*100) * time.Millisecond)
			for _, gw := range []string{"gw1", "gw2"} {
				ids[gw]++
				g := mustAcquire(t, s, now, gw, ids[gw]+1, want(200)).Grants[0]
				total += g.Granted
				if g.Limit.GetRequestsPerUnit() != 20 {
					t.Fatalf("step %d: answer's limit %v, want the global 20/s", i, g.Limit)
				}
			}
		}
		if bound := int64(20 + 20*2); total > bound || total < 20 {
			t.Fatalf("sub-granted %d in 2 s, want ≤ B + R·t = %d (the global limit), and some", total, bound)
		}
		if r := inspect(s, at(3*time.Second)); r.GetLimit().GetRequestsPerUnit() != 20 {
			t.Fatalf("InspectKey shows %v, want the global 20/s", r.GetLimit())
		}
	})
}

// What the region sub-grants of a global key, once a grant recorded the
// global cluster's limit, is at most that limit's B + R·t over any span
// from then on and at most what the pool received, whatever the region's
// copy says: random copies, global limits, grant sizes and gateway calls
// at random instants, with snapshot round trips.
func TestRegionalGlobalLimitBound(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		copyRate := rapid.IntRange(1, 200).Draw(rt, "copy rate")
		s := newCopyState(rt, copyRate, rapid.IntRange(1, 200).Draw(rt, "copy burst"))
		gRate := uint32(rapid.IntRange(1, 200).Draw(rt, "global rate"))
		gBurst := int64(rapid.IntRange(1, 200).Draw(rt, "global burst"))
		lim := globalPerSecond(gRate, gBurst)
		now := at(0)
		mustAcquire(rt, s, now, "gw0", 1, ka("g", "x", 1, 0, 0, 0))
		h := s.Pools(now)[0].Hash
		ids := map[string]uint64{"gw0": 1}
		seq := uint64(0)
		var since int64 // when the limit was recorded
		var granted, received int64
		for i := range rapid.IntRange(1, 50).Draw(rt, "steps") {
			now += int64(rapid.IntRange(0, 400).Draw(rt, "dt")) * int64(time.Millisecond)
			switch rapid.IntRange(0, 4).Draw(rt, "op") {
			case 0: // a grant, carrying the limit
				seq++
				n := int64(rapid.IntRange(0, 300).Draw(rt, "granted"))
				grantUp(rt, s, now, seq, h, n, lim)
				if since == 0 {
					since = now
				}
				received += n
			case 1: // a snapshot round trip
				cfg := testConfig()
				cfg.Regional = true
				r := New(cfg)
				if err := r.Restore(bytes.NewReader(persist(rt, s))); err != nil {
					rt.Fatalf("step %d: Restore: %v", i, err)
				}
				s = r
			default: // a gateway's call
				gw := []string{"gw0", "gw1", "gw2"}[rapid.IntRange(0, 2).Draw(rt, "gw")]
				w := int64(rapid.IntRange(1, 300).Draw(rt, "want"))
				ids[gw]++
				g := mustAcquire(rt, s, now, gw, ids[gw], ka("g", "x", w, 0, 0, 0)).Grants[0]
				if since == 0 {
					continue
				}
				granted += g.Granted
				if g.Limit.GetRequestsPerUnit() != gRate || g.Limit.GetBurst() != gBurst {
					rt.Fatalf("step %d: answer's limit %v, want the global %d/s burst %d", i, g.Limit, gRate, gBurst)
				}
			}
			if since == 0 {
				continue
			}
			span := float64(now-since) / 1e9
			if bound := float64(gBurst) + float64(gRate)*span + 1; float64(granted) > bound {
				rt.Fatalf("step %d: sub-granted %d in %.3f s since the global limit was recorded, want ≤ B + R·t = %.1f",
					i, granted, span, bound)
			}
			if granted > received {
				rt.Fatalf("step %d: sub-granted %d, the pool received %d", i, granted, received)
			}
		}
	})
}

// A version-1 grant entry (no limits) still applies, and leaves a limit
// the pool recorded in place; a state whose pools recorded a limit is
// written as snapshot version 6 and restores to the same bytes, limits
// included, while one without keeps version 5.
func TestRegionalGlobalLimitFormats(t *testing.T) {
	s := newCopyState(t, 10, 10)
	mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 1, 0, 0, 0))
	h := s.Pools(at(0))[0].Hash
	// A version-1 grant: version byte 1, no limit byte after the share.
	v1 := func(now int64, seq uint64) []byte {
		b := AppendUpstreamGrant(nil, now, seq, []UpstreamGrant{{Hash: h, Granted: 5}})
		b[1] = upstreamVersion
		return b[:len(b)-1]
	}
	applyUpT(t, s, AppendUpstreamSend(nil, at(1), 1, []byte("r"), nil))
	if !applyUp(t, s, v1(at(1), 1)) {
		t.Fatal("a version-1 grant did not apply")
	}
	if b := persist(t, s); b[len(snapMagic)] != snapVersionLedger {
		t.Fatalf("no limit recorded: version %d, want %d", b[len(snapMagic)], snapVersionLedger)
	}
	grantUp(t, s, at(2), 2, h, 5, globalPerSecond(100, 50))
	applyUpT(t, s, AppendUpstreamSend(nil, at(3), 3, []byte("r"), nil))
	if !applyUp(t, s, v1(at(3), 3)) {
		t.Fatal("a version-1 grant for send 3 did not apply")
	}
	if p, _ := s.PoolOf(h, at(3)); p.Global == nil || *p.Global != *globalPerSecond(100, 50) || p.Received != 15 {
		t.Fatalf("pool %+v, want the limit kept and 15 received", p)
	}
	r := ledgerRoundTrip(t, s, snapVersionLimits)
	if p, _ := r.PoolOf(h, at(3)); p.Global == nil || *p.Global != *globalPerSecond(100, 50) {
		t.Fatalf("restored pool's limit %+v", p.Global)
	}
	// The restored limit is in force.
	if g := mustAcquire(t, r, at(4), "gw2", 1, ka("g", "x", 12, 0, 0, 0)).Grants[0]; g.Granted != 12 || g.Limit.GetRequestsPerUnit() != 100 {
		t.Fatalf("after restore: granted %d under %v, want 12 under the global 100/s", g.Granted, g.Limit)
	}
}

// GlobalLimitOf reads a grant's Limit message; a limit it cannot apply is
// refused, and a mismatch is told from the region's copy by Same.
func TestGlobalLimitOf(t *testing.T) {
	l := &allotv1.Limit{RequestsPerUnit: 100, Unit: "second", WindowSeconds: 1, Burst: 50, Algorithm: "gcra"}
	g, ok := GlobalLimitOf(l, 4)
	if !ok || g.RequestsPerUnit != 100 || g.Unit != rules.UnitSecond || g.Burst != 50 || g.Algorithm != bucket.GCRA || g.RulesVersion != 4 {
		t.Fatalf("GlobalLimitOf = %+v, %v", g, ok)
	}
	for i, bad := range []*allotv1.Limit{nil, {Unlimited: true}, {RequestsPerUnit: 1, Unit: "fortnight", Burst: 1},
		{RequestsPerUnit: 1, Unit: "second", Burst: 1, Algorithm: "leaky"}, {RequestsPerUnit: 1, Unit: "second", Burst: 0}} {
		if _, ok := GlobalLimitOf(bad, 1); ok {
			t.Errorf("case %d: GlobalLimitOf(%v) accepted", i, bad)
		}
	}
	set, err := rules.Compile(1, []rules.File{{Name: "c.yaml", Source: []byte(copyRules(100, 50))}})
	if err != nil {
		t.Fatal(err)
	}
	r := set.Match("test", []rules.Entry{{Key: "g", Value: "x"}})
	if !globalPerSecond(100, 50).Same(r) || globalPerSecond(100, 51).Same(r) || globalPerSecond(99, 50).Same(r) {
		t.Fatal("Same does not tell the copy from the global limit")
	}
}
