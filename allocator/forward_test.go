package allocator

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestForwardNamesLeader: an Acquire or Release a follower forwarded comes
// back with the leader's advertised gRPC address in the response header
// (allotv1.LeaderAddrHeader); the leader's own answers carry none.
func TestForwardNamesLeader(t *testing.T) {
	tc := newTestCluster(t, 3)
	tc.waitMembers(3)
	l, f := tc.leader(), tc.follower()
	want := tc.node(l).AdvertiseGRPCAddr()
	fol, _ := tc.clients(f)
	var md metadata.MD
	req := &allotv1.AcquireRequest{AgentId: "route", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "route", 1)}}
	if _, err := fol.Acquire(ctxT(t), req, grpc.Header(&md)); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(allotv1.LeaderAddrHeader); len(got) != 1 || got[0] != want {
		t.Fatalf("forwarded Acquire: header %s = %q, want [%q]", allotv1.LeaderAddrHeader, got, want)
	}
	md = nil
	if _, err := fol.Release(ctxT(t), &allotv1.ReleaseRequest{AgentId: "route", RequestId: 2, All: true}, grpc.Header(&md)); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(allotv1.LeaderAddrHeader); len(got) != 1 || got[0] != want {
		t.Fatalf("forwarded Release: header %s = %q, want [%q]", allotv1.LeaderAddrHeader, got, want)
	}
	lead, _ := tc.clients(l)
	md = nil
	req = &allotv1.AcquireRequest{AgentId: "route2", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "route", 1)}}
	if _, err := lead.Acquire(ctxT(t), req, grpc.Header(&md)); err != nil {
		t.Fatal(err)
	}
	if got := md.Get(allotv1.LeaderAddrHeader); len(got) != 0 {
		t.Fatalf("the leader's own answer names a leader: %q", got)
	}
}
