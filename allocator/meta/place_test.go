package meta

import (
	"slices"
	"testing"

	"github.com/allot/allot/pkg/slots"
)

// TestPlacement: with Replicas 3, the nodes that join fill the data
// groups up to 3 members and a fourth joins none; a new group goes to the
// 3 nodes hosting the fewest groups and records them as its founders,
// who bootstrap it; a group whose members changed has no founders left,
// so that none bootstraps it again; the replicas and founders survive a
// snapshot. With Replicas 0 every node joins every group.
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
	if g, _ := s.Group(id); !slices.Equal(g.Founders, members) || !g.Bootstraps("n3") || g.Bootstraps("n1") {
		t.Fatalf("group %d founders %v, want %v, bootstrapped by n3 and not n1", id, g.Founders, members)
	}
	if g, _ := s.Group(1); len(g.Founders) != 0 || !slices.Equal(g.Members, []string{"n0", "n1", "n2"}) || g.Bootstraps("n0") {
		t.Fatalf("group 1: %+v, want no founders left (n1 and n2 joined) with members n0 n1 n2, bootstrapped by none", g)
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

// A founder bootstraps its group only while the group is new: once its
// members changed (a node removed, or one added), no node bootstraps it,
// not even a founder removed and added again (with an empty data dir it
// would elect itself leader of an empty copy of the group). A snapshot
// written before founders were cleared restores with the founders of a
// group whose members changed, and none of them bootstraps it either.
func TestFoundersBootstrapOnlyNewGroup(t *testing.T) {
	var s State
	if err := s.BootstrapData("c", 1, []string{"n0"}); err != nil {
		t.Fatal(err)
	}
	id, err := s.AddGroup([]string{"n0", "n1", "n2"})
	if err != nil {
		t.Fatal(err)
	}
	if g, _ := s.Group(id); !g.Bootstraps("n0") || !g.Bootstraps("n2") || g.Bootstraps("n3") {
		t.Fatalf("new group %+v: want bootstrapped by its founders only", g)
	}
	if err := s.SetMembers(id, []string{"n1", "n2"}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetMembers(id, []string{"n0", "n1", "n2"}); err != nil {
		t.Fatal(err)
	}
	g, _ := s.Group(id)
	if len(g.Founders) != 0 || g.Bootstraps("n0") {
		t.Fatalf("group %+v after n0 was removed and added again: want no founders, bootstrapped by none", g)
	}
	b, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var r State
	if err := r.Restore(b); err != nil {
		t.Fatal(err)
	}
	if !r.Equal(&s) {
		t.Fatal("restored state differs")
	}
	// An older snapshot: the members changed, the founders stayed.
	old := Group{ID: 1, Members: []string{"n0", "n1", "n2"}, Founders: []string{"n0"}}
	if old.Bootstraps("n0") {
		t.Fatalf("group %+v from an older snapshot: bootstrapped by n0", old)
	}
}
