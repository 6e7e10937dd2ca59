package state

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// globalKA is a KeyAcquire on g=x (globalRules: 100/s, scope: global)
// wanting one token with demand, asking for its share when ask.
func globalKA(demand float64, ask bool) *allotv1.KeyAcquire {
	return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "g", Value: "x"}},
		Want: 1, Demand: demand, WantShare: ask}
}

func newGlobalState(t tb) *State {
	t.Helper()
	s := New(testConfig())
	putRules(t, s, t0, globalRules)
	return s
}

// issuedShare applies one Acquire of g=x asking for the share and returns it.
func issuedShare(t tb, s *State, now int64, agent string, id uint64, demand float64) float64 {
	t.Helper()
	g := mustAcquire(t, s, now, agent, id, globalKA(demand, true)).GetGrants()[0]
	if g.Share == nil {
		t.Fatalf("%s: no share answered", agent)
	}
	return g.GetShare()
}

// liveShares returns, for the unexpired leases of g=x at now, the sum of
// the shares last answered to their agents (last; 0 for an agent whose
// last grant did not ask).
func liveShares(s *State, now int64, last map[string]float64) float64 {
	c := s.st
	e, ok := c.leasedEntry(keyHash(c.rules, "test", []rules.Entry{{Key: "g", Value: "x"}}))
	if !ok {
		return 0
	}
	sum := 0.0
	for _, l := range e.leases {
		if l.expiry > now {
			sum += last[c.byNum[l.agent].id]
		}
	}
	return sum
}

// TestIssuedSharesBound: when the demands move between two agents'
// grants, the share answered at the later grant is capped at what the
// other's issued share leaves of R, so the last shares of the live leases
// never sum to more than R; the shares then converge to the fair shares
// at each agent's next grant. An idle agent gets what the others' issued
// shares leave.
func TestIssuedSharesBound(t *testing.T) {
	s := newGlobalState(t)
	ids := map[string]uint64{}
	last := map[string]float64{}
	step := func(now int64, agent string, demand, want float64) {
		t.Helper()
		ids[agent]++
		got := issuedShare(t, s, now, agent, ids[agent], demand)
		last[agent] = got
		if got != want {
			t.Errorf("%s (demand %v) at %v: share %v, want %v", agent, demand, time.Duration(now-t0), got, want)
		}
		if sum := liveShares(s, now, last); sum > 100 {
			t.Fatalf("after %s's grant the live leases' last shares sum to %v, over R = 100", agent, sum)
		}
	}
	step(at(0), "a", 90, 90) // alone: its demand
	step(at(0), "b", 10, 10)
	step(at(0), "a", 90, 90)
	step(at(0), "b", 10, 10)
	// The demands move: b's fair share by the demands the leases report
	// (a's still 90) is 50, but a was issued 90.
	step(at(500*time.Millisecond), "b", 90, 10)
	step(at(600*time.Millisecond), "a", 10, 10) // a gives up its share
	step(at(700*time.Millisecond), "b", 90, 90) // and b takes it
	// An idle agent gets what the others were issued leaves.
	step(at(800*time.Millisecond), "c", 0, 0)
	step(at(900*time.Millisecond), "b", 50, 50)
	step(at(time.Second), "c", 0, 40)
	step(at(1100*time.Millisecond), "a", 10, 10)
}

// TestIssuedSharesProperty: after every step of any sequence of grants
// (asking for the share or not, any demand, idle ones included),
// releases, expiries and snapshot-and-restores, the shares last answered
// to the agents whose leases have not expired sum to at most R, and the
// state's records are of its leases.
func TestIssuedSharesProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := newGlobalState(t)
		ids := map[string]uint64{}
		last := map[string]float64{}
		now := at(0)
		for i := range rapid.IntRange(1, 60).Draw(t, "steps") {
			if rapid.IntRange(0, 9).Draw(t, "jump") == 0 {
				now += int64(rapid.Int64Range(0, 150).Draw(t, "jump s")) * int64(time.Second)
			} else {
				now += int64(rapid.Int64Range(0, 1500).Draw(t, "dt ms")) * int64(time.Millisecond)
			}
			a := rapid.SampledFrom(propAgents).Draw(t, "agent")
			switch op := rapid.IntRange(0, 9).Draw(t, "op"); {
			case op < 6:
				ask := op < 5
				d := 0.0
				if rapid.IntRange(0, 3).Draw(t, "idle") > 0 {
					d = float64(rapid.IntRange(0, 150).Draw(t, "demand"))
				}
				k := globalKA(d, ask)
				k.Want = rapid.Int64Range(0, 30).Draw(t, "want")
				k.Held = rapid.Int64Range(0, 5).Draw(t, "held")
				ids[a]++
				resp, err := acquire(s, now, a, ids[a], k)
				if err != nil {
					t.Fatal(err)
				}
				g := resp.GetGrants()[0]
				if ask != (g.Share != nil) {
					t.Fatalf("step %d: asked %v, share %v", i, ask, g.Share)
				}
				last[a] = g.GetShare()
			case op < 7:
				ids[a]++
				if _, err := release(s, now, a, ids[a], false, globalKA(0, false)); err != nil {
					t.Fatal(err)
				}
				delete(last, a)
			case op < 9:
				expire(s, now)
			default:
				r := New(testConfig())
				if err := r.Restore(bytes.NewReader(persist(t, s))); err != nil {
					t.Fatalf("step %d: Restore: %v", i, err)
				}
				s = r
			}
			if sum := liveShares(s, now, last); sum > 100+1e-9 {
				t.Fatalf("step %d: the live leases' last shares sum to %v, over R = 100", i, sum)
			}
			if err := s.consistency(); err != nil { // the records are the live leases'
				t.Fatalf("step %d: %v", i, err)
			}
		}
	})
}

// TestRestoreSharesV3: testdata/snapshot-v3-shares.bin is a format-3
// snapshot, written by the binary before the issued shares were
// recorded, of g=x (100/s, scope: global) leased by a and b asking for
// their shares: a reporting 90 was answered 90, then b reporting 90 was
// answered 50 (the bound exceeded: 140). Restored, both leases are of
// unknown share and each counts as the whole rate until its next grant;
// the state persists as format 9 and restores from that unchanged.
func TestRestoreSharesV3(t *testing.T) {
	_, s := restoreFixture(t, "snapshot-v3-shares.bin")
	if n := len(s.st.shares); n != 2 {
		t.Fatalf("%d share records, want 2", n)
	}
	for k, sh := range s.st.shares {
		if sh != shareUnknown {
			t.Errorf("agent %d: share %d, want unknown", k.agent, sh)
		}
	}
	v9 := persist(t, s)
	r := New(testConfig())
	if err := r.Restore(bytes.NewReader(v9)); err != nil {
		t.Fatalf("Restore(v9): %v", err)
	}
	if !bytes.Equal(persist(t, r), v9) {
		t.Errorf("format 9 does not round-trip")
	}
	if len(v9) < 9 || v9[8] != snapVersionShares {
		t.Errorf("re-persisted as format %d, want %d", v9[8], snapVersionShares)
	}
	// a's next grant: b's unknown share counts as all of R. Then b's
	// grant records its share, and a's next one gets the rest.
	for _, st := range []struct {
		agent        string
		id           uint64
		demand, want float64
	}{{"a", 3, 10, 0}, {"b", 4, 90, 90}, {"a", 4, 10, 10}} {
		if got := issuedShare(t, r, at(time.Second), st.agent, st.id, st.demand); got != st.want {
			t.Errorf("%s: share %v, want %v", st.agent, got, st.want)
		}
	}
}

// TestRestoreSharesCorrupt: a format-9 snapshot whose share names no
// lease is refused.
func TestRestoreSharesCorrupt(t *testing.T) {
	s := newGlobalState(t)
	issuedShare(t, s, at(0), "a", 1, 10)
	good := persist(t, s)
	if _, err := decodeSnapshot(s.cfg, good); err != nil {
		t.Fatalf("decode: %v", err)
	}
	// Re-frame the body with the share's agent number changed (the last
	// record: fixed64 hash, uvarint agent 1, varint share).
	body := bytes.Clone(good[:len(good)-snapTrailer])
	n := len(body)
	if body[n-4] != 1 {
		t.Fatalf("unexpected layout: agent byte %d", body[n-4])
	}
	body[n-4] = 7
	var bad bytes.Buffer
	e := &enc{w: &bad}
	e.raw(body)
	if err := e.finish(); err != nil {
		t.Fatal(err)
	}
	if _, err := decodeSnapshot(s.cfg, bad.Bytes()); !errors.Is(err, ErrCorruptSnapshot) {
		t.Errorf("a share naming no lease: %v, want ErrCorruptSnapshot", err)
	}
}

// TestSlotMoveShares: a global key's leases moved to another group come
// with their shares unknown (the export does not carry them): each counts
// as the whole rate until its agent's next grant; the source's records
// end with the dropped leases.
func TestSlotMoveShares(t *testing.T) {
	src, dst := newGlobalState(t), newGlobalState(t)
	if err := dst.Disown(at(0), []slots.Range{slots.All}); err != nil {
		t.Fatal(err)
	}
	issuedShare(t, src, at(0), "a", 1, 60)
	issuedShare(t, src, at(0), "b", 1, 40)
	moving := rangesOf([]slots.Slot{slotOf(src, "g", "x")})
	if err := src.Freeze(at(time.Second), moving); err != nil {
		t.Fatal(err)
	}
	data, err := src.Export(moving)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := dst.Import(at(time.Second), data, moving); err != nil || n != 1 {
		t.Fatalf("Import = %d, %v", n, err)
	}
	if n, err := src.Drop(at(time.Second), moving); err != nil || n != 1 {
		t.Fatalf("Drop = %d, %v", n, err)
	}
	if n := len(src.st.shares); n != 0 {
		t.Errorf("source keeps %d share records after the drop", n)
	}
	for _, st := range []struct {
		agent        string
		id           uint64
		demand, want float64
	}{{"a", 2, 60, 0}, {"b", 2, 40, 40}, {"a", 3, 60, 60}} {
		if got := issuedShare(t, dst, at(2*time.Second), st.agent, st.id, st.demand); got != st.want {
			t.Errorf("%s: share %v, want %v", st.agent, got, st.want)
		}
	}
	for _, s := range []*State{src, dst} {
		if err := s.consistency(); err != nil {
			t.Error(err)
		}
	}
}
