package meta

import (
	"errors"
	"slices"
	"testing"

	"github.com/allot/allot/pkg/slots"
)

func TestBootstrapData(t *testing.T) {
	var s State
	if err := s.BootstrapData("c1", 4, []string{"n1", "n0"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	m := s.SlotMap()
	if got := m.String(); got != "0-255=1,256-511=2,512-767=3,768-1023=4" {
		t.Errorf("slot map %s", got)
	}
	if m.Version() != 1 {
		t.Errorf("version %d, want 1", m.Version())
	}
	if got := s.DataGroups(); !slices.Equal(got, []slots.GroupID{1, 2, 3, 4}) {
		t.Errorf("data groups %v", got)
	}
	if g, ok := s.Group(0); !ok || !slices.Equal(g.Members, []string{"n0", "n1"}) {
		t.Errorf("group 0 = %v %v", g, ok)
	}
	if id, err := s.AddGroup([]string{"n0"}); err != nil || id != 5 {
		t.Errorf("AddGroup = %d, %v; want 5", id, err)
	}
	if err := s.BootstrapData("c1", 1, []string{"n0"}); !errors.Is(err, ErrInvalid) {
		t.Errorf("second bootstrap: %v", err)
	}
	for _, n := range []int{0, slots.Count + 1} {
		var e State
		if err := e.BootstrapData("c", n, []string{"n0"}); !errors.Is(err, ErrInvalid) {
			t.Errorf("%d data groups: %v", n, err)
		}
	}
	// A snapshot round-trips.
	b, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var r State
	if err := r.Restore(b); err != nil || !r.Equal(&s) {
		t.Fatalf("restore: %v", err)
	}
}

// Rebalance in a cluster whose meta group serves no keys evens the slots
// out over the data groups only.
func TestRebalanceDataGroups(t *testing.T) {
	var s State
	if err := s.BootstrapData("c1", 2, []string{"n0"}); err != nil {
		t.Fatal(err)
	}
	mv, err := s.BeginMove(1, slots.Range{First: 0, Last: 127}, 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []func() error{
		func() error { return s.Froze(2, mv.ID, 10) },
		func() error { return s.Transferred(3, mv.ID, 11) },
		func() error { return s.Commit(4, mv.ID) },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	plan, err := s.Rebalance()
	if err != nil {
		t.Fatal(err)
	}
	if len(plan) == 0 {
		t.Fatal("no move planned for 384 and 640 slots")
	}
	for _, m := range plan {
		if m.To == 0 || m.From == 0 {
			t.Errorf("planned %v: the meta group owns no slots", m)
		}
	}
}
