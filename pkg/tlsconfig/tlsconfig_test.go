package tlsconfig_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func certWith(uris []string, ou []string, cn string) *x509.Certificate {
	c := &x509.Certificate{}
	for _, s := range uris {
		u, err := url.Parse(s)
		if err != nil {
			panic(err)
		}
		c.URIs = append(c.URIs, u)
	}
	c.Subject.OrganizationalUnit = ou
	c.Subject.CommonName = cn
	return c
}

func TestIdentityFromCert(t *testing.T) {
	long := strings.Repeat("a", tlsconfig.MaxNameLen+1)
	for _, tc := range []struct {
		name string
		cert *x509.Certificate
		want string // Identity.String(); "" = error
	}{
		{"agent uri", certWith([]string{"spiffe://allot/agent/gw-1"}, nil, ""), "agent/gw-1"},
		{"admin uri without name (gen-dev-certs.sh)", certWith([]string{"spiffe://allot/admin"}, []string{"admin"}, "admin"), "admin"},
		{"admin uri with name", certWith([]string{"spiffe://allot/admin/alice"}, nil, ""), "admin/alice"},
		{"allocator uri", certWith([]string{"spiffe://allot/allocator"}, nil, ""), "allocator"},
		{"uri wins over OU", certWith([]string{"spiffe://allot/agent/a"}, []string{"admin"}, "root"), "agent/a"},
		{"other trust domain ignored, OU fallback", certWith([]string{"spiffe://example.org/admin"}, []string{"agent"}, "gw-2"), "agent/gw-2"},
		{"https uri ignored", certWith([]string{"https://allot/admin"}, []string{"agent"}, "gw-2"), "agent/gw-2"},
		{"OU agent", certWith(nil, []string{"agent"}, "gw-3"), "agent/gw-3"},
		{"OU admin", certWith(nil, []string{"ops", "admin"}, "bob"), "admin/bob"},
		{"OU admin without CN", certWith(nil, []string{"admin"}, ""), "admin"},

		{"agent uri without name", certWith([]string{"spiffe://allot/agent"}, nil, ""), ""},
		{"agent uri empty name", certWith([]string{"spiffe://allot/agent/"}, nil, ""), ""},
		{"agent uri nested name", certWith([]string{"spiffe://allot/agent/a/b"}, nil, ""), ""},
		{"agent uri long name", certWith([]string{"spiffe://allot/agent/" + long}, nil, ""), ""},
		{"agent uri escaped", certWith([]string{"spiffe://allot/agent/a%2Fb"}, nil, ""), ""},
		{"uri with query", certWith([]string{"spiffe://allot/admin?x=1"}, nil, ""), ""},
		{"uri with port", certWith([]string{"spiffe://allot:1/admin"}, nil, ""), ""},
		{"upper case trust domain", certWith([]string{"spiffe://ALLOT/admin"}, nil, ""), ""},
		// A malformed allot SAN is an error, never a fallback to the OU.
		{"uri with port, OU admin", certWith([]string{"spiffe://allot:8443/agent/gw-1"}, []string{"admin"}, "ops"), ""},
		{"uri with empty port, OU admin", certWith([]string{"spiffe://allot:/agent/gw-1"}, []string{"admin"}, "ops"), ""},
		{"trust domain with trailing dot, OU admin", certWith([]string{"spiffe://allot./agent/gw-1"}, []string{"admin"}, "ops"), ""},
		{"uri with user, OU admin", certWith([]string{"spiffe://x@allot/agent/gw-1"}, []string{"admin"}, "ops"), ""},
		{"unknown role uri, no fallback", certWith([]string{"spiffe://allot/root"}, []string{"admin"}, "x"), ""},
		{"two uris", certWith([]string{"spiffe://allot/agent/a", "spiffe://allot/admin"}, nil, ""), ""},
		{"two role OUs", certWith(nil, []string{"agent", "admin"}, "x"), ""},
		{"OU agent without CN", certWith(nil, []string{"agent"}, ""), ""},
		{"OU agent bad CN", certWith(nil, []string{"agent"}, "gw 1"), ""},
		{"nothing", certWith(nil, []string{"ops"}, "x"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, err := tlsconfig.IdentityFromCert(tc.cert)
			if tc.want == "" {
				if err == nil {
					t.Fatalf("IdentityFromCert = %v, want an error", id)
				}
				return
			}
			if err != nil || id.String() != tc.want {
				t.Fatalf("IdentityFromCert = %v, %v; want %s", id, err, tc.want)
			}
		})
	}
	if _, err := tlsconfig.IdentityFromCert(certWith(nil, nil, "x")); !errors.Is(err, tlsconfig.ErrNoIdentity) {
		t.Errorf("no identity: err = %v, want ErrNoIdentity", err)
	}
}

func TestParseIdentityAndAgentIDMatches(t *testing.T) {
	for _, s := range []string{"agent/gw-1", "admin", "admin/alice", "allocator"} {
		id, err := tlsconfig.ParseIdentity(s)
		if err != nil || id.String() != s {
			t.Errorf("ParseIdentity(%q) = %v, %v", s, id, err)
		}
	}
	for _, s := range []string{"", "agent", "agent/", "admin/", "root", "agent/a/b", "agent/a b"} {
		if id, err := tlsconfig.ParseIdentity(s); err == nil {
			t.Errorf("ParseIdentity(%q) = %v, want an error", s, id)
		}
	}
	for _, tc := range []struct {
		agentID, name string
		want          bool
	}{
		{"gw-1", "gw-1", true},
		{"gw-1/host-42-abcd", "gw-1", true},
		{"gw-1/", "gw-1", false},
		{"gw-10", "gw-1", false},
		{"gw-1x/y", "gw-1", false},
		{"gw", "gw-1", false},
		{"x", "", false},
	} {
		if got := tlsconfig.AgentIDMatches(tc.agentID, tc.name); got != tc.want {
			t.Errorf("AgentIDMatches(%q, %q) = %v, want %v", tc.agentID, tc.name, got, tc.want)
		}
	}
}

// handshake runs one TLS handshake over loopback; the server writes one
// byte after a successful handshake, which the client reads (with TLS 1.3 a
// rejected client certificate shows only then). It returns the server's
// view and both errors.
func handshake(t *testing.T, srv, cli *tls.Config) (tls.ConnectionState, error, error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type result struct {
		cs  tls.ConnectionState
		err error
	}
	done := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer c.Close()
		tc := tls.Server(c, srv)
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		if err := tc.Handshake(); err != nil {
			done <- result{err: err}
			return
		}
		_, err = tc.Write([]byte{1})
		done <- result{cs: tc.ConnectionState(), err: err}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	tc := tls.Client(c, cli)
	_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
	cerr := tc.Handshake()
	if cerr == nil {
		_, cerr = tc.Read(make([]byte, 1))
	}
	tc.Close()
	r := <-done
	return r.cs, r.err, cerr
}

type pki struct {
	dir        string
	ca, other  *tlstest.CA
	server     tlsconfig.Options
	agent      tlsconfig.Options
	admin      tlsconfig.Options
	stranger   tlsconfig.Options // agent certificate from another CA
	caOnly     tlsconfig.Options
	gatewaySrv tlsconfig.Options
}

func newPKI(t *testing.T) *pki {
	dir := t.TempDir()
	p := &pki{dir: dir, ca: tlstest.NewCA(t, "test CA"), other: tlstest.NewCA(t, "other CA")}
	p.server = tlstest.Files(t, dir, "allocator", p.ca, p.ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, "")))
	p.agent = tlstest.Files(t, dir, "agent", p.ca, p.ca.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1")))
	p.admin = tlstest.Files(t, dir, "admin", p.ca, p.ca.Issue(t, tlstest.Role(tlsconfig.RoleAdmin, "")))
	p.gatewaySrv = tlstest.Files(t, dir, "gateway", p.ca, p.ca.Issue(t, tlstest.Role(tlsconfig.RoleGateway, "")))
	p.stranger = tlstest.Files(t, dir, "stranger", p.ca, p.other.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1")))
	p.caOnly = tlstest.Files(t, dir, "caonly", p.ca, nil)
	return p
}

func load(t *testing.T, o tlsconfig.Options) *tlsconfig.Loader {
	t.Helper()
	l, err := tlsconfig.Load(o)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func server(t *testing.T, l *tlsconfig.Loader, auth tlsconfig.ClientAuth, roles ...tlsconfig.Role) *tls.Config {
	t.Helper()
	c, err := l.Server(auth, roles...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestMutualTLSAndIdentity(t *testing.T) {
	p := newPKI(t)
	srv := load(t, p.server)
	require := server(t, srv, tlsconfig.ClientAuthRequire)

	cs, serr, cerr := handshake(t, require, load(t, p.agent).Client("localhost"))
	if serr != nil || cerr != nil {
		t.Fatalf("agent with a good certificate: server %v, client %v", serr, cerr)
	}
	id, err := tlsconfig.PeerIdentity(cs)
	if err != nil || id != (tlsconfig.Identity{Role: tlsconfig.RoleAgent, Name: "gw-1"}) {
		t.Errorf("PeerIdentity = %v, %v; want agent/gw-1", id, err)
	}
	// The server name is checked against the IP SAN too.
	if _, serr, cerr = handshake(t, require, load(t, p.agent).Client("127.0.0.1")); serr != nil || cerr != nil {
		t.Errorf("by IP: server %v, client %v", serr, cerr)
	}

	for name, cli := range map[string]*tls.Config{
		"no client certificate":        load(t, p.caOnly).Client("localhost"),
		"client certificate, wrong CA": load(t, p.stranger).Client("localhost"),
	} {
		if _, serr, cerr := handshake(t, require, cli); serr == nil || cerr == nil {
			t.Errorf("%s: server %v, client %v; want both to fail", name, serr, cerr)
		}
	}

	// The client rejects a server its CA did not sign, and a wrong name.
	strangerSrv := load(t, tlsconfig.Options{CertFile: p.stranger.CertFile, KeyFile: p.stranger.KeyFile})
	if _, _, cerr := handshake(t, server(t, strangerSrv, tlsconfig.ClientAuthNone), load(t, p.agent).Client("localhost")); cerr == nil {
		t.Error("client accepted a server certificate from another CA")
	}
	if _, _, cerr := handshake(t, require, load(t, p.agent).Client("example.com")); cerr == nil {
		t.Error("client accepted a server certificate for another name")
	}

	// Optional: no certificate is fine, a bad one is not.
	optional := server(t, srv, tlsconfig.ClientAuthOptional)
	cs, serr, cerr = handshake(t, optional, load(t, p.caOnly).Client("localhost"))
	if serr != nil || cerr != nil {
		t.Fatalf("optional, no certificate: server %v, client %v", serr, cerr)
	}
	if id, err := tlsconfig.PeerIdentity(cs); err != nil || !id.IsZero() {
		t.Errorf("optional, no certificate: PeerIdentity = %v, %v; want zero", id, err)
	}
	if _, serr, _ := handshake(t, optional, load(t, p.stranger).Client("localhost")); serr == nil {
		t.Error("optional: a certificate from another CA was accepted")
	}
}

func TestRoleRestrictions(t *testing.T) {
	p := newPKI(t)
	peersOnly := server(t, load(t, p.server), tlsconfig.ClientAuthRequire, tlsconfig.RoleAllocator)
	if _, serr, cerr := handshake(t, peersOnly, load(t, p.server).Client("localhost", tlsconfig.RoleAllocator)); serr != nil || cerr != nil {
		t.Fatalf("allocator to allocator: server %v, client %v", serr, cerr)
	}
	if _, serr, _ := handshake(t, peersOnly, load(t, p.agent).Client("localhost")); serr == nil ||
		!strings.Contains(serr.Error(), "want role") {
		t.Errorf("agent certificate on a peers-only listener: server error %v, want a role error", serr)
	}
	// A client that wants an allocator refuses a gateway's certificate.
	gw := server(t, load(t, p.gatewaySrv), tlsconfig.ClientAuthNone)
	if _, _, cerr := handshake(t, gw, load(t, p.server).Client("localhost", tlsconfig.RoleAllocator)); cerr == nil ||
		!strings.Contains(cerr.Error(), "want role") {
		t.Errorf("allocator dialing a gateway: client error %v, want a role error", cerr)
	}
}

// TestClientNamedForPeerNames: a client that wants an allocator named n1 or n2
// accepts n1's certificate and refuses, naming the certificate, another
// allocator's from the same CA (eu-1), a nameless allocator's, and a
// gateway's named n1 (the role is checked too). Without names it is
// Client: any allocator certificate passes. ClientCredentialsNamed makes
// the same check for gRPC, where the refusal is Unavailable.
func TestClientNamedForPeerNames(t *testing.T) {
	p := newPKI(t)
	issue := func(role tlsconfig.Role, name string) *tls.Config {
		file := string(role) + "-" + name
		return server(t, load(t, tlstest.Files(t, p.dir, file, p.ca, p.ca.Issue(t, tlstest.Role(role, name)))), tlsconfig.ClientAuthRequire)
	}
	cli := load(t, p.server)
	names := []string{"n1", "n2"}
	if _, serr, cerr := handshake(t, issue(tlsconfig.RoleAllocator, "n1"), cli.ClientNamed("localhost", names, tlsconfig.RoleAllocator)); serr != nil || cerr != nil {
		t.Fatalf("listed allocator/n1: server %v, client %v", serr, cerr)
	}
	for _, c := range []struct {
		role       tlsconfig.Role
		name, want string
	}{
		{tlsconfig.RoleAllocator, "eu-1", "server certificate is allocator/eu-1, not one of the allowed names n1,n2"},
		{tlsconfig.RoleAllocator, "", "server certificate is allocator, not one of the allowed names n1,n2"},
		{tlsconfig.RoleGateway, "n1", "server certificate is gateway/n1, want role [allocator]"},
	} {
		id := tlsconfig.Identity{Role: c.role, Name: c.name}
		srv := issue(c.role, c.name)
		if _, _, cerr := handshake(t, srv, cli.ClientNamed("localhost", names, tlsconfig.RoleAllocator)); cerr == nil || !strings.Contains(cerr.Error(), c.want) {
			t.Errorf("%s: client error %v, want %q", id, cerr, c.want)
		}
		// Without names, only the role counts.
		_, _, cerr := handshake(t, srv, cli.ClientNamed("localhost", nil, tlsconfig.RoleAllocator))
		if want := c.role == tlsconfig.RoleAllocator; (cerr == nil) != want {
			t.Errorf("%s, no names: client error %v, want accepted %v", id, cerr, want)
		}
	}

	// gRPC: the unlisted server is refused with Unavailable naming it, the
	// listed one answers.
	serve := func(srv *tls.Config) string {
		gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(srv)))
		healthpb.RegisterHealthServer(gs, health.NewServer())
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go gs.Serve(ln)
		t.Cleanup(gs.Stop)
		return ln.Addr().String()
	}
	check := func(addr string) error {
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(cli.ClientCredentialsNamed("", names, tlsconfig.RoleAllocator)))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	if err := check(serve(issue(tlsconfig.RoleAllocator, "n2"))); err != nil {
		t.Errorf("gRPC to listed allocator/n2: %v", err)
	}
	err := check(serve(issue(tlsconfig.RoleAllocator, "eu-1")))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "allocator/eu-1, not one of the allowed names") {
		t.Errorf("gRPC to unlisted allocator/eu-1: %v, want Unavailable naming allocator/eu-1", err)
	}
}

func TestMinVersion(t *testing.T) {
	p := newPKI(t)
	o := p.server
	o.MinVersion = tls.VersionTLS13
	srv := server(t, load(t, o), tlsconfig.ClientAuthNone)
	cli := load(t, p.caOnly).Client("localhost")
	cli.MaxVersion = tls.VersionTLS12
	if _, serr, _ := handshake(t, srv, cli); serr == nil {
		t.Error("a TLS 1.2 client reached a server with MinVersion 1.3")
	}
	cli = load(t, p.caOnly).Client("localhost")
	cli.MaxVersion = tls.VersionTLS11
	if _, serr, _ := handshake(t, server(t, load(t, p.server), tlsconfig.ClientAuthNone), cli); serr == nil {
		t.Error("a TLS 1.1 client reached a server with the default MinVersion")
	}
}

func TestOptionsAndParsers(t *testing.T) {
	p := newPKI(t)
	bad := map[string]tlsconfig.Options{
		"nothing":          {},
		"cert without key": {CertFile: p.server.CertFile},
		"key without cert": {KeyFile: p.server.KeyFile},
		"tls 1.1":          {CAFile: p.server.CAFile, MinVersion: tls.VersionTLS11},
		"missing CA":       {CAFile: filepath.Join(p.dir, "nope.crt")},
		"CA not PEM":       {CAFile: p.server.KeyFile + ".txt"},
		"key mismatch":     {CertFile: p.server.CertFile, KeyFile: p.agent.KeyFile},
	}
	if err := os.WriteFile(p.server.KeyFile+".txt", []byte("not pem"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, o := range bad {
		if _, err := tlsconfig.Load(o); err == nil || !strings.HasPrefix(err.Error(), "tlsconfig: ") {
			t.Errorf("%s: Load error = %v, want a tlsconfig error", name, err)
		}
	}
	caOnly := load(t, p.caOnly)
	if _, err := caOnly.Server(tlsconfig.ClientAuthNone); err == nil {
		t.Error("Server without a certificate: no error")
	}
	noCA := load(t, tlsconfig.Options{CertFile: p.server.CertFile, KeyFile: p.server.KeyFile})
	if _, err := noCA.Server(tlsconfig.ClientAuthRequire); err == nil {
		t.Error("Server requiring client certificates without a CA: no error")
	}
	if id, err := load(t, p.agent).Identity(); err != nil || id.String() != "agent/gw-1" {
		t.Errorf("Identity = %v, %v", id, err)
	}
	if _, err := caOnly.Identity(); err == nil {
		t.Error("Identity without a certificate: no error")
	}
	for s, want := range map[string]tlsconfig.ClientAuth{"none": tlsconfig.ClientAuthNone, "optional": tlsconfig.ClientAuthOptional, "require": tlsconfig.ClientAuthRequire} {
		if got, err := tlsconfig.ParseClientAuth(s); err != nil || got != want || got.String() != s {
			t.Errorf("ParseClientAuth(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := tlsconfig.ParseClientAuth("yes"); err == nil {
		t.Error("ParseClientAuth(yes): no error")
	}
	if v, err := tlsconfig.ParseVersion("1.3"); err != nil || v != tls.VersionTLS13 {
		t.Errorf("ParseVersion(1.3) = %v, %v", v, err)
	}
	if _, err := tlsconfig.ParseVersion("1.1"); err == nil {
		t.Error("ParseVersion(1.1): no error")
	}
}

// TestReload rotates the server's certificate: Reload picks it up, a
// broken file set keeps the old one, and a changed file is picked up by
// the next handshake after ReloadInterval.
func TestReload(t *testing.T) {
	p := newPKI(t)
	o := p.server
	var reloadErrs []error
	o.ReloadInterval = -1
	l := load(t, o)
	srv := server(t, l, tlsconfig.ClientAuthNone)
	serial := func() string {
		t.Helper()
		cli := load(t, p.caOnly).Client("localhost")
		var got string
		cli.VerifyConnection = func(cs tls.ConnectionState) error {
			got = cs.PeerCertificates[0].SerialNumber.String()
			return nil
		}
		if _, serr, cerr := handshake(t, srv, cli); serr != nil || cerr != nil {
			t.Fatalf("handshake: server %v, client %v", serr, cerr)
		}
		return got
	}
	first := serial()

	next := p.ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))
	write := func(path string, b []byte) {
		t.Helper()
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Half a rotation (new certificate, old key): Reload fails, the old
	// material stays.
	write(o.CertFile, next.CertPEM)
	if err := l.Reload(); err == nil {
		t.Fatal("Reload with a mismatched key: no error")
	}
	if got := serial(); got != first {
		t.Fatalf("after a failed reload the server presents %s, want the old %s", got, first)
	}
	write(o.KeyFile, next.KeyPEM)
	if err := l.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := serial(); got != next.Cert.SerialNumber.String() {
		t.Fatalf("after Reload the server presents %s, want %s", got, next.Cert.SerialNumber)
	}

	// Automatic: a short interval, files changed (mtime moved on).
	o.ReloadInterval = time.Nanosecond // every handshake checks
	o.OnReloadError = func(err error) { reloadErrs = append(reloadErrs, err) }
	l = load(t, o)
	srv = server(t, l, tlsconfig.ClientAuthNone)
	third := p.ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))
	write(o.CertFile, third.CertPEM)
	write(o.KeyFile, third.KeyPEM)
	future := time.Now().Add(time.Hour)
	for _, f := range []string{o.CertFile, o.KeyFile} {
		if err := os.Chtimes(f, future, future); err != nil {
			t.Fatal(err)
		}
	}
	if got := serial(); got != third.Cert.SerialNumber.String() {
		t.Fatalf("after an automatic reload the server presents %s, want %s", got, third.Cert.SerialNumber)
	}
	if len(reloadErrs) != 0 {
		t.Errorf("reload errors: %v", reloadErrs)
	}
}

// TestClientCredentialsFollowCARotation: a gRPC client built once with
// ClientCredentials trusts a new CA as soon as its CA file has it.
func TestClientCredentialsFollowCARotation(t *testing.T) {
	p := newPKI(t)
	// The server's certificate is from the "other" CA.
	srvOpts := tlstest.Files(t, p.dir, "srv2", p.other, p.other.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, "")))
	srvCfg := server(t, load(t, srvOpts), tlsconfig.ClientAuthNone)
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(srvCfg)))
	healthpb.RegisterHealthServer(gs, health.NewServer())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(ln)
	defer gs.Stop()

	cliOpts := tlstest.Files(t, p.dir, "cli", p.ca, nil)
	cliOpts.ReloadInterval = -1
	l := load(t, cliOpts)
	check := func() error {
		cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(l.ClientCredentials("", tlsconfig.RoleAllocator)))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	if err := check(); err == nil {
		t.Fatal("a server from an untrusted CA was accepted")
	}
	if err := os.WriteFile(cliOpts.CAFile, append(append([]byte{}, p.ca.PEM...), p.other.PEM...), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := l.Reload(); err != nil {
		t.Fatal(err)
	}
	if err := check(); err != nil {
		t.Fatalf("after adding the CA to the bundle: %v", err)
	}
}

func TestTokens(t *testing.T) {
	toks := tlsconfig.NewTokens([]string{"0123456789abcdef", "", "fedcba9876543210"})
	if toks.Len() != 2 {
		t.Errorf("Len = %d, want 2", toks.Len())
	}
	for tok, want := range map[string]bool{
		"0123456789abcdef": true, "fedcba9876543210": true,
		"0123456789abcdeF": false, "0123456789abcde": false, "": false, "0123456789abcdef0": false,
	} {
		if got := toks.Valid(tok); got != want {
			t.Errorf("Valid(%q) = %v, want %v", tok, got, want)
		}
	}
	var none *tlsconfig.Tokens
	if none.Valid("0123456789abcdef") || none.Len() != 0 {
		t.Error("nil Tokens accepted a token")
	}
	for h, want := range map[string]string{"Bearer abc": "abc", "bearer  abc ": "abc", "Basic abc": "", "Bearer": "", "Bearer ": ""} {
		got, ok := tlsconfig.BearerToken(h)
		if got != want || ok != (want != "") {
			t.Errorf("BearerToken(%q) = %q, %v; want %q", h, got, ok, want)
		}
	}

	dir := t.TempDir()
	good := filepath.Join(dir, "tokens")
	if err := os.WriteFile(good, []byte("# admins\n\n  0123456789abcdef  \nfedcba9876543210\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := tlsconfig.ReadTokens(good)
	if err != nil || len(got) != 2 || got[0] != "0123456789abcdef" {
		t.Errorf("ReadTokens = %q, %v", got, err)
	}
	for name, content := range map[string]string{
		"empty": "# nothing\n", "short": "abc\n", "space inside": "0123456789 abcdef\n",
	} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := tlsconfig.ReadTokens(path); err == nil {
			t.Errorf("ReadTokens(%s): no error", name)
		}
	}
	if _, err := tlsconfig.ReadTokens(filepath.Join(dir, "missing")); err == nil {
		t.Error("ReadTokens(missing): no error")
	}
}
