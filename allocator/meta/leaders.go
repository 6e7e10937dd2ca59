package meta

import (
	"maps"
	"slices"

	"github.com/allot/allot/pkg/slots"
)

// Transfer asks group Group's leader, From, to hand leadership to To.
type Transfer struct {
	Group    slots.GroupID
	From, To string
}

// PlanLeaders returns the leadership transfers that spread the groups'
// leaders evenly over the live nodes: with every node a member of every
// group, each live node ends up leading ⌊G/N⌋ or ⌈G/N⌉ of the G led
// groups, with the fewest transfers. leaders maps a group to its current
// leader's node id; a group with no leader, or one led by a node not in
// live, is left to its election. A transfer goes only to a live member of
// the group, and no group moves twice. Each step moves one group from a
// most-loaded node to the least-loaded member that leads at least two
// fewer, so the largest load never grows; with partial membership the
// result is as even as those steps reach. Deterministic: ties go to the
// lower group id and node id. An even spread gets no transfers, so the
// runtime can call it after every restart or join.
func PlanLeaders(groups []Group, leaders map[slots.GroupID]string, live []string) []Transfer {
	isLive := make(map[string]bool, len(live))
	load := make(map[string]int, len(live))
	for _, n := range live {
		isLive[n] = true
		load[n] = 0
	}
	members := make(map[slots.GroupID][]string, len(groups))
	led := map[string][]slots.GroupID{} // node → groups it leads, in id order
	for _, g := range groups {
		members[g.ID] = g.Members
		if l, ok := leaders[g.ID]; ok && isLive[l] && slices.Contains(g.Members, l) {
			load[l]++
			led[l] = append(led[l], g.ID)
		}
	}
	for _, gs := range led {
		slices.Sort(gs)
	}
	nodes := slices.Sorted(maps.Keys(load))
	moved := map[slots.GroupID]bool{}
	var out []Transfer
	for {
		// The most-loaded nodes, in id order, try their groups in id order.
		var best *Transfer
		top := 0
		for _, n := range nodes {
			top = max(top, load[n])
		}
		for _, from := range nodes {
			if load[from] != top || best != nil {
				continue
			}
			for _, g := range led[from] {
				if moved[g] {
					continue
				}
				to := ""
				for _, m := range members[g] {
					if isLive[m] && load[m] <= top-2 && (to == "" || load[m] < load[to] || (load[m] == load[to] && m < to)) {
						to = m
					}
				}
				if to != "" {
					best = &Transfer{Group: g, From: from, To: to}
					break
				}
			}
		}
		if best == nil {
			return out
		}
		out = append(out, *best)
		moved[best.Group] = true
		load[best.From]--
		load[best.To]++
		led[best.From] = slices.DeleteFunc(led[best.From], func(g slots.GroupID) bool { return g == best.Group })
	}
}
