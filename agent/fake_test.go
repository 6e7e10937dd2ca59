package agent

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/rules/rulespb"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// fakeAllocator is a small, honest in-memory allocator for agent tests: one
// bucket per canonical key (pkg/bucket), GiveBack for returned tokens, Debit
// for charges, TakeUpTo for grants, idempotent request ids per agent, and a
// WatchRules stream. Failure injection: failNext (calls fail before being
// applied), dropReplies (applied, answer lost), block (handlers wait).
type fakeAllocator struct {
	allotv1.UnimplementedAllocatorServer

	now func() int64

	mu           sync.Mutex // guards everything below
	set          *rules.Set
	ruleSet      *allotv1.RuleSet
	watchers     map[chan struct{}]struct{}
	buckets      map[string]*bucket.State
	agents       map[string]*fakeAgent
	live         uint32 // live_agents to report; 0 = count agents
	ttl          time.Duration
	refresh      time.Duration
	keyAgents    uint32 // agents to report on every key (KeyGrant.agents); 0 = 1
	grantCap     int64  // grant at most this per key and call (an allowance spent); 0 = no cap
	failNext     int
	rejectNext   int // answer InvalidArgument without applying
	throttleNext int // answer ResourceExhausted (overloaded) without applying
	dropReplies  int
	block        chan struct{} // non-nil: Acquire waits for it to close
	entered      chan struct{} // signalled when a blocked Acquire starts
	acquires     []*allotv1.AcquireRequest
	releases     []*allotv1.ReleaseRequest
	applied      int // Acquire requests applied (not answered from the record)
	books        map[string]*books
	readsPacked  bool // read packed keys and say so (AcquireResponse.reads_packed_keys)
	packedCalls  int  // calls whose keys came packed (acquires holds them unpacked)
	// static, when set, is answered to every call that asks for static
	// shares; its hot-set changes (hot_added, hot_removed, hot_reset) go
	// out once, with the next such answer.
	static *allotv1.StaticShares
}

// books are one key's token flows as the fake applied them.
type books struct{ granted, returned, charged, outage int64 }

func (f *fakeAllocator) book(key string) *books {
	if f.books == nil {
		f.books = make(map[string]*books)
	}
	b := f.books[key]
	if b == nil {
		b = &books{}
		f.books[key] = b
	}
	return b
}

func (f *fakeAllocator) booksOf(key string) books {
	f.mu.Lock()
	defer f.mu.Unlock()
	return *f.book(key)
}

type fakeAgent struct {
	lastID   uint64
	lastResp *allotv1.AcquireResponse
	held     map[string]int64
}

func newFake(t testing.TB, now func() int64, yamls ...string) *fakeAllocator {
	t.Helper()
	f := &fakeAllocator{
		now:      now,
		watchers: make(map[chan struct{}]struct{}),
		buckets:  make(map[string]*bucket.State),
		agents:   make(map[string]*fakeAgent),
		ttl:      10 * time.Second,
		refresh:  5 * time.Second,
	}
	f.setRules(t, yamls...)
	return f
}

// setRules compiles yamls as the next version and notifies watchers.
func (f *fakeAllocator) setRules(t testing.TB, yamls ...string) *rules.Set {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	var v uint64 = 1
	if f.set != nil {
		v = f.set.Version() + 1
	}
	rs := &allotv1.RuleSet{Version: v}
	files := make([]rules.File, len(yamls))
	for i, y := range yamls {
		files[i] = rules.File{Name: "f" + string(rune('0'+i)) + ".yaml", Source: []byte(y)}
		rs.Files = append(rs.Files, &allotv1.RuleFile{Name: files[i].Name, Yaml: []byte(y)})
	}
	set, err := rules.Compile(v, files)
	if err != nil {
		t.Fatalf("fake: compile: %v", err)
	}
	f.set, f.ruleSet = set, rs
	for w := range f.watchers {
		select {
		case w <- struct{}{}:
		default:
		}
	}
	return set
}

// pushRuleSet streams rs as is (it may not compile) without changing the
// fake's own rules.
func (f *fakeAllocator) pushRuleSet(rs *allotv1.RuleSet) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ruleSet = rs
	for w := range f.watchers {
		select {
		case w <- struct{}{}:
		default:
		}
	}
}

func (f *fakeAllocator) liveAgents() uint32 {
	if f.live > 0 {
		return f.live
	}
	return uint32(max(len(f.agents), 1))
}

func (f *fakeAllocator) Acquire(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	f.mu.Lock()
	if f.block != nil {
		block, entered := f.block, f.entered
		f.mu.Unlock()
		if entered != nil {
			select {
			case entered <- struct{}{}:
			default:
			}
		}
		select {
		case <-block:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		f.mu.Lock()
	}
	defer f.mu.Unlock()
	if f.readsPacked && len(req.PackedKeys) > 0 {
		keys, err := allotv1.UnpackKeys(req.PackedKeys)
		if err != nil {
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		f.packedCalls++
		req = &allotv1.AcquireRequest{AgentId: req.AgentId, RequestId: req.RequestId, Keys: keys,
			RulesVersion: req.RulesVersion, FallbackKeys: req.FallbackKeys, PackedGrants: req.PackedGrants,
			StaticShares: req.StaticShares, HotVersion: req.HotVersion}
	}
	f.acquires = append(f.acquires, req)
	if f.failNext > 0 {
		f.failNext--
		return nil, status.Error(codes.Unavailable, "fake: injected failure")
	}
	if f.throttleNext > 0 {
		f.throttleNext--
		return nil, status.Error(codes.ResourceExhausted, "fake: overloaded")
	}
	ag := f.agents[req.AgentId]
	if ag == nil {
		ag = &fakeAgent{held: make(map[string]int64)}
		f.agents[req.AgentId] = ag
	}
	switch {
	case req.RequestId == ag.lastID && ag.lastResp != nil:
		return ag.lastResp, nil // a retry gets the recorded answer, as in the real FSM
	case req.RequestId <= ag.lastID:
		return nil, status.Errorf(codes.FailedPrecondition, "fake: stale request id %d ≤ %d", req.RequestId, ag.lastID)
	}
	if f.rejectNext > 0 {
		// A rejection applies nothing (the real FSM validates before
		// applying, and answers a retry of an applied call from its
		// record, so a rejected call was never applied).
		f.rejectNext--
		return nil, status.Error(codes.InvalidArgument, "fake: injected rejection")
	}
	now := f.now()
	resp := &allotv1.AcquireResponse{RulesVersion: f.set.Version(), NowUnixMs: now / 1e6, ReadsPackedKeys: f.readsPacked}
	for _, k := range req.Keys {
		resp.Grants = append(resp.Grants, f.acquireKey(ag, k, now))
	}
	resp.LiveAgents = f.liveAgents()
	if f.static != nil && req.StaticShares {
		resp.Static = proto.Clone(f.static).(*allotv1.StaticShares)
		f.static.HotAdded, f.static.HotRemoved, f.static.HotReset = nil, nil, false
	}
	ag.lastID, ag.lastResp = req.RequestId, resp
	f.applied++
	if f.dropReplies > 0 {
		f.dropReplies--
		return nil, status.Error(codes.Unavailable, "fake: reply lost")
	}
	return resp, nil
}

func fromProto(es []*allotv1.Entry) []rules.Entry {
	out := make([]rules.Entry, len(es))
	for i, e := range es {
		out[i] = rules.Entry{Key: e.Key, Value: e.Value}
	}
	return out
}

func (f *fakeAllocator) acquireKey(ag *fakeAgent, k *allotv1.KeyAcquire, now int64) *allotv1.KeyGrant {
	entries := fromProto(k.Entries)
	r := f.set.Match(k.Domain, entries)
	key := string(rules.AppendKey(nil, r, k.Domain, entries))
	g := &allotv1.KeyGrant{Key: key}
	switch {
	case r == nil:
		g.Status = allotv1.KeyStatus_KEY_STATUS_NO_RULE
		return g
	case r.Unlimited:
		g.Status = allotv1.KeyStatus_KEY_STATUS_UNLIMITED
		return g
	case r.Backend != rules.BackendLease:
		g.Status = allotv1.KeyStatus_KEY_STATUS_NOT_LEASED
		return g
	}
	st := f.buckets[key]
	if st == nil {
		st = &bucket.State{}
		f.buckets[key] = st
	}
	l := r.Limit
	ret := min(k.Returned, ag.held[key])
	l.GiveBack(st, now, ret)
	ag.held[key] -= ret
	l.Debit(st, now, k.Charged)
	outage := l.TakeUpTo(st, now, k.OutageCharged) // never into debt, as the allocator
	ask := min(k.Want, l.Burst())
	if f.grantCap > 0 {
		ask = min(ask, f.grantCap)
	}
	granted := l.TakeUpTo(st, now, ask)
	ag.held[key] += granted
	bk := f.book(key)
	bk.granted += granted
	bk.returned += ret
	bk.charged += k.Charged
	bk.outage += outage
	p := l.Peek(*st, now)
	g.Status = allotv1.KeyStatus_KEY_STATUS_OK
	g.Granted = granted
	g.LeaseTtlMs = f.ttl.Milliseconds()
	g.RefreshAfterMs = f.refresh.Milliseconds()
	g.Remaining = p.Remaining
	g.ResetAfterMs = p.ResetAfter.Milliseconds()
	g.Held = ag.held[key]
	g.Agents = max(f.keyAgents, 1)
	g.Limit = rulespb.Limit(r)
	if granted == 0 && k.Want > 0 && !p.Allowed {
		g.Status = allotv1.KeyStatus_KEY_STATUS_EXHAUSTED
		g.RetryAfterMs = max(p.RetryAfter.Milliseconds(), 1)
	}
	return g
}

func (f *fakeAllocator) Release(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.releases = append(f.releases, req)
	ag := f.agents[req.AgentId]
	if ag == nil {
		ag = &fakeAgent{held: make(map[string]int64)}
		f.agents[req.AgentId] = ag
	}
	if req.RequestId <= ag.lastID {
		return nil, status.Errorf(codes.FailedPrecondition, "fake: stale request id")
	}
	ag.lastID, ag.lastResp = req.RequestId, nil
	now := f.now()
	resp := &allotv1.ReleaseResponse{}
	for _, k := range req.Keys {
		entries := fromProto(k.Entries)
		r := f.set.Match(k.Domain, entries)
		if r == nil || r.Unlimited {
			continue
		}
		key := string(rules.AppendKey(nil, r, k.Domain, entries))
		st := f.buckets[key]
		if st == nil {
			st = &bucket.State{}
			f.buckets[key] = st
		}
		ret := min(k.Returned, ag.held[key])
		r.Limit.GiveBack(st, now, ret)
		ag.held[key] -= ret
		resp.Returned += ret
		r.Limit.Debit(st, now, k.Charged)
		bk := f.book(key)
		bk.returned += ret
		bk.charged += k.Charged
	}
	if req.All {
		resp.LeasesEnded = uint32(len(ag.held))
		delete(f.agents, req.AgentId)
	}
	return resp, nil
}

func (f *fakeAllocator) WatchRules(req *allotv1.WatchRulesRequest, stream grpc.ServerStreamingServer[allotv1.RuleSet]) error {
	w := make(chan struct{}, 1)
	f.mu.Lock()
	f.watchers[w] = struct{}{}
	rs := f.ruleSet
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.watchers, w)
		f.mu.Unlock()
	}()
	var sent uint64
	if rs.Version != req.KnownVersion {
		if err := stream.Send(rs); err != nil {
			return err
		}
		sent = rs.Version
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case <-w:
			f.mu.Lock()
			rs = f.ruleSet
			f.mu.Unlock()
			if rs.Version != sent {
				if err := stream.Send(rs); err != nil {
					return err
				}
				sent = rs.Version
			}
		}
	}
}

// bucketRemaining is the global remaining of a canonical key now (the
// rule's full capacity when the key was never touched).
func (f *fakeAllocator) bucketRemaining(t testing.TB, key string) int64 {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	domain, entries, err := rules.ParseKey(key)
	if err != nil {
		t.Fatalf("fake: %v", err)
	}
	r := f.set.Match(domain, entries)
	if r == nil {
		t.Fatalf("fake: no rule for %q", key)
	}
	st := f.buckets[key]
	if st == nil {
		st = &bucket.State{}
	}
	return r.Limit.Peek(*st, f.now()).Remaining
}

func (f *fakeAllocator) with(fn func(f *fakeAllocator)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func (f *fakeAllocator) counts() (acquires, releases, applied int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.acquires), len(f.releases), f.applied
}

func (f *fakeAllocator) lastAcquire() *allotv1.AcquireRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.acquires) == 0 {
		return nil
	}
	return f.acquires[len(f.acquires)-1]
}

// fakeServer serves a fakeAllocator on 127.0.0.1 and can be stopped and
// restarted on the same address.
type fakeServer struct {
	t    testing.TB
	f    *fakeAllocator
	addr string
	mu   sync.Mutex
	srv  *grpc.Server
}

func serveFake(t testing.TB, f *fakeAllocator) *fakeServer {
	t.Helper()
	s := &fakeServer{t: t, f: f, addr: "127.0.0.1:0"}
	s.start()
	t.Cleanup(s.stop)
	return s
}

func (s *fakeServer) start() {
	s.t.Helper()
	var lis net.Listener
	var err error
	deadline := time.Now().Add(5 * time.Second)
	for {
		lis, err = net.Listen("tcp", s.addr)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // the port is being released
	}
	if err != nil {
		s.t.Fatalf("listen %s: %v", s.addr, err)
	}
	s.addr = lis.Addr().String()
	srv := grpc.NewServer()
	allotv1.RegisterAllocatorServer(srv, s.f)
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	go func() { _ = srv.Serve(lis) }()
}

func (s *fakeServer) stop() {
	s.mu.Lock()
	srv := s.srv
	s.srv = nil
	s.mu.Unlock()
	if srv != nil {
		srv.Stop()
	}
}

// blackHole accepts TCP connections and never answers: a hung allocator.
type blackHole struct {
	lis   net.Listener
	mu    sync.Mutex
	conns []net.Conn
	done  chan struct{}
}

func newBlackHole(t testing.TB) *blackHole {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &blackHole{lis: lis, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			b.mu.Lock()
			b.conns = append(b.conns, c)
			b.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = lis.Close()
		<-b.done
		b.mu.Lock()
		for _, c := range b.conns {
			_ = c.Close()
		}
		b.mu.Unlock()
	})
	return b
}

func (b *blackHole) addr() string { return b.lis.Addr().String() }

func ids(reqs []*allotv1.AcquireRequest) []uint64 {
	out := make([]uint64, len(reqs))
	for i, r := range reqs {
		out[i] = r.RequestId
	}
	return out
}
