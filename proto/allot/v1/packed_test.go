package allotv1

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
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
			if rapid.Bool().Draw(t, "has share") {
				g.Share = proto.Float64(rapid.Float64().Draw(t, "share"))
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

// TestHasStatus: HasStatus finds a status among packed grants exactly when
// one of the grants has it, and reads grants sent as messages the same.
func TestHasStatus(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := &Limit{Burst: 1}
		grants := rapid.SliceOfN(rapid.Custom(func(t *rapid.T) *KeyGrant {
			g := &KeyGrant{Status: KeyStatus(rapid.Int32Range(0, 8).Draw(t, "status")), Key: rapid.String().Draw(t, "key"),
				Granted: rapid.Int64().Draw(t, "granted"), Held: rapid.Int64().Draw(t, "held"), Agents: rapid.Uint32().Draw(t, "agents")}
			if rapid.Bool().Draw(t, "limit") {
				g.Limit = l
			}
			if rapid.Bool().Draw(t, "has share") {
				g.Share = proto.Float64(rapid.Float64().Draw(t, "share"))
			}
			return g
		}), 0, 20).Draw(t, "grants")
		st := KeyStatus(rapid.Int32Range(0, 8).Draw(t, "want"))
		want := slices.ContainsFunc(grants, func(g *KeyGrant) bool { return g.GetStatus() == st })
		packed := &AcquireResponse{}
		packed.PackedGrants, packed.Limits = AppendPackedGrants(nil, nil, grants)
		if got := HasStatus(packed, st); got != want {
			t.Fatalf("HasStatus(packed, %v) = %v, want %v", st, got, want)
		}
		if got := HasStatus(&AcquireResponse{Grants: grants}, st); got != want {
			t.Fatalf("HasStatus(messages, %v) = %v, want %v", st, got, want)
		}
	})
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

// FuzzUnpackGrants: any input decodes or errs without panicking, what
// decodes encodes back to the same bytes, and GrantTotals refuses what
// UnpackGrants refuses and counts what it decodes.
func FuzzUnpackGrants(f *testing.F) {
	l := &Limit{Burst: 1}
	good, _ := AppendPackedGrants(nil, nil, []*KeyGrant{{Status: 1, Key: "d|k=v", Granted: -3, Limit: l, Agents: 2}, {}})
	f.Add(good)
	f.Add([]byte{0})
	f.Fuzz(func(t *testing.T, data []byte) {
		lims := []*Limit{l}
		got, err := UnpackGrants(data, lims)
		moved := HasStatus(&AcquireResponse{PackedGrants: data}, KeyStatus_KEY_STATUS_MOVED) // never panics
		ok, granted, terr := GrantTotals(&AcquireResponse{PackedGrants: data, Limits: lims})
		if len(data) > 0 && (terr != nil) != (err != nil) {
			t.Fatalf("GrantTotals error %v, UnpackGrants error %v", terr, err)
		}
		if err != nil {
			return
		}
		wantOK, wantGranted := 0, int64(0)
		for _, g := range got {
			if g.GetStatus() == KeyStatus_KEY_STATUS_OK {
				wantOK++
				wantGranted += g.GetGranted()
			}
		}
		if len(data) > 0 && (ok != wantOK || granted != wantGranted) {
			t.Fatalf("GrantTotals = %d, %d; UnpackGrants' grants hold %d OK, %d granted", ok, granted, wantOK, wantGranted)
		}
		if want := slices.ContainsFunc(got, func(g *KeyGrant) bool { return g.GetStatus() == KeyStatus_KEY_STATUS_MOVED }); moved != want {
			t.Fatalf("HasStatus(MOVED) = %v on grants %v", moved, got)
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

// benchGrants is a 100-key Acquire answer of one rule, as the allocator
// builds it (one shared Limit message).
func benchGrants() []*KeyGrant {
	l := &Limit{Name: "bench.user", RequestsPerUnit: 1000, Unit: "second", WindowSeconds: 1, Burst: 1000,
		Algorithm: "token_bucket", FailureMode: "open", Backend: "lease", RulePath: "user", Routing: "spread"}
	grants := make([]*KeyGrant, 100)
	for i := range grants {
		grants[i] = &KeyGrant{Status: KeyStatus_KEY_STATUS_OK, Key: "bench:user=" + string(rune('a'+i%26)) + "123456",
			Granted: 5, LeaseTtlMs: 3000, RefreshAfterMs: 1000, Remaining: 950, ResetAfterMs: 50, Limit: l, Agents: 2, Held: 5}
	}
	return grants
}

// TestPackedGrantsAllocs: packing into a buffer of the right size takes one
// allocation (the limit table), unpacking three however many grants.
func TestPackedGrantsAllocs(t *testing.T) {
	grants := benchGrants()
	buf, _ := AppendPackedGrants(nil, nil, grants)
	if n := testing.AllocsPerRun(100, func() { AppendPackedGrants(buf[:0], nil, grants) }); n != 1 {
		t.Errorf("AppendPackedGrants: %v allocations, want 1", n)
	}
	lims := []*Limit{grants[0].Limit}
	if n := testing.AllocsPerRun(100, func() { _, _ = UnpackGrants(buf, lims) }); n != 3 {
		t.Errorf("UnpackGrants: %v allocations, want 3", n)
	}
}

// BenchmarkAcquireAnswer compares, for a 100-key answer, the grants as
// KeyGrant messages with their Limit each (what a caller that does not ask
// for packed grants gets) and packed: encoding on the allocator, decoding
// on the agent. The ns/op are per answer.
func BenchmarkAcquireAnswer(b *testing.B) {
	grants := benchGrants()
	msgs := &AcquireResponse{Grants: grants, LiveAgents: 16, RulesVersion: 3, LeaderId: "a0", NowUnixMs: 1}
	packed := &AcquireResponse{LiveAgents: 16, RulesVersion: 3, LeaderId: "a0", NowUnixMs: 1}
	packed.PackedGrants, packed.Limits = AppendPackedGrants(nil, nil, grants)
	for _, c := range []struct {
		name string
		r    *AcquireResponse
	}{{"messages", msgs}, {"packed", packed}} {
		wire, err := proto.Marshal(c.r)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(c.name+"/encode", func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				r := c.r
				if c.name == "packed" {
					r = &AcquireResponse{LiveAgents: 16, RulesVersion: 3, LeaderId: "a0", NowUnixMs: 1}
					r.PackedGrants, r.Limits = AppendPackedGrants(make([]byte, 0, 4096), nil, grants)
				}
				if _, err := proto.Marshal(r); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(wire)), "wire-bytes")
		})
		b.Run(c.name+"/decode", func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				var r AcquireResponse
				if err := proto.Unmarshal(wire, &r); err != nil {
					b.Fatal(err)
				}
				if g, err := GrantsOf(&r); err != nil || len(g) != 100 {
					b.Fatal(len(g), err)
				}
			}
		})
	}
}

// TestPackedKeysRoundTrip: packed keys decode to the keys they were built
// from, with domains and descriptor keys beyond the dictionary's size sent
// in full; malformed ones are errors.
func TestPackedKeysRoundTrip(t *testing.T) {
	var keys []*KeyAcquire
	for i := range 40 {
		d := "d" + strconv.Itoa(i%11) // more distinct strings than the dictionary holds
		keys = append(keys, &KeyAcquire{Domain: d, Entries: []*Entry{{Key: "k" + strconv.Itoa(i%3), Value: strconv.Itoa(i)}, {Key: d, Value: ""}},
			Want: int64(i), Held: 2, Returned: 3, Charged: 4, Denied: 5, OutageCharged: 6, Demand: 1.5, WantShare: i%2 == 0,
			Promote: i%3 == 0, StaticReport: i%4 == 1})
		if k := keys[len(keys)-1]; k.Promote || k.StaticReport {
			k.StaticLeft = int64(i % 5) // static_left goes with promote or static_report
		}
	}
	keys = append(keys, &KeyAcquire{Domain: "z", Demand: math.Copysign(0, -1)}, &KeyAcquire{})
	data := AppendPackedKeys(nil, keys)
	got, err := UnpackKeys(data)
	if err != nil || len(got) != len(keys) {
		t.Fatalf("UnpackKeys = %d keys, %v", len(got), err)
	}
	for i := range keys {
		if !proto.Equal(got[i], keys[i]) || math.Signbit(got[i].Demand) != math.Signbit(keys[i].Demand) {
			t.Errorf("key %d: %v, want %v", i, got[i], keys[i])
		}
	}
	if (&AcquireRequest{PackedKeys: data}).KeyCount() != len(keys) {
		t.Errorf("KeyCount differs")
	}
	for name, b := range map[string][]byte{
		"truncated":    data[:len(data)-1],
		"trailing":     append(append([]byte(nil), data...), 0),
		"count":        {5, 0},
		"no flags2":    {1, 0, 1, 'd', 0, 0x80},
		"unknown flag": {1, 0, 1, 'd', 0, 0x80, 0x08},
		"no left":      {1, 0, 1, 'd', 0, 0x80, 0x02},
		"dictionary":   {1, 1},
		"entries":      {1, 0, 1, 'd', 9},
	} {
		if got, err := UnpackKeys(b); !errors.Is(err, errPackedKeys) || got != nil {
			t.Errorf("%s: UnpackKeys = %v, %v; want errPackedKeys", name, got, err)
		}
	}
}

// FuzzUnpackKeys: any input decodes or errs without panicking, and what
// decodes encodes back to keys that decode the same.
func FuzzUnpackKeys(f *testing.F) {
	f.Add(AppendPackedKeys(nil, []*KeyAcquire{{Domain: "d", Entries: []*Entry{{Key: "k", Value: "v"}}, Want: 3, Demand: 2},
		{Domain: "d", Charged: 1, OutageCharged: 2}}))
	f.Add([]byte{0})
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := UnpackKeys(data)
		if err != nil {
			return
		}
		again := AppendPackedKeys(nil, got)
		back, err := UnpackKeys(again)
		if err != nil || len(back) != len(got) {
			t.Fatalf("re-encoded keys do not decode: %v", err)
		}
		if third := AppendPackedKeys(nil, back); string(third) != string(again) {
			t.Fatalf("keys change when re-encoded:\n% x\n% x", again, third)
		}
	})
}

// TestGrantTotals: GrantTotals counts what UnpackGrants decodes (OK grants
// and their tokens), packed or not, and refuses exactly what UnpackGrants
// refuses: every truncation, a trailing byte, a limit index out of range
// and random bytes changed.
func TestGrantTotals(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	check := func(what string, r *AcquireResponse) {
		t.Helper()
		gotOK, gotG, gotErr := GrantTotals(r)
		grants, err := GrantsOf(r)
		wantOK, wantG := 0, int64(0)
		for _, g := range grants {
			if g.GetStatus() == KeyStatus_KEY_STATUS_OK {
				wantOK++
				wantG += g.GetGranted()
			}
		}
		if (gotErr != nil) != (err != nil) {
			t.Fatalf("%s: GrantTotals error %v, UnpackGrants error %v", what, gotErr, err)
		}
		if err != nil {
			wantOK, wantG = 0, 0
		}
		if gotOK != wantOK || gotG != wantG {
			t.Fatalf("%s: %d OK, %d granted; UnpackGrants: %d, %d", what, gotOK, gotG, wantOK, wantG)
		}
	}
	limits := []*Limit{{RequestsPerUnit: 10}, {RequestsPerUnit: 20}}
	for iter := range 500 {
		grants := make([]*KeyGrant, rng.IntN(12))
		for i := range grants {
			g := &KeyGrant{Key: strconv.Itoa(rng.IntN(1 << 30)), Status: KeyStatus(rng.IntN(7)),
				Granted: rng.Int64N(1<<40) - 1<<39, LeaseTtlMs: rng.Int64N(100000), Held: rng.Int64N(10) - 5,
				Remaining: rng.Int64N(1 << 50), Agents: rng.Uint32()}
			if rng.IntN(2) == 0 {
				g.Limit = limits[rng.IntN(len(limits))]
			}
			if rng.IntN(4) == 0 {
				s := rng.Float64()
				g.Share = &s
			}
			grants[i] = g
		}
		check("messages", &AcquireResponse{Grants: grants})
		packed, lim := AppendPackedGrants(nil, nil, grants)
		check("packed", &AcquireResponse{PackedGrants: packed, Limits: lim})
		if len(lim) > 0 {
			check("packed, a limit short", &AcquireResponse{PackedGrants: packed, Limits: lim[:len(lim)-1]})
		}
		for n := range packed {
			check("truncated", &AcquireResponse{PackedGrants: packed[:n], Limits: lim})
		}
		check("trailing byte", &AcquireResponse{PackedGrants: append(slices.Clone(packed), 0), Limits: lim})
		for range 20 {
			b := slices.Clone(packed)
			for range 1 + rng.IntN(3) {
				b[rng.IntN(len(b))] = byte(rng.Uint32())
			}
			check("bytes changed "+strconv.Itoa(iter), &AcquireResponse{PackedGrants: b, Limits: lim})
		}
	}
}

// BenchmarkAppendPackedKeys packs a refill-sized call: 100 keys of one
// domain, two descriptor entries each, with want, held and demand set.
func BenchmarkAppendPackedKeys(b *testing.B) {
	keys := make([]*KeyAcquire, 100)
	for i := range keys {
		keys[i] = &KeyAcquire{Domain: "api", Entries: []*Entry{{Key: "plan", Value: "free"}, {Key: "user", Value: "u-" + strconv.Itoa(i)}},
			Want: 20, Held: 3, Demand: 12.5}
	}
	buf := make([]byte, 0, 4096)
	b.ReportAllocs()
	for b.Loop() {
		buf = AppendPackedKeys(buf[:0], keys)
	}
}

// TestPackedKeysWriter: writing keys a part at a time gives the bytes
// AppendPackedKeys gives for the same messages, whichever of Entry or
// EntryBytes and Fields or FieldsPacked writes them, after any prefix
// (AppendPackedKeys's own round trip is tested above).
func TestPackedKeysWriter(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		str := rapid.SampledFrom([]string{"", "api", "user", "plan", "a", "b", "c", "d", "e", "f", "g", "h", "i", "\xff"})
		i64 := rapid.Int64()
		keys := rapid.SliceOfN(rapid.Custom(func(t *rapid.T) *KeyAcquire {
			k := &KeyAcquire{Domain: str.Draw(t, "domain"), Want: i64.Draw(t, "want"), Held: i64.Draw(t, "held"),
				Returned: i64.Draw(t, "returned"), Charged: i64.Draw(t, "charged"), Denied: i64.Draw(t, "denied"),
				OutageCharged: i64.Draw(t, "outage"), Demand: rapid.Float64().Draw(t, "demand"),
				WantShare: rapid.Bool().Draw(t, "want share"), Promote: rapid.Bool().Draw(t, "promote"),
				StaticReport: rapid.Bool().Draw(t, "static report"), StaticLeft: i64.Draw(t, "static left")}
			if rapid.Bool().Draw(t, "negative zero demand") {
				k.Demand = math.Copysign(0, -1)
			}
			for range rapid.IntRange(0, 3).Draw(t, "entries") {
				k.Entries = append(k.Entries, &Entry{Key: str.Draw(t, "key"), Value: rapid.String().Draw(t, "value")})
			}
			return k
		}), 0, 20).Draw(t, "keys")
		prefix := rapid.SliceOfN(rapid.Byte(), 0, 4).Draw(t, "prefix")
		want := AppendPackedKeys(slices.Clone(prefix), keys)

		var w PackedKeysWriter
		w.Start(slices.Clone(prefix), len(keys))
		for _, k := range keys {
			w.Head(k.GetDomain(), len(k.GetEntries()))
			for _, e := range k.GetEntries() {
				if rapid.Bool().Draw(t, "entry as bytes") {
					w.EntryBytes(e.GetKey(), []byte(e.GetValue()))
				} else {
					w.Entry(e.GetKey(), e.GetValue())
				}
			}
			if rapid.Bool().Draw(t, "fields packed") {
				w.FieldsPacked(AppendPackedKeyFields(nil, k))
			} else {
				w.Fields(k)
			}
		}
		if !bytes.Equal(w.B, want) {
			t.Fatalf("writer\n%x\nAppendPackedKeys\n%x", w.B, want)
		}
	})
}
