package allocator

import (
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// A founder of the data groups (the bootstrapping node) removed from the
// cluster (cluster remove) and joining again under the same node id with
// an empty data dir joins the running data groups: it does not bootstrap
// a group of its own.
func TestGroupsRemovedFounderRejoinsRunningGroups(t *testing.T) {
	founderRejoins(t, true)
}

// A founder of the data groups whose disk is wiped, still a member of
// every group, that joins again under the same node id with an empty
// data dir joins the running data groups: it does not bootstrap a group
// of its own.
func TestGroupsWipedFounderRejoinsRunningGroups(t *testing.T) {
	founderRejoins(t, false)
}

// founderRejoins: 3 nodes, 2 data groups on all of them; n0, the founder,
// stops (and is removed from the cluster when remove is set) and joins
// again through n1 with an empty data dir. It must not lead a group of
// its own, and ends up a voter of both running groups.
func founderRejoins(t *testing.T, remove bool) {
	tc := foundedGroups(t, 3, 0)
	waitDataGroupVoters(t, tc, []int{0, 1, 2}, 2, 3)
	tc.stop(0, false)
	if remove {
		removeNode(t, tc, 1, "n0")
	}
	i := rejoinFresh(t, tc, 0, 1)
	tc.start(i)
	neverLeadsAlone(t, tc, i, 15*time.Second)
	waitRejoinedGroups(t, tc.node(i), 2, "n0", "n1", "n2")
}

// As TestGroupsRemovedFounderRejoinsRunningGroups, with the data groups
// placed on 3 of 5 nodes and the running group without a leader when the
// founder rejoins (AddVoter cannot happen): the founder must not bootstrap
// a one-voter replica of the group and lead it, with empty state, while
// the group's real replicas hold its state.
func TestGroupsRejoinedFounderNoSplitBrain(t *testing.T) {
	tc := foundedGroups(t, 5, 3)
	waitDataGroupVoters(t, tc, []int{0}, 2, 3)
	g1, _ := voterIDs(tc.node(0).dataGroup(1).node.raft)
	t.Logf("group 1 voters %v", g1)
	tc.stop(0, false)
	removeNode(t, tc, 4, "n0")
	// Take down one of the two remaining members of the data groups: they
	// have no leader now; the meta group (4 voters, 3 live) has.
	other := ""
	for _, id := range g1 {
		if id != "n0" {
			other = id
			break
		}
	}
	idx := int(other[1] - '0')
	tc.stop(idx, false)
	t.Logf("stopped %s", other)
	join := 4
	if idx == 4 {
		join = 3
	}
	i := rejoinFresh(t, tc, 0, join)
	go tc.start(i)
	watchRejoined(t, tc, i, 20*time.Second, func(g *dataGroup, ids []string) {
		if g.node.raft.State() == raft.Leader && !slices.Contains(ids, other) {
			t.Fatalf("rejoined n0 leads data group %d with configuration %v (term %d); the group's real replicas (with %s) were never part of it",
				g.id, ids, g.node.raft.CurrentTerm(), other)
		}
	})
}

// foundedGroups starts n nodes over TCP, the first bootstrapping 2 data
// groups (of replicas voters each; 0: every node).
func foundedGroups(t *testing.T, n, replicas int) *testCluster {
	t.Helper()
	return newTCPTestCluster(t, n, func(i int, c *Config) {
		if i == 0 && c.Bootstrap {
			c.Groups, c.GroupReplicas = 2, replicas
		}
	})
}

// waitDataGroupVoters waits until each of nodes hosts groups data groups
// of voters voters each.
func waitDataGroupVoters(t *testing.T, tc *testCluster, nodes []int, groups, voters int) {
	t.Helper()
	waitFor(t, 30*time.Second, "data groups of their voters", func() bool {
		for _, i := range nodes {
			s := tc.node(i)
			if !s.multi() || len(s.dataGroups()) != groups {
				return false
			}
			for _, g := range s.dataGroups() {
				v, err := voterIDs(g.node.raft)
				if err != nil || len(v) != voters {
					return false
				}
			}
		}
		return true
	})
}

// removeNode removes id from the cluster through node via.
func removeNode(t *testing.T, tc *testCluster, via int, id string) {
	t.Helper()
	_, admin := tc.clients(via)
	waitFor(t, 30*time.Second, id+" removed", func() bool {
		_, err := admin.RemoveServer(ctxT(t), &allotv1.RemoveServerRequest{Id: id})
		if err != nil {
			t.Logf("remove: %v", err)
		}
		return err == nil
	})
}

// rejoinFresh adds a node with node i's id and a fresh data dir that joins
// through node via, and returns its index; it is not started.
func rejoinFresh(t *testing.T, tc *testCluster, i, via int) int {
	t.Helper()
	cfg := tc.config(i)
	cfg.Bootstrap, cfg.Groups, cfg.GroupReplicas, cfg.InitialRules = false, 0, 0, nil
	cfg.DataDir = filepath.Join(t.TempDir(), cfg.NodeID+"-new")
	cfg.Join = tc.node(via).GRPCAddr()
	tc.mu.Lock()
	tc.nodes = append(tc.nodes, nil)
	tc.trans = append(tc.trans, nil)
	tc.mu.Unlock()
	tc.cfgs = append(tc.cfgs, cfg)
	return len(tc.cfgs) - 1
}

// watchRejoined calls f with each data group node i hosts and the server
// ids of its configuration, every 20 ms for d (a window in which a
// bootstrapped copy would elect itself).
func watchRejoined(t *testing.T, tc *testCluster, i int, d time.Duration, f func(g *dataGroup, ids []string)) {
	t.Helper()
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		s := tc.node(i)
		if s == nil || !s.multi() {
			continue
		}
		for _, g := range s.dataGroups() {
			c := g.node.raft.GetConfiguration()
			if c.Error() != nil {
				continue
			}
			var ids []string
			for _, x := range c.Configuration().Servers {
				ids = append(ids, string(x.ID))
			}
			f(g, ids)
		}
	}
}

// neverLeadsAlone fails the test if node i leads a data group whose
// configuration holds only itself within d.
func neverLeadsAlone(t *testing.T, tc *testCluster, i int, d time.Duration) {
	t.Helper()
	watchRejoined(t, tc, i, d, func(g *dataGroup, ids []string) {
		if g.node.raft.State() == raft.Leader && len(ids) == 1 {
			t.Fatalf("rejoined node leads data group %d alone (configuration %v, term %d) while the cluster's group runs on the others",
				g.id, ids, g.node.raft.CurrentTerm())
		}
	})
	for _, g := range tc.node(i).dataGroups() {
		c := g.node.raft.GetConfiguration()
		t.Logf("group %d on the rejoined node: state %v config %v", g.id, g.node.raft.State(), c.Configuration().Servers)
	}
}

// waitRejoinedGroups waits until s hosts groups data groups whose voters
// include every id in voters: it replicates the running groups.
func waitRejoinedGroups(t *testing.T, s *Server, groups int, voters ...string) {
	t.Helper()
	waitFor(t, 15*time.Second, "the rejoined node in the running data groups", func() bool {
		if len(s.dataGroups()) != groups {
			return false
		}
		for _, g := range s.dataGroups() {
			v, err := voterIDs(g.node.raft)
			if err != nil {
				return false
			}
			for _, id := range voters {
				if !slices.Contains(v, id) {
					return false
				}
			}
		}
		return true
	})
}
