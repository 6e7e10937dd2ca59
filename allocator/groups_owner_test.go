package allocator

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// ownerTestDesc is the key test:user=u1, and ownerTestSlot its slot, the
// group that owns it in a new cluster of two groups and the other group.
var ownerTestDesc = []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "user", Value: "u1"}}}}

func ownerTestSlot() (sl slots.Slot, owner, other slots.GroupID) {
	sl = slots.OfKey("test:user=u1")
	if sl >= slots.Count/2 {
		return sl, 2, 1
	}
	return sl, 1, 2
}

// TestGroupsCheckAddressedToOtherGroup: a Check addressed to a data group
// that does not own the key's slot is refused (FailedPrecondition), not
// served from a bucket of that group's own, which would admit the key's
// burst a second time.
func TestGroupsCheckAddressedToOtherGroup(t *testing.T) {
	s := startOneNodeGroups(t, 2)
	_, admin := dial(t, s.GRPCAddr())
	sl, owner, other := ownerTestSlot()
	r, err := admin.Check(ctxT(t), &allotv1.CheckRequest{Domain: "test", Descriptors: ownerTestDesc, Hits: 50})
	if err != nil || r.GetOverallCode() != allotv1.Code_CODE_OK {
		t.Fatalf("check at the owner: %v, %v", r, err)
	}
	r, err = admin.Check(ctxT(t), &allotv1.CheckRequest{Domain: "test", Descriptors: ownerTestDesc, Hits: 50, Group: uint32(other)})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("check addressed to group %d (slot %d is group %d's): %v, %v; want FailedPrecondition", other, sl, owner, r, err)
	}
	r, err = admin.Check(ctxT(t), &allotv1.CheckRequest{Domain: "test", Descriptors: ownerTestDesc, Hits: 1, Group: uint32(owner)})
	if err != nil || r.GetOverallCode() != allotv1.Code_CODE_OVER_LIMIT {
		t.Fatalf("check addressed to the owner after its burst was taken: %v, %v; want OVER_LIMIT", r, err)
	}
}
