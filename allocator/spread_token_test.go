package allocator

import (
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// In a cluster authenticated by admin tokens alone (no client
// certificates, no -open-reads) the meta leader must still see the other
// voters as live, or it spreads no leadership onto them.
func TestSpreadLiveVotersTokenCluster(t *testing.T) {
	tc := newTCPTestCluster(t, 3, func(_ int, c *Config) { c.AdminTokens = []string{testToken} }, func(i int, c *Config) {
		if i == 0 {
			c.Groups = 2
		}
	})
	admin := tokenAdmin(t, tc.node(0).GRPCAddr())
	var st *allotv1.ClusterStatusResponse
	waitFor(t, 30*time.Second, "3 groups of 3 voters with leaders", func() bool {
		var err error
		st, err = admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
		if err != nil || len(st.GetGroups()) != 3 {
			return false
		}
		for _, g := range st.GetGroups() {
			if len(g.GetMembers()) != 3 || g.GetLeaderId() == "" {
				return false
			}
		}
		return true
	})
	metaLeader := st.GetGroups()[0].GetLeaderId()
	var s *Server
	for i := 0; i < 3; i++ {
		if tc.node(i).cfg.NodeID == metaLeader {
			s = tc.node(i)
		}
	}
	live := s.liveVoters()
	t.Logf("meta leader %s sees live voters %v", metaLeader, live)
	if len(live) != 3 {
		t.Errorf("live voters %v, want all 3", live)
	}
}
