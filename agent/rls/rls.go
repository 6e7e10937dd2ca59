// Package rls serves Envoy's rate limit service API
// (envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit) from the
// embedded agent, so Envoy's global rate limit filter can point at a gateway
// instead of envoyproxy/ratelimit + Redis, and get decisions made in-process
// from leased tokens.
//
// Request mapping, following envoyproxy/ratelimit's semantics:
//
//   - domain and descriptors are required (InvalidArgument otherwise, as are
//     descriptors with no entries or an empty entry key, more than
//     agent.MaxDescriptors descriptors and more than agent.MaxEntries
//     entries in one, which are counted before the entries are copied).
//   - hits_addend: request level, 0 means 1; a descriptor's hits_addend,
//     when present, overrides it, and a present 0 checks the descriptor
//     without consuming. Values above 2³²−1 saturate.
//   - is_negative_hits (refunds) is not supported: InvalidArgument.
//   - A descriptor's limit override is ignored: limits come from the rules.
//
// Response: overall_code is OVER_LIMIT when any non-shadow descriptor is
// over its limit. Each status carries current_limit {requests_per_unit,
// unit, unit_multiplier, name}, limit_remaining (after this request's hits)
// and duration_until_reset (until the limit is full again; for an
// OVER_LIMIT status, until the request could succeed), which is what Envoy
// needs for its x-ratelimit-* headers. Shadow-mode limits always answer OK.
// A descriptor matching no rule, or an unknown domain, is OK with no
// current_limit; an unlimited rule is OK with limit_remaining 2³²−1.
package rls

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"runtime"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/rules"
)

// Checker decides a request with per-descriptor statuses. *agent.Agent
// implements it. It must not retain descs after returning (they are the
// server's pooled memory).
type Checker interface {
	CheckStatuses(ctx context.Context, domain string, descs []agent.Descriptor, hits uint32, out []agent.Status) (agent.Decision, []agent.Status, error)
}

// Server implements rlsv3.RateLimitServiceServer. Create it with New.
type Server struct {
	rlsv3.UnimplementedRateLimitServiceServer
	checker Checker
	logger  *slog.Logger
	byCode  [numOutcomes]prometheus.Counter
	limits  limitCache
}

type outcome int

const (
	outOK outcome = iota
	outOverLimit
	outInvalid
	outError
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"ok", "over_limit", "invalid", "error"}

// Options configures a Server. The zero value is valid.
type Options struct {
	// Logger receives checker errors. Nil: discard.
	Logger *slog.Logger
	// Registerer receives allot_rls_requests_total{code}. Nil: not
	// registered.
	Registerer prometheus.Registerer
}

// New returns a Server that decides with c.
func New(c Checker, opts Options) (*Server, error) {
	if c == nil {
		return nil, errors.New("rls: nil Checker")
	}
	s := &Server{checker: c, logger: opts.Logger}
	if s.logger == nil {
		s.logger = slog.New(slog.DiscardHandler)
	}
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "allot_rls_requests_total",
		Help: "Envoy RLS ShouldRateLimit calls, by outcome (ok, over_limit, invalid, error).",
	}, []string{"code"})
	if opts.Registerer != nil {
		if err := opts.Registerer.Register(vec); err != nil {
			return nil, err
		}
	}
	for i := range s.byCode {
		s.byCode[i] = vec.WithLabelValues(outcomeNames[i])
	}
	return s, nil
}

// Register registers s on g as envoy.service.ratelimit.v3.RateLimitService
// (see serviceDesc).
func (s *Server) Register(g *grpc.Server) { g.RegisterService(&serviceDesc, s) }

// ShouldRateLimit implements the RLS v3 API.
func (s *Server) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	resp, _, err := s.decide(ctx, req)
	return resp, err
}

// decide answers req, and returns the agent's decision with the response
// (for the RateLimit fields of the JSON endpoint). Errors are gRPC status
// errors. The gRPC method, ShouldRateLimit and POST /json all answer
// through answer.
func (s *Server) decide(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, agent.Decision, error) {
	c := getRequest()
	defer putRequest(c)
	c.fromRequest(req)
	r, dec, err := s.answer(ctx, c)
	if err != nil {
		return nil, dec, err
	}
	return &r.RateLimitResponse, dec, nil
}

// answer validates the request c holds, has the checker decide it, and
// builds the response.
func (s *Server) answer(ctx context.Context, c *request) (*reply, agent.Decision, error) {
	if c.domain == "" {
		s.byCode[outInvalid].Inc()
		return nil, agent.Decision{}, status.Error(codes.InvalidArgument, "rls: domain must not be empty")
	}
	if why, ok := strings.CutPrefix(c.domain, undecodable); ok {
		s.byCode[outInvalid].Inc()
		return nil, agent.Decision{}, status.Error(codes.InvalidArgument, "rls: the request is not a valid RateLimitRequest (every string must be valid UTF-8): "+why)
	}
	if c.ndescs == 0 {
		s.byCode[outInvalid].Inc()
		return nil, agent.Decision{}, status.Error(codes.InvalidArgument, "rls: descriptors must not be empty")
	}
	if c.ndescs > agent.MaxDescriptors {
		s.byCode[outInvalid].Inc()
		return nil, agent.Decision{}, status.Errorf(codes.InvalidArgument, "rls: %d descriptors, at most %d", c.ndescs, agent.MaxDescriptors)
	}
	for i, n := range c.nentries {
		if n == 0 || n > agent.MaxEntries {
			s.byCode[outInvalid].Inc()
			return nil, agent.Decision{}, status.Errorf(codes.InvalidArgument, "rls: descriptor %d has %d entries, want 1 to %d", i, n, agent.MaxEntries)
		}
		if c.negative[i] {
			s.byCode[outInvalid].Inc()
			return nil, agent.Decision{}, status.Errorf(codes.InvalidArgument, "rls: descriptor %d: is_negative_hits is not supported", i)
		}
	}

	dec, sts, err := s.checker.CheckStatuses(ctx, c.domain, c.descs, c.hits, c.statuses[:0])
	c.statuses = sts
	if err != nil {
		if errors.Is(err, agent.ErrInvalid) {
			s.byCode[outInvalid].Inc()
			return nil, agent.Decision{}, status.Error(codes.InvalidArgument, "rls: "+err.Error())
		}
		s.byCode[outError].Inc()
		s.logger.Warn("rls: check failed", "err", err)
		return nil, agent.Decision{}, status.Error(codes.Unavailable, "rls: "+err.Error())
	}
	if len(sts) != len(c.descs) {
		s.byCode[outError].Inc()
		return nil, agent.Decision{}, status.Errorf(codes.Internal, "rls: checker returned %d statuses for %d descriptors", len(sts), len(c.descs))
	}

	resp, blk := newResponse(len(sts))
	if !dec.Allowed {
		resp.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
		s.byCode[outOverLimit].Inc()
	} else {
		s.byCode[outOK].Inc()
	}
	for i := range sts {
		s.fillStatus(&blk[i], &sts[i])
	}
	return resp, dec, nil
}

// statusBlock is one descriptor's status with its duration, allocated
// together.
type statusBlock struct {
	st  rlsv3.RateLimitResponse_DescriptorStatus
	dur durationpb.Duration
}

// reply is a response as answer builds it: OverallCode and Statuses, each
// status with at most Code, CurrentLimit (a limitCache message),
// LimitRemaining and DurationUntilReset. The server's codec marshals it
// itself (see codec.Marshal); any other codec sees the embedded message.
type reply struct{ rlsv3.RateLimitResponse }

// reply1 is a reply with one status in one allocation (most Envoy
// requests carry one or two descriptors).
type reply1 struct {
	reply
	ptrs [1]*rlsv3.RateLimitResponse_DescriptorStatus
	blk  [1]statusBlock
}

// reply2 is reply1 for two statuses.
type reply2 struct {
	reply
	ptrs [2]*rlsv3.RateLimitResponse_DescriptorStatus
	blk  [2]statusBlock
}

// newResponse returns an OK reply with n zero statuses, in as few
// allocations as n allows (one for n ≤ 2, three otherwise), and the blocks
// its statuses live in.
func newResponse(n int) (*reply, []statusBlock) {
	var resp *reply
	var ptrs []*rlsv3.RateLimitResponse_DescriptorStatus
	var blk []statusBlock
	switch n {
	case 1:
		r := new(reply1)
		resp, ptrs, blk = &r.reply, r.ptrs[:], r.blk[:]
	case 2:
		r := new(reply2)
		resp, ptrs, blk = &r.reply, r.ptrs[:], r.blk[:]
	default:
		resp = new(reply)
		ptrs = make([]*rlsv3.RateLimitResponse_DescriptorStatus, n)
		blk = make([]statusBlock, n)
	}
	for i := range ptrs {
		ptrs[i] = &blk[i].st
	}
	resp.OverallCode = rlsv3.RateLimitResponse_OK
	resp.Statuses = ptrs
	return resp, blk
}

// fillStatus writes st into b, a zero block from newResponse.
func (s *Server) fillStatus(b *statusBlock, st *agent.Status) {
	out := &b.st
	out.Code = rlsv3.RateLimitResponse_OK
	r := st.Rule
	if r == nil {
		return
	}
	if r.Unlimited {
		out.LimitRemaining = math.MaxUint32
		return
	}
	if !st.Allowed && !st.Shadow && !r.ShadowMode {
		out.Code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	out.CurrentLimit = s.limits.get(r)
	out.LimitRemaining = uint32(max(0, min(st.Remaining, math.MaxUint32)))
	reset := st.ResetAfter
	if out.Code == rlsv3.RateLimitResponse_OVER_LIMIT && st.RetryAfter > 0 {
		// At most the transports' longest wait: bucket.Never (a
		// request over the rule's burst) is not 292 years either.
		reset = min(st.RetryAfter, httplimit.MaxRetryAfter)
	}
	reset = max(reset, 0)
	dur := &b.dur
	dur.Seconds = int64(reset / time.Second)
	dur.Nanos = int32(reset % time.Second)
	out.DurationUntilReset = dur
}

// currentLimit is r's limit as RLS reports it.
func currentLimit(r *rules.Rule) *rlsv3.RateLimitResponse_RateLimit {
	l := &rlsv3.RateLimitResponse_RateLimit{
		Name:            r.Name,
		RequestsPerUnit: r.RequestsPerUnit,
		Unit:            unit(r.Unit),
	}
	if r.UnitMultiplier > 1 {
		l.UnitMultiplier = wrapUint32(r.UnitMultiplier)
	}
	return l
}

// limitCache maps a rule to its current_limit message, built once and
// shared by every response that reports the rule: a response is only read
// after the handler returns (marshalled, which protobuf-go allows from
// several goroutines at once), never changed. Direct-mapped by the rule's
// address; a rule that misses (its slot holds another) gets a fresh
// message and takes the slot.
type limitCache struct {
	slots [limitSlots]atomic.Pointer[limitEntry]
}

const limitSlots = 256 // power of two

type limitEntry struct {
	rule *rules.Rule
	lim  *rlsv3.RateLimitResponse_RateLimit
}

func (c *limitCache) get(r *rules.Rule) *rlsv3.RateLimitResponse_RateLimit {
	p := uintptr(unsafe.Pointer(r))
	slot := &c.slots[(p>>4^p>>12)&(limitSlots-1)]
	if e := slot.Load(); e != nil && e.rule == r {
		return e.lim
	}
	e := &limitEntry{rule: r, lim: currentLimit(r)}
	slot.Store(e)
	return e.lim
}

func unit(u rules.Unit) rlsv3.RateLimitResponse_RateLimit_Unit {
	switch u {
	case rules.UnitSecond:
		return rlsv3.RateLimitResponse_RateLimit_SECOND
	case rules.UnitMinute:
		return rlsv3.RateLimitResponse_RateLimit_MINUTE
	case rules.UnitHour:
		return rlsv3.RateLimitResponse_RateLimit_HOUR
	case rules.UnitDay:
		return rlsv3.RateLimitResponse_RateLimit_DAY
	case rules.UnitWeek:
		return rlsv3.RateLimitResponse_RateLimit_WEEK
	case rules.UnitMonth:
		return rlsv3.RateLimitResponse_RateLimit_MONTH
	case rules.UnitYear:
		return rlsv3.RateLimitResponse_RateLimit_YEAR
	}
	return rlsv3.RateLimitResponse_RateLimit_UNKNOWN
}

func wrapUint32(v uint32) *wrapperspb.UInt32Value { return wrapperspb.UInt32(v) }

// ServerOptions are the gRPC server options the RLS server is meant to run
// with (cmd/gateway adds credentials and a message size bound):
//   - calls are served by a pool of long-lived goroutines (grpc spills over
//     to a new goroutine when all are busy) rather than a goroutine per
//     call, whose stack would be grown again on every call;
//   - ShouldRateLimit's request and reply are decoded and encoded by codec
//     (no message tree, fewer allocations; every other message by gRPC's
//     proto codec).
//
// They apply to every service on the server (the health service too).
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.NumStreamWorkers(uint32(max(64, 4*runtime.GOMAXPROCS(0)))),
		grpc.ForceServerCodecV2(newCodec()),
	}
}
