package allocator

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
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
