package state

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/allot/allot/pkg/slots"
)

// Slot entries. Each slot operation (slots.go) is replicated as a log
// entry of its own kind, applied in log order:
//
//	entry   0x00, 0x40, op byte, uvarint now (Unix ns),
//	        uvarint ranges, ranges × (uvarint first, uvarint last),
//	        uvarint payload length, payload
//
// A fenced entry has the second byte 0x41 and a uvarint fence after the
// op byte: the meta group's term in which its leader proposed it. A
// group applies a slot entry only if its fence is at least the highest
// fence it has applied (an entry of the kind 0x40 has fence 0); a lower
// one is refused, so the entries of a meta leader that was deposed while
// they were in flight cannot act on the slots once a newer meta leader
// has (a second drop of slots that were frozen again since, say). The
// refusal, like every one, changes nothing; an entry that passes the
// fence raises it even when its operation is refused.
//
// Like a compact Acquire entry it starts with 0x00, which never starts a
// protobuf Command; its second byte, 0x40 or 0x41, is not a compact
// Acquire version, so a binary that does not know slot entries stops on
// one (ApplyCompact: ErrUnknownCommand) instead of skipping it. The payload
// is the export for SlotImport (whose ranges are then the slots the group
// owns once the move commits) and empty otherwise.

// SlotOp is a slot operation.
type SlotOp uint8

// The slot operations (see Slots in slots.go).
const (
	SlotFreeze SlotOp = 1 + iota // served → frozen
	SlotThaw                     // frozen → served (a move aborted)
	SlotImport                   // gone → served, with an export's keys
	SlotDrop                     // frozen → gone, its keys freed
	SlotDisown                   // served → gone, for slots without keys
)

func (op SlotOp) String() string {
	switch op {
	case SlotFreeze:
		return "freeze"
	case SlotThaw:
		return "thaw"
	case SlotImport:
		return "import"
	case SlotDrop:
		return "drop"
	case SlotDisown:
		return "disown"
	}
	return fmt.Sprintf("slot op %d", uint8(op))
}

const (
	slotEntryKind       = 0x40
	fencedSlotEntryKind = 0x41
)

// errSlotEntry: a slot entry does not decode.
var errSlotEntry = errors.New("state: slot entry does not decode")

// IsSlotEntry reports whether a log entry's data is a slot entry. Check
// it before IsCompactEntry: both start with 0x00.
func IsSlotEntry(data []byte) bool {
	return len(data) > 1 && data[0] == compactMarker && (data[1] == slotEntryKind || data[1] == fencedSlotEntryKind)
}

// AppendSlotEntry appends the slot entry of op on rs, stamped now, to dst.
// payload is SlotImport's export (nil otherwise).
func AppendSlotEntry(dst []byte, op SlotOp, now int64, rs []slots.Range, payload []byte) []byte {
	return AppendFencedSlotEntry(dst, op, 0, now, rs, payload)
}

// AppendFencedSlotEntry is AppendSlotEntry with a fence (the proposing
// meta leader's term; 0: none).
func AppendFencedSlotEntry(dst []byte, op SlotOp, fence uint64, now int64, rs []slots.Range, payload []byte) []byte {
	if fence == 0 {
		dst = append(dst, compactMarker, slotEntryKind, byte(op))
	} else {
		dst = append(dst, compactMarker, fencedSlotEntryKind, byte(op))
		dst = binary.AppendUvarint(dst, fence)
	}
	dst = binary.AppendUvarint(dst, uint64(max(now, 0)))
	dst = binary.AppendUvarint(dst, uint64(len(rs)))
	for _, r := range rs {
		dst = binary.AppendUvarint(dst, uint64(r.First))
		dst = binary.AppendUvarint(dst, uint64(r.Last))
	}
	dst = binary.AppendUvarint(dst, uint64(len(payload)))
	return append(dst, payload...)
}

// SlotEntry is a decoded slot entry.
type SlotEntry struct {
	Op      SlotOp
	Fence   uint64 // 0: none
	Now     int64
	Ranges  []slots.Range
	Payload []byte // aliases the entry
}

// DecodeSlotEntry decodes a slot entry. It never panics.
func DecodeSlotEntry(data []byte) (SlotEntry, error) {
	if !IsSlotEntry(data) || len(data) < 3 {
		return SlotEntry{}, fmt.Errorf("%w: no marker", errSlotEntry)
	}
	se := SlotEntry{Op: SlotOp(data[2])}
	d := &dec{b: data[3:]}
	if data[1] == fencedSlotEntryKind {
		if se.Fence = d.uvarintMax(1<<63-1, "fence"); se.Fence == 0 && d.err == nil {
			return SlotEntry{}, fmt.Errorf("%w: a fenced entry with fence 0", errSlotEntry)
		}
	}
	se.Now = int64(d.uvarintMax(1<<63-1, "time"))
	n := d.count("ranges")
	for i := 0; i < n && d.err == nil; i++ {
		first, last := d.uvarintMax(1<<16-1, "slot"), d.uvarintMax(1<<16-1, "slot")
		se.Ranges = append(se.Ranges, slots.Range{First: slots.Slot(first), Last: slots.Slot(last)})
	}
	se.Payload = d.view()
	if d.err != nil {
		return SlotEntry{}, fmt.Errorf("%w: %v", errSlotEntry, errors.Unwrap(d.err))
	}
	if len(d.b) != 0 {
		return SlotEntry{}, fmt.Errorf("%w: %d trailing bytes", errSlotEntry, len(d.b))
	}
	if se.Op < SlotFreeze || se.Op > SlotDisown {
		return SlotEntry{}, fmt.Errorf("%w: %v is not known to this binary", ErrUnknownCommand, se.Op)
	}
	return se, nil
}

// Check refuses an entry whose ranges are not valid, sorted and apart
// (ErrInvalid): every slot operation needs such ranges.
func (se SlotEntry) Check() error { return checkRanges(se.Ranges) }

// SlotResult is the result of a slot entry.
type SlotResult struct {
	Op   SlotOp
	Keys int // keys imported (SlotImport) or freed (SlotDrop)
	// Err: the operation was refused (ErrSlotRefused, ErrBadExport,
	// ErrInvalid) and changed nothing but the slot fence: an entry of a
	// newer meta term fences out the older ones whether or not its
	// operation applies. An entry that fails Check changes nothing at
	// all. Every replica refuses alike.
	Err error
}

// ApplySlotEntry applies a slot entry at time max(its stamp, the last
// applied time) (a refused one leaves the time too). An entry that does not decode, or names an operation this
// binary does not know (ErrUnknownCommand), returns an error and changes
// nothing: the raft adapter must stop the node, as for a compact entry. A
// refused operation is not an error: it is in the result.
func (s *State) ApplySlotEntry(data []byte) (SlotResult, error) {
	se, err := DecodeSlotEntry(data)
	if err != nil {
		return SlotResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.st
	c.cow = s.live > 0
	c.tab.grown = false
	res := SlotResult{Op: se.Op}
	if err := se.Check(); err != nil {
		// Malformed: refused before its fence counts.
		res.Err = err
		return res, nil
	}
	if se.Fence < c.slotFence {
		res.Err = fmt.Errorf("%w: %s proposed by a meta leader of term %d, after one of term %d acted on this group's slots",
			ErrSlotRefused, se.Op, se.Fence, c.slotFence)
		return res, nil
	}
	c.slotFence = se.Fence
	switch se.Op {
	case SlotFreeze:
		res.Err = c.freeze(se.Ranges)
	case SlotThaw:
		res.Err = c.thaw(se.Ranges)
	case SlotImport:
		res.Keys, res.Err = c.importKeys(se.Payload, se.Ranges)
	case SlotDrop:
		res.Keys, res.Err = c.drop(se.Ranges)
	case SlotDisown:
		res.Err = c.disown(se.Ranges)
	}
	if res.Err == nil {
		c.now = max(se.Now, c.now) // a refused entry changes nothing, its time included
	}
	return res, nil
}

// apply runs one slot operation through its entry.
func (s *State) applySlot(op SlotOp, now int64, rs []slots.Range, payload []byte) (int, error) {
	res, err := s.ApplySlotEntry(AppendSlotEntry(nil, op, now, rs, payload))
	if err != nil {
		return 0, err
	}
	return res.Keys, res.Err
}

// Freeze stops serving the slots rs (see Slots): from now on their keys'
// state is final, for Export. What a SlotFreeze entry does.
func (s *State) Freeze(now int64, rs []slots.Range) error {
	_, err := s.applySlot(SlotFreeze, now, rs, nil)
	return err
}

// Thaw serves frozen slots again (the move was aborted before the import).
func (s *State) Thaw(now int64, rs []slots.Range) error {
	_, err := s.applySlot(SlotThaw, now, rs, nil)
	return err
}

// Import installs an export's keys and serves its slots, every one of
// which owned must cover (the slots this group owns once the move
// commits) and which must be gone here. It returns how many keys it
// installed.
func (s *State) Import(now int64, export []byte, owned []slots.Range) (int, error) {
	return s.applySlot(SlotImport, now, owned, export)
}

// Drop frees the keys of frozen slots rs, after the move committed, and
// returns how many.
func (s *State) Drop(now int64, rs []slots.Range) (int, error) {
	return s.applySlot(SlotDrop, now, rs, nil)
}

// Disown marks served slots that hold no key as not this group's (a group
// that does not own every slot starts so).
func (s *State) Disown(now int64, rs []slots.Range) error {
	_, err := s.applySlot(SlotDisown, now, rs, nil)
	return err
}

// Export returns the exact state of the keys in rs's slots, every one of
// which must be frozen: each key's bucket state and limit, and its leases
// (agent ids, not numbers) and rates. It reads under the read lock; the
// Raft adapter takes it after the freeze entry applied. Format above
// export in slots.go; DecodeExport reads it.
func (s *State) Export(rs []slots.Range) ([]byte, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.st.export(rs)
}

// SlotModes returns the slots this State does not serve: those frozen and
// those gone (another group's), as ranges in slot order. Both are nil for
// a State that serves every slot.
func (s *State) SlotModes() (frozen, gone []slots.Range) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.st.modes == nil {
		return nil, nil
	}
	for _, r := range s.st.modes.runs() {
		if r.mode == slotFrozen {
			frozen = append(frozen, r.Range)
		} else {
			gone = append(gone, r.Range)
		}
	}
	return frozen, gone
}
