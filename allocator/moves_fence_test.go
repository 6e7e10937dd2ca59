package allocator

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	"github.com/allot/allot/pkg/tlsconfig"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestGroupsSlotFence: a meta leader deposed mid-move cannot act on a
// data group's slots once a newer meta leader has. A one-node cluster
// with two groups stands in for both: an entry stamped with the next meta
// term (the newer leader's) freezes a key's slot again; then the drop a
// deposed leader of the current term would have in flight, and the thaw
// its driver proposes for frozen slots no move takes, are refused, and
// the key's state stays intact; an entry of the newer term thaws it.
func TestGroupsSlotFence(t *testing.T) {
	addrs := testproc.FreeAddrs(t, 2)
	cfg := DefaultConfig()
	cfg.NodeID, cfg.DataDir = "n0", t.TempDir()
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = addrs[0], addrs[1], ""
	cfg.Bootstrap, cfg.Groups = true, 2
	cfg.InitialRules = testRuleFiles()
	cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = 250*time.Millisecond, 250*time.Millisecond, 125*time.Millisecond
	cfg.Logger = testLogger(t, slog.LevelError)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Error(err)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	alloc, admin := dial(t, s.GRPCAddr())
	resp, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "u1", 20)}})
	if err != nil || resp.GetGrants()[0].GetGranted() == 0 {
		t.Fatalf("Acquire: %v, %v", resp, err)
	}
	sl := slots.OfKey("test:user=u1")
	rs := []slots.Range{{First: sl, Last: sl}}
	group := slots.GroupID(1)
	if sl >= 512 {
		group = 2
	}
	term := s.barrierTerm.Load()
	propose := func(fence uint64, op state.SlotOp) *allotv1.ApplySlotEntryResponse {
		t.Helper()
		res, err := s.proposeSlot(ctx, fence, group, op, rs, nil)
		if err != nil {
			t.Fatalf("%v at fence %d: %v", op, fence, err)
		}
		return res
	}
	tracked := func() bool {
		t.Helper()
		r, err := admin.InspectKey(ctx, &allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: "user", Value: "u1"}}})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetTracked() && len(r.GetLeases()) == 1
	}
	if res := propose(term+1, state.SlotFreeze); res.GetRefused() != "" {
		t.Fatalf("freeze of the newer term: refused: %s", res.GetRefused())
	}
	for _, op := range []state.SlotOp{state.SlotDrop, state.SlotThaw} {
		if res := propose(term, op); !strings.Contains(res.GetRefused(), "meta leader of term") {
			t.Errorf("%v of the deposed term %d after term %d: refused %q, want refused by the fence", op, term, term+1, res.GetRefused())
		}
	}
	if !tracked() {
		t.Fatal("the frozen key's state is gone after the refused drop")
	}
	if res := propose(term+1, state.SlotThaw); res.GetRefused() != "" {
		t.Fatalf("thaw of the newer term: refused: %s", res.GetRefused())
	}
	resp, err = alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{key("user", "u1", 20)}})
	if err != nil || resp.GetGrants()[0].GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK {
		t.Fatalf("Acquire after the thaw: %v, %v", resp, err)
	}
}

// TestGroupsApplySlotEntryRefusesFenceAboveMetaTerm: Admin.ApplySlotEntry
// refuses (InvalidArgument, nothing applied) an entry fenced above the
// meta group's term, which would make the group refuse every later
// driver's entry for its slots, an entry without a fence, and one whose
// ranges overlap. The slot stays served and a move of it still commits.
func TestGroupsApplySlotEntryRefusesFenceAboveMetaTerm(t *testing.T) {
	s := startOneNodeGroups(t, 2)
	alloc, admin := dial(t, s.GRPCAddr())
	sl, owner, other := ownerTestSlot()
	rs := []slots.Range{{First: sl, Last: sl}}
	for name, entry := range map[string][]byte{
		"fence 2^40":                  state.AppendFencedSlotEntry(nil, state.SlotFreeze, 1<<40, time.Now().UnixNano(), rs, nil),
		"no fence":                    state.AppendSlotEntry(nil, state.SlotFreeze, time.Now().UnixNano(), rs, nil),
		"overlapping ranges, fence 1": state.AppendFencedSlotEntry(nil, state.SlotFreeze, 1, time.Now().UnixNano(), append(rs, rs...), nil),
	} {
		res, err := admin.ApplySlotEntry(ctxT(t), &allotv1.ApplySlotEntryRequest{Group: uint32(owner), Entry: entry})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("ApplySlotEntry, freeze with %s: %v, %v; want InvalidArgument", name, res, err)
		}
	}
	r, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "u1", 20)}})
	if err != nil || r.GetGrants()[0].GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK {
		t.Fatalf("acquire in slot %d after the refused entries: %v, %v; want OK", sl, r, err)
	}
	mv, err := admin.MoveSlots(ctxT(t), &allotv1.MoveSlotsRequest{Slots: rs[0].String(), To: uint32(other)})
	if err != nil || !mv.GetMove().GetCommitted() {
		t.Fatalf("move of slot %d after the refused entries: %v, %v; want committed", sl, mv, err)
	}
}

// TestApplySlotEntryPeersOnly: only a caller whose certificate has the
// allocator role may call Admin.ApplySlotEntry; an admin (certificate or
// token) may not. Where client certificates are not verified (ClientAuth
// none, with or without TLS) no node has a certificate: there a node
// proves itself with the admin token every node's file holds.
func TestApplySlotEntryPeersOnly(t *testing.T) {
	m := allotv1.Admin_ApplySlotEntry_FullMethodName
	for _, c := range []struct {
		name    string
		noCerts bool
		p       principal
		want    codes.Code
	}{
		{"allocator certificate", false, principal{cert: tlsconfig.Identity{Role: tlsconfig.RoleAllocator, Name: "n1"}}, codes.OK},
		{"admin certificate", false, principal{cert: tlsconfig.Identity{Role: tlsconfig.RoleAdmin, Name: "ops"}}, codes.PermissionDenied},
		{"admin token", false, principal{token: true}, codes.PermissionDenied},
		{"anonymous", false, principal{}, codes.Unauthenticated},
		{"admin token, no client certificates", true, principal{token: true}, codes.OK},
		{"anonymous, no client certificates", true, principal{}, codes.Unauthenticated},
	} {
		g := &guard{noCerts: c.noCerts}
		var err error
		if aerr := g.authorize(c.p, classify(m), m, &allotv1.ApplySlotEntryRequest{}); aerr != nil {
			err = aerr.err
		}
		if got := status.Code(err); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
}
