package state

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/allot/allot/pkg/slots"
)

// TestSlotFence pins the fencing of slot entries by the meta leader's
// term: after a move of term 3 froze a slot again, a drop of term 2 (a
// deposed meta leader's, in flight since its move committed) is refused
// and the keys stay for the export; a refusal for another reason still
// raises the fence; the fence survives a snapshot (version 7); an entry
// without a fence decodes with fence 0.
func TestSlotFence(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 5, 0, 0, 0))
	x := slotOf(s, "tb", "x")
	r := []slots.Range{{First: x, Last: x}}
	apply := func(op SlotOp, fence uint64) SlotResult {
		t.Helper()
		res, err := s.ApplySlotEntry(AppendFencedSlotEntry(nil, op, fence, at(time.Second), r, nil))
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	if res := apply(SlotFreeze, 2); res.Err != nil {
		t.Fatalf("freeze of term 2: %v", res.Err)
	}
	if res := apply(SlotThaw, 3); res.Err != nil {
		t.Fatalf("thaw of term 3: %v", res.Err)
	}
	if res := apply(SlotFreeze, 3); res.Err != nil {
		t.Fatalf("freeze of term 3: %v", res.Err)
	}
	res := apply(SlotDrop, 2)
	if !errors.Is(res.Err, ErrSlotRefused) || res.Keys != 0 {
		t.Fatalf("drop of term 2 after term 3: %+v, want refused", res)
	}
	if x := exported(t, s, r); len(x.Keys) != 1 {
		t.Fatalf("export after the refused drop: %d keys, want 1", len(x.Keys))
	}
	// Refused for its operation (the slot is frozen, not served), a
	// disown of term 4 raises the fence: term 3 is refused from then on.
	if res := apply(SlotDisown, 4); !errors.Is(res.Err, ErrSlotRefused) {
		t.Fatalf("disown of a frozen slot: %v, want refused", res.Err)
	}
	if res := apply(SlotThaw, 3); !errors.Is(res.Err, ErrSlotRefused) {
		t.Fatalf("thaw of term 3 after term 4: %v, want refused", res.Err)
	}
	b := persist(t, s)
	if v := b[len(snapMagic)]; v != snapVersionFence {
		t.Fatalf("format version %d, want %d", v, snapVersionFence)
	}
	r2 := newRestored(t, b)
	if !bytes.Equal(b, persist(t, r2)) {
		t.Fatal("restored state persists to other bytes")
	}
	if res, err := r2.ApplySlotEntry(AppendFencedSlotEntry(nil, SlotDrop, 3, at(time.Second), r, nil)); err != nil || !errors.Is(res.Err, ErrSlotRefused) {
		t.Fatalf("restored: drop of term 3 after term 4: %+v, %v; want refused", res, err)
	}
	if res, err := r2.ApplySlotEntry(AppendFencedSlotEntry(nil, SlotDrop, 4, at(time.Second), r, nil)); err != nil || res.Err != nil || res.Keys != 1 {
		t.Fatalf("restored: drop of term 4: %+v, %v; want 1 key dropped", res, err)
	}
	se, err := DecodeSlotEntry(AppendSlotEntry(nil, SlotThaw, 1, r, nil))
	if err != nil || se.Fence != 0 {
		t.Fatalf("unfenced entry: %+v, %v", se, err)
	}
	if _, err := DecodeSlotEntry([]byte{compactMarker, fencedSlotEntryKind, byte(SlotThaw), 0, 0, 0, 0}); err == nil {
		t.Fatal("a fenced entry with fence 0 decoded")
	}
}
