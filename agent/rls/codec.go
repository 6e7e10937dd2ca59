package rls

import (
	"math"
	"unicode/utf8"
	"unsafe"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the "proto" codec requestCodec falls back on
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// requestCodec is gRPC's proto codec with a decoder of its own for
// RateLimitRequest, the one message the server reads per check. The
// standard decoder allocates every descriptor, entry and string apart (ten
// allocations for one descriptor of two entries, thirty-odd for three of
// three); this one copies the message into one string that all the
// request's strings point into, and allocates descriptors and entries in
// one block (up to two descriptors of six entries in all) or one block each:
// two allocations, or five whatever the shape.
//
// It decodes only the shape Envoy sends: domain, descriptors (entries,
// hits_addend, is_negative_hits) and hits_addend, each string valid UTF-8.
// Anything else (a descriptor's limit override, unknown fields, invalid
// UTF-8, a malformed message, a field in an unexpected wire type) goes to
// the standard codec, which then decides exactly as it would alone
// (FuzzRequestCodec compares the two on arbitrary bytes). Marshal and every
// other message type are the standard codec's.
//
// A RateLimitRequest that the standard codec refuses is not an error here:
// gRPC would answer it Internal before any handler runs, as if the server
// had failed. It decodes as a request whose domain is undecodable followed
// by the codec's error, which ShouldRateLimit answers InvalidArgument.
type requestCodec struct{ std encoding.CodecV2 }

// undecodable starts the domain of a request requestCodec could not
// decode: bytes that are not UTF-8, so no decoded request has them.
const undecodable = "\xff\xfe"

func newRequestCodec() requestCodec {
	return requestCodec{std: encoding.GetCodecV2("proto")}
}

// Name is the standard codec's: clients send application/grpc (+proto).
func (c requestCodec) Name() string { return "proto" }

func (c requestCodec) Marshal(v any) (mem.BufferSlice, error) { return c.std.Marshal(v) }

func (c requestCodec) Unmarshal(data mem.BufferSlice, v any) error {
	req, ok := v.(*rlsv3.RateLimitRequest)
	if ok && data.Len() <= maxFastRequest {
		b := make([]byte, data.Len())
		data.CopyTo(b)
		if decodeRequest(unsafe.String(unsafe.SliceData(b), len(b)), req) {
			return nil
		}
	}
	err := c.std.Unmarshal(data, v)
	if err != nil && ok {
		proto.Reset(req)
		req.Domain = undecodable + err.Error()
		return nil
	}
	return err
}

// maxFastRequest bounds the requests decodeRequest takes (cmd/gateway
// refuses larger ones anyway).
const maxFastRequest = 64 << 10

// decodeRequest decodes s into req, a zero message, and reports whether it
// did; on false req is untouched. The decoded strings point into s, which
// must not change afterwards.
func decodeRequest(s string, req *rlsv3.RateLimitRequest) bool {
	var n counts
	if !walkRequest(s, &n, nil) {
		return false
	}
	f := filler{req: req}
	switch {
	case n.descs <= 1 && n.entries <= 3:
		blk := new(request1)
		f.descs, f.descPtr = blk.descs[:n.descs], blk.descPtr[:n.descs]
		f.entries, f.entPtr = blk.entries[:n.entries], blk.entPtr[:n.entries]
	case n.descs <= 2 && n.entries <= 6:
		blk := new(request2)
		f.descs, f.descPtr = blk.descs[:n.descs], blk.descPtr[:n.descs]
		f.entries, f.entPtr = blk.entries[:n.entries], blk.entPtr[:n.entries]
	default:
		f.descs = make([]rlcommon.RateLimitDescriptor, n.descs)
		f.descPtr = make([]*rlcommon.RateLimitDescriptor, n.descs)
		f.entries = make([]rlcommon.RateLimitDescriptor_Entry, n.entries)
		f.entPtr = make([]*rlcommon.RateLimitDescriptor_Entry, n.entries)
	}
	walkRequest(s, &counts{}, &f)
	if n.descs > 0 {
		req.Descriptors = f.descPtr
	}
	return true
}

type counts struct{ descs, entries int }

// request1 holds the descriptor and entries of a request of one
// descriptor with up to three entries in one allocation; request2 two
// descriptors with up to six entries in all.
type request1 struct {
	descs   [1]rlcommon.RateLimitDescriptor
	descPtr [1]*rlcommon.RateLimitDescriptor
	entries [3]rlcommon.RateLimitDescriptor_Entry
	entPtr  [3]*rlcommon.RateLimitDescriptor_Entry
}

type request2 struct {
	descs   [2]rlcommon.RateLimitDescriptor
	descPtr [2]*rlcommon.RateLimitDescriptor
	entries [6]rlcommon.RateLimitDescriptor_Entry
	entPtr  [6]*rlcommon.RateLimitDescriptor_Entry
}

// filler is walkRequest's second pass: where the decoded values go.
type filler struct {
	descs   []rlcommon.RateLimitDescriptor
	descPtr []*rlcommon.RateLimitDescriptor
	entries []rlcommon.RateLimitDescriptor_Entry
	entPtr  []*rlcommon.RateLimitDescriptor_Entry
	req     *rlsv3.RateLimitRequest
}

// walkRequest checks and counts (f nil) or fills (f set, after a checking
// pass succeeded) a RateLimitRequest.
func walkRequest(s string, n *counts, f *filler) bool {
	for len(s) > 0 {
		num, typ, l := protowire.ConsumeTag(b(s))
		if l < 0 {
			return false
		}
		s = s[l:]
		switch {
		case num == 1 && typ == protowire.BytesType: // domain
			v, l := consumeString(s)
			if l < 0 {
				return false
			}
			if f != nil {
				f.req.Domain = v
			}
			s = s[l:]
		case num == 2 && typ == protowire.BytesType: // descriptors
			v, l := consumeMessage(s)
			if l < 0 {
				return false
			}
			first := n.entries
			if f != nil {
				d := &f.descs[n.descs]
				f.descPtr[n.descs] = d
				if !walkDescriptor(v, n, f, d) {
					return false
				}
				if n.entries > first {
					d.Entries = f.entPtr[first:n.entries:n.entries]
				}
			} else if !walkDescriptor(v, n, nil, nil) {
				return false
			}
			n.descs++
			s = s[l:]
		case num == 3 && typ == protowire.VarintType: // hits_addend
			v, l := protowire.ConsumeVarint(b(s))
			if l < 0 || v > math.MaxUint32 {
				return false
			}
			if f != nil {
				f.req.HitsAddend = uint32(v)
			}
			s = s[l:]
		default:
			return false
		}
	}
	return true
}

func walkDescriptor(s string, n *counts, f *filler, d *rlcommon.RateLimitDescriptor) bool {
	hitsSeen := false
	for len(s) > 0 {
		num, typ, l := protowire.ConsumeTag(b(s))
		if l < 0 {
			return false
		}
		s = s[l:]
		switch {
		case num == 1 && typ == protowire.BytesType: // entries
			v, l := consumeMessage(s)
			if l < 0 {
				return false
			}
			var e *rlcommon.RateLimitDescriptor_Entry
			if f != nil {
				e = &f.entries[n.entries]
				f.entPtr[n.entries] = e
			}
			if !walkEntry(v, e) {
				return false
			}
			n.entries++
			s = s[l:]
		case num == 3 && typ == protowire.BytesType && !hitsSeen: // hits_addend (UInt64Value)
			v, l := consumeMessage(s)
			if l < 0 {
				return false
			}
			hitsSeen = true
			var w *wrapperspb.UInt64Value
			if f != nil {
				w = new(wrapperspb.UInt64Value)
				d.HitsAddend = w
			}
			if !walkUInt64(v, w) {
				return false
			}
			s = s[l:]
		case num == 4 && typ == protowire.VarintType: // is_negative_hits
			v, l := protowire.ConsumeVarint(b(s))
			if l < 0 || v > 1 {
				return false
			}
			if d != nil {
				d.IsNegativeHits = v == 1
			}
			s = s[l:]
		default: // including limit (2): the standard codec decodes it
			return false
		}
	}
	return true
}

func walkEntry(s string, e *rlcommon.RateLimitDescriptor_Entry) bool {
	for len(s) > 0 {
		num, typ, l := protowire.ConsumeTag(b(s))
		if l < 0 || typ != protowire.BytesType || (num != 1 && num != 2) {
			return false
		}
		s = s[l:]
		v, l := consumeString(s)
		if l < 0 {
			return false
		}
		if e != nil {
			if num == 1 {
				e.Key = v
			} else {
				e.Value = v
			}
		}
		s = s[l:]
	}
	return true
}

func walkUInt64(s string, w *wrapperspb.UInt64Value) bool {
	for len(s) > 0 {
		num, typ, l := protowire.ConsumeTag(b(s))
		if l < 0 || num != 1 || typ != protowire.VarintType {
			return false
		}
		s = s[l:]
		v, l := protowire.ConsumeVarint(b(s))
		if l < 0 {
			return false
		}
		if w != nil {
			w.Value = v
		}
		s = s[l:]
	}
	return true
}

// consumeMessage is protowire.ConsumeBytes over a string: the field's
// bytes (a nested message) and the length consumed, or -1.
func consumeMessage(s string) (string, int) {
	v, l := protowire.ConsumeBytes(b(s))
	if l < 0 {
		return "", -1
	}
	return s[l-len(v) : l], l
}

// consumeString is consumeMessage for a string field: invalid UTF-8 is
// refused (proto3 string fields refuse it; the standard codec then reports
// the error).
func consumeString(s string) (string, int) {
	v, l := consumeMessage(s)
	if l < 0 || !utf8.ValidString(v) {
		return "", -1
	}
	return v, l
}

// b views s as bytes for protowire, which only reads them.
func b(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }
