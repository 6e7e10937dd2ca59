package allocator

import (
	"testing"
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
	metaLeader := waitThreeGroupsLed(t, admin).GetGroups()[0].GetLeaderId()
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
