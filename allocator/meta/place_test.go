package meta

import (
	"slices"
	"testing"

	"github.com/allot/allot/pkg/slots"
)

// TestPlacement: with Replicas 3, the nodes that join fill the data
// groups up to 3 members and a fourth joins none; a new group goes to the
// 3 nodes hosting the fewest groups and records them as its founders; the
// replicas and founders survive a snapshot. With Replicas 0 every node
// joins every group.
func TestPlacement(t *testing.T) {
	var s State
	if err := s.BootstrapData("c", 2, []string{"n0"}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetReplicas(16); err == nil {
		t.Fatal("SetReplicas(16) accepted")
	}
	if got := s.GroupsToJoin("n1"); !slices.Equal(got, []slots.GroupID{1, 2}) {
		t.Fatalf("Replicas 0: n1 joins %v, want [1 2]", got)
	}
	if err := s.SetReplicas(3); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"n1", "n2"} {
		for _, id := range s.GroupsToJoin(n) {
			g, _ := s.Group(id)
			if err := s.SetMembers(id, append(g.Members, n)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := s.GroupsToJoin("n3"); len(got) != 0 {
		t.Fatalf("n3 joins %v, want none: every group has 3 members", got)
	}
	members := s.PlaceGroup([]string{"n3", "n2", "n1", "n0", "n4"})
	if !slices.Equal(members, []string{"n0", "n3", "n4"}) {
		t.Fatalf("PlaceGroup = %v, want [n0 n3 n4]", members)
	}
	id, err := s.AddGroup(members)
	if err != nil {
		t.Fatal(err)
	}
	if g, _ := s.Group(id); !slices.Equal(g.Founders, members) {
		t.Fatalf("group %d founders %v, want %v", id, g.Founders, members)
	}
	if g, _ := s.Group(1); !slices.Equal(g.Founders, []string{"n0"}) || !slices.Equal(g.Members, []string{"n0", "n1", "n2"}) {
		t.Fatalf("group 1: %+v, want founded by n0 with members n0 n1 n2", g)
	}
	b, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var r State
	if err := r.Restore(b); err != nil {
		t.Fatal(err)
	}
	if !r.Equal(&s) || r.Replicas() != 3 {
		t.Fatalf("restored: replicas %d, equal %v", r.Replicas(), r.Equal(&s))
	}
}
