package state

import (
	"errors"
	"math"
	"testing"

	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// genRequest draws an Acquire request, valid or not: any strings, repeated
// domains and descriptor keys (the records' dictionary), amounts of any
// sign, and demands that are zero, negative zero, NaN or infinite.
func genRequest(t *rapid.T, label string) *allotv1.AcquireRequest {
	strs := rapid.SampledFrom([]string{"", "test", "tb", "x", "ünï", "a,b=c", string(make([]byte, 300))})
	req := &allotv1.AcquireRequest{
		AgentId:      rapid.String().Draw(t, label+"agent"),
		RequestId:    rapid.Uint64().Draw(t, label+"id"),
		RulesVersion: rapid.Uint64().Draw(t, label+"rules"),
		FallbackKeys: rapid.Uint32().Draw(t, label+"fallback"),
		StaticShares: rapid.Bool().Draw(t, label+"static"),
		HotVersion:   rapid.SampledFrom([]uint64{0, 1, 1 << 62, math.MaxUint64}).Draw(t, label+"hotVersion"),
	}
	for range rapid.IntRange(0, 12).Draw(t, label+"keys") {
		k := &allotv1.KeyAcquire{
			Domain:        strs.Draw(t, "domain"),
			Want:          rapid.Int64().Draw(t, "want"),
			Held:          rapid.Int64Range(-1, 1e12).Draw(t, "held"),
			Returned:      rapid.Int64Range(0, 3).Draw(t, "returned"),
			Charged:       rapid.Int64Range(0, 3).Draw(t, "charged"),
			OutageCharged: rapid.Int64Range(0, 3).Draw(t, "outage_charged"),
			Denied:        rapid.Int64Range(0, 3).Draw(t, "denied"),
			Demand: rapid.SampledFrom([]float64{0, math.Copysign(0, -1), 1.5, -2, math.NaN(), math.Inf(1), 1e300}).
				Draw(t, "demand"),
		}
		if k.Promote = rapid.Bool().Draw(t, "promote"); k.Promote { // static_left travels with promote only
			k.StaticLeft = rapid.Int64Range(-1, 3).Draw(t, "static_left")
		}
		for range rapid.IntRange(0, 10).Draw(t, "entries") {
			k.Entries = append(k.Entries, &allotv1.Entry{Key: strs.Draw(t, "key"), Value: rapid.String().Draw(t, "value")})
		}
		req.Keys = append(req.Keys, k)
	}
	return req
}

// genCalls draws the calls of one step: requests from genRequest, about
// half of them made plausible (known agents, the step as request id,
// matching keys and sane amounts).
func genCalls(t *rapid.T, step int) []*allotv1.AcquireRequest {
	var reqs []*allotv1.AcquireRequest
	for i := range rapid.IntRange(0, 3).Draw(t, "calls") {
		req := genRequest(t, string(rune('a'+i)))
		if rapid.Bool().Draw(t, "plausible") {
			req.AgentId = rapid.SampledFrom(propAgents).Draw(t, "agent")
			req.RequestId = uint64(step)
			for _, k := range req.Keys {
				k.Domain = "test"
				k.Entries = []*allotv1.Entry{{Key: rapid.SampledFrom([]string{"tb", "gcra", "fw", "nope"}).Draw(t, "k"), Value: "x"}}
				k.Want, k.Held, k.Demand = max(k.Want%20, 0), max(k.Held%5, 0), 1
			}
		}
		reqs = append(reqs, req)
	}
	return reqs
}

// TestCompactEntryRoundTrip: a compact entry decodes to exactly the
// requests and stamp it was built from.
func TestCompactEntryRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		now := rapid.Int64().Draw(t, "now")
		var reqs []*allotv1.AcquireRequest
		for i := range rapid.IntRange(0, 4).Draw(t, "calls") {
			reqs = append(reqs, genRequest(t, string(rune('a'+i))))
		}
		data := compactEntry(now, reqs...)
		if !IsCompactEntry(data) {
			t.Fatalf("not recognised as compact")
		}
		gotNow, got, err := DecodeAcquireEntry(data)
		if err != nil {
			t.Fatalf("decode: %v", err)
		}
		if gotNow != now || len(got) != len(reqs) {
			t.Fatalf("decoded now %d and %d calls, want %d and %d", gotNow, len(got), now, len(reqs))
		}
		for i := range reqs {
			// NaN demands compare unequal in proto.Equal; compare encodings.
			a, _ := proto.MarshalOptions{Deterministic: true}.Marshal(reqs[i])
			b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(got[i])
			if string(a) != string(b) {
				t.Fatalf("call %d: decoded %v, want %v", i, got[i], reqs[i])
			}
		}
	})
}

// TestCompactEntryNeverProtobuf: no Command encodes to a first byte of 0,
// so the two kinds of entry cannot be confused.
func TestCompactEntryNeverProtobuf(t *testing.T) {
	for _, cmd := range []*allotv1.Command{
		{},
		{NowUnixNanos: 1},
		{IgnoreIfUnknown: true},
		{Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{}}},
		{Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}},
	} {
		b, err := proto.Marshal(cmd)
		if err != nil {
			t.Fatal(err)
		}
		if IsCompactEntry(b) {
			t.Errorf("Command %v encodes as a compact entry: % x", cmd, b)
		}
	}
}

// TestCompactEntryUnknownVersion: an entry of a later version is refused
// with ErrUnknownCommand and changes nothing.
func TestCompactEntryUnknownVersion(t *testing.T) {
	s := newTestState(t)
	before := persist(t, s)
	data := compactEntry(at(0), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{ka("tb", "x", 1, 0, 0, 0)}})
	data[1] = compactVersion + 1
	if _, err := s.ApplyCompact(data); !errors.Is(err, ErrUnknownCommand) {
		t.Fatalf("ApplyCompact(version %d) = %v, want ErrUnknownCommand", data[1], err)
	}
	if after := persist(t, s); string(after) != string(before) {
		t.Fatalf("a refused entry changed the state")
	}
}

// TestCompactMatchesProtobuf: the same calls applied as a compact entry
// and as a protobuf Command give the same answers, errors included, and
// the same state.
func TestCompactMatchesProtobuf(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		a, b := newTestState(t), newTestState(t)
		for step := range rapid.IntRange(1, 6).Draw(t, "steps") {
			now := at(0) + int64(step)*1e8
			reqs := genCalls(t, step)
			ra := a.Apply(acquireCmd(now, reqs...)).(*AcquireBatchResult)
			rb, err := b.ApplyCompact(compactEntry(now, reqs...))
			if err != nil {
				t.Fatalf("ApplyCompact: %v", err)
			}
			for i := range reqs {
				if (ra.Errs[i] == nil) != (rb.Errs[i] == nil) || !errors.Is(rb.Errs[i], errors.Unwrap(ra.Errs[i])) && ra.Errs[i] != nil {
					t.Fatalf("call %d: errors %v and %v", i, ra.Errs[i], rb.Errs[i])
				}
				if !proto.Equal(ra.Responses[i], rb.Responses[i]) {
					t.Fatalf("call %d: responses %v and %v", i, ra.Responses[i], rb.Responses[i])
				}
			}
			if ra.Granted != rb.Granted || ra.Returned != rb.Returned || ra.Charged != rb.Charged {
				t.Fatalf("sums %d/%d/%d and %d/%d/%d", ra.Granted, ra.Returned, ra.Charged, rb.Granted, rb.Returned, rb.Charged)
			}
		}
		if string(persist(t, a)) != string(persist(t, b)) {
			t.Fatalf("snapshots differ")
		}
	})
}

// FuzzApplyCompact: any bytes after the marker either apply or are refused
// with an error; nothing panics, and a refused entry's calls before the
// malformed one leave a consistent state.
func FuzzApplyCompact(f *testing.F) {
	f.Add(compactEntry(at(0), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1,
		Keys: []*allotv1.KeyAcquire{ka("tb", "x", 1, 0, 0, 0), ka("gcra", "x", 2, 0, 0, 1)}}))
	f.Add(compactEntry(at(0)))
	f.Add([]byte{0, 1, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		s := newTestState(t)
		_, _, decErr := DecodeAcquireEntry(data)
		_, applyErr := s.ApplyCompact(data)
		if (decErr == nil) != (applyErr == nil) {
			// Decoding and applying must agree on what is well formed.
			t.Fatalf("on % x: DecodeAcquireEntry: %v; ApplyCompact: %v", data, decErr, applyErr)
		}
		if err := s.consistency(); err != nil {
			t.Fatalf("after % x: %v", data, err)
		}
	})
}
