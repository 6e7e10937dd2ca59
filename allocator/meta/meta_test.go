package meta

import (
	"errors"
	"strings"
	"testing"

	"github.com/allot/allot/pkg/slots"
)

func mustBoot(t *testing.T, n int) *State {
	t.Helper()
	var s State
	if err := s.Bootstrap("c1", n, []string{"n2", "n1", "n3"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	return &s
}

// A slot move, step by step, at fixed instants t0..t4.
func TestMoveSteps(t *testing.T) {
	const t0, t1, t2, t3, t4 = 1000, 2000, 3000, 4000, 5000
	s := mustBoot(t, 2)
	if got := s.SlotMap(); got.String() != "0-511=0,512-1023=1" || got.Version() != 1 {
		t.Fatalf("bootstrap map v%d %s", got.Version(), got.String())
	}
	g, err := s.AddGroup([]string{"n1", "n2", "n3"})
	if err != nil || g != 2 {
		t.Fatalf("AddGroup = %d, %v", g, err)
	}
	mv, err := s.BeginMove(t0, slots.Range{First: 100, Last: 199}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if mv.ID != 1 || mv.From != 0 || mv.Phase != PhaseFreezing {
		t.Fatalf("BeginMove = %v", mv)
	}
	steps := []struct {
		name string
		do   func() error
		want Phase // 0: ended
	}{
		{"step 1: Froze(t1)", func() error { return s.Froze(t1, 1, 40) }, PhaseFrozen},
		{"step 2: Froze(t1) again", func() error { return s.Froze(t1, 1, 40) }, PhaseFrozen},
		{"step 3: Transferred(t2)", func() error { return s.Transferred(t2, 1, 7) }, PhaseTransferred},
		{"step 4: Transferred(t2) again", func() error { return s.Transferred(t2, 1, 7) }, PhaseTransferred},
		{"step 5: Commit(t3)", func() error { return s.Commit(t3, 1) }, 0},
		{"step 6: Commit(t4) again", func() error { return s.Commit(t4, 1) }, 0},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		_, moving := s.Route(150)
		switch {
		case st.want == 0 && moving != nil:
			t.Fatalf("%s: slot 150 still moving: %v", st.name, moving)
		case st.want != 0 && (moving == nil || moving.Phase != st.want):
			t.Fatalf("%s: slot 150 moving = %v, want phase %s", st.name, moving, st.want)
		}
	}
	m := s.SlotMap()
	if m.Version() != 2 || m.String() != "0-99=0,100-199=2,200-511=0,512-1023=1" {
		t.Fatalf("after the move: v%d %s", m.Version(), m.String())
	}
	f := s.Finished()
	if len(f) != 1 || !f[0].Committed || f[0].SrcIndex != 40 || f[0].DstIndex != 7 || f[0].Started != t0 || f[0].Updated != t3 {
		t.Fatalf("finished = %+v", f)
	}
}

func TestRefusals(t *testing.T) {
	s := mustBoot(t, 2)
	if _, err := s.AddGroup([]string{"n1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.BeginMove(0, slots.Range{First: 0, Last: 9}, 2); err != nil {
		t.Fatal(err)
	}
	r := func(a, b slots.Slot) slots.Range { return slots.Range{First: a, Last: b} }
	for _, tc := range []struct {
		name string
		do   func() error
		is   error
		msg  string
	}{
		{"move to a group that does not exist", func() error { _, err := s.BeginMove(0, r(20, 29), 9); return err },
			ErrNoGroup, "move slots 20-29 to group 9: group 9 does not exist"},
		{"overlapping move", func() error { _, err := s.BeginMove(0, r(5, 15), 1); return err },
			ErrOverlap, "slots 5-15 overlap move 1 (slots 0-9, group 0 → 2, freezing)"},
		{"slots of two groups", func() error { _, err := s.BeginMove(0, r(500, 600), 2); return err },
			ErrInvalid, "have several owners (500-511=0, 512-600=1)"},
		{"move to the owner", func() error { _, err := s.BeginMove(0, r(600, 601), 1); return err },
			ErrInvalid, "group 1 already owns slots 600-601"},
		{"bad range", func() error { _, err := s.BeginMove(0, r(9, 3), 1); return err }, ErrInvalid, "slot range 9-3"},
		{"transfer before freeze", func() error { return s.Transferred(0, 1, 5) }, ErrPhase, "is freezing, want frozen"},
		{"commit before transfer", func() error { return s.Commit(0, 1) }, ErrPhase, "want transferred"},
		{"no such move", func() error { return s.Froze(0, 42, 1) }, ErrNoMove, "move 42"},
		{"remove a group with slots", func() error { return s.RemoveGroup(1) }, ErrBusy, "owns slots 512-1023"},
		{"remove a group in a move", func() error { return s.RemoveGroup(2) }, ErrBusy, "takes part in move 1"},
		{"remove the meta group", func() error { return s.RemoveGroup(0) }, ErrBusy, "meta group"},
		{"remove a missing group", func() error { return s.RemoveGroup(7) }, ErrNoGroup, "group 7"},
		{"members listed twice", func() error { return s.SetMembers(1, []string{"a", "a"}) }, ErrInvalid, `"a" listed twice`},
		{"no members", func() error { _, err := s.AddGroup(nil); return err }, ErrInvalid, "at least one member"},
		{"bootstrap twice", func() error { return s.Bootstrap("c2", 1, []string{"n1"}) }, ErrInvalid, "already bootstrapped"},
		{"rebalance during a move", func() error { _, err := s.Rebalance(); return err }, ErrOverlap, "1 moves in flight"},
	} {
		before, _ := s.Snapshot()
		err := tc.do()
		if !errors.Is(err, tc.is) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: err = %v, want %v with %q", tc.name, err, tc.is, tc.msg)
		}
		if after, _ := s.Snapshot(); string(after) != string(before) {
			t.Errorf("%s: a refused command changed the state", tc.name)
		}
	}
	// After Transferred the move can only finish.
	if err := s.Froze(0, 1, 3); err != nil {
		t.Fatal(err)
	}
	if err := s.Transferred(0, 1, 3); err != nil {
		t.Fatal(err)
	}
	if err := s.Abort(0, 1, "operator"); !errors.Is(err, ErrPhase) {
		t.Fatalf("Abort after Transferred: %v", err)
	}
	var empty State
	if _, err := empty.AddGroup([]string{"n1"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("AddGroup before Bootstrap: %v", err)
	}
	for _, n := range []int{0, -1, slots.Count + 1} {
		if err := empty.Bootstrap("c", n, []string{"n1"}); !errors.Is(err, ErrInvalid) {
			t.Errorf("Bootstrap(%d groups): %v", n, err)
		}
	}
}

func TestAbortAndRemove(t *testing.T) {
	s := mustBoot(t, 2)
	if _, err := s.BeginMove(0, slots.Range{First: 0, Last: 511}, 1); err != nil {
		t.Fatal(err)
	}
	if err := s.Froze(1, 1, 9); err != nil {
		t.Fatal(err)
	}
	if err := s.Abort(2, 1, "source lost its leader"); err != nil {
		t.Fatal(err)
	}
	if err := s.Abort(3, 1, "again"); err != nil {
		t.Fatalf("second Abort: %v", err)
	}
	if err := s.Commit(3, 1); !errors.Is(err, ErrNoMove) {
		t.Fatalf("Commit of an aborted move: %v", err)
	}
	if m := s.SlotMap(); m.Version() != 1 || m.Owner(0) != 0 {
		t.Fatalf("an aborted move changed the map: v%d", m.Version())
	}
	// Drain group 1 by hand, then remove it.
	mv, err := s.BeginMove(4, slots.Range{First: 512, Last: 1023}, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []func() error{
		func() error { return s.Froze(5, mv.ID, 1) },
		func() error { return s.Transferred(6, mv.ID, 1) },
		func() error { return s.Commit(7, mv.ID) },
		func() error { return s.RemoveGroup(1) },
	} {
		if err := f(); err != nil {
			t.Fatal(err)
		}
	}
	if gs := s.Groups(); len(gs) != 1 || gs[0].ID != 0 || strings.Join(gs[0].Members, ",") != "n1,n2,n3" {
		t.Fatalf("groups = %+v", gs)
	}
	if id, err := s.AddGroup([]string{"n1"}); err != nil || id != 2 {
		t.Fatalf("AddGroup after removing 1 = %d, %v; ids are not reused", id, err)
	}
}

func TestSnapshotRestore(t *testing.T) {
	s := mustBoot(t, 3)
	if _, err := s.BeginMove(10, slots.Range{First: 0, Last: 5}, 2); err != nil {
		t.Fatal(err)
	}
	b, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var r State
	if err := r.Restore(b); err != nil {
		t.Fatal(err)
	}
	if !r.Equal(s) {
		t.Fatal("restored state differs")
	}
	// A snapshot that breaks an invariant is refused and changes nothing.
	for _, bad := range []string{
		strings.Replace(string(b), `"format":1`, `"format":2`, 1),
		strings.Replace(string(b), `"to":2`, `"to":8`, 1),
		strings.Replace(string(b), `"0-341=0`, `"0-341=5`, 1),
		strings.Replace(string(b), `"range":"0-5"`, `"range":"0-400"`, 1),
		`{"format":1,"groups":[{"id":0,"members":["a"]}]}`,
		`not json`,
	} {
		if bad == string(b) {
			t.Fatalf("the test's replacement did not apply: %s", b)
		}
		if err := r.Restore([]byte(bad)); err == nil {
			t.Errorf("Restore(%s): no error", bad)
		}
		if !r.Equal(s) {
			t.Fatal("a refused Restore changed the state")
		}
	}
}

func FuzzRestore(f *testing.F) {
	s := State{}
	_ = s.Bootstrap("c", 3, []string{"a", "b"})
	_, _ = s.BeginMove(1, slots.Range{First: 0, Last: 5}, 2)
	b, _ := s.Snapshot()
	f.Add(b)
	f.Add([]byte(`{"format":1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var s State
		if err := s.Restore(b); err != nil {
			return
		}
		if err := s.Validate(); err != nil {
			t.Fatalf("restored an invalid state: %v", err)
		}
		again, err := s.Snapshot()
		if err != nil {
			t.Fatal(err)
		}
		var r State
		if err := r.Restore(again); err != nil || !r.Equal(&s) {
			t.Fatalf("snapshot of a restored state does not round trip: %v", err)
		}
	})
}
