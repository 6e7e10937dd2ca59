package rls

import (
	"math"
	"unicode/utf8"
	"unsafe"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the "proto" codec this one falls back on
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/agent"
)

// codec is gRPC's proto codec with a decoder of its own for a
// ShouldRateLimit call's request and an encoder of its own for its reply,
// the two messages the server handles per check.
//
// The decoder takes a *request (see handleShouldRateLimit): it copies the
// request's bytes into one string that the domain and every entry point
// into, and fills the request's descriptors and entries (pooled)
// directly; the standard decoder would allocate every descriptor, entry
// and string apart, into a message tree read once. It decodes only the shape Envoy sends: domain,
// descriptors (entries, hits_addend, is_negative_hits) and hits_addend,
// each string valid UTF-8. Anything else (a descriptor's limit override,
// unknown fields, invalid UTF-8, a malformed message, a field in an
// unexpected wire type) goes to the standard codec, which then decides
// exactly as it would alone (FuzzRequestCodec compares the two on
// arbitrary bytes).
//
// A request that the standard codec refuses is not an error here: gRPC
// would answer it Internal before any handler runs, as if the server had
// failed. It decodes as a request whose domain is undecodable followed by
// the codec's error, which the server answers InvalidArgument.
//
// The encoder takes a *reply and writes the bytes proto.Marshal would
// (FuzzReplyMarshal compares them), without proto's reflection, in one
// allocation. Every other message is the standard codec's.
type codec struct{ std encoding.CodecV2 }

// undecodable starts the domain of a request the codec could not decode:
// bytes that are not UTF-8, so no decoded request has them.
const undecodable = "\xff\xfe"

func newCodec() codec {
	return codec{std: encoding.GetCodecV2("proto")}
}

// Name is the standard codec's: clients send application/grpc (+proto).
func (c codec) Name() string { return "proto" }

func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	if r, ok := v.(*reply); ok {
		if n, ok := r.size(); ok {
			return r.marshal(n), nil
		}
	}
	return c.std.Marshal(v)
}

func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	switch m := v.(type) {
	case *request:
		if data.Len() <= maxFastRequest {
			b := make([]byte, data.Len())
			data.CopyTo(b)
			if decodeRequest(unsafe.String(unsafe.SliceData(b), len(b)), m) {
				return nil
			}
		}
		if err := c.std.Unmarshal(data, m); err != nil {
			proto.Reset(&m.RateLimitRequest)
			m.decoded, m.domain = true, undecodable+err.Error()
		}
		return nil
	case *rlsv3.RateLimitRequest:
		if err := c.std.Unmarshal(data, m); err != nil {
			proto.Reset(m)
			m.Domain = undecodable + err.Error()
		}
		return nil
	}
	return c.std.Unmarshal(data, v)
}

// maxFastRequest bounds the requests decodeRequest takes (the gateway
// refuses larger ones by default: gateway.DefaultRLSMaxRequestBytes).
const maxFastRequest = 64 << 10

// decodeRequest decodes the RateLimitRequest s into c, fresh from getRequest,
// and reports whether it did; on false c is untouched. The decoded strings
// point into s, which must not change afterwards.
func decodeRequest(s string, c *request) bool {
	var n counts
	if !walkRequest(s, &n, nil) {
		return false
	}
	c.decoded, c.fast, c.ndescs = true, true, n.descs
	if n.descs <= agent.MaxDescriptors {
		entries := n.entries
		if n.widest > agent.MaxEntries {
			entries = 0 // answer refuses the request: its entries are not copied
		}
		c.grow(n.descs, entries)
	}
	walkRequest(s, &counts{}, c)
	return true
}

// counts are what a checking pass counts: descriptors, entries in all,
// and the most entries in one descriptor.
type counts struct{ descs, entries, widest int }

// walkRequest checks and counts (c nil) or fills (c set, after a checking
// pass succeeded) a RateLimitRequest. It fills c's descriptors when c has
// room for them (c.grow), and their entries when it has room for those.
func walkRequest(s string, n *counts, c *request) bool {
	fill := c != nil && len(c.descs) == c.ndescs
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
			if c != nil {
				c.domain = v
			}
			s = s[l:]
		case num == 2 && typ == protowire.BytesType: // descriptors
			v, l := consumeMessage(s)
			if l < 0 {
				return false
			}
			first := n.entries
			dc := c
			if !fill {
				dc = nil
			}
			if !walkDescriptor(v, n, dc, n.descs) {
				return false
			}
			n.widest = max(n.widest, n.entries-first)
			if fill {
				c.nentries[n.descs] = n.entries - first
				if len(c.entries) > 0 {
					c.descs[n.descs].Entries = c.entries[first:n.entries:n.entries]
				}
			}
			n.descs++
			s = s[l:]
		case num == 3 && typ == protowire.VarintType: // hits_addend
			v, l := protowire.ConsumeVarint(b(s))
			if l < 0 || v > math.MaxUint32 {
				return false
			}
			if c != nil {
				c.hits = uint32(v)
			}
			s = s[l:]
		default:
			return false
		}
	}
	return true
}

// walkDescriptor checks and counts a descriptor, and fills descriptor i
// of c when c is set (its entries when c has room for them).
func walkDescriptor(s string, n *counts, c *request, i int) bool {
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
			var key, value string
			if !walkEntry(v, &key, &value) {
				return false
			}
			if c != nil && len(c.entries) > 0 {
				e := &c.entries[n.entries]
				e.Key, e.Value = key, value
			}
			n.entries++
			s = s[l:]
		case num == 3 && typ == protowire.BytesType && !hitsSeen: // hits_addend (UInt64Value)
			// A second occurrence would merge with the first: the
			// standard codec decodes it.
			v, l := consumeMessage(s)
			if l < 0 {
				return false
			}
			hitsSeen = true
			h, ok := walkUInt64(v)
			if !ok {
				return false
			}
			if c != nil {
				c.descs[i].HitsAddendSet = true
				c.descs[i].HitsAddend = uint32(min(h, math.MaxUint32))
			}
			s = s[l:]
		case num == 4 && typ == protowire.VarintType: // is_negative_hits
			v, l := protowire.ConsumeVarint(b(s))
			if l < 0 || v > 1 {
				return false
			}
			if c != nil {
				c.negative[i] = v == 1
			}
			s = s[l:]
		default: // including limit (2): the standard codec decodes it
			return false
		}
	}
	return true
}

func walkEntry(s string, key, value *string) bool {
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
		if num == 1 {
			*key = v
		} else {
			*value = v
		}
		s = s[l:]
	}
	return true
}

// walkUInt64 decodes a google.protobuf.UInt64Value.
func walkUInt64(s string) (uint64, bool) {
	var v uint64
	for len(s) > 0 {
		num, typ, l := protowire.ConsumeTag(b(s))
		if l < 0 || num != 1 || typ != protowire.VarintType {
			return 0, false
		}
		s = s[l:]
		x, l := protowire.ConsumeVarint(b(s))
		if l < 0 {
			return 0, false
		}
		v = x
		s = s[l:]
	}
	return v, true
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

// Field numbers of the reply's messages (envoy/service/ratelimit/v3/rls.proto,
// google/protobuf/duration.proto and wrappers.proto).
const (
	respOverallCode = 1
	respStatuses    = 2

	statusCode               = 1
	statusCurrentLimit       = 2
	statusLimitRemaining     = 3
	statusDurationUntilReset = 4

	limitRequestsPerUnit = 1
	limitUnit            = 2
	limitName            = 3
	limitUnitMultiplier  = 4

	durationSeconds = 1
	durationNanos   = 2

	wrapperValue = 1
)

// size is r's marshalled size, and false when r has a field appendTo does
// not write (answer sets none).
func (r *reply) size() (int, bool) {
	m := &r.RateLimitResponse
	if m.ResponseHeadersToAdd != nil || m.RequestHeadersToAdd != nil || m.RawBody != nil || m.DynamicMetadata != nil || m.Quota != nil {
		return 0, false
	}
	n := varintSize(respOverallCode, uint64(m.OverallCode))
	for _, st := range m.Statuses {
		if st == nil || st.Quota != nil {
			return 0, false
		}
		if l := st.CurrentLimit; l != nil && !utf8.ValidString(l.Name) {
			return 0, false // proto.Marshal refuses it
		}
		n += messageSize(respStatuses, statusSize(st))
	}
	return n, true
}

// appendTo appends r's encoding (r.size said it can) to out.
func (r *reply) appendTo(out []byte) []byte {
	m := &r.RateLimitResponse
	out = appendVarint(out, respOverallCode, uint64(m.OverallCode))
	for _, st := range m.Statuses {
		out = protowire.AppendTag(out, respStatuses, protowire.BytesType)
		out = protowire.AppendVarint(out, uint64(statusSize(st)))
		out = appendVarint(out, statusCode, uint64(st.Code))
		if l := st.CurrentLimit; l != nil {
			out = protowire.AppendTag(out, statusCurrentLimit, protowire.BytesType)
			out = protowire.AppendVarint(out, uint64(limitSize(l)))
			out = appendVarint(out, limitRequestsPerUnit, uint64(l.RequestsPerUnit))
			out = appendVarint(out, limitUnit, uint64(l.Unit))
			if l.Name != "" {
				out = protowire.AppendTag(out, limitName, protowire.BytesType)
				out = protowire.AppendString(out, l.Name)
			}
			if w := l.UnitMultiplier; w != nil {
				out = protowire.AppendTag(out, limitUnitMultiplier, protowire.BytesType)
				out = protowire.AppendVarint(out, uint64(varintSize(wrapperValue, uint64(w.Value))))
				out = appendVarint(out, wrapperValue, uint64(w.Value))
			}
		}
		out = appendVarint(out, statusLimitRemaining, uint64(st.LimitRemaining))
		if d := st.DurationUntilReset; d != nil {
			out = protowire.AppendTag(out, statusDurationUntilReset, protowire.BytesType)
			out = protowire.AppendVarint(out, uint64(durationSize(d.Seconds, d.Nanos)))
			out = appendVarint(out, durationSeconds, uint64(d.Seconds))
			out = appendVarint(out, durationNanos, uint64(d.Nanos))
		}
	}
	return out
}

func statusSize(st *rlsv3.RateLimitResponse_DescriptorStatus) int {
	n := varintSize(statusCode, uint64(st.Code)) + varintSize(statusLimitRemaining, uint64(st.LimitRemaining))
	if l := st.CurrentLimit; l != nil {
		n += messageSize(statusCurrentLimit, limitSize(l))
	}
	if d := st.DurationUntilReset; d != nil {
		n += messageSize(statusDurationUntilReset, durationSize(d.Seconds, d.Nanos))
	}
	return n
}

func limitSize(l *rlsv3.RateLimitResponse_RateLimit) int {
	n := varintSize(limitRequestsPerUnit, uint64(l.RequestsPerUnit)) + varintSize(limitUnit, uint64(l.Unit))
	if l.Name != "" {
		n += messageSize(limitName, len(l.Name))
	}
	if w := l.UnitMultiplier; w != nil {
		n += messageSize(limitUnitMultiplier, varintSize(wrapperValue, uint64(w.Value)))
	}
	return n
}

func durationSize(seconds int64, nanos int32) int {
	return varintSize(durationSeconds, uint64(seconds)) + varintSize(durationNanos, uint64(nanos))
}

// varintSize is the size of a proto3 varint field (nothing when v is 0).
// Negative int32 and enum values are passed sign-extended, as proto
// encodes them: uint64(x) of the signed value.
func varintSize(num protowire.Number, v uint64) int {
	if v == 0 {
		return 0
	}
	return protowire.SizeTag(num) + protowire.SizeVarint(v)
}

func appendVarint(out []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return out
	}
	out = protowire.AppendTag(out, num, protowire.VarintType)
	return protowire.AppendVarint(out, v)
}

// messageSize is the size of a length-delimited field of n bytes.
func messageSize(num protowire.Number, n int) int {
	return protowire.SizeTag(num) + protowire.SizeBytes(n)
}

// replyBytes is a marshalled reply in one allocation: the BufferSlice gRPC
// is handed, its one buffer, and (for most replies) the bytes. The buffer
// is a *mem.SliceBuffer, which has SliceBuffer's methods: Free does
// nothing, the garbage collector takes the bytes.
type replyBytes struct {
	bufs [1]mem.Buffer
	sb   mem.SliceBuffer
	b    [inlineReplyBytes]byte
}

// inlineReplyBytes: replyBytes is 144 bytes, a size class; a reply of one
// or two statuses fits.
const inlineReplyBytes = 144 - 16 - 24

// marshal encodes r, of size n.
func (r *reply) marshal(n int) mem.BufferSlice {
	rb := new(replyBytes)
	var out []byte
	if n <= len(rb.b) {
		out = rb.b[:0:n]
	} else {
		out = make([]byte, 0, n)
	}
	rb.sb = r.appendTo(out)
	rb.bufs[0] = &rb.sb
	return rb.bufs[:]
}
