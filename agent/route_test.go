package agent

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// follower stands for an allocator follower in front of the fake leader:
// it forwards Acquire and Release to the fake and names the leader in the
// response header, as the allocator does, or (refuse) answers Unavailable
// with the leader hint in an ErrorInfo.
type follower struct {
	*fakeAllocator
	hint   func() string // the leader address it names
	refuse atomic.Bool
	calls  atomic.Int64
}

func (s *follower) Acquire(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	s.calls.Add(1)
	if s.refuse.Load() {
		return nil, notLeaderStatus(s.hint())
	}
	r, err := s.fakeAllocator.Acquire(ctx, req)
	if err == nil {
		_ = grpc.SetHeader(ctx, metadata.Pairs(allotv1.LeaderAddrHeader, s.hint()))
	}
	return r, err
}

func (s *follower) Release(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	s.calls.Add(1)
	r, err := s.fakeAllocator.Release(ctx, req)
	if err == nil {
		_ = grpc.SetHeader(ctx, metadata.Pairs(allotv1.LeaderAddrHeader, s.hint()))
	}
	return r, err
}

func notLeaderStatus(addr string) error {
	st := status.New(codes.Unavailable, "allocator: not the leader")
	st, _ = st.WithDetails(&errdetails.ErrorInfo{Reason: "NOT_LEADER", Domain: allotv1.ErrorDomain,
		Metadata: map[string]string{allotv1.ErrorInfoLeaderID: "n0", allotv1.ErrorInfoLeaderAddr: addr}})
	return st.Err()
}

// serveFollower serves f on 127.0.0.1 and returns its address.
func serveFollower(t *testing.T, f *follower) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	allotv1.RegisterAllocatorServer(srv, f)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

// routeSetup is a stepped agent whose list is allocators(followerAddr,
// leaderAddr), in front of a fake leader and a follower naming it.
func routeSetup(t *testing.T, allocators func(f, l string) []string) (*steppedAgent, *follower, string) {
	t.Helper()
	clock := newFakeClock()
	fake := newFake(t, clock.now, testRules)
	leader := serveFake(t, fake)
	fol := &follower{fakeAllocator: fake, hint: func() string { return leader.addr }}
	fAddr := serveFollower(t, fol)
	cfg := DefaultConfig()
	cfg.Allocators = allocators(fAddr, leader.addr)
	cfg.Now = clock.now
	cfg.Rules = mustCompile(t, 0, testRules)
	cfg.CallTimeout = 5 * time.Second
	cfg.manual = true
	return &steppedAgent{Agent: newAgent(t, cfg), clock: clock, fake: fake, srv: leader}, fol, leader.addr
}

// acquireOnce makes the agent send one Acquire (a check of a new key, then
// a tick) and fails unless it was answered.
func acquireOnce(t *testing.T, s *steppedAgent, key string) {
	t.Helper()
	n, _, _ := s.fake.counts()
	check(t, s.Agent, desc("api_key", key))
	s.step()
	if m, _, _ := s.fake.counts(); m != n+1 {
		t.Fatalf("Acquire for %q: the leader saw %d calls, want %d", key, m-n, 1)
	}
}

// TestRouteFollowsLeaderOutsideList: a forwarded answer's leader header
// moves the refill loop to the leader, dialed though it is not in the
// list; the follower sees only the first call, Release included.
func TestRouteFollowsLeaderOutsideList(t *testing.T) {
	s, fol, leader := routeSetup(t, func(f, _ string) []string { return []string{f} })
	acquireOnce(t, s, "r1")
	if fol.calls.Load() != 1 {
		t.Fatalf("follower calls %d, want 1", fol.calls.Load())
	}
	if s.rt.cur == nil || s.rt.cur.addr != leader {
		t.Fatalf("following %+v, want the leader %s", s.rt.cur, leader)
	}
	for i := range 3 {
		acquireOnce(t, s, "r"+string(rune('2'+i)))
	}
	if err := s.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := fol.calls.Load(); n != 1 {
		t.Fatalf("follower calls %d after following the leader, want 1", n)
	}
	if _, releases, _ := s.fake.counts(); releases != 1 {
		t.Fatalf("releases %d, want 1 (to the leader)", releases)
	}
}

// TestRouteFollowsLeaderInList: a hint naming a configured address moves
// the loop to that connection; nothing is dialed.
func TestRouteFollowsLeaderInList(t *testing.T) {
	s, fol, _ := routeSetup(t, func(f, l string) []string { return []string{f, l} })
	acquireOnce(t, s, "r1")
	if s.rf.addr != 1 || s.rt.cur != nil || len(s.rt.conns) != 0 {
		t.Fatalf("addr %d, following %+v, %d dialed; want the configured leader (1), none dialed", s.rf.addr, s.rt.cur, len(s.rt.conns))
	}
	acquireOnce(t, s, "r2")
	if n := fol.calls.Load(); n != 1 {
		t.Fatalf("follower calls %d, want 1", n)
	}
}

// TestRouteNotLeaderRedirects: an Unavailable answer that names the leader
// is retried there within the same tick and counts as no failure.
func TestRouteNotLeaderRedirects(t *testing.T) {
	s, fol, leader := routeSetup(t, func(f, _ string) []string { return []string{f} })
	fol.refuse.Store(true)
	acquireOnce(t, s, "r1")
	if f := s.rf.core.Failures(); f != 0 {
		t.Fatalf("breaker failures %d after a redirect, want 0", f)
	}
	if s.rt.cur == nil || s.rt.cur.addr != leader {
		t.Fatalf("following %+v, want the leader %s", s.rt.cur, leader)
	}
	if s.rf.unacked != nil {
		t.Fatal("the redirected call is still unacknowledged")
	}
}

// TestRouteBadHint: a follower that names an address where nothing
// listens costs one failed call: the loop returns to its list, ignores the
// hint for hintBackoff, and its breaker never opens; a follower naming a
// new address each time gets at most maxHintConns connections dialed.
func TestRouteBadHint(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := lis.Addr().String()
	_ = lis.Close()
	s, fol, _ := routeSetup(t, func(f, _ string) []string { return []string{f} })
	fol.hint = func() string { return dead }
	check(t, s.Agent, desc("api_key", "b1"))
	s.step() // to the follower, which names the dead address
	if s.rt.cur == nil || s.rt.cur.addr != dead {
		t.Fatalf("following %+v, want %s", s.rt.cur, dead)
	}
	for i := range 6 {
		check(t, s.Agent, desc("api_key", "b"+string(rune('2'+i))))
		s.step()
	}
	if s.breakerOpen.Load() {
		t.Fatalf("breaker open after a bad hint (%d failures)", s.rf.core.Failures())
	}
	if s.rt.cur != nil {
		t.Fatalf("still following the dead address %s", s.rt.cur.addr)
	}
	if s.rf.unacked != nil {
		t.Fatal("a call is still unacknowledged")
	}
	if n := fol.calls.Load(); n < 6 {
		t.Fatalf("follower calls %d, want the list to carry the load (≥ 6)", n)
	}

	// A new address every answer: dials are bounded.
	var seq atomic.Int64
	fol.hint = func() string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return dead
		}
		defer l.Close()
		seq.Add(1)
		return l.Addr().String()
	}
	for i := range 10 {
		check(t, s.Agent, desc("api_key", "c"+string(rune('0'+i))))
		s.step()
	}
	if n := len(s.rt.conns); n > maxHintConns {
		t.Fatalf("%d hint connections, want at most %d", n, maxHintConns)
	}
	if s.breakerOpen.Load() {
		t.Fatal("breaker open after changing hints")
	}
}
