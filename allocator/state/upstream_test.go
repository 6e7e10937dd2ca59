package state

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const globalRules = `domain: test
scope: global
descriptors:
  - key: g
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
  - key: r
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100, scope: regional}
`

func newRegionalState(t *testing.T) *State {
	t.Helper()
	cfg := testConfig()
	cfg.Regional = true
	s := New(cfg)
	putRules(t, s, t0, globalRules)
	return s
}

func applyUp(t *testing.T, s *State, data []byte) bool {
	t.Helper()
	res, err := s.ApplyUpstream(data)
	if err != nil {
		t.Fatalf("ApplyUpstream: %v", err)
	}
	return res.Applied
}

// A regional cluster sub-grants a global key only from what it holds: a
// gateway gets nothing before a grant, at most the pool after one, and a
// return goes back to the pool. A regional key is untouched.
func TestRegionalPoolBoundsSubGrants(t *testing.T) {
	s := newRegionalState(t)
	g := mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 50, 0, 0, 0)).Grants[0]
	if g.Granted != 0 {
		t.Fatalf("step 1: granted %d from an empty pool, want 0", g.Granted)
	}
	if g.RefreshAfterMs > poolRefresh.Milliseconds() {
		t.Fatalf("step 1: refresh after %d ms, want ≤ %v", g.RefreshAfterMs, poolRefresh)
	}
	if r := mustAcquire(t, s, at(0), "gw1", 2, ka("r", "x", 50, 0, 0, 0)).Grants[0]; r.Granted != 50 {
		t.Fatalf("step 2: regional key granted %d, want 50", r.Granted)
	}
	pools := s.Pools(at(0))
	if len(pools) != 1 || pools[0].Key != string(rules.AppendKey(nil, s.Rules().Match("test", []rules.Entry{{Key: "g", Value: "x"}}), "test", []rules.Entry{{Key: "g", Value: "x"}})) {
		t.Fatalf("step 3: pools %+v, want one for g=x", pools)
	}
	h := pools[0].Hash
	if pools[0].Demand != 50 {
		t.Fatalf("step 3: demand %v, want 50", pools[0].Demand)
	}
	seq, req := s.PendingUpstream()
	if seq != 0 || req != nil {
		t.Fatalf("step 4: pending %d %q, want none", seq, req)
	}
	if !applyUp(t, s, AppendUpstreamSend(nil, at(time.Millisecond), 1, []byte("call-1"), []UpstreamReturn{{Hash: h}})) {
		t.Fatal("step 5: send not applied")
	}
	// A grant answering another call changes nothing.
	if applyUp(t, s, AppendUpstreamGrant(nil, at(2*time.Millisecond), 2, []UpstreamGrant{{Hash: h, Granted: 30}})) {
		t.Fatal("step 6: a grant for call 2 applied while call 1 is pending")
	}
	if seq, req := s.PendingUpstream(); seq != 1 || string(req) != "call-1" {
		t.Fatalf("step 7: pending %d %q, want 1 call-1", seq, req)
	}
	if !applyUp(t, s, AppendUpstreamGrant(nil, at(3*time.Millisecond), 1, []UpstreamGrant{{Hash: h, Granted: 30, Share: 25}})) {
		t.Fatal("step 8: grant not applied")
	}
	// Repeated: counted once.
	if applyUp(t, s, AppendUpstreamGrant(nil, at(3*time.Millisecond), 1, []UpstreamGrant{{Hash: h, Granted: 30}})) {
		t.Fatal("step 9: a repeated grant applied")
	}
	g = mustAcquire(t, s, at(4*time.Millisecond), "gw1", 3, ka("g", "x", 50, 0, 0, 0)).Grants[0]
	if g.Granted != 30 {
		t.Fatalf("step 10: granted %d, want the pool's 30", g.Granted)
	}
	g = mustAcquire(t, s, at(5*time.Millisecond), "gw2", 1, ka("g", "x", 50, 0, 0, 0)).Grants[0]
	if g.Granted != 0 {
		t.Fatalf("step 11: second gateway granted %d from a spent pool, want 0", g.Granted)
	}
	if p, _ := s.PoolOf(h, at(5*time.Millisecond)); p.ShortAt != at(5*time.Millisecond) {
		t.Fatalf("step 11: the pool's last cut want at %d, want %d (the spent pool cut gw2's)", p.ShortAt, at(5*time.Millisecond))
	}
	// gw1 keeps 10 and hands 20 back: they return to the pool.
	mustAcquire(t, s, at(6*time.Millisecond), "gw1", 4, ka("g", "x", 0, 10, 20, 0))
	if p, _ := s.PoolOf(h, at(6*time.Millisecond)); p.Available != 20 || p.Received != 30 || p.Share != 25 {
		t.Fatalf("step 12: pool %+v, want 20 available of 30 received, share 25", p)
	}
	// A mint adds fallback tokens, owed upstream until a send reports them.
	applyUp(t, s, AppendUpstreamMint(nil, at(7*time.Millisecond), []UpstreamMint{{Hash: h, Minted: 5}}))
	// A send of version 1 hands back at most what the pool holds (one of
	// version 3 puts the rest into debt: TestRegionalSendBeyondPoolIsDebt).
	send := AppendUpstreamSend(nil, at(8*time.Millisecond), 2, []byte("call-2"), []UpstreamReturn{{Hash: h, Returned: 100, Charged: 5}})
	send[1] = upstreamVersion
	applyUp(t, s, send)
	if p, _ := s.PoolOf(h, at(8*time.Millisecond)); p.Available != 0 || p.Returned != 25 || p.Owed != 0 || p.Minted != 5 {
		t.Fatalf("step 13: pool %+v, want 0 available, 25 returned (capped), 0 owed, 5 minted", p)
	}
	// A send that is not newer than the last is from a deposed leader.
	if applyUp(t, s, AppendUpstreamSend(nil, at(9*time.Millisecond), 2, []byte("old"), nil)) {
		t.Fatal("step 14: a send with an old sequence applied")
	}
}

// The ledger survives a snapshot, byte for byte; a state without one is
// written in the previous format version.
func TestRegionalLedgerSnapshot(t *testing.T) {
	plain := newTestState(t)
	if b := persist(t, plain); b[len(snapMagic)] != snapVersion {
		t.Fatalf("a state without a ledger is written as version %d, want %d", b[len(snapMagic)], snapVersion)
	}
	s := newRegionalState(t)
	mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 50, 0, 0, 0))
	h := s.Pools(at(0))[0].Hash
	applyUp(t, s, AppendUpstreamSend(nil, at(1), 7, []byte("call-7"), nil))
	applyUp(t, s, AppendUpstreamGrant(nil, at(2), 7, []UpstreamGrant{{Hash: h, Granted: 40, Share: 12.5}}))
	applyUp(t, s, AppendUpstreamSend(nil, at(3), 8, []byte("call-8"), nil))
	r := ledgerRoundTrip(t, s, snapVersionLedger)
	if seq, req := r.PendingUpstream(); seq != 8 || string(req) != "call-8" {
		t.Fatalf("pending %d %q, want 8 call-8", seq, req)
	}
	if p, _ := r.PoolOf(h, at(3)); p.Available != 40 || p.Share != 12.5 || len(p.Entries) != 1 {
		t.Fatalf("pool %+v after restore", p)
	}
}

func FuzzApplyUpstream(f *testing.F) {
	f.Add(AppendUpstreamSend(nil, t0, 1, []byte("r"), []UpstreamReturn{{Hash: 1, Returned: 2, Charged: 3}}))
	f.Add(AppendUpstreamGrant(nil, t0, 1, []UpstreamGrant{{Hash: 1, Granted: 2, Share: 3}}))
	f.Add(AppendUpstreamMint(nil, t0, []UpstreamMint{{Hash: 1, Minted: 2}}))
	f.Add(AppendUpstreamMint(nil, t0, []UpstreamMint{{Hash: 1, Minted: 4, Keep: 2}}))
	f.Add(AppendUpstreamGrant(nil, t0, 1, []UpstreamGrant{{Hash: 1, Granted: 2, Share: 3, Limit: &GlobalLimit{RequestsPerUnit: 5, Unit: rules.UnitSecond, Burst: 5}}}))
	f.Add(AppendUpstreamForget(nil, t0, []uint64{1, 2}))
	f.Add(AppendUpstreamFail(nil, t0, 1, []UpstreamReturn{{Hash: 1, Charged: 3}}))
	f.Add(AppendUpstreamGrant(nil, t0, 1, []UpstreamGrant{{Hash: 1, Granted: 2, Share: 3, Owed: 4}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg := testConfig()
		cfg.Regional = true
		s := New(cfg)
		putRules(t, s, t0, globalRules)
		mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 50, 0, 0, 0))
		before := persist(t, s)
		if _, err := s.ApplyUpstream(data); err != nil && !bytes.Equal(persist(t, s), before) {
			t.Fatalf("a failed entry changed the state")
		}
		for _, p := range s.Pools(at(0)) {
			if p.Available < 0 || p.Owed < 0 {
				t.Fatalf("pool %+v", p)
			}
		}
	})
}

// The ledger's conservation law, over random histories of gateway calls
// (wants, returns, charges, outage charges), upstream sends, grants (some
// answering an older send), mints, expiries and snapshot round trips:
//
//	avail − debt + out + charged + outageTaken = received + minted − returned
//
// where out is what gateways were granted less what was credited back, so
// a region never sub-grants more than it received and minted (plus what
// its gateways' fallbacks charged into debt); avail and debt are never
// negative, and both positive only once a mint kept part of itself from
// the debt.
func TestRegionalLedgerConservation(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		cfg := testConfig()
		cfg.Regional = true
		s := New(cfg)
		putRules(rt, s, t0, globalRules)
		now := at(0)
		ids := map[string]uint64{}
		recHeld := map[string]int64{} // each gateway's held, as its last answer recorded it
		var out, charged, outageTaken int64
		var seq uint64
		var hash uint64
		kept := false // a mint kept part of itself from the debt
		for i := range rapid.IntRange(1, 60).Draw(rt, "steps") {
			now += int64(rapid.IntRange(0, 300).Draw(rt, "dt")) * int64(time.Millisecond)
			gw := fmt.Sprintf("gw%d", rapid.IntRange(0, 2).Draw(rt, "gw"))
			var before Pool
			if hash != 0 {
				before, _ = s.PoolOf(hash, now)
			}
			switch rapid.IntRange(0, 7).Draw(rt, "op") {
			case 0, 1: // a gateway's call
				k := ka("g", "x", int64(rapid.IntRange(0, 80).Draw(rt, "want")), 0,
					int64(rapid.IntRange(0, 30).Draw(rt, "returned")), int64(rapid.IntRange(0, 5).Draw(rt, "charged")))
				k.Held = int64(rapid.IntRange(0, 40).Draw(rt, "held"))
				k.OutageCharged = int64(rapid.IntRange(0, 3).Draw(rt, "outage"))
				ids[gw]++
				resp, err := acquire(s, now, gw, ids[gw], k)
				if err != nil {
					rt.Fatalf("step %d: %v", i, err)
				}
				if hash == 0 {
					hash = s.Pools(now)[0].Hash
					before, _ = s.PoolOf(hash, now)
					before.Available, before.Debt = 0, 0
				}
				after, _ := s.PoolOf(hash, now)
				out += resp.Grants[0].Granted
				charged += k.Charged
				// What the call credited and took, read from the pool: the
				// rest of the law checks that nothing else moved.
				credited := after.Available - after.Debt - (before.Available - before.Debt) + resp.Grants[0].Granted + k.Charged
				taken := int64(0)
				if credited < 0 { // an outage charge taken from the pool
					taken = -credited
					credited = 0
				}
				if taken > k.OutageCharged || credited > k.Returned || credited > max(0, recHeld[gw]-k.Held) {
					rt.Fatalf("step %d: the pool moved by %d credited, %d taken for returned %d of %d held (record %d), outage %d",
						i, credited, taken, k.Returned, k.Held, recHeld[gw], k.OutageCharged)
				}
				recHeld[gw] = resp.Grants[0].Held
				out -= credited
				outageTaken += taken
			case 2: // a send
				if hash == 0 {
					continue
				}
				seq++
				applyUpT(rt, s, AppendUpstreamSend(nil, now, seq, []byte("r"), []UpstreamReturn{{Hash: hash,
					Returned: int64(rapid.IntRange(0, 50).Draw(rt, "up-returned")), Charged: int64(rapid.IntRange(0, 5).Draw(rt, "up-charged"))}}))
			case 3: // a grant, perhaps for an older send, perhaps owing a charge again
				if hash == 0 {
					continue
				}
				id := seq - uint64(rapid.IntRange(0, 1).Draw(rt, "older"))
				applyUpT(rt, s, AppendUpstreamGrant(nil, now, id, []UpstreamGrant{{Hash: hash, Granted: int64(rapid.IntRange(0, 100).Draw(rt, "granted")),
					Owed: int64(rapid.IntRange(0, 1).Draw(rt, "moved") * rapid.IntRange(0, 5).Draw(rt, "owed-again"))}}))
			case 4: // a mint
				if hash == 0 {
					continue
				}
				m := UpstreamMint{Hash: hash, Minted: int64(rapid.IntRange(0, 10).Draw(rt, "minted")), Keep: int64(rapid.IntRange(0, 10).Draw(rt, "keep"))}
				kept = kept || (m.Keep > 0 && m.Minted > 0 && before.Debt > 0)
				applyUpT(rt, s, AppendUpstreamMint(nil, now, []UpstreamMint{m}))
			case 5:
				expire(s, now) // an expired lease's record holds nothing: recHeld stays an upper bound
			case 6: // a snapshot round trip
				r := New(cfg)
				if err := r.Restore(bytes.NewReader(persist(rt, s))); err != nil {
					rt.Fatalf("step %d: Restore: %v", i, err)
				}
				s = r
			case 7: // a send given up, perhaps an older one: its charge is owed again
				if hash == 0 {
					continue
				}
				id := seq - uint64(rapid.IntRange(0, 1).Draw(rt, "older"))
				applyUpT(rt, s, AppendUpstreamFail(nil, now, id, []UpstreamReturn{{Hash: hash, Charged: int64(rapid.IntRange(0, 5).Draw(rt, "owed-again"))}}))
			}
			if hash == 0 {
				continue
			}
			p, _ := s.PoolOf(hash, now)
			if p.Available < 0 || p.Debt < 0 || (!kept && p.Available > 0 && p.Debt > 0) {
				rt.Fatalf("step %d: pool %+v", i, p)
			}
			if l, r := p.Available-p.Debt+out+charged+outageTaken, p.Received+p.Minted-p.Returned; l != r {
				rt.Fatalf("step %d: avail %d − debt %d + out %d + charged %d + outage %d = %d, received %d + minted %d − returned %d = %d",
					i, p.Available, p.Debt, out, charged, outageTaken, l, p.Received, p.Minted, p.Returned, r)
			}
		}
	})
}

func applyUpT(t tb, s *State, data []byte) {
	t.Helper()
	if _, err := s.ApplyUpstream(data); err != nil {
		t.Fatalf("ApplyUpstream: %v", err)
	}
}

// On a region, a global key reports what the pool holds as its remaining
// tokens (when its bucket holds more), so that gateways re-base their
// fallback buckets on the region's holdings.
func TestRegionalPoolRemaining(t *testing.T) {
	s := newRegionalState(t)
	mustAcquire(t, s, at(0), "gw0", 1, ka("g", "x", 1, 0, 0, 0))
	h := s.Pools(at(0))[0].Hash
	applyUp(t, s, AppendUpstreamSend(nil, at(1), 1, []byte("r"), nil))
	applyUp(t, s, AppendUpstreamGrant(nil, at(2), 1, []UpstreamGrant{{Hash: h, Granted: 40}}))
	g := mustAcquire(t, s, at(3), "gw1", 1, ka("g", "x", 10, 0, 0, 0)).Grants[0]
	if p, _ := s.PoolOf(h, at(3)); g.Granted != 10 || g.Remaining != p.Available || p.Available != 30 {
		t.Fatalf("granted %d, remaining %d, pool %d; want 10, the pool's 30", g.Granted, g.Remaining, p.Available)
	}
}

// A gateway whose want a spent pool cut waits 50 ms, or 500 ms while the
// region is cut off (it minted tokens not yet reported) and its pool's
// debt (what its gateways' fallback buckets admitted beyond what it held)
// exceeds a tenth of the key's capacity per refresh interval.
func TestRegionalPoolRetry(t *testing.T) {
	s := newRegionalState(t)
	g := mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 10, 0, 0, 0)).Grants[0]
	if g.Status != allotv1.KeyStatus_KEY_STATUS_EXHAUSTED || g.RetryAfterMs != poolRefresh.Milliseconds() {
		t.Fatalf("step 1: %v retry %d ms, want EXHAUSTED after %v", g.Status, g.RetryAfterMs, poolRefresh)
	}
	h := s.Pools(at(0))[0].Hash
	// Gateways' fallbacks admitted 15 (more than a tenth of the key's 100
	// a refresh interval): the pool owes them.
	mustAcquire(t, s, at(time.Millisecond), "gw1", 2, ka("g", "x", 0, 0, 0, 15))
	g = mustAcquire(t, s, at(2*time.Millisecond), "gw1", 3, ka("g", "x", 10, 0, 0, 0)).Grants[0]
	if g.RetryAfterMs != poolRefresh.Milliseconds() {
		t.Fatalf("step 2: connected and in debt: retry %d ms, want %v", g.RetryAfterMs, poolRefresh)
	}
	// Cut off: a mint of 2 pays part of the debt.
	applyUp(t, s, AppendUpstreamMint(nil, at(3*time.Millisecond), []UpstreamMint{{Hash: h, Minted: 2}}))
	g = mustAcquire(t, s, at(4*time.Millisecond), "gw1", 4, ka("g", "x", 10, 0, 0, 0)).Grants[0]
	if g.RetryAfterMs != poolDebtRefresh.Milliseconds() {
		t.Fatalf("step 3: cut off and in debt: retry %d ms, want %v", g.RetryAfterMs, poolDebtRefresh)
	}
}

// A mint that keeps part of itself from the debt: the kept tokens are held
// for the gateways while the rest pays the debt (a pool then holds tokens
// and a debt at once, which snapshots write as format version 7); a mint
// that keeps nothing pays the debt first, as a version-1 entry.
func TestRegionalMintKeep(t *testing.T) {
	s := newRegionalState(t)
	mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 10, 0, 0, 0))
	h := s.Pools(at(0))[0].Hash
	// Gateways' fallbacks admitted 15 beyond what the pool held.
	mustAcquire(t, s, at(time.Millisecond), "gw1", 2, ka("g", "x", 0, 0, 0, 15))
	if p, _ := s.PoolOf(h, at(time.Millisecond)); p.Debt != 15 || p.Available != 0 {
		t.Fatalf("step 1: pool %+v, want a debt of 15", p)
	}
	plain := AppendUpstreamMint(nil, at(2*time.Millisecond), []UpstreamMint{{Hash: h, Minted: 2}})
	if plain[1] != upstreamVersion {
		t.Fatalf("step 2: a mint keeping nothing is version %d, want %d", plain[1], upstreamVersion)
	}
	applyUp(t, s, plain)
	if p, _ := s.PoolOf(h, at(2*time.Millisecond)); p.Debt != 13 || p.Available != 0 || p.Minted != 2 || p.Owed != 2 {
		t.Fatalf("step 2: pool %+v, want the mint of 2 paying the debt to 13", p)
	}
	keep := AppendUpstreamMint(nil, at(3*time.Millisecond), []UpstreamMint{{Hash: h, Minted: 4, Keep: 2}})
	if keep[1] != upstreamVersionV2 {
		t.Fatalf("step 3: a mint keeping tokens is version %d, want %d", keep[1], upstreamVersionV2)
	}
	applyUp(t, s, keep)
	if p, _ := s.PoolOf(h, at(3*time.Millisecond)); p.Debt != 11 || p.Available != 2 || p.Minted != 6 || p.Owed != 6 {
		t.Fatalf("step 3: pool %+v, want 2 held, a debt of 11, 6 minted and owed", p)
	}
	// The kept tokens go to a gateway; the next want, cut to nothing,
	// comes back after 50 ms (more is kept for it at the next mint), not
	// the 500 ms of a cut-off pool in debt that pays it with all it mints.
	if g := mustAcquire(t, s, at(4*time.Millisecond), "gw1", 3, ka("g", "x", 10, 0, 0, 0)).Grants[0]; g.Granted != 2 {
		t.Fatalf("step 4: granted %d, want the 2 kept", g.Granted)
	}
	if g := mustAcquire(t, s, at(4*time.Millisecond), "gw2", 1, ka("g", "x", 10, 0, 0, 0)).Grants[0]; g.RetryAfterMs != poolRefresh.Milliseconds() {
		t.Fatalf("step 4: retry %d ms while the mints keep, want %v", g.RetryAfterMs, poolRefresh)
	}
	// Keep is at most what is minted.
	applyUp(t, s, AppendUpstreamMint(nil, at(5*time.Millisecond), []UpstreamMint{{Hash: h, Minted: 3, Keep: 9}}))
	if p, _ := s.PoolOf(h, at(5*time.Millisecond)); p.Debt != 11 || p.Available != 3 {
		t.Fatalf("step 5: pool %+v, want 3 held, the debt still 11", p)
	}
	// A snapshot of a pool holding tokens and a debt is version 7 and
	// restores byte for byte.
	r := ledgerRoundTrip(t, s, snapVersionKeep)
	if p, _ := r.PoolOf(h, at(5*time.Millisecond)); p.Debt != 11 || p.Available != 3 {
		t.Fatalf("step 6: pool %+v after restore", p)
	}
	// A grant pays the debt first.
	applyUp(t, r, AppendUpstreamSend(nil, at(6*time.Millisecond), 1, []byte("r"), nil))
	applyUp(t, r, AppendUpstreamGrant(nil, at(7*time.Millisecond), 1, []UpstreamGrant{{Hash: h, Granted: 20}}))
	if p, _ := r.PoolOf(h, at(7*time.Millisecond)); p.Debt != 0 || p.Available != 12 {
		t.Fatalf("step 7: pool %+v, want the grant of 20 paying the debt of 11: 12 held", p)
	}
}

// ledgerRoundTrip persists s, checks that the snapshot is in format version,
// restores it into a regional State and checks that the restored state
// persists to the same bytes.
func ledgerRoundTrip(t *testing.T, s *State, version byte) *State {
	t.Helper()
	b := persist(t, s)
	if b[len(snapMagic)] != version {
		t.Fatalf("snapshot version %d, want %d", b[len(snapMagic)], version)
	}
	cfg := testConfig()
	cfg.Regional = true
	r := New(cfg)
	if err := r.Restore(bytes.NewReader(b)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if !bytes.Equal(persist(t, r), b) {
		t.Fatal("restored state persists to other bytes")
	}
	return r
}

// poolHashes returns the pools' key hashes by their entry's value.
func poolHashes(s *State, now int64) map[string]uint64 {
	hs := map[string]uint64{}
	for _, p := range s.Pools(now) {
		hs[p.Entries[0].Value] = p.Hash
	}
	return hs
}

// A fail gives up the pending send: what it reported as outage_charged
// is owed again, for a later call to report, and its grant no longer
// counts. A fail of any other send changes nothing.
func TestRegionalFailOwesChargeAgain(t *testing.T) {
	s := newRegionalState(t)
	mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 50, 0, 0, 0))
	h := s.Pools(at(0))[0].Hash
	owed := func(step int, want int64) {
		t.Helper()
		if p, _ := s.PoolOf(h, at(0)); p.Owed != want {
			t.Fatalf("step %d: owed %d, want %d", step, p.Owed, want)
		}
	}
	applyUp(t, s, AppendUpstreamMint(nil, at(1), []UpstreamMint{{Hash: h, Minted: 5}}))
	owed(1, 5)
	applyUp(t, s, AppendUpstreamSend(nil, at(2), 1, []byte("call-1"), []UpstreamReturn{{Hash: h, Charged: 5}}))
	owed(2, 0)
	if applyUp(t, s, AppendUpstreamFail(nil, at(3), 2, []UpstreamReturn{{Hash: h, Charged: 5}})) {
		t.Fatal("step 3: a fail of a send that was never made applied")
	}
	owed(3, 0)
	if !applyUp(t, s, AppendUpstreamFail(nil, at(4), 1, []UpstreamReturn{{Hash: h, Charged: 5}})) {
		t.Fatal("step 4: the fail of the pending send not applied")
	}
	owed(4, 5)
	if seq, req := s.PendingUpstream(); seq != 1 || req != nil {
		t.Fatalf("step 5: pending %d %q, want none after send 1", seq, req)
	}
	if applyUp(t, s, AppendUpstreamGrant(nil, at(5), 1, []UpstreamGrant{{Hash: h, Granted: 30}})) {
		t.Fatal("step 6: a grant of a send given up applied")
	}
	if applyUp(t, s, AppendUpstreamFail(nil, at(6), 1, []UpstreamReturn{{Hash: h, Charged: 5}})) {
		t.Fatal("step 7: a repeated fail applied")
	}
	owed(7, 5)
	// The next send reports it; once answered, it is reported.
	applyUp(t, s, AppendUpstreamSend(nil, at(7), 2, []byte("call-2"), []UpstreamReturn{{Hash: h, Charged: 5}}))
	applyUp(t, s, AppendUpstreamGrant(nil, at(8), 2, []UpstreamGrant{{Hash: h, Granted: 30}}))
	owed(8, 0)
	r := ledgerRoundTrip(t, s, snapVersionLedger)
	if p, _ := r.PoolOf(h, at(8)); p.Available != 35 || p.Owed != 0 { // 5 minted, 30 granted
		t.Fatalf("after restore: pool %+v", p)
	}
}

// A grant that answers a key without serving it (the global cluster
// answered KEY_STATUS_MOVED) owes the key's outage charge again, as a fail
// does, and is a version-4 entry; one that owes nothing again stays a
// version-2 entry. A grant that does not answer the pending send owes
// nothing again.
func TestRegionalMovedGrantOwesChargeAgain(t *testing.T) {
	s := newRegionalState(t)
	mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 50, 0, 0, 0))
	h := s.Pools(at(0))[0].Hash
	owed := func(step int, want int64) {
		t.Helper()
		if p, _ := s.PoolOf(h, at(0)); p.Owed != want {
			t.Fatalf("step %d: owed %d, want %d", step, p.Owed, want)
		}
	}
	if e := AppendUpstreamGrant(nil, at(0), 1, []UpstreamGrant{{Hash: h, Granted: 3}}); e[1] != upstreamVersionV2 {
		t.Fatalf("a grant owing nothing again is version %d, want %d", e[1], upstreamVersionV2)
	}
	applyUp(t, s, AppendUpstreamMint(nil, at(1), []UpstreamMint{{Hash: h, Minted: 5}}))
	applyUp(t, s, AppendUpstreamSend(nil, at(2), 1, []byte("call-1"), []UpstreamReturn{{Hash: h, Charged: 5}}))
	owed(2, 0)
	moved := AppendUpstreamGrant(nil, at(3), 1, []UpstreamGrant{{Hash: h, Owed: 5}})
	if moved[1] != upstreamVersionV4 {
		t.Fatalf("a grant owing a charge again is version %d, want %d", moved[1], upstreamVersionV4)
	}
	if applyUp(t, s, AppendUpstreamGrant(nil, at(3), 2, []UpstreamGrant{{Hash: h, Owed: 5}})) {
		t.Fatal("step 3: a grant of a send that was never made applied")
	}
	owed(3, 0)
	if !applyUp(t, s, moved) {
		t.Fatal("step 4: the grant of the pending send not applied")
	}
	owed(4, 5)
	if applyUp(t, s, moved) {
		t.Fatal("step 5: a repeated grant applied")
	}
	owed(5, 5)
	r := ledgerRoundTrip(t, s, snapVersionLedger)
	if p, _ := r.PoolOf(h, at(5)); p.Owed != 5 || p.Minted != 5 {
		t.Fatalf("after restore: pool %+v", p)
	}
	// Only grants are written as version 4.
	fail := AppendUpstreamFail(nil, at(6), 1, []UpstreamReturn{{Hash: h, Charged: 5}})
	fail[1] = upstreamVersionV4
	if _, err := s.ApplyUpstream(fail); err == nil || errors.Is(err, ErrUnknownCommand) {
		t.Errorf("a fail as version 4: %v, want an entry that does not decode", err)
	}
}

// A forget drops a pool that holds nothing, owes nothing, is owed nothing
// and whose key no gateway holds an unexpired lease of; every other pool
// stays. A gateway that uses the key again starts an empty pool.
func TestRegionalForgetIdlePool(t *testing.T) {
	s := newRegionalState(t)
	for i, v := range []string{"leased", "holds", "owes", "debt", "idle"} {
		k := ka("g", v, 50, 0, 0, 0)
		if v == "debt" {
			k.Charged = 5 // a gateway's fallback admitted 5 beyond the empty pool
		}
		mustAcquire(t, s, at(0), "gw1", uint64(i+1), k)
	}
	hs := poolHashes(s, at(0))
	applyUp(t, s, AppendUpstreamMint(nil, at(1), []UpstreamMint{{Hash: hs["owes"], Minted: 3}}))
	applyUp(t, s, AppendUpstreamSend(nil, at(2), 1, []byte("call-1"), []UpstreamReturn{{Hash: hs["holds"]}, {Hash: hs["owes"], Returned: 3}}))
	applyUp(t, s, AppendUpstreamGrant(nil, at(3), 1, []UpstreamGrant{{Hash: hs["holds"], Granted: 10}}))
	late := at(time.Minute)
	mustAcquire(t, s, late, "gw2", 1, ka("g", "leased", 0, 0, 0, 0), ka("g", "leased", 1, 0, 0, 0))
	forget := at(time.Minute + time.Second)
	all := []uint64{hs["leased"], hs["holds"], hs["owes"], hs["debt"], hs["idle"], 12345}
	if !applyUp(t, s, AppendUpstreamForget(nil, forget, all)) {
		t.Fatal("forget not applied")
	}
	left := poolHashes(s, forget)
	for _, v := range []string{"leased", "holds", "owes", "debt"} {
		if _, ok := left[v]; !ok {
			t.Errorf("the pool of %s was dropped", v)
		}
	}
	if _, ok := left["idle"]; ok || len(left) != 4 {
		t.Errorf("pools %v after the forget, want all but idle", left)
	}
	r := ledgerRoundTrip(t, s, snapVersionLedger)
	if len(r.Pools(forget)) != 4 {
		t.Fatalf("%d pools after restore, want 4", len(r.Pools(forget)))
	}
	g := mustAcquire(t, r, forget, "gw1", 10, ka("g", "idle", 50, 0, 0, 0)).Grants[0]
	if p, ok := r.PoolOf(hs["idle"], forget); !ok || g.Granted != 0 || p.Available != 0 || p.Received != 0 || p.ShortAt != forget {
		t.Fatalf("a gateway back on a forgotten key: granted %d, pool %+v (found %v); want an empty new pool that cut its want", g.Granted, p, ok)
	}
}

// Forgets and fails are version-3 entries: in an older version they do
// not decode, and a version this binary does not know asks for an
// upgrade.
func TestRegionalLedgerEntryVersions(t *testing.T) {
	s := newRegionalState(t)
	for _, e := range [][]byte{AppendUpstreamForget(nil, t0, []uint64{1}), AppendUpstreamFail(nil, t0, 1, []UpstreamReturn{{Hash: 1}})} {
		if e[1] != upstreamVersionV3 {
			t.Fatalf("entry %x written as version %d, want 3", e, e[1])
		}
		old := bytes.Clone(e)
		old[1] = upstreamVersionV2
		if _, err := s.ApplyUpstream(old); err == nil || errors.Is(err, ErrUnknownCommand) {
			t.Errorf("entry %x as version 2: %v, want an entry that does not decode", e, err)
		}
	}
	next := AppendUpstreamForget(nil, t0, nil)
	next[1] = upstreamVersionV4 + 1
	if _, err := s.ApplyUpstream(next); !errors.Is(err, ErrUnknownCommand) {
		t.Errorf("a version-%d entry: %v, want ErrUnknownCommand", next[1], err)
	}
}

// A send hands back what the leader read the pool to hold beyond its
// target; gateways granted part of it before the send applied. The
// global cluster credits all the send hands back, so what the pool no
// longer holds becomes its debt, repaid out of the next grant: the region
// never sub-grants tokens the global cluster counts as handed back.
func TestRegionalSendBeyondPoolIsDebt(t *testing.T) {
	s := newRegionalState(t)
	mustAcquire(t, s, at(0), "gw1", 1, ka("g", "x", 0, 0, 0, 0))
	h := s.Pools(at(0))[0].Hash
	applyUp(t, s, AppendUpstreamSend(nil, at(1), 1, []byte("call-1"), []UpstreamReturn{{Hash: h}}))
	applyUp(t, s, AppendUpstreamGrant(nil, at(2), 1, []UpstreamGrant{{Hash: h, Granted: 30}}))
	// The leader reads 30 and hands back 20; a gateway takes 25 first.
	if g := mustAcquire(t, s, at(3), "gw2", 1, ka("g", "x", 25, 0, 0, 0)).Grants[0]; g.Granted != 25 {
		t.Fatalf("step 1: granted %d, want 25", g.Granted)
	}
	applyUp(t, s, AppendUpstreamSend(nil, at(4), 2, []byte("call-2"), []UpstreamReturn{{Hash: h, Returned: 20}}))
	if p, _ := s.PoolOf(h, at(4)); p.Available != 0 || p.Debt != 15 || p.Returned != 20 {
		t.Fatalf("step 2: pool %+v, want 0 available, 15 in debt, 20 returned", p)
	}
	applyUp(t, s, AppendUpstreamGrant(nil, at(5), 2, []UpstreamGrant{{Hash: h, Granted: 40}}))
	if p, _ := s.PoolOf(h, at(5)); p.Available != 25 || p.Debt != 0 {
		t.Fatalf("step 3: pool %+v, want the debt repaid: 25 available", p)
	}
	if g := mustAcquire(t, s, at(6), "gw3", 1, ka("g", "x", 50, 0, 0, 0)).Grants[0]; g.Granted != 25 {
		t.Fatalf("step 4: granted %d, want 25: received 70 − returned 20 − granted 25", g.Granted)
	}
}
