package allocator

import (
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/raftmux"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestPeerNamesProcessCluster runs a 3-node cluster as real processes with
// TLS everywhere and -peer-names listing the nodes' certificates: it forms
// by joining, and an agent leases through a follower (forwarded). A
// regional node's allocator certificate from the same CA (allocator/eu-1)
// still leases as region:eu, but its forwarded admin identity is refused
// and the Raft port closes its connection.
func TestPeerNamesProcessCluster(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "allot test CA")
	files := func(name string, role tlsconfig.Role, id string) tlsconfig.Options {
		spec := tlstest.Role(role, id)
		spec.IPs = []net.IP{net.IPv4(127, 0, 0, 1), net.ParseIP(testproc.ClusterHost())}
		o := tlstest.Files(t, dir, name, ca, ca.Issue(t, spec))
		o.ReloadInterval = -1
		return o
	}
	nodes := make([]tlsconfig.Options, 3)
	for i := range nodes {
		nodes[i] = files(fmt.Sprintf("n%d", i), tlsconfig.RoleAllocator, fmt.Sprintf("n%d", i))
	}
	admin, agent := files("admin", tlsconfig.RoleAdmin, "ops"), files("agent", tlsconfig.RoleAgent, "gw-1")
	regional := files("eu-1", tlsconfig.RoleAllocator, "eu-1")
	load := func(o tlsconfig.Options) *tlsconfig.Loader {
		l, err := tlsconfig.Load(o)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	args := []string{"-lease-ttl", "2s", "-max-lease-ttl", "4s", "-refresh-interval", "200ms",
		"-agent-ttl", "6s", "-expire-interval", "200ms",
		"-tls-ca", nodes[0].CAFile, "-tls-client-auth", "require", "-raft-tls", "-peer-names", "n0,n1,n2"}
	c := startProcessClusterConfig(t, testproc.ClusterConfig{Size: 3, Args: args,
		NodeArgs: func(i int) []string { return []string{"-tls-cert", nodes[i].CertFile, "-tls-key", nodes[i].KeyFile} },
		Creds:    load(admin).ClientCredentials("", tlsconfig.RoleAllocator)})
	follower := c.Followers(c.Leader(t, 30*time.Second).ID)[0]

	dialAs := func(o tlsconfig.Options) *grpc.ClientConn {
		cc, err := grpc.NewClient(follower.GRPC, grpc.WithTransportCredentials(load(o).ClientCredentials("", tlsconfig.RoleAllocator)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		return cc
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := allotv1.NewAllocatorClient(dialAs(agent)).Acquire(ctx, acquireReq("gw-1", 1, key("user", "a", 1))); err != nil {
		t.Errorf("agent Acquire through a follower: %v", err)
	}

	eu := dialAs(regional)
	if _, err := allotv1.NewAllocatorClient(eu).Acquire(ctx, acquireReq("region:eu", 1, key("user", "b", 1))); err != nil {
		t.Errorf("allocator/eu-1 Acquire as region:eu: %v", err)
	}
	fwd := metadata.AppendToOutgoingContext(ctx, forwardedKey, "eu-1", identityKey, "admin/ops")
	_, err := allotv1.NewAdminClient(eu).PutRules(fwd, &allotv1.PutRulesRequest{})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "allocator/eu-1") {
		t.Errorf("allocator/eu-1 forwarding as admin/ops: %v, want PermissionDenied naming allocator/eu-1", err)
	}
	if _, err := allotv1.NewAdminClient(eu).AddVoter(ctx, &allotv1.AddVoterRequest{Id: "eu-1", RaftAddr: "127.0.0.1:1"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("allocator/eu-1 AddVoter: %v, want PermissionDenied", err)
	}

	m, err := raftmux.Listen("127.0.0.1:0", raftmux.Config{TLS: load(regional)})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	s, err := m.Group(0)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := s.Dial(raft.ServerAddress(follower.Raft), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, _ = conn.Write([]byte{0})
	if _, err := conn.Read(make([]byte, 1)); err != io.EOF && !strings.Contains(fmt.Sprint(err), "reset") {
		t.Errorf("Raft connection from allocator/eu-1: read %v, want it closed", err)
	}
	conn.Close()
	testproc.Eventually(t, 10*time.Second, "the Raft refusal in the follower's log", func() bool {
		return strings.Contains(follower.Proc.Output(), "peer certificate allocator/eu-1 is not one of the peer names")
	})
}
