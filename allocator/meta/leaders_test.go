package meta

import (
	"fmt"
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/slots"
)

func fullGroups(g int, nodes []string) []Group {
	out := make([]Group, g)
	for i := range out {
		out[i] = Group{ID: slots.GroupID(i), Members: nodes}
	}
	return out
}

// With 3 nodes and 6 groups, each node leads 2, also after a restarted
// node came back leading nothing.
func TestPlanLeadersThreeNodesSixGroups(t *testing.T) {
	nodes := []string{"n1", "n2", "n3"}
	leaders := map[slots.GroupID]string{0: "n1", 1: "n1", 2: "n1", 3: "n2", 4: "n2", 5: "n2"}
	plan := PlanLeaders(fullGroups(6, nodes), leaders, nodes)
	want := []Transfer{{0, "n1", "n3"}, {3, "n2", "n3"}}
	if !slices.Equal(plan, want) {
		t.Fatalf("plan = %v, want %v", plan, want)
	}
	for _, tr := range plan {
		leaders[tr.Group] = tr.To
	}
	if again := PlanLeaders(fullGroups(6, nodes), leaders, nodes); len(again) != 0 {
		t.Fatalf("an even spread planned %v", again)
	}
	// n3 is down: its groups have no live leader and are left alone.
	if plan := PlanLeaders(fullGroups(6, nodes), leaders, nodes[:2]); len(plan) != 0 {
		t.Fatalf("plan with n3 down = %v", plan)
	}
}

func TestPropertyPlanLeaders(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(1, 5).Draw(t, "nodes")
		var nodes []string
		for i := range n {
			nodes = append(nodes, fmt.Sprintf("n%d", i))
		}
		full := rapid.Bool().Draw(t, "full membership")
		groups := make([]Group, rapid.IntRange(0, 12).Draw(t, "groups"))
		leaders := map[slots.GroupID]string{}
		for i := range groups {
			ms := nodes
			if !full {
				ms = rapid.SliceOfNDistinct(rapid.SampledFrom(nodes), 1, n, rapid.ID[string]).Draw(t, "members")
				slices.Sort(ms)
			}
			groups[i] = Group{ID: slots.GroupID(i), Members: ms}
			if rapid.IntRange(0, 5).Draw(t, "led") > 0 {
				leaders[groups[i].ID] = rapid.SampledFrom(ms).Draw(t, "leader")
			}
		}
		live := nodes
		if rapid.Bool().Draw(t, "one down") {
			live = slices.Delete(slices.Clone(nodes), 0, 1)
		}
		plan := PlanLeaders(groups, leaders, live)

		loads := func(ls map[slots.GroupID]string) map[string]int {
			out := map[string]int{}
			for _, l := range ls {
				if slices.Contains(live, l) {
					out[l]++
				}
			}
			return out
		}
		before := loads(leaders)
		after := map[slots.GroupID]string{}
		for g, l := range leaders {
			after[g] = l
		}
		seen := map[slots.GroupID]bool{}
		for _, tr := range plan {
			if seen[tr.Group] || after[tr.Group] != tr.From || !slices.Contains(groups[tr.Group].Members, tr.To) || !slices.Contains(live, tr.To) {
				t.Fatalf("bad transfer %v in %v", tr, plan)
			}
			seen[tr.Group] = true
			after[tr.Group] = tr.To
		}
		al := loads(after)
		top := func(m map[string]int) (hi, lo int) {
			lo = 1 << 30
			for _, n := range live {
				hi, lo = max(hi, m[n]), min(lo, m[n])
			}
			return hi, lo
		}
		hiB, _ := top(before)
		hiA, loA := top(al)
		if hiA > hiB {
			t.Fatalf("the largest load grew from %d to %d", hiB, hiA)
		}
		if !full {
			return
		}
		if hiA-loA > 1 {
			t.Fatalf("loads %v after %v: not even", al, plan)
		}
		// Fewest transfers: the led groups over len(live) nodes, the
		// extra ones to the nodes leading the most now.
		ledN := 0
		var ls []int
		for _, n := range live {
			ledN += before[n]
			ls = append(ls, before[n])
		}
		slices.Sort(ls)
		slices.Reverse(ls)
		fewest := 0
		for i, l := range ls {
			target := ledN / len(live)
			if i < ledN%len(live) {
				target++
			}
			fewest += max(0, l-target)
		}
		if len(plan) != fewest {
			t.Fatalf("%d transfers, the fewest is %d: %v (loads %v)", len(plan), fewest, plan, before)
		}
	})
}
