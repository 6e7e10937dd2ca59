package allotv1

import (
	"errors"
	"math"
	"testing"

	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"
)

// TestPackedGrantsRoundTrip: every field of every grant survives
// AppendPackedGrants → UnpackGrants, each distinct Limit is carried once
// and shared by the grants that referred to it.
func TestPackedGrantsRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lims := []*Limit{{Name: "a", RequestsPerUnit: 10, WindowSeconds: 1, Burst: 10}, {Name: "b", Burst: 3}}
		i64 := rapid.Int64()
		grants := rapid.SliceOfN(rapid.Custom(func(t *rapid.T) *KeyGrant {
			g := &KeyGrant{
				Status:  KeyStatus(rapid.Int32Range(0, math.MaxInt32).Draw(t, "status")),
				Key:     rapid.String().Draw(t, "key"),
				Granted: i64.Draw(t, "granted"), LeaseTtlMs: i64.Draw(t, "ttl"), RefreshAfterMs: i64.Draw(t, "refresh"),
				Remaining: i64.Draw(t, "remaining"), ResetAfterMs: i64.Draw(t, "reset"), RetryAfterMs: i64.Draw(t, "retry"),
				Agents: rapid.Uint32().Draw(t, "agents"), Held: i64.Draw(t, "held"),
			}
			if li := rapid.IntRange(-1, 1).Draw(t, "limit"); li >= 0 {
				g.Limit = lims[li]
			}
			return g
		}), 0, 50).Draw(t, "grants")
		data, table := AppendPackedGrants(nil, nil, grants)
		if len(table) > len(lims) {
			t.Fatalf("limit table of %d for %d distinct limits", len(table), len(lims))
		}
		got, err := UnpackGrants(data, table)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(grants) {
			t.Fatalf("%d grants back, want %d", len(got), len(grants))
		}
		for i := range grants {
			if !proto.Equal(got[i], grants[i]) || got[i].Limit != grants[i].Limit {
				t.Fatalf("grant %d: got %v, want %v", i, got[i], grants[i])
			}
		}
	})
}

// TestGrantsOf: a response with grants as messages (an allocator that does
// not pack) and one with them packed read the same.
func TestGrantsOf(t *testing.T) {
	l := &Limit{RequestsPerUnit: 5, WindowSeconds: 1, Burst: 5}
	grants := []*KeyGrant{{Status: KeyStatus_KEY_STATUS_OK, Key: "d|k=v", Granted: 3, Limit: l}, {Key: "d|k=w"}}
	plain := &AcquireResponse{Grants: grants}
	packed := &AcquireResponse{}
	packed.PackedGrants, packed.Limits = AppendPackedGrants(nil, nil, grants)
	// Over the wire: the limits are separate messages after decoding.
	wire, err := proto.Marshal(packed)
	if err != nil {
		t.Fatal(err)
	}
	var back AcquireResponse
	if err := proto.Unmarshal(wire, &back); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*AcquireResponse{plain, &back} {
		got, err := GrantsOf(r)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 2 || !proto.Equal(got[0], grants[0]) || !proto.Equal(got[1], grants[1]) {
			t.Fatalf("GrantsOf = %v, want %v", got, grants)
		}
	}
}

// TestUnpackGrantsRejects: malformed packed grants give an error, never a
// panic or a partial answer.
func TestUnpackGrantsRejects(t *testing.T) {
	good, lims := AppendPackedGrants(nil, nil, []*KeyGrant{{Key: "k", Limit: &Limit{}}})
	for name, c := range map[string]struct {
		data []byte
		lims []*Limit
	}{
		"empty":           {nil, nil},
		"count too big":   {[]byte{200, 1}, nil},
		"truncated":       {good[:len(good)-1], lims},
		"trailing":        {append(append([]byte(nil), good...), 0), lims},
		"unknown limit":   {good, nil},
		"varint too long": {[]byte{1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, nil},
	} {
		got, err := UnpackGrants(c.data, c.lims)
		if !errors.Is(err, errPacked) || got != nil {
			t.Errorf("%s: UnpackGrants = %v, %v; want errPacked", name, got, err)
		}
	}
}

// FuzzUnpackGrants: any input decodes or errs without panicking, and what
// decodes encodes back to the same bytes.
func FuzzUnpackGrants(f *testing.F) {
	l := &Limit{Burst: 1}
	good, _ := AppendPackedGrants(nil, nil, []*KeyGrant{{Status: 1, Key: "d|k=v", Granted: -3, Limit: l, Agents: 2}, {}})
	f.Add(good)
	f.Add([]byte{0})
	f.Fuzz(func(t *testing.T, data []byte) {
		lims := []*Limit{l}
		got, err := UnpackGrants(data, lims)
		if err != nil {
			return
		}
		again, table := AppendPackedGrants(nil, nil, got)
		back, err := UnpackGrants(again, table)
		if err != nil || len(back) != len(got) {
			t.Fatalf("re-encoded grants do not decode: %v", err)
		}
		for i := range got {
			if !proto.Equal(back[i], got[i]) {
				t.Fatalf("grant %d: %v after re-encoding, was %v", i, back[i], got[i])
			}
		}
	})
}
