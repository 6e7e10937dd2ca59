package agent

import (
	"context"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Leader routing. Every allocator node answers Acquire and Release, a
// follower by forwarding the call to the leader, which costs the follower a
// decode, an encode and a second round trip. The refill loop therefore
// sends its calls to the leader: a follower's forwarded answer names the
// leader's address (allotv1.LeaderAddrHeader), and an Unavailable status
// carries the same hint (allotv1.ErrorInfoLeaderAddr). A hint naming one of
// Config.Allocators moves the loop to that connection; a hint naming
// another address is dialed with the same dial options, at most
// maxHintConns such connections held (the least recently used is closed)
// and at most one new one dialed per hintDialInterval, so a bad hint costs
// a bounded number of connections. A hinted address whose call fails is
// not followed again for hintBackoff, doubling with each failure in a row:
// the loop falls back to its list, as without hints. An Unavailable answer with a hint to another address is
// retried there at once, and counts as no failure. A cluster of several
// Raft groups has a leader per group: groups.go routes each group's calls
// to its own leader over the same connections.

const (
	// maxHintConns bounds the connections dialed for hints outside
	// Config.Allocators.
	maxHintConns = 2
	// hintDialInterval is the least time between two such dials.
	hintDialInterval = time.Second
	// hintBackoff is how long a hinted address whose call failed is
	// ignored; it doubles with each failure in a row, up to
	// maxHintBackoff (an address the agent cannot use, a name its TLS
	// configuration does not accept, costs a call every few minutes).
	hintBackoff    = 10 * time.Second
	maxHintBackoff = 5 * time.Minute
)

// router is the refill loop's choice of connection beyond the configured
// list (refiller.addr). Owned by the refill loop, then by Close.
type router struct {
	cur      *hintConn            // the hinted leader outside the list being followed (nil: the list)
	conns    map[string]*hintConn // dialed hint and group leader addresses
	lastDial time.Time

	// Group routing (groups.go). topo is written by the rule watch too.
	topo       atomic.Pointer[topology]
	learned    map[slots.GroupID]groupLeader // since learnedFor
	learnedFor *topology
	owners     []slots.GroupID // splitByGroup's scratch
	runs       []groupRun
	sorted     []*keyState
}

// hintConn is a connection dialed for a leader hint.
type hintConn struct {
	addr     string
	cc       *grpc.ClientConn
	client   allotv1.AllocatorClient
	used     time.Time // last chosen (least recently used is closed first)
	badUntil time.Time // a call failed: not followed before then
	fails    int       // failed calls in a row
}

// target returns the client the loop calls and its address.
func (a *Agent) target() (allotv1.AllocatorClient, string) {
	if h := a.rt.cur; h != nil {
		return h.client, h.addr
	}
	return a.clients[a.rf.addr], a.names[a.rf.addr]
}

// callAcquire sends req to the leader as far as the loop knows it (see
// Leader routing), following the hint of the answer for the next call.
func (a *Agent) callAcquire(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	if req.TopologyVersion != 0 {
		return a.callGroup(ctx, req) // addressed to a group: groups.go
	}
	return routed(a, ctx, func(ctx context.Context, c allotv1.AllocatorClient, opts ...grpc.CallOption) (*allotv1.AcquireResponse, error) {
		return c.Acquire(ctx, req, opts...)
	})
}

// callRelease is callAcquire for a Release.
func (a *Agent) callRelease(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	return routed(a, ctx, func(ctx context.Context, c allotv1.AllocatorClient, opts ...grpc.CallOption) (*allotv1.ReleaseResponse, error) {
		return c.Release(ctx, req, opts...)
	})
}

// routed makes one call, and at most one more to the leader an Unavailable
// answer names. ctx bounds both.
func routed[R any](a *Agent, ctx context.Context, call func(context.Context, allotv1.AllocatorClient, ...grpc.CallOption) (R, error)) (R, error) {
	for redirected := false; ; redirected = true {
		c, addr := a.target()
		var md metadata.MD
		resp, err := call(ctx, c, grpc.Header(&md))
		if err == nil {
			if h := a.rt.cur; h != nil {
				h.fails = 0
			}
			if v := md.Get(allotv1.LeaderAddrHeader); len(v) > 0 {
				a.follow(v[0])
			}
			return resp, nil
		}
		a.callFailedAt(addr)
		hint := hintOf(err)
		if redirected || hint == "" || hint == addr || ctx.Err() != nil || !a.follow(hint) {
			return resp, err
		}
	}
}

// follow moves the loop to the leader at addr: the configured connection
// of that address, else a dialed one (see Leader routing). It reports
// whether the loop now calls addr.
func (a *Agent) follow(addr string) bool {
	rt := &a.rt
	for i, n := range a.names {
		if n == addr {
			a.rf.addr = i
			rt.cur = nil
			return true
		}
	}
	h := a.hintConn(addr, 0)
	if h == nil {
		return false
	}
	rt.cur = h
	return true
}

// hintConn returns the connection dialed for addr, dialing it if need be
// (at most one dial per hintDialInterval; at most maxHintConns+extra such
// connections held, the least recently used closed first), or nil: in-memory
// clients, no dial allowed yet, or a call to addr failed within its
// backoff.
func (a *Agent) hintConn(addr string, extra int) *hintConn {
	rt := &a.rt
	if len(a.cfg.Clients) > 0 {
		return nil // in-memory clients: nothing to dial
	}
	now := time.Now()
	h := rt.conns[addr]
	if h == nil {
		if now.Sub(rt.lastDial) < hintDialInterval {
			return nil
		}
		cc, err := grpc.NewClient(addr, a.dialOpts...)
		if err != nil {
			a.logs.log(a.log, "hint_dial", "agent: cannot dial the leader an allocator named; staying on the configured list",
				"addr", addr, "err", err)
			return nil
		}
		rt.lastDial = now
		if len(rt.conns) >= maxHintConns+extra {
			rt.evict()
		}
		h = &hintConn{addr: addr, cc: cc, client: allotv1.NewAllocatorClient(cc)}
		if rt.conns == nil {
			rt.conns = make(map[string]*hintConn)
		}
		rt.conns[addr] = h
	}
	if now.Before(h.badUntil) {
		return nil
	}
	h.used = now
	return h
}

// callFailedAt records a failed call to addr: a hinted leader outside the
// list is not followed again for hintBackoff, and the loop returns to its
// list (where callFailed rotates as usual).
func (a *Agent) callFailedAt(addr string) {
	rt := &a.rt
	if h := rt.conns[addr]; h != nil {
		h.fails++
		h.badUntil = time.Now().Add(min(hintBackoff<<min(h.fails-1, 10), maxHintBackoff))
		if rt.cur == h {
			rt.cur = nil
		}
	}
}

// evict closes the least recently used hint connection that is not
// being followed.
func (rt *router) evict() {
	var old *hintConn
	for _, h := range rt.conns {
		if h != rt.cur && (old == nil || h.used.Before(old.used)) {
			old = h
		}
	}
	if old != nil {
		_ = old.cc.Close()
		delete(rt.conns, old.addr)
	}
}

// close closes the hint connections. Called by Close once the loop has
// stopped.
func (rt *router) close() {
	for addr, h := range rt.conns {
		_ = h.cc.Close()
		delete(rt.conns, addr)
	}
	rt.cur = nil
}

// hintOf returns the leader address an Unavailable status names ("" when
// none).
func hintOf(err error) string {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == allotv1.ErrorDomain {
			return info.GetMetadata()[allotv1.ErrorInfoLeaderAddr]
		}
	}
	return ""
}
