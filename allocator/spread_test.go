package allocator

import (
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestInRaftContact: the spreader hands a group's leadership only to a
// voter that follows the meta group's leader over Raft and heard from it
// within the heartbeat timeout. Regression: a node whose Raft traffic was
// cut while its gRPC port answered counted as live, so the meta leader
// asked a group's leader, every second, to hand it the leadership; each
// transfer stayed "in progress" for up to the transport's timeout, and
// hashicorp/raft refused the group's writes meanwhile (a group stuck for
// 30 s in TestAllocatorIsolatedGroups, test/fault).
func TestInRaftContact(t *testing.T) {
	const hb = 500 * time.Millisecond
	steps := []struct {
		name string
		st   *allotv1.ClusterStatusResponse
		want bool
	}{
		{"follower in contact", &allotv1.ClusterStatusResponse{State: "follower", LeaderId: "n0", LastContactMs: 40}, true},
		{"contact at the timeout", &allotv1.ClusterStatusResponse{State: "follower", LeaderId: "n0", LastContactMs: 500}, true},
		{"contact older than the timeout", &allotv1.ClusterStatusResponse{State: "follower", LeaderId: "n0", LastContactMs: 501}, false},
		{"no leader known (cut off)", &allotv1.ClusterStatusResponse{State: "follower", LastContactMs: 0}, false},
		{"candidate (cut off)", &allotv1.ClusterStatusResponse{State: "candidate", LastContactMs: 3000}, false},
		{"follows another leader", &allotv1.ClusterStatusResponse{State: "follower", LeaderId: "n2", LastContactMs: 10}, false},
		{"still believes it leads", &allotv1.ClusterStatusResponse{State: "leader", LeaderId: "n1"}, false},
		{"no status", nil, false},
	}
	for i, s := range steps {
		if got := inRaftContact(s.st, "n0", hb); got != s.want {
			t.Errorf("step %d (%s): inRaftContact(%v) = %v, want %v", i, s.name, s.st, got, s.want)
		}
	}
}
