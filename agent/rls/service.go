package rls

import (
	"context"
	"math"
	"sync"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// serviceDesc is envoy.service.ratelimit.v3.RateLimitService as the
// generated code describes it (same service, method and file), with a
// handler of its own: handleShouldRateLimit.
var serviceDesc = grpc.ServiceDesc{
	ServiceName: "envoy.service.ratelimit.v3.RateLimitService",
	HandlerType: (*rlsv3.RateLimitServiceServer)(nil),
	Methods:     []grpc.MethodDesc{{MethodName: "ShouldRateLimit", Handler: handleShouldRateLimit}},
	Streams:     []grpc.StreamDesc{},
	Metadata:    "envoy/service/ratelimit/v3/rls.proto",
}

// handleShouldRateLimit serves ShouldRateLimit. The generated handler
// decodes into a new RateLimitRequest, a tree of messages the server only
// reads once; this one decodes into a pooled request, which the server's
// codec fills with the checker's descriptors directly (any other codec
// fills its embedded RateLimitRequest, converted afterwards), and
// answers a reply, which the codec marshals itself. With an interceptor
// it serves the generated way: the interceptor sees a RateLimitRequest
// and ShouldRateLimit.
func handleShouldRateLimit(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
	s := srv.(*Server)
	if icpt != nil {
		in := new(rlsv3.RateLimitRequest)
		if err := dec(in); err != nil {
			return nil, err
		}
		info := &grpc.UnaryServerInfo{Server: srv, FullMethod: rlsv3.RateLimitService_ShouldRateLimit_FullMethodName}
		return icpt(ctx, in, info, func(ctx context.Context, req any) (any, error) {
			return s.ShouldRateLimit(ctx, req.(*rlsv3.RateLimitRequest))
		})
	}
	c := getRequest()
	defer putRequest(c)
	if err := dec(c); err != nil {
		return nil, err
	}
	if !c.decoded {
		c.fromRequest(&c.RateLimitRequest)
	}
	r, _, err := s.answer(ctx, c)
	if err != nil {
		return nil, err
	}
	return r, nil
}

// request is one ShouldRateLimit request as the checker takes it, and the
// call's working memory; pooled. Its strings point into a copy of the
// request's bytes made for the call, or into RateLimitRequest.
type request struct {
	// RateLimitRequest is what a codec other than the server's own
	// decodes into (*request is a proto.Message through it); fromRequest
	// converts it.
	rlsv3.RateLimitRequest

	decoded  bool   // the fields below hold the request
	fast     bool   // decoded by decodeRequest: RateLimitRequest is untouched
	domain   string // undecodable+why for a request the codec refused
	hits     uint32 // the request's hits_addend
	ndescs   int    // descriptors in the request; descs holds them when ≤ agent.MaxDescriptors
	descs    []agent.Descriptor
	negative []bool // is_negative_hits, per descriptor
	// nentries counts each descriptor's entries. The entries themselves
	// are held only when no descriptor has more than agent.MaxEntries (a
	// request answer refuses is not copied).
	nentries []int
	entries  []rules.Entry
	statuses []agent.Status
}

var requestPool = sync.Pool{New: func() any { return new(request) }}

func getRequest() *request { return requestPool.Get().(*request) }

// maxPooledEntries bounds the entries a pooled request keeps room for: one
// that grew past it (a request of many descriptors) is dropped.
const maxPooledEntries = 4 * agent.MaxDescriptors

// putRequest clears c and returns it to the pool.
func putRequest(c *request) {
	if !c.fast {
		proto.Reset(&c.RateLimitRequest)
	}
	if cap(c.entries) > maxPooledEntries {
		return
	}
	clear(c.descs)
	clear(c.negative)
	clear(c.nentries)
	clear(c.entries)
	clear(c.statuses)
	c.decoded, c.fast, c.domain, c.hits, c.ndescs = false, false, "", 0, 0
	c.descs, c.negative, c.nentries = c.descs[:0], c.negative[:0], c.nentries[:0]
	c.entries, c.statuses = c.entries[:0], c.statuses[:0]
	requestPool.Put(c)
}

// grow makes room for descs descriptors (at most agent.MaxDescriptors) of
// entries entries in all, and sets the lengths (the elements are zero:
// putRequest clears what a call used). entries is 0 for a request with a
// descriptor of more than agent.MaxEntries: what a request can make the
// server allocate before answer refuses it is bounded by the limits, not
// by its size.
func (c *request) grow(descs, entries int) {
	if cap(c.descs) < descs {
		c.descs = make([]agent.Descriptor, descs)
		c.negative = make([]bool, descs)
		c.nentries = make([]int, descs)
	}
	if cap(c.entries) < entries {
		c.entries = make([]rules.Entry, entries)
	}
	c.descs, c.negative, c.nentries, c.entries = c.descs[:descs], c.negative[:descs], c.nentries[:descs], c.entries[:entries]
}

// fromRequest sets c (fresh from getRequest, or holding only its embedded
// request) to req.
func (c *request) fromRequest(req *rlsv3.RateLimitRequest) {
	c.decoded = true
	c.domain, c.hits = req.GetDomain(), req.GetHitsAddend()
	in := req.GetDescriptors()
	c.ndescs = len(in)
	if len(in) > agent.MaxDescriptors {
		return
	}
	total, widest := 0, 0
	for _, d := range in {
		total += len(d.GetEntries())
		widest = max(widest, len(d.GetEntries()))
	}
	if widest > agent.MaxEntries {
		total = 0
	}
	c.grow(len(in), total)
	total = 0
	for i, d := range in {
		c.nentries[i] = len(d.GetEntries())
		var ad agent.Descriptor
		if len(c.entries) > 0 {
			start := total
			for _, e := range d.GetEntries() {
				c.entries[total] = rules.Entry{Key: e.GetKey(), Value: e.GetValue()}
				total++
			}
			ad.Entries = c.entries[start:total:total]
		}
		if h := d.GetHitsAddend(); h != nil {
			ad.HitsAddendSet = true
			ad.HitsAddend = uint32(min(h.GetValue(), math.MaxUint32))
		}
		c.descs[i] = ad
		c.negative[i] = d.GetIsNegativeHits()
	}
}
