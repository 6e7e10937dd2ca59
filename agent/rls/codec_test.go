package rls

import (
	"bytes"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// codecSeeds are requests of every shape: the ones the codec decodes
// itself and the ones it leaves to the standard codec.
func codecSeeds() []*rlsv3.RateLimitRequest {
	entry := func(k, v string) *rlcommon.RateLimitDescriptor_Entry {
		return &rlcommon.RateLimitDescriptor_Entry{Key: k, Value: v}
	}
	return []*rlsv3.RateLimitRequest{
		{Domain: "bench", Descriptors: []*rlcommon.RateLimitDescriptor{
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tier", "free"), entry("api_key", "k_bench_01")}}}},
		{Domain: "rls-test", HitsAddend: 300, Descriptors: []*rlcommon.RateLimitDescriptor{
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("path", "/a")}, HitsAddend: wrapperspb.UInt64(200)},
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("shadowed", "x"), entry("", "")}, IsNegativeHits: true},
			{HitsAddend: wrapperspb.UInt64(0)},
			{}}},
		{Domain: "ünïcode", Descriptors: []*rlcommon.RateLimitDescriptor{
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("ключ", "値"), entry("k", "")}}}},
		{Domain: "two", HitsAddend: 2, Descriptors: []*rlcommon.RateLimitDescriptor{
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tier", "free"), entry("api_key", "k")}},
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("tier", "free"), entry("route", "/v1"), entry("api_key", "k")}, HitsAddend: wrapperspb.UInt64(1 << 40)}}},
		{Domain: "one", Descriptors: []*rlcommon.RateLimitDescriptor{
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("a", "1"), entry("b", "2"), entry("c", "3"), entry("d", "4")}}}},
		{},
		// A descriptor over agent.MaxEntries: counted, no entry copied.
		{Domain: "wide", Descriptors: []*rlcommon.RateLimitDescriptor{
			{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("a", "1")}},
			{Entries: slices.Repeat([]*rlcommon.RateLimitDescriptor_Entry{entry("k", "v")}, agent.MaxEntries+1)},
			{IsNegativeHits: true}}},
		// Left to the standard codec: a limit override.
		{Domain: "d", Descriptors: []*rlcommon.RateLimitDescriptor{{
			Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("a", "b")},
			Limit:   &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 5}}}},
	}
}

// requestView is what a decoded request holds, for comparing two.
type requestView struct {
	Decoded  bool
	Domain   string
	Hits     uint32
	NDescs   int
	Descs    []descView
	Negative []bool
	NEntries []int
}

type descView struct {
	Entries       []rules.Entry
	HitsAddend    uint32
	HitsAddendSet bool
}

func viewOf(r *request) requestView {
	v := requestView{Decoded: r.decoded, Domain: r.domain, Hits: r.hits, NDescs: r.ndescs, Negative: clone(r.negative), NEntries: clone(r.nentries)}
	for _, d := range r.descs {
		v.Descs = append(v.Descs, descView{clone(d.Entries), d.HitsAddend, d.HitsAddendSet})
	}
	return v
}

// clone is s copied, nil when empty.
func clone[T any](s []T) []T {
	if len(s) == 0 {
		return nil
	}
	return slices.Clone(s)
}

// fromProto is the request fromRequest makes of m.
func fromProto(m *rlsv3.RateLimitRequest) requestView {
	r := new(request)
	r.fromRequest(m)
	return viewOf(r)
}

// TestRequestCodecTakesEnvoyRequests: the requests Envoy sends (no limit
// override) are decoded by the codec itself, equal to proto.Unmarshal's.
func TestRequestCodecTakesEnvoyRequests(t *testing.T) {
	for i, want := range codecSeeds() {
		b, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		got := new(request)
		ok := decodeRequest(string(b), got)
		override := false
		for _, d := range want.Descriptors {
			override = override || d.Limit != nil
		}
		if ok == override {
			t.Fatalf("request %d: decoded %v, want %v", i, ok, !override)
		}
		if ok && !reflect.DeepEqual(viewOf(got), fromProto(want)) {
			t.Fatalf("request %d: decoded %+v, want %+v", i, viewOf(got), fromProto(want))
		}
	}
}

// TestRequestCodecTooManyDescriptors: a request of more descriptors than
// a check takes is decoded to its count alone.
func TestRequestCodecTooManyDescriptors(t *testing.T) {
	m := &rlsv3.RateLimitRequest{Domain: "d"}
	for range agent.MaxDescriptors + 1 {
		m.Descriptors = append(m.Descriptors, desc("k", "v"))
	}
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	got := new(request)
	if !decodeRequest(string(b), got) {
		t.Fatal("not decoded")
	}
	if want := fromProto(m); !reflect.DeepEqual(viewOf(got), want) || got.ndescs != agent.MaxDescriptors+1 || len(got.descs) != 0 {
		t.Fatalf("decoded %+v, want %+v with no descriptors", viewOf(got), want)
	}
}

// FuzzRequestCodec: on arbitrary bytes, the codec's Unmarshal of a request
// marks it undecodable exactly when proto.Unmarshal fails, and otherwise
// gives the request fromRequest makes of proto.Unmarshal's message; and
// what decodeRequest accepts, proto.Unmarshal accepts too, equal. A
// RateLimitRequest (the interceptor path) is decoded as proto.Unmarshal
// does, or marked undecodable.
func FuzzRequestCodec(f *testing.F) {
	for _, r := range codecSeeds() {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte("\x0a\x02\xff\xfe"))                   // domain: invalid UTF-8
	f.Add([]byte("\x12\x06\x0a\x04\x0a\x02\xc0\x80"))   // an entry key: overlong encoding
	f.Add([]byte("\x18\x80\x80\x80\x80\x10"))           // hits_addend above 2³²−1
	f.Add([]byte("\x0a\x01a\x0a\x01b\x18\x01\x18\x02")) // repeated singular fields: the last wins
	f.Add([]byte("\x12\x02\x20\x02"))                   // is_negative_hits 2
	f.Add([]byte("\x22\x00"))                           // an unknown field
	f.Add([]byte("\x12\x05\x0a\x03\x0a\x01"))           // truncated
	f.Add([]byte("\x12\x04\x1a\x02\x08\x05\x12\x00"))   // a descriptor's hits_addend 5, an empty descriptor
	c := newCodec()
	f.Fuzz(func(t *testing.T, data []byte) {
		want := new(rlsv3.RateLimitRequest)
		wantErr := proto.Unmarshal(data, want)
		fast := getRequest()
		defer putRequest(fast)
		if decodeRequest(string(data), fast) {
			if wantErr != nil {
				t.Fatalf("decodeRequest took %q, proto.Unmarshal: %v", data, wantErr)
			}
			if !reflect.DeepEqual(viewOf(fast), fromProto(want)) {
				t.Fatalf("decodeRequest(%q) = %+v, proto.Unmarshal %+v", data, viewOf(fast), fromProto(want))
			}
		} else if !reflect.DeepEqual(viewOf(fast), viewOf(new(request))) {
			t.Fatalf("decodeRequest(%q) declined but changed the request: %+v", data, viewOf(fast))
		}

		got := getRequest()
		defer putRequest(got)
		if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, got); err != nil {
			t.Fatalf("Unmarshal(%q): %v, want a request (marked undecodable when proto.Unmarshal fails)", data, err)
		}
		if !got.decoded { // as handleShouldRateLimit does
			got.fromRequest(&got.RateLimitRequest)
		}
		marked := strings.HasPrefix(got.domain, undecodable)
		if marked != (wantErr != nil) {
			t.Fatalf("Unmarshal(%q) marked undecodable %v (%+v), proto.Unmarshal: %v", data, marked, viewOf(got), wantErr)
		}
		if !marked && !reflect.DeepEqual(viewOf(got), fromProto(want)) {
			t.Fatalf("Unmarshal(%q) = %+v, proto.Unmarshal %+v", data, viewOf(got), fromProto(want))
		}

		m := new(rlsv3.RateLimitRequest)
		if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, m); err != nil {
			t.Fatalf("Unmarshal(%q) into a RateLimitRequest: %v", data, err)
		}
		if marked := strings.HasPrefix(m.GetDomain(), undecodable); marked != (wantErr != nil) || (!marked && !proto.Equal(m, want)) {
			t.Fatalf("Unmarshal(%q) into a RateLimitRequest = %v, proto.Unmarshal %v (%v)", data, m, want, wantErr)
		}
	})
}

// FuzzReplyMarshal: the codec marshals a reply to the bytes proto.Marshal
// gives its message, or leaves it to the standard codec (a field it does
// not write, a name proto.Marshal refuses), for replies of 0 to 4
// statuses with arbitrary field values.
func FuzzReplyMarshal(f *testing.F) {
	f.Add(int64(1), "per_key", uint8(1))
	f.Add(int64(2), "", uint8(2))
	f.Add(int64(3), "\xff", uint8(3))
	f.Add(int64(4), "a longer name of a rule, to go past the inline bytes of a reply", uint8(4))
	c := newCodec()
	f.Fuzz(func(t *testing.T, seed int64, name string, n uint8) {
		rng := rand.New(rand.NewPCG(uint64(seed), 0))
		r, blk := newResponse(int(n % 5))
		u32 := func() uint32 { return []uint32{0, 1, 127, 128, math.MaxUint32, rng.Uint32()}[rng.IntN(6)] }
		i32 := func() int32 { return []int32{0, 1, 2, -1, math.MaxInt32, math.MinInt32, rng.Int32()}[rng.IntN(7)] }
		r.OverallCode = rlsv3.RateLimitResponse_Code(i32())
		for i := range blk {
			st := &blk[i].st
			st.Code = rlsv3.RateLimitResponse_Code(i32())
			st.LimitRemaining = u32()
			if rng.IntN(4) > 0 {
				st.CurrentLimit = &rlsv3.RateLimitResponse_RateLimit{Name: name[:rng.IntN(len(name)+1)],
					RequestsPerUnit: u32(), Unit: rlsv3.RateLimitResponse_RateLimit_Unit(i32())}
				if rng.IntN(2) == 0 {
					st.CurrentLimit.UnitMultiplier = wrapperspb.UInt32(u32())
				}
			}
			if rng.IntN(4) > 0 {
				blk[i].dur.Seconds = []int64{0, 1, -1, math.MaxInt64, math.MinInt64, rng.Int64()}[rng.IntN(6)]
				blk[i].dur.Nanos = i32()
				st.DurationUntilReset = &blk[i].dur
			}
		}
		if rng.IntN(8) == 0 {
			r.RawBody = []byte("x")
		}
		want, wantErr := proto.Marshal(&r.RateLimitResponse)
		_, fast := r.size()
		got, err := c.Marshal(r)
		if (err != nil) != (wantErr != nil) {
			t.Fatalf("Marshal: %v, proto.Marshal: %v", err, wantErr)
		}
		if fast && wantErr != nil {
			t.Fatalf("marshalled a reply proto.Marshal refuses (%v)", wantErr)
		}
		if err == nil && !bytes.Equal(got.Materialize(), want) {
			t.Fatalf("Marshal = %x, proto.Marshal %x (%v)", got.Materialize(), want, &r.RateLimitResponse)
		}
	})
}
