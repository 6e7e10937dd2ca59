package state

import (
	"bytes"
	"fmt"
	"maps"
	"math"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// bigKeys returns n keys of the "big" descriptor, named prefix0, prefix1,
// …, each wanting 1 token.
func bigKeys(prefix string, n int) []*allotv1.KeyAcquire {
	keys := make([]*allotv1.KeyAcquire, n)
	for i := range keys {
		keys[i] = ka("big", fmt.Sprint(prefix, i), 1, 0, 0, 0)
	}
	return keys
}

func budgetedExpire(now int64, max uint32) *allotv1.Command {
	return &allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{MaxEntries: max, SkipSweep: true}}}
}

// A budgeted Expire that stops within a second ends the same leases on a replica
// that applied the log and on one restored from a snapshot of the same
// state, whose expiry wheels hold the keys in different orders.
func TestBudgetedExpireSameOnRestoredReplica(t *testing.T) {
	a := newTestState(t)
	keys := bigKeys("key-", 100)
	mustAcquire(t, a, at(0), "a", 1, keys...)
	b := newRestored(t, persist(t, a))
	if !bytes.Equal(persist(t, a), persist(t, b)) {
		t.Fatal("restored state differs")
	}
	want := 100 - uint64(budgetedEnds(a, at(70*time.Second), 10)) // whole wheel units: 10 keys or a few more
	a.Apply(budgetedExpire(at(70*time.Second), 10))
	b.Apply(budgetedExpire(at(70*time.Second), 10))
	if want > 90 || a.Stats().Leases != want || b.Stats().Leases != want {
		t.Errorf("leases after an Expire ending 10 or more: log-applied replica %d, restored replica %d, want %d", a.Stats().Leases, b.Stats().Leases, want)
	}
	la, _ := a.ListLeases(&allotv1.ListLeasesRequest{PageSize: 1000}, at(70*time.Second))
	lb, _ := b.ListLeases(&allotv1.ListLeasesRequest{PageSize: 1000}, at(70*time.Second))
	if fmt.Sprint(la.Leases) != fmt.Sprint(lb.Leases) || !bytes.Equal(persist(t, a), persist(t, b)) {
		t.Fatalf("replicas diverged after the same budgeted Expire: different leases survive")
	}
}

// The same, seen from the grants the two replicas then answer.
func TestBudgetedExpireSameGrantsOnRestoredReplica(t *testing.T) {
	a := newTestState(t)
	var keys, keysB []*allotv1.KeyAcquire
	for i := range 100 {
		keys = append(keys, ka("big", fmt.Sprint("key-", i), 60, 0, 0, 0))
		keysB = append(keysB, ka("big", fmt.Sprint("key-", i), 100, 0, 0, 0))
	}
	mustAcquire(t, a, at(0), "a", 1, keys...)
	b := newRestored(t, persist(t, a))
	for _, s := range []*State{a, b} {
		s.Apply(budgetedExpire(at(70*time.Second), 10))
	}
	ra := mustAcquire(t, a, at(70*time.Second), "b", 1, keysB...)
	rb := mustAcquire(t, b, at(70*time.Second), "b", 1, keysB...)
	diff := 0
	for i := range ra.Grants {
		if ra.Grants[i].Granted != rb.Grants[i].Granted || ra.Grants[i].Agents != rb.Grants[i].Agents {
			diff++
		}
	}
	if diff > 0 {
		t.Errorf("%d of 100 keys answered differently by the two replicas to the same entry", diff)
	}
}

// Property: a replica that applied the whole log (renewals, moves and
// releases leaving stale and early wheel entries, frozen slots re-queued)
// and one restored from a snapshot at a random point agree on every state
// after each entry that follows, budgeted Expires included.
func TestBudgetedExpireRestoredReplicaProperty(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		a := newTestState(rt)
		var b *State
		restoreAt := rapid.IntRange(0, 60).Draw(rt, "restoreAt")
		nKeys := rapid.IntRange(5, 60).Draw(rt, "keys")
		agents := []string{"a", "b", "c"}
		ids := map[string]uint64{}
		now := at(0)
		half := slots.Range{First: 0, Last: slots.All.Last / 2}
		frozen := false
		apply := func(cmd *allotv1.Command) {
			ra := a.Apply(cmd)
			if b != nil {
				rb := b.Apply(cmd)
				if x, ok := ra.(*AcquireBatchResult); ok {
					y := rb.(*AcquireBatchResult)
					if !proto.Equal(x.Responses[0], y.Responses[0]) || fmt.Sprint(x.Errs) != fmt.Sprint(y.Errs) {
						rt.Fatalf("replicas answered differently: %v / %v", x.Responses[0], y.Responses[0])
					}
				}
			}
		}
		for step := range 120 {
			if step == restoreAt {
				b = newRestored(rt, persist(rt, a))
			}
			now += int64(rapid.IntRange(0, 3000).Draw(rt, "dtMs")) * int64(time.Millisecond)
			switch op := rapid.IntRange(0, 9).Draw(rt, "op"); {
			case op < 5: // acquire or renew, demand deciding the lease TTL
				ag := rapid.SampledFrom(agents).Draw(rt, "agent")
				ids[ag]++
				var keys []*allotv1.KeyAcquire
				for range rapid.IntRange(1, nKeys).Draw(rt, "n") {
					k := ka("big", fmt.Sprint("k", rapid.IntRange(0, nKeys-1).Draw(rt, "key")), int64(rapid.IntRange(0, 3).Draw(rt, "want")), 0, 0, 0)
					k.Demand = float64(rapid.SampledFrom([]int{0, 1, 1000}).Draw(rt, "demand"))
					keys = append(keys, k)
				}
				apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{Requests: []*allotv1.AcquireRequest{{AgentId: ag, RequestId: ids[ag], Keys: keys}}}}})
			case op < 6:
				ag := rapid.SampledFrom(agents).Draw(rt, "agent")
				ids[ag]++
				k := ka("big", fmt.Sprint("k", rapid.IntRange(0, nKeys-1).Draw(rt, "key")), 0, 0, 0, 0)
				apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Release{Release: &allotv1.ReleaseRequest{AgentId: ag, RequestId: ids[ag], Keys: []*allotv1.KeyAcquire{k}}}})
			case op < 9:
				// max 0: unbudgeted, which must ignore LastUnit.
				max := uint32(rapid.IntRange(0, 6).Draw(rt, "max"))
				cmd := budgetedExpire(now, max)
				switch from := rapid.IntRange(0, 3).Draw(rt, "lastUnitFrom"); from {
				case 1, 2:
					// LastUnit as a leader computes it from its own wheel
					// (either replica may lead), for this time or one a
					// little earlier (the leader looks before it stamps).
					leader := a
					if from == 2 && b != nil {
						leader = b
					}
					look := now - int64(rapid.IntRange(0, 1500).Draw(rt, "lookEarlierMs"))*int64(time.Millisecond)
					cmd.GetExpire().LastUnit = leader.ExpireLastUnit(look, uint32(rapid.IntRange(0, 20).Draw(rt, "lastEntries")))
				case 3: // any unit of the last 70 seconds
					back := int64(rapid.IntRange(0, 70).Draw(rt, "lastBack"))
					cmd.GetExpire().LastUnit = unitOf(floorDiv(now, 1e9)-back, uint64(rapid.IntRange(0, 63).Draw(rt, "lastPrefix"))<<(64-unitBits))
				}
				apply(cmd)
			default:
				freeze := rapid.Bool().Draw(rt, "freeze")
				frozen = freeze
				for _, s := range []*State{a, b} {
					if s == nil {
						continue
					}
					if freeze {
						_ = s.Freeze(now, []slots.Range{half})
					} else {
						_ = s.Thaw(now, []slots.Range{half})
					}
				}
			}
			if b == nil {
				continue
			}
			if !bytes.Equal(persist(rt, a), persist(rt, b)) {
				rt.Fatalf("step %d: the log-applied and the restored replica diverged", step)
			}
			for _, s := range []*State{a, b} {
				if frozen {
					break // consistency wants every key queued by its earliest expiry: a served key's invariant
				}
				if err := s.consistency(); err != nil {
					rt.Fatalf("step %d: %v", step, err)
				}
			}
		}
	})
}

// Thousands of keys due in one second, worked off by small budgets: a
// replica restored in the middle, the second's units partly taken (its
// wheel rebuilt in table order, without stale or early entries), ends the
// same keys at each following Expire as the replica that applied the log,
// with renewals and new leases landing meanwhile.
func TestBudgetedExpireRestoredMidSecond(t *testing.T) {
	a := newTestState(t)
	const n = 3000
	keys := bigKeys("key-", n)
	for i := 0; i < n; i += 500 {
		mustAcquire(t, a, at(0), "a", uint64(i+1), keys[i:i+500]...)
	}
	now := at(61 * time.Second)
	var b *State
	for step := range 40 {
		if step == 5 {
			b = newRestored(t, persist(t, a))
		}
		now += int64(50 * time.Millisecond)
		if step%7 == 3 { // another agent leases some of the keys
			ks := []*allotv1.KeyAcquire{keys[step], keys[n-1-step], keys[n/2+step]}
			for _, s := range []*State{a, b} {
				if s != nil {
					mustAcquire(t, s, now, "b", uint64(step+1), ks...)
				}
			}
		}
		for _, s := range []*State{a, b} {
			if s != nil {
				s.Apply(budgetedExpire(now, 97))
			}
		}
		if b != nil && !bytes.Equal(persist(t, a), persist(t, b)) {
			t.Fatalf("Expire %d: the replicas diverged", step)
		}
	}
	if got := a.Stats().Leases; got >= n {
		t.Fatalf("%d leases left, want fewer than %d", got, n)
	}
	mustConsistent(t, a)
	mustConsistent(t, b)
}

// budgetedEnds returns how many keys of s a budgeted Expire at now ends:
// the served leased keys due by the end of now's previous second, by
// wheel unit (second, then hash prefix), whole units until budget keys.
func budgetedEnds(s *State, now int64, budget int) int {
	c := s.st
	last := floorDiv(now, 1e9) - 1
	units := map[int64]int{}
	var e entry
	for i := 0; i < c.tab.size; i++ {
		sl := c.tab.at(i)
		if sl.link == 0 || c.frozen(sl.hash) {
			continue
		}
		c.loadEntry(&e, sl.hash, sl.link)
		if m := e.minSec(); m <= last {
			units[unitOf(m, sl.hash)]++
		}
	}
	ended := 0
	for _, u := range slices.Sorted(maps.Keys(units)) {
		if ended >= budget {
			break
		}
		ended += units[u]
	}
	return ended
}

// A budgeted Expire whose due units hold only renewed keys' early entries
// ends nothing, so MaxEntries does not stop it; LastUnit does: the Expire
// takes the units up to the one at which ExpireLastUnit counted the
// entries it was asked for, and leaves the rest due (ExpireBacklog).
func TestBudgetedExpireLastUnitBoundsEarlyEntries(t *testing.T) {
	s := newTestState(t)
	keys := bigKeys("key-", 1000)
	mustAcquire(t, s, at(0), "a", 1, keys...)
	mustAcquire(t, s, at(5*time.Second), "a", 2, keys...) // every entry is early now
	now := at(12 * time.Second)
	if got := s.ExpireLastUnit(now, 0); got != 0 {
		t.Fatalf("ExpireLastUnit(0 entries) = %d, want 0", got)
	}
	if got, want := s.ExpireLastUnit(now, 1001), unitOf(floorDiv(now, 1e9)-1, math.MaxUint64); got != want {
		t.Fatalf("ExpireLastUnit(more than are due) = %d, want %d (the last unit of the last second due)", got, want)
	}
	last := s.ExpireLastUnit(now, 100)
	var want int // entries of the units up to last: at least 100, under a unit more
	var units []int64
	s.st.wheel.each(func(u int64, _ uint32) {
		if u <= last {
			want++
		}
		units = append(units, u)
	})
	if last == 0 || want < 100 || want >= 100+64 {
		t.Fatalf("ExpireLastUnit(100) = %d covering %d entries; want ≥ 100 entries, under a unit more", last, want)
	}
	cmd := budgetedExpire(now, 4096)
	cmd.GetExpire().LastUnit = last
	s.Apply(cmd)
	st := s.Stats()
	if st.Leases != 1000 || st.ExpireBacklog != uint64(1000-want) {
		t.Fatalf("after the Expire: %d leases, backlog %d; want 1000 (renewed keys end nothing) and %d", st.Leases, st.ExpireBacklog, 1000-want)
	}
	s.st.wheel.each(func(u int64, _ uint32) {
		if u <= last {
			t.Fatalf("unit %d ≤ LastUnit %d still queued", u, last)
		}
	})
	if err := s.consistency(); err != nil {
		t.Fatal(err)
	}
	s.Apply(budgetedExpire(now, 4096)) // no LastUnit: the rest
	if st := s.Stats(); st.ExpireBacklog != 0 || st.Leases != 1000 {
		t.Fatalf("after an unbounded Expire: backlog %d, leases %d; want 0, 1000", st.ExpireBacklog, st.Leases)
	}
}

// An unbudgeted Expire ignores LastUnit: it ends the due leases of every
// entry it takes, early ones included, so a bound on its units would end a
// renewed key's leases on a replica whose wheel holds an early entry for
// it and not on one restored from a snapshot.
func TestUnbudgetedExpireIgnoresLastUnit(t *testing.T) {
	a := newTestState(t)
	keys := bigKeys("key-", 200)
	mustAcquire(t, a, at(0), "a", 1, keys...)
	mustAcquire(t, a, at(5*time.Second), "a", 2, keys...) // renewed: a's entries are early
	b := newRestored(t, persist(t, a))                    // b's are at the earliest expiry
	early, _ := a.st.wheel.minSec()
	real, _ := b.st.wheel.minSec()
	if early >= real {
		t.Fatalf("setup: the log-applied replica's earliest entry second %d, the restored one's %d; want it earlier", early, real)
	}
	cmd := &allotv1.Command{NowUnixNanos: (real + 30) * int64(time.Second), Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{
		LastUnit: unitOf(early, math.MaxUint64), SkipSweep: true}}} // every unit of the early second, none of the real one
	a.Apply(cmd)
	b.Apply(cmd)
	if la, lb := a.Stats().Leases, b.Stats().Leases; la != lb || !bytes.Equal(persist(t, a), persist(t, b)) {
		t.Fatalf("the same unbudgeted Expire with LastUnit: log-applied replica %d leases, restored replica %d", la, lb)
	}
}

// The leader looks at its wheel at one time and stamps the Expire a little
// later: when the due units held fewer entries than its budget at the look
// and the stamp falls in the next second, LastUnit still stops the Expire
// at the look's last due second, so a second of renewed keys' early
// entries (which end nothing and do not count against MaxEntries) is not
// taken in one Expire.
func TestLastUnitBoundsAcrossSecondBoundary(t *testing.T) {
	s := newTestState(t)
	const n = 3000
	keys, few := bigKeys("key-", n), bigKeys("few-", 10)
	mustAcquire(t, s, at(0), "b", 1, few...)
	first, _ := s.st.wheel.minSec()
	for i := 0; i < n; i += 500 {
		mustAcquire(t, s, at(2*time.Second), "a", uint64(i/500+1), keys[i:i+500]...)
	}
	for i := 0; i < n; i += 500 {
		mustAcquire(t, s, at(7*time.Second), "a", uint64(100+i/500), keys[i:i+500]...) // renewed: every entry early
	}
	perSec := map[int64]int{}
	s.st.wheel.each(func(u int64, _ uint32) { perSec[unitSec(u)]++ })
	var full int64
	for sec, k := range perSec {
		if k >= n {
			full = sec
		}
	}
	if full <= first {
		t.Fatalf("setup: the few keys in second %d, the others in %d (%v)", first, full, perSec)
	}
	const budget = 100
	look := (full+1)*int64(time.Second) - int64(time.Millisecond) // the second after full's, 999 ms in: full is not yet due
	stamp := look + 2*int64(time.Millisecond)                     // two seconds after full's: full is due
	if s.ExpireIdle(look, budget) {
		t.Fatal("setup: the leader's look is idle")
	}
	cmd := budgetedExpire(stamp, budget)
	cmd.GetExpire().LastUnit = s.ExpireLastUnit(look, budget)
	s.Apply(cmd)
	left := 0
	s.st.wheel.each(func(u int64, _ uint32) {
		if unitSec(u) == full {
			left++
		}
	})
	if left < n-2*budget {
		t.Fatalf("one budgeted Expire (MaxEntries %d, LastUnit %d) took %d of second %d's %d early entries", budget, cmd.GetExpire().LastUnit, n-left, full, n)
	}
}
