package rls

import (
	"context"
	"errors"
	"math"
	"net"
	"sync/atomic"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/internal/agenttest"
	"github.com/allot/allot/pkg/rules"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testRules = `
domain: rls-test
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 10, name: per_key}
  - key: path
    value: /a
    rate_limit: {unit: second, requests_per_unit: 3, name: path_a}
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1, name: dark}
  - key: free
    rate_limit: {unlimited: true}
  - key: team
    rate_limit: {unit: minute, unit_multiplier: 5, requests_per_unit: 7}
`

// startServer runs a real gRPC server on 127.0.0.1 backed by a standalone
// agent with a frozen clock (no refill between calls), and returns a client.
func startServer(t *testing.T) rlsv3.RateLimitServiceClient {
	t.Helper()
	a, srv := newTestServer(t)
	return serveGRPC(t, srv, func() { a.Close(context.Background()) })
}

// newTestServer returns a frozen agent with testRules (agenttest.Frozen:
// no refill between calls), and a Server over it. The agent is closed when
// the test ends, or before by the caller.
func newTestServer(t testing.TB) (*agent.Agent, *Server) {
	t.Helper()
	a := agenttest.Frozen(t, testRules)
	srv, err := New(a, Options{})
	if err != nil {
		a.Close(context.Background())
		t.Fatal(err)
	}
	return a, srv
}

func serveGRPC(t *testing.T, srv *Server, after func()) rlsv3.RateLimitServiceClient {
	t.Helper()
	return rlsv3.NewRateLimitServiceClient(serveConn(t, srv, after))
}

// serveConn serves srv on 127.0.0.1 and returns a connection to it.
func serveConn(t *testing.T, srv *Server, after func()) *grpc.ClientConn {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(ServerOptions()...) // as cmd/gateway serves it
	srv.Register(g)
	done := make(chan struct{})
	go func() { defer close(done); _ = g.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		g.Stop()
		<-done
		if after != nil {
			after()
		}
	})
	return cc
}

func desc(kv ...string) *rlcommon.RateLimitDescriptor {
	d := &rlcommon.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &rlcommon.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

func call(t *testing.T, c rlsv3.RateLimitServiceClient, req *rlsv3.RateLimitRequest) *rlsv3.RateLimitResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.ShouldRateLimit(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Statuses) != len(req.Descriptors) {
		t.Fatalf("%d statuses for %d descriptors", len(resp.Statuses), len(req.Descriptors))
	}
	return resp
}

func TestRemainingCountsDownThenOverLimit(t *testing.T) {
	c := startServer(t)
	for i := 1; i <= 10; i++ {
		resp := call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k1")}})
		st := resp.Statuses[0]
		if resp.OverallCode != rlsv3.RateLimitResponse_OK || st.Code != rlsv3.RateLimitResponse_OK {
			t.Fatalf("call %d: %v", i, resp)
		}
		if st.LimitRemaining != uint32(10-i) {
			t.Fatalf("call %d: limit_remaining %d, want %d", i, st.LimitRemaining, 10-i)
		}
		cl := st.CurrentLimit
		if cl.GetName() != "per_key" || cl.GetRequestsPerUnit() != 10 || cl.GetUnit() != rlsv3.RateLimitResponse_RateLimit_MINUTE {
			t.Fatalf("current_limit %v", cl)
		}
		if st.DurationUntilReset.AsDuration() <= 0 {
			t.Fatalf("call %d: duration_until_reset %v", i, st.DurationUntilReset.AsDuration())
		}
	}
	resp := call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k1")}})
	st := resp.Statuses[0]
	if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || st.Code != rlsv3.RateLimitResponse_OVER_LIMIT || st.LimitRemaining != 0 {
		t.Fatalf("11th call: %v", resp)
	}
	// 10/minute refills one token every 6 s: the retry hint.
	if d := st.DurationUntilReset.AsDuration(); d <= 0 || d > 6*time.Second {
		t.Fatalf("OVER_LIMIT duration_until_reset %v, want (0, 6s]", d)
	}
	// Another key has its own budget.
	resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k2")}})
	if resp.Statuses[0].LimitRemaining != 9 {
		t.Fatalf("k2: %v", resp)
	}
}

func TestSeveralDescriptorsAndRefund(t *testing.T) {
	c := startServer(t)
	req := &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{
		desc("api_key", "k3"), desc("path", "/a"), desc("nomatch", "x"),
	}}
	resp := call(t, c, req)
	if resp.OverallCode != rlsv3.RateLimitResponse_OK {
		t.Fatalf("%v", resp)
	}
	if got := []uint32{resp.Statuses[0].LimitRemaining, resp.Statuses[1].LimitRemaining}; got[0] != 9 || got[1] != 2 {
		t.Fatalf("remaining %v, want [9 2]", got)
	}
	if resp.Statuses[1].CurrentLimit.GetUnit() != rlsv3.RateLimitResponse_RateLimit_SECOND {
		t.Fatalf("unit %v", resp.Statuses[1].CurrentLimit)
	}
	if nm := resp.Statuses[2]; nm.Code != rlsv3.RateLimitResponse_OK || nm.CurrentLimit != nil {
		t.Fatalf("unmatched descriptor status %v", nm)
	}
	// Use up path /a (2 left), then the combined request is OVER_LIMIT and
	// the api_key token it took is given back.
	call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", HitsAddend: 2, Descriptors: []*rlcommon.RateLimitDescriptor{desc("path", "/a")}})
	resp = call(t, c, req)
	if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT || resp.Statuses[1].Code != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("%v", resp)
	}
	if resp.Statuses[0].Code != rlsv3.RateLimitResponse_OK {
		t.Fatalf("api_key status %v", resp.Statuses[0])
	}
	peek := &rlcommon.RateLimitDescriptor{Entries: desc("api_key", "k3").Entries, HitsAddend: wrapperspb.UInt64(0)}
	resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{peek}})
	if resp.Statuses[0].LimitRemaining != 9 {
		t.Fatalf("after the denied request api_key k3 has %d left, want 9 (refunded)", resp.Statuses[0].LimitRemaining)
	}
}

func TestHitsAddend(t *testing.T) {
	c := startServer(t)
	// Request level: 3 hits.
	resp := call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", HitsAddend: 3, Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "h")}})
	if resp.Statuses[0].LimitRemaining != 7 {
		t.Fatalf("after hits_addend 3: %d left, want 7", resp.Statuses[0].LimitRemaining)
	}
	// Descriptor level overrides request level.
	d := desc("api_key", "h")
	d.HitsAddend = wrapperspb.UInt64(5)
	resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", HitsAddend: 1, Descriptors: []*rlcommon.RateLimitDescriptor{d}})
	if resp.Statuses[0].LimitRemaining != 2 {
		t.Fatalf("after descriptor hits_addend 5: %d left, want 2", resp.Statuses[0].LimitRemaining)
	}
	// Descriptor level 0: checked without consuming.
	d.HitsAddend = wrapperspb.UInt64(0)
	for i := 0; i < 3; i++ {
		resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{d}})
		if resp.OverallCode != rlsv3.RateLimitResponse_OK || resp.Statuses[0].LimitRemaining != 2 {
			t.Fatalf("hits_addend 0, call %d: %v", i, resp)
		}
	}
	// More hits than remain: over limit, nothing taken.
	resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", HitsAddend: 3, Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "h")}})
	if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("3 hits with 2 left: %v", resp)
	}
	// Saturation: a huge descriptor hits_addend is an over-limit, not a wrap-around.
	d.HitsAddend = wrapperspb.UInt64(math.MaxUint64)
	resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{d}})
	if resp.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("huge hits_addend: %v", resp)
	}
}

func TestShadowModeForcesOK(t *testing.T) {
	c := startServer(t)
	for i := 0; i < 3; i++ {
		resp := call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("shadowed", "s")}})
		st := resp.Statuses[0]
		if resp.OverallCode != rlsv3.RateLimitResponse_OK || st.Code != rlsv3.RateLimitResponse_OK {
			t.Fatalf("shadow call %d: %v", i, resp)
		}
		if st.CurrentLimit.GetName() != "dark" || st.CurrentLimit.GetUnit() != rlsv3.RateLimitResponse_RateLimit_HOUR {
			t.Fatalf("shadow current_limit %v", st.CurrentLimit)
		}
	}
}

func TestUnknownDomainUnlimitedAndMultiplier(t *testing.T) {
	c := startServer(t)
	resp := call(t, c, &rlsv3.RateLimitRequest{Domain: "nope", Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k")}})
	if resp.OverallCode != rlsv3.RateLimitResponse_OK || resp.Statuses[0].Code != rlsv3.RateLimitResponse_OK || resp.Statuses[0].CurrentLimit != nil {
		t.Fatalf("unknown domain: %v", resp)
	}
	resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("free", "x")}})
	if st := resp.Statuses[0]; st.Code != rlsv3.RateLimitResponse_OK || st.LimitRemaining != math.MaxUint32 || st.CurrentLimit != nil {
		t.Fatalf("unlimited: %v", resp)
	}
	resp = call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("team", "t")}})
	cl := resp.Statuses[0].CurrentLimit
	if cl.GetUnitMultiplier().GetValue() != 5 || cl.GetRequestsPerUnit() != 7 || cl.GetName() == "" {
		t.Fatalf("unit_multiplier: %v", cl)
	}
}

func TestInvalidArgument(t *testing.T) {
	c := startServer(t)
	neg := desc("api_key", "k")
	neg.IsNegativeHits = true
	many := make([]*rlcommon.RateLimitDescriptor, agent.MaxDescriptors+1)
	for i := range many {
		many[i] = desc("api_key", "k")
	}
	cases := map[string]*rlsv3.RateLimitRequest{
		"empty domain":     {Descriptors: []*rlcommon.RateLimitDescriptor{desc("a", "b")}},
		"no descriptors":   {Domain: "rls-test"},
		"empty descriptor": {Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{{}}},
		"empty entry key":  {Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("", "v")}},
		"negative hits":    {Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{neg}},
		"too many":         {Domain: "rls-test", Descriptors: many},
	}
	for name, req := range cases {
		_, err := c.ShouldRateLimit(context.Background(), req)
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: err %v, want InvalidArgument", name, err)
		}
	}
}

// failing is a Checker whose errors are not about the input.
type failing struct{ calls atomic.Int32 }

func (f *failing) CheckStatuses(context.Context, string, []agent.Descriptor, uint32, []agent.Status) (agent.Decision, []agent.Status, error) {
	f.calls.Add(1)
	return agent.Decision{}, nil, errors.New("agent: closed")
}

func TestCheckerErrorIsUnavailable(t *testing.T) {
	f := &failing{}
	srv, err := New(f, Options{})
	if err != nil {
		t.Fatal(err)
	}
	c := serveGRPC(t, srv, nil)
	_, err = c.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "d", Descriptors: []*rlcommon.RateLimitDescriptor{desc("a", "b")}})
	if status.Code(err) != codes.Unavailable || f.calls.Load() != 1 {
		t.Fatalf("err %v calls %d; want Unavailable (Envoy then applies failure_mode_deny)", err, f.calls.Load())
	}
	if _, err := New(nil, Options{}); err == nil {
		t.Fatal("New(nil) succeeded")
	}
}

func BenchmarkShouldRateLimit(b *testing.B) {
	set, err := rules.Compile(1, []rules.File{{Name: "rls.yaml", Source: []byte(testRules)}})
	if err != nil {
		b.Fatal(err)
	}
	cfg := agent.DefaultConfig()
	cfg.Rules = set
	a, err := agent.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close(context.Background())
	srv, _ := New(a, Options{})
	req := &rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("free", "x"), desc("nomatch", "y")}}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := srv.ShouldRateLimit(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
}

// TestServedAnyWay: the same calls get the same answers from a server
// with ServerOptions (the codec decodes into the handler's pooled request
// and encodes its reply), from one without them (gRPC's proto codec
// decodes into the request's embedded message and encodes the reply's),
// and from one with an interceptor (which sees a RateLimitRequest and a
// RateLimitResponse).
func TestServedAnyWay(t *testing.T) {
	override := desc("api_key", "k9")
	override.Limit = &rlcommon.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 1}
	negative := desc("api_key", "k9")
	negative.IsNegativeHits = true
	reqs := []*rlsv3.RateLimitRequest{
		{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k9")}},
		{Domain: "rls-test", HitsAddend: 2, Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k9"), desc("path", "/a"), desc("free", "x")}},
		{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("path", "/a"), desc("team", "t")}},
		{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{override}},
		{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{desc("shadowed", "s"), desc("shadowed", "s")}},
		{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{negative}},
		{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{{}}},
		{Domain: "rls-test"},
		{Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k9")}},
	}
	type answer struct {
		resp *rlsv3.RateLimitResponse
		code codes.Code
		msg  string
	}
	run := func(opts []grpc.ServerOption, seen *atomic.Int64) []answer {
		a, srv := newTestServer(t)
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		g := grpc.NewServer(opts...)
		srv.Register(g)
		done := make(chan struct{})
		go func() { defer close(done); _ = g.Serve(lis) }()
		defer func() { g.Stop(); <-done; a.Close(context.Background()) }()
		cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		c := rlsv3.NewRateLimitServiceClient(cc)
		var out []answer
		for _, req := range reqs {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			resp, err := c.ShouldRateLimit(ctx, req)
			cancel()
			st := status.Convert(err)
			out = append(out, answer{resp, st.Code(), st.Message()})
		}
		if seen != nil && seen.Load() != int64(len(reqs)) {
			t.Fatalf("the interceptor saw %d RateLimitRequests and responses, want %d", seen.Load(), len(reqs))
		}
		return out
	}
	var seen atomic.Int64
	icpt := grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		_, isReq := req.(*rlsv3.RateLimitRequest)
		resp, err := h(ctx, req)
		if _, isResp := resp.(*rlsv3.RateLimitResponse); isReq && (isResp || err != nil) && info.FullMethod == rlsv3.RateLimitService_ShouldRateLimit_FullMethodName {
			seen.Add(1)
		}
		return resp, err
	})
	want := run(ServerOptions(), nil)
	for name, got := range map[string][]answer{
		"without ServerOptions": run(nil, nil),
		"with an interceptor":   run(append(ServerOptions(), icpt), &seen),
	} {
		for i := range want {
			if got[i].code != want[i].code || got[i].msg != want[i].msg || !proto.Equal(got[i].resp, want[i].resp) {
				t.Errorf("%s: request %d: %v %v %q, want %v %v %q", name, i, got[i].resp, got[i].code, got[i].msg, want[i].resp, want[i].code, want[i].msg)
			}
		}
	}
	if want[0].code != codes.OK || want[3].code != codes.OK || want[5].code != codes.InvalidArgument || want[8].code != codes.InvalidArgument {
		t.Fatalf("answers %v", want)
	}
}
