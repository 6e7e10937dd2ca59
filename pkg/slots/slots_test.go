package slots

import (
	"errors"
	"strings"
	"testing"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/rules"
)

// A key's slot is the same from the canonical key and from the hash both
// sides compute, and the ten bits are the hash's lowest.
func TestSlotOfKey(t *testing.T) {
	ents := []rules.Entry{{Key: "tier", Value: "free"}, {Key: "api_key", Value: "k:1"}}
	key := string(rules.AppendKey(nil, nil, "public-api", ents))
	h := rules.KeyHash(nil, "public-api", ents)
	if OfKey(key) != Of(h) {
		t.Fatalf("OfKey(%q) = %d, Of(KeyHash) = %d", key, OfKey(key), Of(h))
	}
	for _, tc := range []struct {
		h    uint64
		want Slot
	}{{0, 0}, {1023, 1023}, {1024, 0}, {1<<64 - 1, 1023}, {0xABCD_0000_0000_0401, 1}} {
		if got := Of(tc.h); got != tc.want {
			t.Errorf("Of(%#x) = %d, want %d", tc.h, got, tc.want)
		}
	}
}

func TestParseRange(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Range
		err  string
	}{
		{"0-1023", All, ""},
		{"5", Range{5, 5}, ""},
		{"0", Range{0, 0}, ""},
		{"100-199", Range{100, 199}, ""},
		{"", Range{}, "slot \"\""},
		{"5-5", Range{}, "a single slot is written A"},
		{"9-3", Range{}, "A < B"},
		{"0-1024", Range{}, "the slots are 0-1023"},
		{"05", Range{}, "want a number"},
		{"+5", Range{}, "want a number"},
		{"1-", Range{}, "want a number"},
		{"-1", Range{}, "want a number"},
		{"1-2-3", Range{}, "want a number"},
		{" 1", Range{}, "want a number"},
		{"99999", Range{}, "want a number"},
	} {
		got, err := ParseRange(tc.in)
		if tc.err != "" {
			if err == nil || !errors.Is(err, ErrSyntax) || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseRange(%q) = %v, %v; want an error with %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want || got.String() != tc.in {
			t.Errorf("ParseRange(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseRanges(t *testing.T) {
	rs, err := ParseRanges("20-29,0-9,15")
	if err != nil || FormatRanges(rs) != "0-9,15,20-29" {
		t.Fatalf("ParseRanges = %v, %v", rs, err)
	}
	for _, in := range []string{"", "0-9,9-12", "0-9,,12", "0-9,5"} {
		if _, err := ParseRanges(in); err == nil {
			t.Errorf("ParseRanges(%q): no error", in)
		}
	}
}

func FuzzParseRange(f *testing.F) {
	for _, s := range []string{"0-1023", "5", "9-3", "05", "1-2-3", "1023-1023"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRange(s)
		if err != nil {
			return
		}
		// Only the canonical form parses.
		if !r.Valid() || r.String() != s {
			t.Fatalf("ParseRange(%q) = %v (%q)", s, r, r.String())
		}
	})
}

func FuzzParseRanges(f *testing.F) {
	for _, s := range []string{"0-9,20-29", "5,4", "0-9,9-12", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		rs, err := ParseRanges(s)
		if err != nil {
			return
		}
		for i, r := range rs {
			if !r.Valid() || (i > 0 && rs[i-1].Last >= r.First) {
				t.Fatalf("ParseRanges(%q) = %v: not sorted, disjoint and valid", s, rs)
			}
		}
		again, err := ParseRanges(FormatRanges(rs))
		if err != nil || FormatRanges(again) != FormatRanges(rs) {
			t.Fatalf("round trip of %q: %v, %v", s, again, err)
		}
	})
}

func FuzzParseMap(f *testing.F) {
	even, _ := Even(0, []GroupID{0, 1, 2})
	f.Add(even.String())
	f.Add("0-1023=0")
	f.Add("0-511=0,512-1023=1,5=2")
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseMap(3, s)
		if err != nil {
			return
		}
		again, err := ParseMap(3, m.String())
		if err != nil || again != m {
			t.Fatalf("ParseMap(%q) does not round trip: %v", s, err)
		}
	})
}

func TestEvenAndZero(t *testing.T) {
	var zero Map
	if zero.Version() != 0 || zero.String() != "0-1023=0" {
		t.Fatalf("zero Map = v%d %s", zero.Version(), zero.String())
	}
	m, err := Even(1, []GroupID{0, 1, 2})
	if err != nil {
		t.Fatal(err)
	}
	if got := m.String(); got != "0-341=0,342-682=1,683-1023=2" {
		t.Fatalf("Even(0,1,2) = %s", got)
	}
	if m.Owner(342) != 1 || m.OwnerOf(1024+683) != 2 {
		t.Fatal("Owner")
	}
	for _, gs := range [][]GroupID{nil, {1, 1}} {
		if _, err := Even(1, gs); err == nil {
			t.Errorf("Even(%v): no error", gs)
		}
	}
	if err := m.Validate([]GroupID{0, 1}); err == nil || !strings.Contains(err.Error(), "slots 683-1023 are owned by group 2, which does not exist") {
		t.Fatalf("Validate: %v", err)
	}
}

func TestRebalanceExamples(t *testing.T) {
	two, _ := Even(1, []GroupID{0, 1})
	moves, err := Rebalance(&two, []GroupID{0, 1, 2})
	if err != nil {
		t.Fatal(err)
	}
	// Group 0 keeps 342 (it and group 1 own the most; ties to the lower
	// id), so it gives 170 and group 1 gives 171, each its highest.
	want := []Move{{Range{342, 511}, 0, 2}, {Range{853, 1023}, 1, 2}}
	if len(moves) != len(want) || moves[0] != want[0] || moves[1] != want[1] {
		t.Fatalf("moves = %v, want %v", moves, want)
	}
	// Draining group 1 of three.
	three, _ := Even(1, []GroupID{0, 1, 2})
	moves, err = Rebalance(&three, []GroupID{0, 2})
	if err != nil {
		t.Fatal(err)
	}
	after, err := three.Apply(moves)
	if err != nil {
		t.Fatal(err)
	}
	if c := after.Counts(); c[0] != 512 || c[2] != 512 || c[1] != 0 {
		t.Fatalf("after draining group 1: %v (%v)", c, moves)
	}
	if _, err := two.Apply([]Move{{Range{0, 600}, 0, 1}}); err == nil {
		t.Fatal("a move of slots the source does not own: no error")
	}
}

// genMap draws a map over groups 0-7 in up to 12 runs.
func genMap(t *rapid.T) Map {
	var m Map
	cuts := rapid.SliceOfNDistinct(rapid.IntRange(1, Count-1), 0, 11, rapid.ID[int]).Draw(t, "cuts")
	owners := rapid.SliceOfN(rapid.Uint32Range(0, 7), len(cuts)+1, len(cuts)+1).Draw(t, "owners")
	start := 0
	for i := 0; i <= len(cuts); i++ {
		end := Count
		if i < len(cuts) {
			end = cuts[i]
		}
		for s := start; s < end; s++ {
			m.owner[s] = GroupID(owners[i])
		}
		start = max(start, end)
	}
	return m
}

func TestPropertyRebalance(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		m := genMap(t)
		ids := rapid.SliceOfNDistinct(rapid.Uint32Range(0, 11), 1, 12, rapid.ID[uint32]).Draw(t, "groups")
		groups := make([]GroupID, len(ids))
		for i, g := range ids {
			groups[i] = GroupID(g)
		}
		moves, err := Rebalance(&m, groups)
		if err != nil {
			t.Fatal(err)
		}
		after, err := m.Apply(moves)
		if err != nil {
			t.Fatalf("apply %v: %v", moves, err)
		}
		if after.Version() != m.Version()+1 {
			t.Fatal("version did not grow")
		}
		if err := after.Validate(groups); err != nil {
			t.Fatal(err)
		}
		n := len(groups)
		counts := after.Counts()
		for _, g := range groups {
			if c := counts[g]; c != Count/n && c != Count/n+1 {
				t.Fatalf("group %d owns %d slots, want %d or %d", g, c, Count/n, Count/n+1)
			}
		}
		// Fewest slots moved: each listed group's target is reached with
		// arrivals only where it had fewer. The lower bound, over every
		// choice of which groups get the extra slot, is the slots of
		// unlisted groups plus each listed group's slots beyond its
		// largest possible target, plus what the extra slots cannot
		// absorb.
		have := m.Counts()
		moved := 0
		seen := map[Slot]bool{}
		givers, takers := map[GroupID]bool{}, map[GroupID]bool{}
		for i, mv := range moves {
			if i > 0 && moves[i-1].Range.Last >= mv.Range.First {
				t.Fatalf("moves %v and %v out of order or overlapping", moves[i-1], mv)
			}
			for s := mv.Range.First; s <= mv.Range.Last; s++ {
				if seen[s] {
					t.Fatalf("slot %d moved twice", s)
				}
				seen[s] = true
			}
			moved += mv.Range.Len()
			givers[mv.From], takers[mv.To] = true, true
		}
		for g := range givers {
			if takers[g] {
				t.Fatalf("group %d both gives and receives: %v", g, moves)
			}
		}
		if moved != minMoved(have, groups) {
			t.Fatalf("moved %d slots, the fewest possible is %d (%v)", moved, minMoved(have, groups), moves)
		}
		// An even map stays put.
		if again, err := Rebalance(&after, groups); err != nil || len(again) != 0 {
			t.Fatalf("rebalancing an even map: %v, %v", again, err)
		}
	})
}

// minMoved computes, by trying every number of listed groups that get the
// extra slot among those owning more than the base, the fewest slots any
// plan can move: a slot stays only if its owner is listed and within its
// target.
func minMoved(have map[GroupID]int, groups []GroupID) int {
	n := len(groups)
	base, extra := Count/n, Count%n
	stay := 0
	big := 0 // listed groups owning more than base: each keeps one more slot if it gets an extra one
	for _, g := range groups {
		stay += min(have[g], base)
		if have[g] > base {
			big++
		}
	}
	return Count - stay - min(big, extra)
}
