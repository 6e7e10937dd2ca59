package state

import (
	"bytes"
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func budgetedExpire(now int64, max uint32) *allotv1.Command {
	return &allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{MaxEntries: max, SkipSweep: true}}}
}

// A budgeted Expire that cuts a second ends the same leases on a replica
// that applied the log and on one restored from a snapshot of the same
// state, whose expiry wheels hold the keys in different orders.
func TestBudgetedExpireSameOnRestoredReplica(t *testing.T) {
	a := newTestState(t)
	var keys []*allotv1.KeyAcquire
	for i := range 100 {
		keys = append(keys, ka("big", fmt.Sprint("key-", i), 1, 0, 0, 0))
	}
	mustAcquire(t, a, at(0), "a", 1, keys...)
	b := newRestored(t, persist(t, a))
	if !bytes.Equal(persist(t, a), persist(t, b)) {
		t.Fatal("restored state differs")
	}
	a.Apply(budgetedExpire(at(70*time.Second), 10))
	b.Apply(budgetedExpire(at(70*time.Second), 10))
	if a.Stats().Leases != 90 || b.Stats().Leases != 90 {
		t.Errorf("leases after an Expire ending 10: log-applied replica %d, restored replica %d, want 90", a.Stats().Leases, b.Stats().Leases)
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
				apply(budgetedExpire(now, uint32(rapid.IntRange(1, 6).Draw(rt, "max"))))
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

// sortCut orders by hash then link, as a comparison sort does, at sizes
// that take its insertion sort and its radix pass.
func TestSortCut(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 5, 63, 64, 65, 1000, 5000, 70000} {
		a := make([]cutEntry, n)
		for i := range a {
			a[i] = cutEntry{hash: rng.Uint64(), link: rng.Uint32()}
			if i > 0 && rng.IntN(10) == 0 {
				a[i].hash = a[i-1].hash // a key's entries share its hash
			}
		}
		want := slices.Clone(a)
		slices.SortFunc(want, func(x, y cutEntry) int {
			if x.hash != y.hash {
				return cmp.Compare(x.hash, y.hash)
			}
			return cmp.Compare(x.link, y.link)
		})
		if got := sortCut(a); !slices.Equal(got, want) {
			t.Errorf("sortCut of %d entries: out of order", n)
		}
	}
}

// Thousands of keys due in one second, worked off by small budgets: a
// replica restored in the middle (its wheel rebuilt, the second's cut
// gone) ends the same keys at each following Expire as the replica that
// kept the sorted cut, with renewals and new leases landing meanwhile.
func TestBudgetedExpireRestoredMidSecond(t *testing.T) {
	a := newTestState(t)
	const n = 3000
	keys := make([]*allotv1.KeyAcquire, n)
	for i := range keys {
		keys[i] = ka("big", fmt.Sprint("key-", i), 1, 0, 0, 0)
	}
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
