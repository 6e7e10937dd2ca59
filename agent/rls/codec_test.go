package rls

import (
	"strings"
	"testing"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// codecSeeds are requests of every shape: the ones requestCodec decodes
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
		// Left to the standard codec: a limit override.
		{Domain: "d", Descriptors: []*rlcommon.RateLimitDescriptor{{
			Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("a", "b")},
			Limit:   &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 5}}}},
	}
}

// TestRequestCodecTakesEnvoyRequests: the requests Envoy sends (no limit
// override) are decoded by requestCodec itself, equal to proto.Unmarshal's.
func TestRequestCodecTakesEnvoyRequests(t *testing.T) {
	for i, want := range codecSeeds() {
		b, err := proto.Marshal(want)
		if err != nil {
			t.Fatal(err)
		}
		got := new(rlsv3.RateLimitRequest)
		ok := decodeRequest(string(b), got)
		override := false
		for _, d := range want.Descriptors {
			override = override || d.Limit != nil
		}
		if ok == override {
			t.Fatalf("request %d: decoded %v, want %v", i, ok, !override)
		}
		if ok && !proto.Equal(got, want) {
			t.Fatalf("request %d: decoded %v, want %v", i, got, want)
		}
	}
}

// FuzzRequestCodec: on arbitrary bytes, requestCodec.Unmarshal fails
// exactly when proto.Unmarshal does and otherwise gives an equal message;
// and what decodeRequest accepts, proto.Unmarshal accepts too, equal.
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
	c := newRequestCodec()
	f.Fuzz(func(t *testing.T, data []byte) {
		want := new(rlsv3.RateLimitRequest)
		wantErr := proto.Unmarshal(data, want)
		fast := new(rlsv3.RateLimitRequest)
		if decodeRequest(string(data), fast) {
			if wantErr != nil {
				t.Fatalf("decodeRequest took %q, proto.Unmarshal: %v", data, wantErr)
			}
			if !proto.Equal(fast, want) {
				t.Fatalf("decodeRequest(%q) = %v, proto.Unmarshal %v", data, fast, want)
			}
		} else if !proto.Equal(fast, new(rlsv3.RateLimitRequest)) {
			t.Fatalf("decodeRequest(%q) declined but changed the message: %v", data, fast)
		}
		got := new(rlsv3.RateLimitRequest)
		if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(data)}, got); err != nil {
			t.Fatalf("Unmarshal(%q): %v, want a request (marked undecodable when proto.Unmarshal fails)", data, err)
		}
		marked := strings.HasPrefix(got.GetDomain(), undecodable)
		if marked != (wantErr != nil) {
			t.Fatalf("Unmarshal(%q) marked undecodable %v (%v), proto.Unmarshal: %v", data, marked, got, wantErr)
		}
		if !marked && !proto.Equal(got, want) {
			t.Fatalf("Unmarshal(%q) = %v, proto.Unmarshal %v", data, got, want)
		}
	})
}
