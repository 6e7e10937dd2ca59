package allocator

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/tlsconfig"
)

// ErrorInfo reasons of ResourceExhausted refusals (nothing was applied;
// the RetryInfo detail says when to come back).
const (
	// ReasonAgentRate: the agent sent calls faster than Config.AgentRate.
	ReasonAgentRate = "AGENT_RATE_LIMITED"
	// ReasonOverloaded: the node is at Config.MaxInflight calls, or the
	// leader's batcher queue is full.
	ReasonOverloaded = "OVERLOADED"
)

// overloadRetry is the retry hint of an OVERLOADED refusal.
const overloadRetry = 100 * time.Millisecond

// guard is the gRPC server's front door: it authenticates and authorizes
// every call, limits each agent's call rate, and caps the calls in flight,
// in that order, so that a refused call costs next to nothing. It knows
// nothing of Raft, so it is tested against fake services.
type guard struct {
	authOn       bool // authentication configured (Config.authEnabled)
	requireCerts bool // ClientAuth require: agents must present certificates
	noCerts      bool // ClientAuth none: no caller, peers included, presents a certificate
	openReads    bool
	tokens       atomic.Pointer[tlsconfig.Tokens]
	// peers are Config.PeerNames (nil: every allocator certificate is a
	// node); see isPeer.
	peers map[string]bool

	agents      atomic.Pointer[agentLimiter] // nil: no per-agent limit
	maxInflight int64
	inflight    atomic.Int64

	log      *slog.Logger
	rejected func(reason string) // metrics; may be nil
	logGate  logGate
	now      func() int64 // Unix nanoseconds
}

func newGuard(cfg Config, log *slog.Logger) *guard {
	g := &guard{
		authOn:       cfg.authEnabled(),
		requireCerts: cfg.ClientAuth == tlsconfig.ClientAuthRequire,
		noCerts:      cfg.ClientAuth == tlsconfig.ClientAuthNone,
		openReads:    cfg.OpenReads,
		maxInflight:  int64(cfg.MaxInflight),
		log:          log,
		now:          func() int64 { return time.Now().UnixNano() },
	}
	g.tokens.Store(tlsconfig.NewTokens(cfg.AdminTokens))
	if len(cfg.PeerNames) > 0 {
		g.peers = make(map[string]bool, len(cfg.PeerNames))
		for _, n := range cfg.PeerNames {
			g.peers[n] = true
		}
	}
	if cfg.AgentRate > 0 {
		g.agents.Store(newAgentLimiter(cfg.AgentRate, cfg.AgentBurst))
	}
	return g
}

// unary is the unary server interceptor.
func (g *guard) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	class := classify(info.FullMethod)
	if class == classOpen {
		return handler(ctx, req)
	}
	var p principal
	if g.authOn {
		var aerr *authError
		if p, aerr = g.authenticate(ctx); aerr == nil {
			aerr = g.authorize(p, class, info.FullMethod, req)
		}
		if aerr != nil {
			return nil, g.refuse(aerr.reason, aerr.err, info.FullMethod, p)
		}
		ctx = withPrincipal(ctx, p)
	}
	if lim := g.agents.Load(); class == classAgent && lim != nil && !p.forwarded {
		if err := g.limitAgent(lim, p, req); err != nil {
			return nil, g.refuse("agent_rate", err, info.FullMethod, p)
		}
	}
	if g.inflight.Add(1) > g.maxInflight {
		g.inflight.Add(-1)
		err := exhausted(ReasonOverloaded, overloadRetry,
			"allocator: overloaded: %d calls in flight; retry shortly", g.maxInflight)
		return nil, g.refuse("inflight", err, info.FullMethod, p)
	}
	defer g.inflight.Add(-1)
	resp, err := handler(ctx, req)
	if class != classAgent && !p.forwarded {
		g.audit(ctx, class, info.FullMethod, p, req, err)
	}
	return resp, err
}

// audit logs an admin call: who (the certificate identity or "token",
// "anonymous" without authentication), what (the method and its redacted
// arguments), from where (the peer address) and the result (the gRPC
// code, and the error without descriptor values: errAttrs). Changes are
// logged at Info, reads at Debug. A call forwarded by
// another node was logged there.
func (g *guard) audit(ctx context.Context, class methodClass, method string, p principal, req any, err error) {
	from := ""
	if pr, ok := peer.FromContext(ctx); ok && pr.Addr != nil {
		from = pr.Addr.String()
	}
	attrs := append([]any{"method", method, "caller", p.String(), "from", from, "code", status.Code(err).String()}, auditAttrs(req)...)
	if err != nil {
		attrs = append(attrs, errAttrs(err)...)
	}
	g.log.Log(ctx, auditLevel(class), "admin call", attrs...)
}

// stream is the stream server interceptor (WatchRules). Streams are
// long-lived, so they are not counted in flight; MaxConcurrentStreams
// bounds them per connection.
func (g *guard) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	class := classify(info.FullMethod)
	if class == classOpen || !g.authOn {
		return handler(srv, ss)
	}
	p, aerr := g.authenticate(ss.Context())
	if aerr == nil {
		aerr = g.authorize(p, class, info.FullMethod, nil)
	}
	if aerr != nil {
		return g.refuse(aerr.reason, aerr.err, info.FullMethod, p)
	}
	return handler(srv, &principalStream{ServerStream: ss, ctx: withPrincipal(ss.Context(), p)})
}

type principalStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *principalStream) Context() context.Context { return s.ctx }

// refuse counts and (rate-limited) logs a refusal, and returns err.
func (g *guard) refuse(reason string, err error, method string, p principal) error {
	if g.rejected != nil {
		g.rejected(reason)
	}
	if n, ok := g.logGate.allow(g.now()); ok {
		g.log.Warn("call refused", "reason", reason, "method", method, "caller", p.String(),
			"suppressed", n, "err", status.Convert(err).Message())
	}
	return err
}

// limitAgent takes one call from the agent's bucket in lim.
func (g *guard) limitAgent(lim *agentLimiter, p principal, req any) error {
	key := ""
	if id := p.acting(); id.Role == tlsconfig.RoleAgent {
		key = id.Name // every incarnation of a certificate shares one bucket
	} else if r, ok := req.(interface{ GetAgentId() string }); ok {
		key = "id:" + r.GetAgentId()
	}
	res := lim.allow(key, g.now())
	if res.Allowed {
		return nil
	}
	return exhausted(ReasonAgentRate, res.RetryAfter,
		"allocator: agent over its call rate (%d calls/s, burst %d); retry after %v",
		lim.limit.Quota(), lim.limit.Burst(), res.RetryAfter)
}

// setTokens replaces the admin tokens.
func (g *guard) setTokens(tokens []string) { g.tokens.Store(tlsconfig.NewTokens(tokens)) }

// exhausted is a ResourceExhausted status with an ErrorInfo reason and a
// RetryInfo delay.
func exhausted(reason string, retry time.Duration, format string, args ...any) error {
	st := status.New(codes.ResourceExhausted, fmt.Sprintf(format, args...))
	if d, err := st.WithDetails(
		&errdetails.ErrorInfo{Reason: reason, Domain: errorDomain},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(max(retry, time.Millisecond))},
	); err == nil {
		st = d
	}
	return st.Err()
}

// agentLimiter is a token bucket per agent, sharded by key hash. An entry
// whose bucket is full again is indistinguishable from a new one, so
// sweeps drop those: memory follows the agents active within one refill
// of the burst, not every agent ever seen.
type agentLimiter struct {
	limit  bucket.Limit
	shards [16]agentShard
}

type agentShard struct {
	mu      sync.Mutex // guards m and sweepAt
	m       map[string]*bucket.State
	sweepAt int // sweep before inserting at this size
}

const minSweepAt = 64

func newAgentLimiter(rate, burst int) *agentLimiter {
	lim, err := bucket.NewLimit(bucket.TokenBucket, int64(rate), time.Second, int64(max(burst, 1)))
	if err != nil {
		// Config.Validate keeps rate and burst positive; a bucket error here
		// is a programming error.
		panic(fmt.Sprintf("allocator: agent limit %d/s burst %d: %v", rate, burst, err))
	}
	a := &agentLimiter{limit: lim}
	for i := range a.shards {
		a.shards[i].m = make(map[string]*bucket.State)
		a.shards[i].sweepAt = minSweepAt
	}
	return a
}

// allow takes one call for key at now.
func (a *agentLimiter) allow(key string, now int64) bucket.Result {
	sh := &a.shards[xxhash.Sum64String(key)%uint64(len(a.shards))]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	st := sh.m[key]
	if st == nil {
		if len(sh.m) >= sh.sweepAt {
			for k, s := range sh.m {
				if a.limit.Peek(*s, now).Remaining >= a.limit.Burst() {
					delete(sh.m, k)
				}
			}
			sh.sweepAt = max(minSweepAt, 2*len(sh.m))
		}
		st = new(bucket.State)
		sh.m[key] = st
	}
	return a.limit.AllowN(st, now, 1)
}

// size returns the number of tracked agents (tests).
func (a *agentLimiter) size() int {
	n := 0
	for i := range a.shards {
		a.shards[i].mu.Lock()
		n += len(a.shards[i].m)
		a.shards[i].mu.Unlock()
	}
	return n
}

// logGate lets one log line through per second and counts the rest, so a
// flood of refused calls cannot flood the log.
type logGate struct {
	last       atomic.Int64
	suppressed atomic.Int64
}

// allow reports whether to log now, and how many lines were suppressed
// since the last one.
func (l *logGate) allow(now int64) (int64, bool) {
	last := l.last.Load()
	if now-last < int64(time.Second) || !l.last.CompareAndSwap(last, now) {
		l.suppressed.Add(1)
		return 0, false
	}
	return l.suppressed.Swap(0), true
}
