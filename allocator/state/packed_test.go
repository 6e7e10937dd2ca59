package state

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// packedOf returns req with its keys packed (AcquireRequest.packed_keys).
func packedOf(req *allotv1.AcquireRequest) *allotv1.AcquireRequest {
	return &allotv1.AcquireRequest{AgentId: req.AgentId, RequestId: req.RequestId, RulesVersion: req.RulesVersion,
		FallbackKeys: req.FallbackKeys, PackedGrants: req.PackedGrants, StaticShares: req.StaticShares, HotVersion: req.HotVersion,
		PackedKeys: allotv1.AppendPackedKeys(nil, req.Keys)}
}

// TestPackedKeysRoundTrip: a request with its keys packed is validated as
// the same request unpacked is (by the fast check and the key-by-key one), and has the same compact record, so the
// allocator may copy packed keys into its log as they came.
func TestPackedKeysRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		req := genRequest(t, "")
		p := packedOf(req)
		if len(req.Keys) != p.KeyCount() {
			t.Fatalf("KeyCount %d, want %d", p.KeyCount(), len(req.Keys))
		}
		if a, b := ValidateAcquire(req), ValidateAcquire(p); (a == nil) != (b == nil) {
			t.Fatalf("ValidateAcquire: unpacked %v, packed %v", a, b)
		} else if b != nil && !errors.Is(b, ErrInvalid) {
			t.Fatalf("ValidateAcquire(packed) = %v, want ErrInvalid", b)
		}
		// Keys of known flags: the fast check and the key-by-key one agree.
		r := allotv1.Reader{S: string(p.PackedKeys), Base: errPacked}
		n := r.Uvarint()
		if fast, err := packedValid(r.S, r.P, int(n)), packedCause(r.S, r.P, int(n)); fast != (err == nil) {
			t.Fatalf("packedValid %v, packedCause %v", fast, err)
		}
		if a, b := AppendAcquireRecord(nil, req), AppendAcquireRecord(nil, p); string(a) != string(b) {
			t.Fatalf("records differ:\n% x\n% x", a, b)
		}
	})
}

// TestPackedKeysApply: calls applied with their keys packed, in a
// protobuf Command or a compact entry, answer and change the state as the
// same calls unpacked do.
func TestPackedKeysApply(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		a, b, c := newTestState(t), newTestState(t), newTestState(t)
		for step := range rapid.IntRange(1, 6).Draw(t, "steps") {
			now := at(0) + int64(step)*1e8
			reqs := genCalls(t, step)
			var packed []*allotv1.AcquireRequest
			for _, req := range reqs {
				packed = append(packed, packedOf(req))
			}
			ra := a.Apply(acquireCmd(now, reqs...)).(*AcquireBatchResult)
			rb := b.Apply(acquireCmd(now, packed...)).(*AcquireBatchResult)
			rc, err := c.ApplyCompact(compactEntry(now, packed...))
			if err != nil {
				t.Fatalf("ApplyCompact: %v", err)
			}
			for i := range reqs {
				for _, r := range []*AcquireBatchResult{rb, rc} {
					if (ra.Errs[i] == nil) != (r.Errs[i] == nil) {
						t.Fatalf("call %d: errors %v and %v", i, ra.Errs[i], r.Errs[i])
					}
					if !proto.Equal(ra.Responses[i], r.Responses[i]) {
						t.Fatalf("call %d: responses %v and %v", i, ra.Responses[i], r.Responses[i])
					}
				}
			}
		}
		if pa := string(persist(t, a)); pa != string(persist(t, b)) || pa != string(persist(t, c)) {
			t.Fatalf("snapshots differ")
		}
	})
}

// TestPackedKeysInvalid: packed keys that break the format, the bounds or
// UTF-8 are refused with ErrInvalid.
func TestPackedKeysInvalid(t *testing.T) {
	good := packedOf(&allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{ka("tb", "x", 1, 0, 0, 0)}})
	if err := ValidateAcquire(good); err != nil {
		t.Fatalf("ValidateAcquire(good) = %v", err)
	}
	mk := func(keys ...*allotv1.KeyAcquire) []byte { return allotv1.AppendPackedKeys(nil, keys) }
	many := make([]*allotv1.KeyAcquire, allotv1.MaxKeysPerCall+1)
	for i := range many {
		many[i] = ka("tb", "x", 1, 0, 0, 0)
	}
	for name, p := range map[string][]byte{
		"truncated":      good.PackedKeys[:len(good.PackedKeys)-1],
		"trailing":       append(append([]byte(nil), good.PackedKeys...), 0),
		"count":          {0xff, 0xff, 0xff, 0xff, 0x0f},
		"unknown flag":   {1, 0, 1, 'd', 0, 0x80},
		"dictionary":     {1, 2},
		"empty domain":   mk(&allotv1.KeyAcquire{Domain: "", Want: 1}),
		"negative want":  mk(ka("tb", "x", -1, 0, 0, 0)),
		"not utf-8":      mk(ka("tb", "\xff", 1, 0, 0, 0)),
		"key too long":   mk(ka("tb", strings.Repeat("x", allotv1.MaxKeyBytes), 1, 0, 0, 0)),
		"too many keys":  mk(many...),
		"both forms set": nil,
	} {
		req := &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, PackedKeys: p}
		if p == nil {
			req.PackedKeys, req.Keys = good.PackedKeys, []*allotv1.KeyAcquire{ka("tb", "x", 1, 0, 0, 0)}
		}
		if err := ValidateAcquire(req); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: ValidateAcquire = %v, want ErrInvalid", name, err)
		}
	}
}

// FuzzPackedKeys: any bytes as packed keys are accepted or refused with
// ErrInvalid, never a panic; accepted ones make a compact entry that every
// replica applies (it decodes, and applies as the protobuf request does).
func FuzzPackedKeys(f *testing.F) {
	f.Add(allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{ka("tb", "x", 1, 0, 0, 0), ka("gcra", "y", 2, 1, 1, 1)}))
	f.Add(allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{{Domain: "test", Entries: []*allotv1.Entry{{Key: "tb", Value: "x"}, {Key: "u", Value: "v"}},
		Want: 3, Demand: 2.5, OutageCharged: 4, Denied: 1}}))
	f.Add([]byte{0})
	f.Add([]byte{1, 0, 4, 't', 'e', 's', 't', 1, 0, 2, 't', 'b', 1, 'x', 1, 2})
	f.Add(allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{ka("tb", "é", 1, 0, 0, 0), ka("tb", "\xff", 1, 0, 0, 0), ka("\xc3", "x", 1, 0, 0, 0)}))
	f.Add(allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{{Domain: "test", Entries: []*allotv1.Entry{{Key: "tb", Value: "x"}}, Want: 1e12 + 1, Demand: math.NaN(), WantShare: true}}))
	f.Add(allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{{Domain: "test", Entries: []*allotv1.Entry{{Key: "tb", Value: "x"}}, Want: 1, Promote: true, StaticLeft: 2},
		{Domain: "test", Entries: []*allotv1.Entry{{Key: "tb", Value: "y"}}, StaticReport: true, StaticLeft: -1}}))
	f.Fuzz(func(t *testing.T, data []byte) {
		// The fast check never passes keys the key-by-key one refuses.
		r := allotv1.Reader{S: string(data), Base: errPacked}
		if n := r.Uvarint(); r.Err == nil && n <= uint64(len(data)) && packedValid(r.S, r.P, int(n)) {
			if err := packedCause(r.S, r.P, int(n)); err != nil {
				t.Fatalf("packedValid passes % x, which packedCause refuses: %v", data, err)
			}
		}
		req := &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, PackedKeys: data}
		if err := ValidateAcquire(req); err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("ValidateAcquire = %v, want ErrInvalid", err)
			}
			return
		}
		_, reqs, err := DecodeAcquireEntry(compactEntry(at(0), req))
		if err != nil || len(reqs) != 1 {
			t.Fatalf("accepted packed keys % x do not decode: %v", data, err)
		}
		if err := ValidateAcquire(reqs[0]); err != nil {
			t.Fatalf("accepted packed keys % x decode to a request that is refused: %v", data, err)
		}
		a, b := newTestState(t), newTestState(t)
		rb, err := b.ApplyCompact(compactEntry(at(0), req))
		if err != nil {
			t.Fatalf("ApplyCompact: %v", err)
		}
		ra := a.Apply(acquireCmd(at(0), reqs[0])).(*AcquireBatchResult)
		if (ra.Errs[0] == nil) != (rb.Errs[0] == nil) || !proto.Equal(ra.Responses[0], rb.Responses[0]) {
			t.Fatalf("on % x: %v %v and %v %v", data, ra.Responses[0], ra.Errs[0], rb.Responses[0], rb.Errs[0])
		}
		if err := b.consistency(); err != nil {
			t.Fatal(err)
		}
	})
}

// TestPackedGrantsConfig: with Config.PackedGrants the answers, recorded
// ones and those restored from a snapshot included, carry the grants the
// message form carries, and the state changes alike.
func TestPackedGrantsConfig(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		a := newTestState(t)
		cfg := testConfig()
		cfg.PackedGrants = true
		b := New(cfg)
		putRules(t, b, t0, testRules)
		same := func(what string, ra, rb *AcquireBatchResult) {
			for i := range ra.Responses {
				if (ra.Errs[i] == nil) != (rb.Errs[i] == nil) {
					t.Fatalf("%s call %d: errors %v and %v", what, i, ra.Errs[i], rb.Errs[i])
				}
				if ra.Errs[i] != nil {
					continue
				}
				pa, pb := ra.Responses[i], rb.Responses[i]
				if len(pb.GetGrants()) != 0 || len(pb.GetPackedGrants()) == 0 {
					t.Fatalf("%s call %d: answer %v is not packed", what, i, pb)
				}
				gb, err := allotv1.GrantsOf(pb)
				if err != nil || len(gb) != len(pa.GetGrants()) {
					t.Fatalf("%s call %d: %d packed grants (%v), want %d", what, i, len(gb), err, len(pa.GetGrants()))
				}
				for j, g := range pa.GetGrants() {
					if !proto.Equal(g, gb[j]) {
						t.Fatalf("%s call %d grant %d: packed %v, message %v", what, i, j, gb[j], g)
					}
				}
				if pa.GetLiveAgents() != pb.GetLiveAgents() || pa.GetRulesVersion() != pb.GetRulesVersion() || pa.GetNowUnixMs() != pb.GetNowUnixMs() {
					t.Fatalf("%s call %d: %v and %v", what, i, pa, pb)
				}
			}
			if ra.Granted != rb.Granted || ra.Returned != rb.Returned || ra.Charged != rb.Charged {
				t.Fatalf("%s: sums differ", what)
			}
		}
		var last []*allotv1.AcquireRequest
		var now int64
		for step := range rapid.IntRange(1, 6).Draw(t, "steps") {
			now = at(0) + int64(step)*1e8
			last = genCalls(t, step)
			same("apply", a.Apply(acquireCmd(now, last...)).(*AcquireBatchResult), applyCompactly(b, acquireCmd(now, last...)).(*AcquireBatchResult))
		}
		if sa, sb := a.Stats(), b.Stats(); sa != sb {
			t.Fatalf("stats %+v and %+v", sa, sb)
		}
		// The last step's calls again are retries: recorded answers, from
		// the live state and from one restored from its snapshot.
		r := New(cfg)
		if err := r.Restore(bytes.NewReader(persist(t, b))); err != nil {
			t.Fatal(err)
		}
		ra := a.Apply(acquireCmd(now, last...)).(*AcquireBatchResult)
		same("replay", ra, b.Apply(acquireCmd(now, last...)).(*AcquireBatchResult))
		same("replay after restore", ra, r.Apply(acquireCmd(now, last...)).(*AcquireBatchResult))
	})
}
