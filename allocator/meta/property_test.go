package meta

import (
	"errors"
	"fmt"
	"testing"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/slots"
)

// command is one drawn command, replayable on another State.
type command struct {
	name string
	run  func(s *State) error
}

// drawCommand draws a command against s: mostly plausible ones (moves of
// one owner's slots, phases of moves in flight), some arbitrary.
func drawCommand(t *rapid.T, s *State, now int64) command {
	groupID := func(label string) slots.GroupID {
		return slots.GroupID(rapid.Uint32Range(0, uint32(s.nextGroup)+1).Draw(t, label))
	}
	moveID := func() uint64 {
		if ms := s.Moves(); len(ms) > 0 && rapid.IntRange(0, 3).Draw(t, "known") > 0 {
			return rapid.SampledFrom(ms).Draw(t, "move").ID
		}
		return rapid.Uint64Range(0, s.nextMove+1).Draw(t, "move id")
	}
	members := func() []string {
		return rapid.SliceOfN(rapid.SampledFrom([]string{"n1", "n2", "n3", "n4", ""}), 0, 4).Draw(t, "members")
	}
	if ms := s.Moves(); len(ms) > 0 && rapid.Bool().Draw(t, "advance") {
		// The next phase of a move in flight, as its driver would.
		m := rapid.SampledFrom(ms).Draw(t, "move to advance")
		switch m.Phase {
		case PhaseFreezing:
			return command{fmt.Sprintf("Froze(%d, %d, 1)", now, m.ID), func(s *State) error { return s.Froze(now, m.ID, 1) }}
		case PhaseFrozen:
			return command{fmt.Sprintf("Transferred(%d, %d, 1)", now, m.ID), func(s *State) error { return s.Transferred(now, m.ID, 1) }}
		default:
			return command{fmt.Sprintf("Commit(%d, %d)", now, m.ID), func(s *State) error { return s.Commit(now, m.ID) }}
		}
	}
	switch rapid.IntRange(0, 9).Draw(t, "kind") {
	case 0:
		ms := members()
		return command{fmt.Sprintf("AddGroup(%v)", ms), func(s *State) error { _, err := s.AddGroup(ms); return err }}
	case 1:
		g := groupID("group")
		return command{fmt.Sprintf("RemoveGroup(%d)", g), func(s *State) error { return s.RemoveGroup(g) }}
	case 2:
		g, ms := groupID("group"), members()
		return command{fmt.Sprintf("SetMembers(%d, %v)", g, ms), func(s *State) error { return s.SetMembers(g, ms) }}
	case 3, 4:
		var r slots.Range
		if as := s.slotMap.Assignments(); rapid.Bool().Draw(t, "within one owner") {
			a := rapid.SampledFrom(as).Draw(t, "assignment")
			first := rapid.IntRange(int(a.Range.First), int(a.Range.Last)).Draw(t, "first")
			r = slots.Range{First: slots.Slot(first), Last: slots.Slot(rapid.IntRange(first, int(a.Range.Last)).Draw(t, "last"))}
		} else {
			r = slots.Range{First: slots.Slot(rapid.IntRange(0, slots.Count).Draw(t, "first")), Last: slots.Slot(rapid.IntRange(0, slots.Count).Draw(t, "last"))}
		}
		to := groupID("to")
		return command{fmt.Sprintf("BeginMove(%d, %s, %d)", now, r, to), func(s *State) error { _, err := s.BeginMove(now, r, to); return err }}
	case 5:
		id, idx := moveID(), rapid.Uint64Range(0, 100).Draw(t, "index")
		return command{fmt.Sprintf("Froze(%d, %d, %d)", now, id, idx), func(s *State) error { return s.Froze(now, id, idx) }}
	case 6:
		id, idx := moveID(), rapid.Uint64Range(0, 100).Draw(t, "index")
		return command{fmt.Sprintf("Transferred(%d, %d, %d)", now, id, idx), func(s *State) error { return s.Transferred(now, id, idx) }}
	case 7, 8:
		id := moveID()
		return command{fmt.Sprintf("Commit(%d, %d)", now, id), func(s *State) error { return s.Commit(now, id) }}
	default:
		id := moveID()
		return command{fmt.Sprintf("Abort(%d, %d)", now, id), func(s *State) error { return s.Abort(now, id, "drawn") }}
	}
}

func wrapsSentinel(err error) bool {
	for _, is := range []error{ErrNoGroup, ErrOverlap, ErrNoMove, ErrPhase, ErrBusy, ErrInvalid} {
		if errors.Is(err, is) {
			return true
		}
	}
	return false
}

// Every slot always has exactly one owner, an existing group; moves in
// flight never overlap; a refused command changes nothing; the owner of a
// slot changes only by a committed move, and then to its target, with the
// map's version one higher; snapshots round trip; and replaying the same
// commands on a fresh State gives the same bytes (determinism).
func TestPropertyMoves(t *testing.T) {
	commits := 0
	defer func() { t.Logf("%d committed moves", commits) }()
	rapid.Check(t, func(t *rapid.T) {
		var s State
		n := rapid.IntRange(1, 4).Draw(t, "groups")
		if err := s.Bootstrap("c", n, []string{"n1", "n2", "n3"}); err != nil {
			t.Fatal(err)
		}
		var log []command
		for step := range rapid.IntRange(1, 60).Draw(t, "steps") {
			now := int64(step) * 10
			cmd := drawCommand(t, &s, now)
			before, _ := s.Snapshot()
			mapBefore, movesBefore := s.SlotMap(), s.Moves()
			err := cmd.run(&s)
			after, _ := s.Snapshot()
			if err != nil {
				if string(before) != string(after) {
					t.Fatalf("step %d: %s refused (%v) but changed the state", step, cmd.name, err)
				}
				if !wrapsSentinel(err) {
					t.Fatalf("step %d: %s: error %v wraps no sentinel", step, cmd.name, err)
				}
				continue
			}
			log = append(log, cmd)
			if s.SlotMap() != mapBefore {
				commits++
			}
			if err := s.Validate(); err != nil {
				t.Fatalf("step %d: after %s: %v", step, cmd.name, err)
			}
			mapAfter := s.SlotMap()
			if mapAfter != mapBefore {
				// Exactly one move ended, committed, and only its slots
				// changed owner, to its target.
				f := s.Finished()
				last := f[len(f)-1]
				if !last.Committed || mapAfter.Version() != mapBefore.Version()+1 {
					t.Fatalf("step %d: %s changed the map (v%d → v%d) without a commit", step, cmd.name, mapBefore.Version(), mapAfter.Version())
				}
				var was *Move
				for i := range movesBefore {
					if movesBefore[i].ID == last.ID {
						was = &movesBefore[i]
					}
				}
				if was == nil || was.Phase != PhaseTransferred {
					t.Fatalf("step %d: committed %v, which was not transferred", step, last.Move)
				}
				for sl := range slots.Count {
					sl := slots.Slot(sl)
					want := mapBefore.Owner(sl)
					if last.Range.Contains(sl) {
						want = last.To
					}
					if got := mapAfter.Owner(sl); got != want {
						t.Fatalf("step %d: slot %d owned by %d, want %d", step, sl, got, want)
					}
				}
			}
			var r State
			if err := r.Restore(after); err != nil || !r.Equal(&s) {
				t.Fatalf("step %d: snapshot does not round trip: %v", step, err)
			}
		}
		var replay State
		if err := replay.Bootstrap("c", n, []string{"n1", "n2", "n3"}); err != nil {
			t.Fatal(err)
		}
		for _, c := range log {
			if err := c.run(&replay); err != nil {
				t.Fatalf("replaying %s: %v", c.name, err)
			}
		}
		a, _ := s.Snapshot()
		b, _ := replay.Snapshot()
		if string(a) != string(b) {
			t.Fatal("replaying the same commands gave another state")
		}
	})
}

// Rebalance's plan, carried out move by move through every phase, ends
// with an even map.
func TestPropertyRebalanceThroughMoves(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var s State
		if err := s.Bootstrap("c", rapid.IntRange(1, 3).Draw(t, "groups"), []string{"n1"}); err != nil {
			t.Fatal(err)
		}
		for range rapid.IntRange(1, 4).Draw(t, "added") {
			if _, err := s.AddGroup([]string{"n1"}); err != nil {
				t.Fatal(err)
			}
		}
		plan, err := s.Rebalance()
		if err != nil {
			t.Fatal(err)
		}
		for i, mv := range plan {
			now := int64(i)
			m, err := s.BeginMove(now, mv.Range, mv.To)
			if err != nil {
				t.Fatalf("BeginMove %v: %v", mv, err)
			}
			if m.From != mv.From {
				t.Fatalf("move %v: source %d", mv, m.From)
			}
			for _, err := range []error{s.Froze(now, m.ID, 1), s.Transferred(now, m.ID, 1), s.Commit(now, m.ID)} {
				if err != nil {
					t.Fatal(err)
				}
			}
		}
		gs := s.Groups()
		m := s.SlotMap()
		for g, c := range m.Counts() {
			if c < slots.Count/len(gs) || c > slots.Count/len(gs)+1 {
				t.Fatalf("group %d owns %d slots after rebalancing", g, c)
			}
		}
		if len(m.Counts()) != len(gs) {
			t.Fatalf("%d of %d groups own slots", len(m.Counts()), len(gs))
		}
	})
}
