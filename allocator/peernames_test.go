package allocator

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// certCtx returns an incoming call's context from a caller with a
// verified certificate for spec, and metadata kv.
func certCtx(t *testing.T, ca *tlstest.CA, spec tlstest.Spec, kv ...string) context.Context {
	t.Helper()
	leaf := ca.Issue(t, spec)
	state := tls.ConnectionState{
		PeerCertificates: []*x509.Certificate{leaf.Cert},
		VerifiedChains:   [][]*x509.Certificate{{leaf.Cert, ca.Cert}},
	}
	ctx := peer.NewContext(context.Background(), &peer.Peer{AuthInfo: credentials.TLSInfo{State: state}})
	return metadata.NewIncomingContext(ctx, metadata.Pairs(kv...))
}

// With PeerNames, a forwarded call's identity is honoured only from a
// listed allocator certificate: another allocator certificate of the same
// CA (a regional node's) forwarding an admin identity is refused
// PermissionDenied, logged, and reaches no handler. Without PeerNames any
// allocator certificate forwards.
func TestPeerNamesForwarding(t *testing.T) {
	ca := tlstest.NewCA(t, "allot test CA")
	forwarded := func(name string) context.Context {
		return certCtx(t, ca, tlstest.Role(tlsconfig.RoleAllocator, name),
			forwardedKey, name, identityKey, "admin/ops")
	}
	method := allotv1.Admin_PutRules_FullMethodName
	for _, c := range []struct {
		name  string
		peers []string
		from  string
		want  codes.Code
	}{
		{"listed", []string{"n1", "n2"}, "n2", codes.OK},
		{"unlisted", []string{"n1", "n2"}, "eu-1", codes.PermissionDenied},
		{"nameless", []string{"n1", "n2"}, "", codes.PermissionDenied},
		{"no peer names", nil, "eu-1", codes.OK},
	} {
		var logs bytes.Buffer
		g := newGuard(Config{ClientAuth: tlsconfig.ClientAuthRequire, PeerNames: c.peers, AgentRate: -1, MaxInflight: 10},
			slog.New(slog.NewTextHandler(&logs, nil)))
		var acted tlsconfig.Identity
		handler := func(ctx context.Context, _ any) (any, error) {
			p, _ := principalFrom(ctx)
			acted = p.acting()
			return &allotv1.PutRulesResponse{}, nil
		}
		_, err := g.unary(forwarded(c.from), &allotv1.PutRulesRequest{}, &grpc.UnaryServerInfo{FullMethod: method}, handler)
		if got := status.Code(err); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
			continue
		}
		if c.want == codes.OK {
			if acted.String() != "admin/ops" {
				t.Errorf("%s: the call acted as %q, want admin/ops", c.name, acted)
			}
			continue
		}
		if !acted.IsZero() {
			t.Errorf("%s: refused, but the handler ran (as %s)", c.name, acted)
		}
		cert := tlsconfig.Identity{Role: tlsconfig.RoleAllocator, Name: c.from}.String()
		if msg := status.Convert(err).Message(); !strings.Contains(msg, cert+" may not forward calls") {
			t.Errorf("%s: refusal %q does not name %s", c.name, msg, cert)
		}
		if !strings.Contains(logs.String(), "call refused") || !strings.Contains(logs.String(), cert) {
			t.Errorf("%s: no refusal logged naming %s: %s", c.name, cert, logs.String())
		}
	}
}

// With PeerNames, ApplySlotEntry and AddVoter (a node joining) are the
// listed nodes' (and AddVoter an admin's, and a listed node's forwarded
// join): an unlisted allocator certificate is refused both; it still
// reads and leases as its region's agent (docs/regions.md). Without
// PeerNames every allocator certificate may.
func TestPeerNamesPeerCalls(t *testing.T) {
	alloc := func(name string) tlsconfig.Identity {
		return tlsconfig.Identity{Role: tlsconfig.RoleAllocator, Name: name}
	}
	listed, unlisted, nameless := principal{cert: alloc("n1")}, principal{cert: alloc("eu-1")}, principal{cert: alloc("")}
	admin := principal{cert: tlsconfig.Identity{Role: tlsconfig.RoleAdmin, Name: "ops"}}
	joinVia := principal{cert: alloc("n1"), forwarded: true, via: nodeIdentity}
	apply, join := allotv1.Admin_ApplySlotEntry_FullMethodName, allotv1.Admin_AddVoter_FullMethodName
	acquire, read := allotv1.Allocator_Acquire_FullMethodName, allotv1.Admin_ClusterStatus_FullMethodName
	regionReq := &allotv1.AcquireRequest{AgentId: "region:eu"}
	for _, c := range []struct {
		name   string
		peers  []string
		p      principal
		method string
		req    any
		want   codes.Code
	}{
		{"listed ApplySlotEntry", []string{"n1"}, listed, apply, nil, codes.OK},
		{"unlisted ApplySlotEntry", []string{"n1"}, unlisted, apply, nil, codes.PermissionDenied},
		{"nameless ApplySlotEntry", []string{"n1"}, nameless, apply, nil, codes.PermissionDenied},
		{"listed AddVoter", []string{"n1"}, listed, join, nil, codes.OK},
		{"forwarded join", []string{"n1"}, joinVia, join, nil, codes.OK},
		// A listed node started without the list forwards an unlisted
		// certificate's join: refused on arrival.
		{"unlisted join forwarded", []string{"n1"}, principal{cert: alloc("n1"), forwarded: true, via: alloc("eu-1")}, join, nil, codes.PermissionDenied},
		{"no peer names: forwarded named join", nil, principal{cert: alloc("n1"), forwarded: true, via: alloc("eu-1")}, join, nil, codes.OK},
		{"admin AddVoter", []string{"n1"}, admin, join, nil, codes.OK},
		{"unlisted AddVoter", []string{"n1"}, unlisted, join, nil, codes.PermissionDenied},
		{"nameless AddVoter", []string{"n1"}, nameless, join, nil, codes.PermissionDenied},
		{"unlisted reads", []string{"n1"}, unlisted, read, nil, codes.OK},
		{"unlisted leases as its region", []string{"n1"}, unlisted, acquire, regionReq, codes.OK},
		{"no peer names: ApplySlotEntry", nil, unlisted, apply, nil, codes.OK},
		{"no peer names: AddVoter", nil, nameless, join, nil, codes.OK},
	} {
		g := newGuard(Config{ClientAuth: tlsconfig.ClientAuthRequire, PeerNames: c.peers}, slog.New(slog.DiscardHandler))
		var err error
		if aerr := g.authorize(c.p, classify(c.method), c.method, c.req); aerr != nil {
			err = aerr.err
		}
		if got := status.Code(err); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
		if err != nil && !strings.Contains(err.Error(), "-peer-names") {
			t.Errorf("%s: refusal %q does not say why (-peer-names)", c.name, err)
		}
	}
}

// PeerNames needs verified client certificates and valid names, and
// New refuses a node whose own certificate is not listed.
func TestPeerNamesConfig(t *testing.T) {
	ca := tlstest.NewCA(t, "allot test CA")
	dir := t.TempDir()
	files := tlstest.Files(t, dir, "n1", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, "n1")))
	base := func() Config {
		cfg := DefaultConfig()
		cfg.NodeID, cfg.DataDir = "n1", t.TempDir()
		cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0", ""
		cfg.TLS, cfg.ClientAuth, cfg.RaftTLS = files, tlsconfig.ClientAuthRequire, true
		cfg.PeerNames = []string{"n1", "n2"}
		cfg.Bootstrap = true
		cfg.Logger = testLogger(t, slog.LevelWarn)
		return cfg
	}
	if err := base().Validate(); err != nil {
		t.Fatalf("valid: %v", err)
	}
	for _, c := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"bad name", func(c *Config) { c.PeerNames = []string{"n1", "eu/1"} }, `PeerNames (-peer-names) "eu/1"`},
		{"empty name", func(c *Config) { c.PeerNames = []string{"n1", ""} }, `PeerNames (-peer-names) ""`},
		{"no client certificates", func(c *Config) { c.ClientAuth = tlsconfig.ClientAuthNone; c.AdminTokens = []string{testToken} },
			"PeerNames (-peer-names) needs verified client certificates"},
		{"no TLS", func(c *Config) {
			c.TLS, c.ClientAuth, c.RaftTLS, c.AdminTokens = tlsconfig.Options{}, tlsconfig.ClientAuthNone, false, []string{testToken}
		}, "PeerNames (-peer-names) needs verified client certificates"},
	} {
		cfg := base()
		c.edit(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Validate() = %v, want %q", c.name, err, c.want)
		}
	}

	cfg := base()
	cfg.PeerNames = []string{"n2", "n3"}
	if s, err := New(cfg); err == nil {
		s.Shutdown(context.Background())
		t.Fatal("New with its own name not in PeerNames succeeded")
	} else if !strings.Contains(err.Error(), "allocator/n1") || !strings.Contains(err.Error(), "-peer-names n2,n3") {
		t.Errorf("New: %v, want a refusal naming allocator/n1 and -peer-names", err)
	}
}

// peerStandIn is a gRPC server with an allocator certificate that records
// the forwarded calls it receives (a node, or another cluster's allocator
// that Raft named as the leader).
type peerStandIn struct {
	allotv1.UnimplementedAdminServer
	calls atomic.Int32
	ident atomic.Value // string: the last call's x-allot-identity
}

func (p *peerStandIn) PutRules(ctx context.Context, _ *allotv1.PutRulesRequest) (*allotv1.PutRulesResponse, error) {
	p.calls.Add(1)
	md, _ := metadata.FromIncomingContext(ctx)
	p.ident.Store(strings.Join(md.Get(identityKey), ","))
	return &allotv1.PutRulesResponse{}, nil
}

func (p *peerStandIn) ClusterStatus(context.Context, *allotv1.ClusterStatusRequest) (*allotv1.ClusterStatusResponse, error) {
	p.calls.Add(1)
	return &allotv1.ClusterStatusResponse{NodeId: "global-1"}, nil
}

// servePeerStandIn serves a peerStandIn over TLS with o's certificate,
// requiring an allocator client certificate, and returns it and its
// address.
func servePeerStandIn(t *testing.T, o tlsconfig.Options) (*peerStandIn, string) {
	t.Helper()
	l, err := tlsconfig.Load(o)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := l.Server(tlsconfig.ClientAuthRequire, tlsconfig.RoleAllocator)
	if err != nil {
		t.Fatal(err)
	}
	p := &peerStandIn{}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(cfg)))
	allotv1.RegisterAdminServer(gs, p)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(ln)
	t.Cleanup(gs.Stop)
	return p, ln.Addr().String()
}

// With PeerNames a node dials only listed certificates: a call it
// forwards to a leader whose certificate is another allocator's from the
// same CA (a region's, allocator/eu-1) fails the handshake, Unavailable
// naming allocator/eu-1, and the stand-in receives nothing (neither the
// admin's identity nor the request); the same call to a listed node
// (allocator/n2) arrives with the admin's identity. The global allocators
// (-global-allocators, another cluster) are dialed without the list.
func TestPeerNamesForwardDial(t *testing.T) {
	ca, dir := tlstest.NewCA(t, "allot test CA"), t.TempDir()
	files := func(name string) tlsconfig.Options {
		o := tlstest.Files(t, dir, name, ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, name)))
		o.ReloadInterval = -1
		return o
	}
	tc := newTestCluster(t, 1, func(_ int, c *Config) {
		c.TLS, c.ClientAuth, c.PeerNames = files("n1"), tlsconfig.ClientAuthRequire, []string{"n1", "n2"}
	})
	s := tc.node(0)
	listed, listedAddr := servePeerStandIn(t, files("n2"))
	rogue, rogueAddr := servePeerStandIn(t, files("eu-1"))

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ctx = withPrincipal(ctx, principal{cert: tlsconfig.Identity{Role: tlsconfig.RoleAdmin, Name: "ops"}})
	putRules := func(ctx context.Context, cc *grpc.ClientConn) error {
		_, err := allotv1.NewAdminClient(cc).PutRules(ctx, &allotv1.PutRulesRequest{})
		return err
	}

	if err := s.forward(ctx, leaderHint{id: "n2", addr: listedAddr}, putRules); err != nil {
		t.Fatalf("forward to listed allocator/n2: %v", err)
	}
	if got, _ := listed.ident.Load().(string); listed.calls.Load() != 1 || got != "admin/ops" {
		t.Fatalf("listed allocator/n2: %d calls, identity %q; want 1 call as admin/ops", listed.calls.Load(), got)
	}

	hint := leaderHint{id: "n3", addr: rogueAddr}
	err := toStatus(s.forward(ctx, hint, putRules), hint)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "allocator/eu-1") {
		t.Errorf("forward to unlisted allocator/eu-1: %v, want Unavailable naming allocator/eu-1", err)
	}
	if n := rogue.calls.Load(); n != 0 {
		t.Errorf("unlisted allocator/eu-1 received %d forwarded calls, want none", n)
	}

	// The regional runner's dials to a global allocator keep the role
	// check only: a global node's name is not in this cluster's list.
	if st, err := s.upstreamStatus(ctx, rogueAddr); err != nil || st.GetNodeId() != "global-1" {
		t.Errorf("upstream ClusterStatus of allocator/eu-1 as a global allocator: %v, %v", st, err)
	}
}
