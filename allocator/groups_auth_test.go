package allocator

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestGroupsMembershipAcrossNodesAuthenticated: with authentication on, the
// meta leader's calls to a data group led by another node carry
// credentials that node accepts: the meta leader's own when a node joins
// (AddVoter of the data group), the admin's when an admin removes a node
// (RemoveServer of the data group). With tokens alone, with client
// certificates, and with client certificates and PeerNames naming every
// node's certificate.
func TestGroupsMembershipAcrossNodesAuthenticated(t *testing.T) {
	p := newTestPKI(t)
	ca, dir := tlstest.NewCA(t, "allot test CA"), t.TempDir()
	named := make([]tlsconfig.Options, 4)
	for i := range named {
		name := fmt.Sprintf("n%d", i)
		named[i] = tlstest.Files(t, dir, name, ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, name)))
	}
	namedAdmin := tlstest.Files(t, dir, "admin", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAdmin, "")))
	for _, tt := range []struct {
		name  string
		auth  clusterOpt
		admin func(t *testing.T, addr string) allotv1.AdminClient
	}{
		{"tokens", func(_ int, c *Config) { c.AdminTokens = []string{testToken} }, tokenAdmin},
		{"client certificates", withTLS(p), func(t *testing.T, addr string) allotv1.AdminClient {
			_, admin := dialAs(t, addr, p.admin, "")
			return admin
		}},
		{"client certificates, peer names", func(i int, c *Config) {
			c.TLS, c.ClientAuth, c.RaftTLS = named[i], tlsconfig.ClientAuthRequire, true
			c.PeerNames = []string{"n0", "n1", "n2", "n3"}
		}, func(t *testing.T, addr string) allotv1.AdminClient {
			_, admin := dialAs(t, addr, namedAdmin, "")
			return admin
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tc := newTCPTestCluster(t, 3, tt.auth, func(i int, c *Config) {
				if i == 0 {
					c.Groups = 2
				}
			})
			admin := tt.admin(t, tc.node(0).GRPCAddr())
			metaLeader, g1Leader := leadGroup1Elsewhere(t, admin)

			tc.add(0)
			waitFor(t, 20*time.Second, "n3 a voter of every data group", func() bool {
				st, err := admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
				if err != nil {
					return false
				}
				for _, g := range st.GetGroups() {
					if !slices.Contains(g.GetMembers(), "n3") {
						return false
					}
				}
				return true
			})

			victim := ""
			for _, id := range []string{"n0", "n1", "n2", "n3"} {
				if id != metaLeader && id != g1Leader {
					victim = id
					break
				}
			}
			t.Logf("meta leader %s, group 1 leader %s, removing %s through %s", metaLeader, g1Leader, victim, g1Leader)
			// Through a node that forwards the call to the meta leader.
			via := tt.admin(t, tc.node(int(g1Leader[1]-'0')).GRPCAddr())
			if _, err := via.RemoveServer(ctxT(t), &allotv1.RemoveServerRequest{Id: victim}); err != nil {
				t.Fatalf("RemoveServer(%s) by an admin: %v", victim, err)
			}
			st, err := admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
			if err != nil {
				t.Fatal(err)
			}
			for _, g := range st.GetGroups() {
				if slices.Contains(g.GetMembers(), victim) {
					t.Errorf("group %d still lists %s: %v", g.GetId(), victim, g.GetMembers())
				}
			}
		})
	}
}

// tokenAdmin is an Admin client of addr over plaintext with the test token.
func tokenAdmin(t *testing.T, addr string) allotv1.AdminClient {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(bearerCreds(testToken)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return allotv1.NewAdminClient(cc)
}

// leadGroup1Elsewhere waits for a cluster of three groups (the meta group
// and two data groups) with leaders, moves data group 1's leadership off
// the meta group's leader if needed, and returns both leaders.
func leadGroup1Elsewhere(t *testing.T, admin allotv1.AdminClient) (metaLeader, g1Leader string) {
	t.Helper()
	st := waitThreeGroupsLed(t, admin)
	metaLeader = st.GetGroups()[0].GetLeaderId()
	if st.GetGroups()[1].GetLeaderId() == metaLeader {
		to := "n0"
		if metaLeader == to {
			to = "n1"
		}
		if _, err := admin.TransferLeadership(ctxT(t), &allotv1.TransferLeadershipRequest{Group: 1, Id: to}); err != nil {
			t.Fatalf("transfer group 1 to %s: %v", to, err)
		}
	}
	waitFor(t, 10*time.Second, "group 1 led by another node than the meta group", func() bool {
		var err error
		st, err = admin.ClusterStatus(ctxT(t), &allotv1.ClusterStatusRequest{})
		return err == nil && st.GetGroups()[0].GetLeaderId() == metaLeader &&
			st.GetGroups()[1].GetLeaderId() != "" && st.GetGroups()[1].GetLeaderId() != metaLeader
	})
	return metaLeader, st.GetGroups()[1].GetLeaderId()
}

// waitThreeGroupsLed waits until admin's cluster reports three groups (the
// meta group and two data groups) of three voters, each with a leader, and
// returns that status.
func waitThreeGroupsLed(t *testing.T, admin allotv1.AdminClient) *allotv1.ClusterStatusResponse {
	t.Helper()
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
	return st
}
