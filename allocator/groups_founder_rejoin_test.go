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
	tc := newTCPTestCluster(t, 3, func(i int, c *Config) {
		if i == 0 && c.Bootstrap {
			c.Groups = 2
		}
	})
	waitFor(t, 30*time.Second, "data groups of 3 voters", func() bool {
		for i := 0; i < 3; i++ {
			s := tc.node(i)
			if !s.multi() || len(s.dataGroups()) != 2 {
				return false
			}
			for _, g := range s.dataGroups() {
				v, err := voterIDs(g.node.raft)
				if err != nil || len(v) != 3 {
					return false
				}
			}
		}
		return true
	})
	tc.stop(0, false)
	admin := func() allotv1.AdminClient { _, a := tc.clients(1); return a }()
	waitFor(t, 30*time.Second, "n0 removed", func() bool {
		_, err := admin.RemoveServer(ctxT(t), &allotv1.RemoveServerRequest{Id: "n0"})
		if err != nil {
			t.Logf("remove: %v", err)
		}
		return err == nil
	})
	// n0 again, fresh data dir, joining through n1.
	cfg := tc.config(0)
	cfg.Bootstrap, cfg.Groups, cfg.InitialRules = false, 0, nil
	cfg.DataDir = filepath.Join(t.TempDir(), "n0-new")
	cfg.Join = tc.node(1).GRPCAddr()
	tc.mu.Lock()
	tc.nodes = append(tc.nodes, nil)
	tc.trans = append(tc.trans, nil)
	tc.mu.Unlock()
	tc.cfgs = append(tc.cfgs, cfg)
	i := len(tc.cfgs) - 1

	tc.start(i)
	s := tc.node(i)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if s.multi() {
			for _, g := range s.dataGroups() {
				f := g.node.raft.GetConfiguration()
				if f.Error() != nil {
					continue
				}
				srv := f.Configuration().Servers
				if g.node.raft.State() == raft.Leader && len(srv) == 1 {
					t.Fatalf("rejoined n0 leads data group %d alone (configuration %v, term %d) while the cluster's group runs on n1,n2",
						g.id, srv, g.node.raft.CurrentTerm())
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, g := range s.dataGroups() {
		f := g.node.raft.GetConfiguration()
		t.Logf("group %d on new n0: state %v config %v", g.id, g.node.raft.State(), f.Configuration().Servers)
	}
	// It replicates the running groups: their configurations hold n1 and n2.
	waitFor(t, 15*time.Second, "n0 in the running data groups", func() bool {
		if len(s.dataGroups()) != 2 {
			return false
		}
		for _, g := range s.dataGroups() {
			v, err := voterIDs(g.node.raft)
			if err != nil || !slices.Contains(v, "n1") || !slices.Contains(v, "n2") || !slices.Contains(v, "n0") {
				return false
			}
		}
		return true
	})
}
