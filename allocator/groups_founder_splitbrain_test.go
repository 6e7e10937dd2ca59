package allocator

import (
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// As TestGroupsRemovedFounderRejoinsRunningGroups, with the data groups
// placed on 3 of 5 nodes and the running group without a leader when the
// founder rejoins (AddVoter cannot happen): the founder must not bootstrap
// a one-voter replica of the group and lead it, with empty state, while
// the group's real replicas hold its state.
func TestGroupsRejoinedFounderNoSplitBrain(t *testing.T) {
	tc := newTCPTestCluster(t, 5, func(i int, c *Config) {
		if i == 0 && c.Bootstrap {
			c.Groups, c.GroupReplicas = 2, 3
		}
	})
	waitFor(t, 30*time.Second, "data groups of 3 voters on n0", func() bool {
		s := tc.node(0)
		if !s.multi() || len(s.dataGroups()) != 2 {
			return false
		}
		for _, g := range s.dataGroups() {
			v, err := voterIDs(g.node.raft)
			if err != nil || len(v) != 3 {
				return false
			}
		}
		return true
	})
	g1, _ := voterIDs(tc.node(0).dataGroup(1).node.raft)
	t.Logf("group 1 voters %v", g1)
	tc.stop(0, false)
	_, admin := tc.clients(4)
	waitFor(t, 30*time.Second, "n0 removed", func() bool {
		_, err := admin.RemoveServer(ctxT(t), &allotv1.RemoveServerRequest{Id: "n0"})
		return err == nil
	})
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
	cfg := tc.config(0)
	cfg.Bootstrap, cfg.Groups, cfg.GroupReplicas, cfg.InitialRules = false, 0, 0, nil
	cfg.DataDir = filepath.Join(t.TempDir(), "n0-new")
	join := 4
	if idx == 4 {
		join = 3
	}
	cfg.Join = tc.node(join).GRPCAddr()
	tc.mu.Lock()
	tc.nodes = append(tc.nodes, nil)
	tc.trans = append(tc.trans, nil)
	tc.mu.Unlock()
	tc.cfgs = append(tc.cfgs, cfg)
	i := len(tc.cfgs) - 1
	go tc.start(i)
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		s := tc.node(i)
		if s != nil && s.multi() {
			for _, g := range s.dataGroups() {
				f := g.node.raft.GetConfiguration()
				if f.Error() != nil {
					continue
				}
				srv := f.Configuration().Servers
				ids := []string{}
				for _, x := range srv {
					ids = append(ids, string(x.ID))
				}
				if g.node.raft.State() == raft.Leader && !slices.Contains(ids, other) {
					t.Fatalf("rejoined n0 leads data group %d with configuration %v (term %d); the group's real replicas (with %s) were never part of it",
						g.id, ids, g.node.raft.CurrentTerm(), other)
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
}
