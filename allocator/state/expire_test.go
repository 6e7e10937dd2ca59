package state

import (
	"fmt"
	"math"
	"testing"
	"time"

	"pgregory.net/rapid"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// An Expire with a MaxEntries budget takes that many due keys, or the few
// more that complete a wheel unit (budgetedEnds), and leaves the rest
// due, earliest unit first, and takes whole past seconds
// only; budgeted Expires repeated until the backlog is gone end exactly the
// leases one unbounded Expire ends at the end of that second.
func TestPropertyExpireBudget(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		whole, budgeted := newTestState(t), newTestState(t)
		nKeys := rapid.IntRange(1, 300).Draw(t, "keys")
		budget := uint32(rapid.IntRange(1, 50).Draw(t, "budget"))
		var id uint64
		now := at(0)
		for k := range nKeys {
			// Keys leased at different times, so their leases fall due in
			// different seconds.
			now += int64(rapid.IntRange(0, 300).Draw(t, fmt.Sprint("gap", k))) * int64(time.Millisecond)
			id++
			for _, s := range []*State{whole, budgeted} {
				mustAcquire(t, s, now, "a", id, ka("big", fmt.Sprint(k), 1, 0, 0, 0))
			}
		}
		end := now + int64(time.Duration(rapid.IntRange(0, 90).Draw(t, "later_s"))*time.Second) // agents live 2 min
		// A budgeted Expire takes whole past seconds only: at the first
		// instant of the next second it ends what an unbounded one ends
		// at the last instant of end's second.
		next := (end/1e9 + 1) * 1e9
		whole.Apply(&allotv1.Command{NowUnixNanos: next - 1, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{SkipSweep: true}}})
		for i := 0; ; i++ {
			before := budgeted.Stats().Leases
			want := budgetedEnds(budgeted, next, int(budget))
			budgeted.Apply(&allotv1.Command{NowUnixNanos: next, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{MaxEntries: budget, SkipSweep: true}}})
			st := budgeted.Stats()
			if ended := before - st.Leases; ended != uint64(want) {
				t.Fatalf("Expire %d with budget %d ended %d leases, want %d (whole wheel units)", i, budget, ended, want)
			}
			if err := budgeted.consistency(); err != nil {
				t.Fatalf("after budgeted Expire %d: %v", i, err)
			}
			if st.ExpireBacklog == 0 {
				break
			}
			if i > 4*nKeys+10 {
				t.Fatalf("backlog %d after %d Expires of %d", st.ExpireBacklog, i+1, budget)
			}
		}
		if w, b := whole.Stats().Leases, budgeted.Stats().Leases; w != b {
			t.Fatalf("leases after expiry: %d unbounded, %d budgeted", w, b)
		}
		for k := range nKeys {
			req := &allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: fmt.Sprint(k)}}}
			w, err1 := whole.InspectKey(req, end)
			b, err2 := budgeted.InspectKey(req, end)
			if err1 != nil || err2 != nil {
				t.Fatal(err1, err2)
			}
			if len(w.GetLeases()) != len(b.GetLeases()) {
				t.Fatalf("key %d: %d leases unbounded, %d budgeted", k, len(w.GetLeases()), len(b.GetLeases()))
			}
		}
	})
}

// The budget leaves the latest-due keys: a backlog is worked off in the
// order leases fell due.
func TestExpireBudgetEarliestFirst(t *testing.T) {
	s := newTestState(t)
	// Key k is leased at k seconds, so its lease falls due in a later
	// second than key k−1's.
	for k := range 5 {
		mustAcquire(t, s, at(time.Duration(k)*time.Second), "a", uint64(k+1), ka("big", fmt.Sprint(k), 1, 0, 0, 0))
	}
	late := at(90 * time.Second) // every lease due (≤ 60 s), the agent still live (2 min)
	s.Apply(&allotv1.Command{NowUnixNanos: late, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{MaxEntries: 2, SkipSweep: true}}})
	if st := s.Stats(); st.Leases != 3 || st.ExpireBacklog != 3 {
		t.Fatalf("after a budget of 2: %d leases, backlog %d; want 3 and 3", st.Leases, st.ExpireBacklog)
	}
	for k := range 5 {
		held, err := s.InspectKey(&allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: fmt.Sprint(k)}}}, late)
		if err != nil {
			t.Fatal(err)
		}
		if leased, want := len(held.GetLeases()) > 0, k >= 2; leased != want {
			t.Errorf("key %d leased = %v, want %v (the two earliest end first)", k, leased, want)
		}
	}
}

// When ExpireIdle says an Expire has nothing to do, applying one ends no
// lease and forgets no agent; and once leases are due it says so.
func TestPropertyExpireIdle(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := newTestState(t)
		now := at(0)
		for k := range rapid.IntRange(0, 20).Draw(t, "keys") {
			now += int64(rapid.IntRange(0, 3000).Draw(t, fmt.Sprint("gap", k))) * int64(time.Millisecond)
			agent := rapid.SampledFrom(propAgents).Draw(t, "agent")
			mustAcquire(t, s, now, agent, uint64(k+1), ka("big", fmt.Sprint(k), 1, 0, 0, 0))
		}
		for range rapid.IntRange(1, 10).Draw(t, "expires") {
			now += int64(rapid.IntRange(0, 200_000).Draw(t, "later_ms")) * int64(time.Millisecond)
			budget := uint32(rapid.IntRange(0, 3).Draw(t, "budget"))
			idle := s.ExpireIdle(now, budget)
			before := s.Stats()
			s.Apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{MaxEntries: budget, SkipSweep: true}}})
			after := s.Stats()
			if idle && (after.Leases != before.Leases || after.Agents != before.Agents) {
				t.Fatalf("ExpireIdle(%d) = true, but the Expire took leases %d → %d, agents %d → %d",
					now, before.Leases, after.Leases, before.Agents, after.Agents)
			}
		}
		// Past every lease and agent TTL, something is due until an
		// Expire has ended it all.
		now += int64(10 * time.Minute)
		if before := s.Stats(); before.Agents > 0 && s.ExpireIdle(now, 0) {
			t.Fatalf("ExpireIdle past every TTL with %d agents and %d leases", before.Agents, before.Leases)
		}
		expire(s, now)
		if !s.ExpireIdle(now, 0) {
			t.Fatalf("ExpireIdle false after an unbounded Expire ended everything (%+v)", s.Stats())
		}
	})
}

// NextDue names the instant an Expire first has work: the end of a due
// lease's second (a second later with a budget) or an agent's TTL, and
// none for a state with neither.
func TestNextDue(t *testing.T) {
	s := newTestState(t)
	if got := s.NextDue(0); got != math.MaxInt64 {
		t.Fatalf("empty state: NextDue = %d, want none", got)
	}
	mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 5, 0, 0, 0))
	for _, budget := range []uint32{0, 4096} {
		due := s.NextDue(budget)
		if due <= at(0) || due > at(testConfig().MaxLeaseTTL+2*time.Second) {
			t.Fatalf("budget %d: NextDue %v after the grant, want within the lease TTL and 2 s", budget, time.Duration(due-at(0)))
		}
		if !s.ExpireIdle(due-1, budget) {
			t.Fatalf("budget %d: an Expire has work at %d, before NextDue %d", budget, due-1, due)
		}
		if s.ExpireIdle(due, budget) {
			t.Fatalf("budget %d: no work at NextDue %d", budget, due)
		}
	}
	// Once the lease has ended, the agent's TTL is what is due next.
	expire(s, at(testConfig().MaxLeaseTTL+2*time.Second))
	if got, want := s.NextDue(0), at(testConfig().AgentTTL); got != want {
		t.Fatalf("after the lease: NextDue = %v, want the agent TTL %v", time.Duration(got-at(0)), testConfig().AgentTTL)
	}
}
