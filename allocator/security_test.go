package allocator

import (
	"bytes"
	"context"

	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const testToken = "test-admin-token-0123456789"

// testPKI is a CA with the certificates of gen-dev-certs.sh, written to a
// temporary directory, and a second, untrusted CA.
type testPKI struct {
	allocator, agent, admin, gateway tlsconfig.Options
	strangerAgent                    tlsconfig.Options // agent gw-1 signed by another CA
	caOnly                           tlsconfig.Options // the CA, no certificate
}

// gatewayClient is a gateway certificate that may also be used as a
// client (the dev script's is server-only, which TLS itself refuses).
var gatewayClient = func() tlstest.Spec {
	s := tlstest.Role(tlsconfig.RoleGateway, "")
	s.Client = true
	return s
}()

func newTestPKI(t testing.TB) *testPKI {
	t.Helper()
	dir := t.TempDir()
	ca, other := tlstest.NewCA(t, "allot test CA"), tlstest.NewCA(t, "other CA")
	return &testPKI{
		allocator:     tlstest.Files(t, dir, "allocator", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))),
		agent:         tlstest.Files(t, dir, "agent-gw-1", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1"))),
		admin:         tlstest.Files(t, dir, "admin", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAdmin, ""))),
		gateway:       tlstest.Files(t, dir, "gateway", ca, ca.Issue(t, gatewayClient)),
		strangerAgent: tlstest.Files(t, dir, "stranger", ca, other.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1"))),
		caOnly:        tlstest.Files(t, dir, "ca", ca, nil),
	}
}

// withTLS turns on TLS everywhere: gRPC with required client certificates,
// Raft over mutual TLS, and an admin token.
func withTLS(p *testPKI) clusterOpt {
	return func(_ int, c *Config) {
		c.TLS = p.allocator
		c.ClientAuth = tlsconfig.ClientAuthRequire
		c.RaftTLS = true
		c.AdminTokens = []string{testToken}
	}
}

// dialAs returns clients to addr over TLS with o's files (o.CertFile ""
// presents no certificate), sending token as a bearer token when non-empty.
func dialAs(t testing.TB, addr string, o tlsconfig.Options, token string, extra ...grpc.DialOption) (allotv1.AllocatorClient, allotv1.AdminClient) {
	t.Helper()
	o.ReloadInterval = -1
	l, err := tlsconfig.Load(o)
	if err != nil {
		t.Fatal(err)
	}
	opts := append([]grpc.DialOption{grpc.WithTransportCredentials(l.ClientCredentials(""))}, extra...)
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearerCreds(token)))
	}
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return allotv1.NewAllocatorClient(cc), allotv1.NewAdminClient(cc)
}

// bearerCreds sends "authorization: Bearer <token>" (over any transport,
// for the plaintext tests too).
type bearerCreds string

func (b bearerCreds) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}
func (b bearerCreds) RequireTransportSecurity() bool { return false }

func wantCode(t *testing.T, what string, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Errorf("%s: error = %v, want %v", what, err, code)
	}
}

func acquireReq(agentID string, reqID uint64, keys ...*allotv1.KeyAcquire) *allotv1.AcquireRequest {
	return &allotv1.AcquireRequest{AgentId: agentID, RequestId: reqID, Keys: keys}
}

const extraRules = `domain: extra
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 5}
`

// TestTLSClusterBasicFlow: three nodes with TLS everywhere (gRPC with
// required client certificates, Raft over mutual TLS) form a cluster by
// joining, and the basic flow works through a follower: an agent leases
// as its certificate's id, watches rules, an admin puts rules and moves
// leadership (forwarded to the leader with the admin's identity).
func TestTLSClusterBasicFlow(t *testing.T) {
	p := newTestPKI(t)
	tc := newTCPTestCluster(t, 3, withTLS(p))
	f := tc.follower()
	addr := tc.node(f).GRPCAddr()
	ctx := ctxT(t)

	alloc, _ := dialAs(t, addr, p.agent, "")
	resp, err := alloc.Acquire(ctx, acquireReq("gw-1/incarnation-1", 1, key("user", "alice", 10)))
	if err != nil {
		t.Fatalf("agent Acquire through a follower: %v", err)
	}
	if g := resp.GetGrants(); len(g) != 1 || g[0].GetGranted() != 10 {
		t.Fatalf("Acquire = %v, want a grant of 10", resp)
	}
	if _, err := alloc.Release(ctx, &allotv1.ReleaseRequest{AgentId: "gw-1/incarnation-1", RequestId: 2, All: true}); err != nil {
		t.Fatalf("agent Release: %v", err)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	watch, err := alloc.WatchRules(wctx, &allotv1.WatchRulesRequest{AgentId: "gw-1/incarnation-1"})
	if err != nil {
		t.Fatal(err)
	}
	first, err := watch.Recv()
	if err != nil || first.GetVersion() == 0 {
		t.Fatalf("WatchRules first = %v, %v", first, err)
	}

	_, admin := dialAs(t, addr, p.admin, "")
	put, err := admin.PutRules(ctx, &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "extra.yaml", Yaml: []byte(extraRules)}}})
	if err != nil {
		t.Fatalf("admin PutRules through a follower: %v", err)
	}
	next, err := watch.Recv()
	if err != nil || next.GetVersion() != put.GetVersion() {
		t.Fatalf("WatchRules after the put = %v, %v; want version %d", next, err, put.GetVersion())
	}
	st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
	if err != nil || len(st.GetMembers()) != 3 {
		t.Fatalf("ClusterStatus = %v, %v", st, err)
	}
	// Leadership moves through the follower too, and the cluster keeps
	// replicating over TLS afterwards.
	// A transfer that does not complete within an election timeout (a
	// loaded machine) answers Unavailable, and the node still leads.
	var tr *allotv1.TransferLeadershipResponse
	waitFor(t, 20*time.Second, "a leadership transfer", func() bool {
		tr, err = admin.TransferLeadership(ctx, &allotv1.TransferLeadershipRequest{})
		if status.Code(err) == codes.Unavailable {
			t.Logf("TransferLeadership: %v; again", err)
			return false
		}
		if err != nil {
			t.Fatalf("TransferLeadership: %v", err)
		}
		return true
	})
	waitFor(t, 10*time.Second, "the new leader to be known", func() bool {
		id, _ := tc.node(f).Leader()
		return id == tr.GetLeaderId()
	})
	if _, err := alloc.Acquire(ctx, acquireReq("gw-1/incarnation-2", 1, key("user", "bob", 5))); err != nil {
		t.Fatalf("Acquire after the leadership transfer: %v", err)
	}
	cancel()
}

// TestTLSRejections: every refusal of an mTLS cluster, each changing
// nothing.
func TestTLSRejections(t *testing.T) {
	p := newTestPKI(t)
	tc := newTCPTestCluster(t, 3, withTLS(p), func(_ int, c *Config) { c.ExpireInterval = time.Hour })
	l := tc.node(tc.leader())
	addr := tc.node(tc.follower()).GRPCAddr()
	ctx := ctxT(t)
	before := commandsApplied(l)
	rulesBefore := l.rulesVersion()
	put := &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "extra.yaml", Yaml: []byte(extraRules)}}}

	t.Run("transport", func(t *testing.T) {
		for name, o := range map[string]tlsconfig.Options{
			"no client certificate":        p.caOnly,
			"client certificate, wrong CA": p.strangerAgent,
		} {
			alloc, _ := dialAs(t, addr, o, "")
			_, err := alloc.Acquire(ctx, acquireReq("gw-1", 1, key("user", "u", 1)))
			wantCode(t, name, err, codes.Unavailable)
		}
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		_, err = allotv1.NewAllocatorClient(cc).Acquire(ctx, acquireReq("gw-1", 1, key("user", "u", 1)))
		wantCode(t, "plaintext", err, codes.Unavailable)
	})

	t.Run("agent identity", func(t *testing.T) {
		alloc, admin := dialAs(t, addr, p.agent, "")
		for _, id := range []string{"gw-2", "gw-10", "gw-1x/y", "gw-1/", "gw"} {
			_, err := alloc.Acquire(ctx, acquireReq(id, 1, key("user", "u", 1)))
			wantCode(t, "Acquire as "+id, err, codes.PermissionDenied)
			_, err = alloc.Release(ctx, &allotv1.ReleaseRequest{AgentId: id, RequestId: 1, All: true})
			wantCode(t, "Release as "+id, err, codes.PermissionDenied)
		}
		_, err := admin.PutRules(ctx, put)
		wantCode(t, "agent PutRules", err, codes.PermissionDenied)
		_, err = admin.Check(ctx, &allotv1.CheckRequest{Domain: "test", Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "user", Value: "u"}}}}})
		wantCode(t, "agent Check", err, codes.PermissionDenied)
		_, err = admin.RemoveServer(ctx, &allotv1.RemoveServerRequest{Id: "n1"})
		wantCode(t, "agent RemoveServer", err, codes.PermissionDenied)
		_, err = admin.AddVoter(ctx, &allotv1.AddVoterRequest{Id: "evil", RaftAddr: "127.0.0.1:1"})
		wantCode(t, "agent AddVoter", err, codes.PermissionDenied)
		_, err = admin.TransferLeadership(ctx, &allotv1.TransferLeadershipRequest{})
		wantCode(t, "agent TransferLeadership", err, codes.PermissionDenied)
		_, err = admin.ListLeases(ctx, &allotv1.ListLeasesRequest{})
		wantCode(t, "agent ListLeases (a read)", err, codes.PermissionDenied)
		_, err = admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		wantCode(t, "agent ClusterStatus (a read)", err, codes.PermissionDenied)
	})

	t.Run("other roles cannot lease", func(t *testing.T) {
		for name, o := range map[string]tlsconfig.Options{"admin": p.admin, "gateway": p.gateway, "allocator": p.allocator} {
			alloc, _ := dialAs(t, addr, o, "")
			_, err := alloc.Acquire(ctx, acquireReq("gw-1", 1, key("user", "u", 1)))
			wantCode(t, name+" Acquire", err, codes.PermissionDenied)
		}
		_, admin := dialAs(t, addr, p.gateway, "")
		_, err := admin.PutRules(ctx, put)
		wantCode(t, "gateway PutRules", err, codes.PermissionDenied)
	})

	t.Run("admin token", func(t *testing.T) {
		_, admin := dialAs(t, addr, p.agent, "wrong-token-0123456789")
		_, err := admin.PutRules(ctx, put)
		wantCode(t, "wrong token", err, codes.Unauthenticated)
		alloc, _ := dialAs(t, addr, p.agent, "wrong-token-0123456789")
		_, err = alloc.Acquire(ctx, acquireReq("gw-1", 1, key("user", "u", 1)))
		wantCode(t, "Acquire with a wrong token", err, codes.Unauthenticated)
		_, admin = dialAs(t, addr, p.agent, "", grpc.WithUnaryInterceptor(withMD("authorization", "Basic abc")))
		_, err = admin.PutRules(ctx, put)
		wantCode(t, "malformed authorization", err, codes.Unauthenticated)
	})

	t.Run("forged forwarding metadata", func(t *testing.T) {
		// An agent claiming to be a forwarding node, acting for an admin:
		// the metadata is trusted only from allocator certificates.
		_, admin := dialAs(t, addr, p.agent, "", grpc.WithUnaryInterceptor(withMD(forwardedKey, "n0", identityKey, "admin")))
		_, err := admin.PutRules(ctx, put)
		wantCode(t, "forged identity", err, codes.PermissionDenied)
	})

	if after := commandsApplied(l); after != before {
		t.Errorf("%v commands applied by refused calls", after-before)
	}
	if v := l.rulesVersion(); v != rulesBefore {
		t.Errorf("rules version %d after refused puts, want %d", v, rulesBefore)
	}

	t.Run("admin token accepted", func(t *testing.T) {
		// A valid token makes any admitted caller an admin.
		_, admin := dialAs(t, addr, p.agent, testToken)
		if _, err := admin.PutRules(ctx, put); err != nil {
			t.Fatalf("PutRules with the token: %v", err)
		}
		if _, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{}); err != nil {
			t.Fatalf("ClusterStatus with the token: %v", err)
		}
	})
}

// withMD adds metadata pairs to every unary call.
func withMD(kv ...string) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		return invoker(metadata.AppendToOutgoingContext(ctx, kv...), method, req, reply, cc, opts...)
	}
}

// syncBuffer is a goroutine-safe log sink.
type syncBuffer struct {
	mu  sync.Mutex // guards buf
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestTokenAuthWithoutTLS: a plaintext cluster with admin tokens only.
// Joining needs the token (the nodes present it), admin calls need it
// (and a follower forwards it for the leader to check again), agents are
// anonymous, and no log line carries a descriptor value.
func TestTokenAuthWithoutTLS(t *testing.T) {
	logs := &syncBuffer{}
	tc := newTestCluster(t, 3, func(i int, c *Config) {
		c.AdminTokens = []string{testToken}
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: levelTrace}))
	})
	f := tc.follower()
	alloc, admin := tc.clients(f)
	ctx := ctxT(t)
	const secret = "sk_live_SECRET_api_key_42"

	if _, err := alloc.Acquire(ctx, acquireReq("agent-a", 1, key("user", secret, 3))); err != nil {
		t.Fatalf("anonymous Acquire: %v", err)
	}
	put := &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "extra.yaml", Yaml: []byte(extraRules)}}}
	_, err := admin.PutRules(ctx, put)
	wantCode(t, "PutRules without a token", err, codes.Unauthenticated)
	_, err = admin.ListAgents(ctx, &allotv1.ListAgentsRequest{})
	wantCode(t, "ListAgents without a token", err, codes.Unauthenticated)

	cc, err := grpc.NewClient(tc.node(f).GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(bearerCreds(testToken)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	tokAdmin := allotv1.NewAdminClient(cc)
	if _, err := tokAdmin.PutRules(ctx, put); err != nil {
		t.Fatalf("PutRules with the token through a follower: %v", err)
	}
	desc := []*allotv1.Entry{{Key: "user", Value: secret}}
	if _, err := tokAdmin.Check(ctx, &allotv1.CheckRequest{Domain: "test", Descriptors: []*allotv1.Descriptor{{Entries: desc}}}); err != nil {
		t.Fatalf("Check: %v", err)
	}
	if _, err := tokAdmin.InspectKey(ctx, &allotv1.InspectKeyRequest{Domain: "test", Entries: desc}); err != nil {
		t.Fatalf("InspectKey: %v", err)
	}
	if _, err := tokAdmin.ListLeases(ctx, &allotv1.ListLeasesRequest{Key: "test:user=" + secret}); err != nil {
		t.Fatalf("ListLeases: %v", err)
	}

	// Rotation: the old token stops working on every node once replaced.
	const rotated = "rotated-admin-token-987654321"
	for i := range 3 {
		if err := tc.node(i).SetAdminTokens([]string{rotated}); err != nil {
			t.Fatal(err)
		}
	}
	_, err = tokAdmin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
	wantCode(t, "old token after rotation", err, codes.Unauthenticated)
	if err := tc.node(0).SetAdminTokens([]string{"short"}); err == nil {
		t.Error("SetAdminTokens accepted a short token")
	}

	out := logs.String()
	if strings.Contains(out, secret) {
		t.Errorf("a descriptor value reached the log:\n%s", grepLines(out, secret))
	}
	if !strings.Contains(out, "admin call") || !strings.Contains(out, redactDescriptor("test", desc)) {
		t.Errorf("no audit line with the redacted key %s", redactDescriptor("test", desc))
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func TestOpenReadsAndNoAuth(t *testing.T) {
	tc := newTestCluster(t, 1, func(_ int, c *Config) {
		c.AdminTokens = []string{testToken}
		c.OpenReads = true
	})
	_, admin := tc.clients(0)
	ctx := ctxT(t)
	if _, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{}); err != nil {
		t.Errorf("ClusterStatus with OpenReads: %v", err)
	}
	_, err := admin.TransferLeadership(ctx, &allotv1.TransferLeadershipRequest{})
	wantCode(t, "TransferLeadership with OpenReads", err, codes.Unauthenticated)

	// Without any authentication configured, SetAdminTokens cannot turn it
	// on behind the operator's back.
	open := newTestCluster(t, 1)
	if err := open.node(0).SetAdminTokens([]string{testToken}); err == nil {
		t.Error("SetAdminTokens on a node without authentication: no error")
	}
}

func TestRedactKey(t *testing.T) {
	a, b := redactKey("api:key=secret-1"), redactKey("api:key=secret-2")
	if a == b || !strings.HasPrefix(a, "key#") || len(a) != len("key#")+8 {
		t.Errorf("redactKey = %q, %q: want distinct key#<8 hex>", a, b)
	}
	if redactKey("api:key=secret-1") != a {
		t.Error("redactKey is not stable")
	}
	if strings.Contains(a, "secret") {
		t.Error("redactKey leaks the key")
	}
	attrs := auditAttrs(&allotv1.InspectKeyRequest{Key: "api:key=secret-1"})
	if len(attrs) != 2 || attrs[1] != a {
		t.Errorf("auditAttrs(InspectKey) = %v", attrs)
	}
}

func TestRemoveServerUnknownNotFound(t *testing.T) {
	tc := newTestCluster(t, 1)
	_, admin := tc.clients(0)
	_, err := admin.RemoveServer(ctxT(t), &allotv1.RemoveServerRequest{Id: "nobody"})
	wantCode(t, "RemoveServer(nobody)", err, codes.NotFound)
}

func TestValidateCheckExported(t *testing.T) {
	ok := &allotv1.CheckRequest{Domain: "d", Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "k", Value: "v"}}}}}
	if err := ValidateCheck(ok); err != nil {
		t.Errorf("ValidateCheck(ok) = %v", err)
	}
	for name, req := range map[string]*allotv1.CheckRequest{
		"no domain":      {Descriptors: ok.Descriptors},
		"no descriptors": {Domain: "d"},
		"nil descriptor": {Domain: "d", Descriptors: []*allotv1.Descriptor{nil}},
		"long":           {Domain: "d", Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "k", Value: strings.Repeat("v", 5000)}}}}},
	} {
		if err := ValidateCheck(req); err == nil || !strings.HasPrefix(err.Error(), "allocator: ") {
			t.Errorf("ValidateCheck(%s) = %v, want an allocator error", name, err)
		}
	}
}

// retryInfo returns a status error's ErrorInfo reason and RetryInfo delay.
func retryInfo(err error) (string, time.Duration) {
	st, _ := status.FromError(err)
	var reason string
	var d time.Duration
	for _, det := range st.Details() {
		switch v := det.(type) {
		case *errdetails.ErrorInfo:
			reason = v.GetReason()
		case *errdetails.RetryInfo:
			d = v.GetRetryDelay().AsDuration()
		}
	}
	return reason, d
}

// TestAuditLogNoDescriptorValueInErrors: a call whose error message quotes
// a descriptor value (a PutRules refused for a duplicate per-key rule, an
// InspectKey of a malformed key) is audited without that value at any
// level, while the caller gets the whole message.
func TestAuditLogNoDescriptorValueInErrors(t *testing.T) {
	logs := &syncBuffer{}
	tc := newTestCluster(t, 1, func(_ int, c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: levelTrace}))
	})
	_, admin := tc.clients(0)
	const secret = "sk_live_SECRET_api_key_42"
	dup := "domain: extra\ndescriptors:\n  - key: api_key\n    value: " + secret +
		"\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: api_key\n    value: " + secret +
		"\n    rate_limit: {unit: second, requests_per_unit: 6}\n"
	_, err := admin.PutRules(ctxT(t), &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "x.yaml", Yaml: []byte(dup)}}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), secret) {
		t.Errorf("PutRules with a duplicate per-key rule: %v, want InvalidArgument naming the key", err)
	}
	_, err = admin.InspectKey(ctxT(t), &allotv1.InspectKeyRequest{Key: "test:user=alice," + secret})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), secret) {
		t.Errorf("InspectKey of a malformed key: %v, want InvalidArgument quoting the entry", err)
	}
	out := logs.String()
	if l := grepLines(out, secret); l != "" {
		t.Errorf("a descriptor value reached the log:\n%s", l)
	}
	if !strings.Contains(out, "admin call") || !strings.Contains(out, "code=InvalidArgument") {
		t.Errorf("no audit line of the refused calls")
	}
}

func TestRedactQuoted(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`entry "a=b\"c" has no '='`, `entry "` + redactKey(`a=b\"c`) + `" has no '` + redactKey("=") + `'`},
		{"the node's key 'v", "the node's key '" + redactKey("v")},
		{"no quotes", "no quotes"},
	} {
		if got := redactQuoted(c.in); got != c.want {
			t.Errorf("redactQuoted(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestReloadAdminTokensFailureKeepsPrevious: a token file that fails to
// reload (a bad line, no token left) keeps every previous token valid,
// the one being revoked included, and each failure is counted in
// allot_allocator_admin_token_reload_failures_total.
func TestReloadAdminTokensFailureKeepsPrevious(t *testing.T) {
	tc := newTestCluster(t, 1, func(_ int, c *Config) { c.AdminTokens = []string{testToken} })
	s := tc.node(0)
	path := filepath.Join(t.TempDir(), "tokens")
	for i, content := range []string{"rotated-admin-token-987654321\nshort\n", "# every token removed\n"} {
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := s.ReloadAdminTokens(path); err == nil {
			t.Fatalf("reload %d of %q: no error", i, content)
		}
		if !s.guard.tokens.Load().Valid(testToken) {
			t.Fatalf("reload %d failed but revoked the previous token", i)
		}
		if got := testutilCounter(s.metrics.tokenReloadFailures); got != float64(i+1) {
			t.Errorf("after failed reload %d: admin_token_reload_failures_total = %v, want %d", i, got, i+1)
		}
	}
	if err := os.WriteFile(path, []byte("rotated-admin-token-987654321\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.ReloadAdminTokens(path); err != nil {
		t.Fatal(err)
	}
	if tok := s.guard.tokens.Load(); tok.Valid(testToken) || !tok.Valid("rotated-admin-token-987654321") {
		t.Error("a good reload did not replace the tokens")
	}
	if got := testutilCounter(s.metrics.tokenReloadFailures); got != 2 {
		t.Errorf("after a good reload: admin_token_reload_failures_total = %v, want 2", got)
	}
}
