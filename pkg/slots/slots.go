package slots

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// Count is the number of slots.
const Count = 1024

// Slot is a slot number, below Count.
type Slot uint16

// GroupID names a Raft group. Group 0 is the meta group.
type GroupID uint32

// Of returns the slot of the key whose canonical-key hash is h
// (rules.KeyHash).
func Of(h uint64) Slot { return Slot(h & (Count - 1)) }

// OfKey returns the slot of a canonical budget key.
func OfKey(key string) Slot { return Of(xxhash.Sum64String(key)) }

// ErrSyntax is wrapped by every parse error.
var ErrSyntax = errors.New("slots: syntax")

// Range is the slots First through Last, inclusive.
type Range struct{ First, Last Slot }

// Len is the number of slots in r.
func (r Range) Len() int { return int(r.Last) - int(r.First) + 1 }

// Contains reports whether s is in r.
func (r Range) Contains(s Slot) bool { return r.First <= s && s <= r.Last }

// Overlaps reports whether r and o share a slot.
func (r Range) Overlaps(o Range) bool { return r.First <= o.Last && o.First <= r.Last }

// String is "A-B", or "A" for a single slot: what ParseRange reads.
func (r Range) String() string {
	if r.First == r.Last {
		return strconv.Itoa(int(r.First))
	}
	return strconv.Itoa(int(r.First)) + "-" + strconv.Itoa(int(r.Last))
}

// MarshalText writes r as String does.
func (r Range) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// UnmarshalText reads r as ParseRange does.
func (r *Range) UnmarshalText(b []byte) error {
	v, err := ParseRange(string(b))
	if err != nil {
		return err
	}
	*r = v
	return nil
}

// Valid reports whether r is a range of existing slots, First ≤ Last.
func (r Range) Valid() bool { return r.First <= r.Last && r.Last < Count }

// All is every slot.
var All = Range{0, Count - 1}

// parseSlot reads a slot number in canonical decimal: digits only, no
// leading zero, below Count.
func parseSlot(s string) (Slot, error) {
	if s == "" || len(s) > 4 || (len(s) > 1 && s[0] == '0') {
		return 0, fmt.Errorf("%w: slot %q: want a number 0-%d", ErrSyntax, s, Count-1)
	}
	n := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("%w: slot %q: want a number 0-%d", ErrSyntax, s, Count-1)
		}
		n = n*10 + int(c-'0')
	}
	if n >= Count {
		return 0, fmt.Errorf("%w: slot %d: the slots are 0-%d", ErrSyntax, n, Count-1)
	}
	return Slot(n), nil
}

// ParseRange reads "A-B" (A ≤ B) or "A".
func ParseRange(s string) (Range, error) {
	a, b, isRange := strings.Cut(s, "-")
	first, err := parseSlot(a)
	if err != nil {
		return Range{}, err
	}
	last := first
	if isRange {
		if last, err = parseSlot(b); err != nil {
			return Range{}, err
		}
		if last <= first {
			return Range{}, fmt.Errorf("%w: range %q: want A-B with A < B (a single slot is written A)", ErrSyntax, s)
		}
	}
	return Range{first, last}, nil
}

// ParseRanges reads a comma-separated list of ranges ("0-9,20-29"), in any
// order, none overlapping another; it returns them in slot order.
func ParseRanges(s string) ([]Range, error) {
	if s == "" {
		return nil, fmt.Errorf("%w: no slot range", ErrSyntax)
	}
	var out []Range
	for part := range strings.SplitSeq(s, ",") {
		r, err := ParseRange(part)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b Range) int { return int(a.First) - int(b.First) })
	for i := 1; i < len(out); i++ {
		if out[i-1].Overlaps(out[i]) {
			return nil, fmt.Errorf("slots: ranges %s and %s overlap", out[i-1], out[i])
		}
	}
	return out, nil
}

// FormatRanges writes ranges as ParseRanges reads them.
func FormatRanges(rs []Range) string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = r.String()
	}
	return strings.Join(parts, ",")
}
