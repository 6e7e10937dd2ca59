// Package tlsconfig loads allot's TLS material from PEM files (a CA bundle,
// a certificate and its private key) and builds server and client
// tls.Configs from it, and extracts the allot identity (a role and a name)
// a verified peer certificate carries.
//
// A Loader re-reads its files when they change (checked at most every
// Options.ReloadInterval, on a handshake) or when Reload is called; a file
// set that fails to load keeps the previous material, so a rotation that
// writes the certificate before the key never breaks new handshakes. Every
// Config it builds reads the current material at each handshake, so
// rotated certificates and CA bundles apply to new connections without a
// restart (gRPC clients: use ClientCredentials).
//
// Identities (see IdentityFromCert): a SPIFFE-style URI SAN
// spiffe://allot/agent/<id>, spiffe://allot/admin[/<name>] or
// spiffe://allot/allocator[/<name>], or, as a fallback, a subject with
// OU=agent|admin|allocator and CN=<name>. deploy/certs/gen-dev-certs.sh
// issues both forms.
//
// Admin bearer tokens are here too: ReadTokens reads a token file, Tokens
// checks a presented token in constant time, BearerToken parses the
// "authorization" metadata. pkg/tlsconfig/tlstest makes throw-away CAs and
// certificates for tests.
//
// Most callers need Load, then Server (listeners), Client or
// ClientCredentials (dialers; ClientNamed and ClientCredentialsNamed also
// require the server's certificate to carry one of a list of names), and
// IdentityFromCert. A Loader is safe for
// concurrent use.
package tlsconfig

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/credentials"
)

// ClientAuth is a server's policy for client certificates.
type ClientAuth uint8

const (
	// ClientAuthNone: no client certificate is requested.
	ClientAuthNone ClientAuth = iota
	// ClientAuthOptional: a client certificate is requested and, when
	// presented, must verify against the CA bundle.
	ClientAuthOptional
	// ClientAuthRequire: a client certificate is required and must verify.
	ClientAuthRequire
)

// String returns "none", "optional" or "require".
func (a ClientAuth) String() string {
	switch a {
	case ClientAuthNone:
		return "none"
	case ClientAuthOptional:
		return "optional"
	case ClientAuthRequire:
		return "require"
	}
	return fmt.Sprintf("ClientAuth(%d)", uint8(a))
}

// ParseClientAuth parses "none", "optional" or "require".
func ParseClientAuth(s string) (ClientAuth, error) {
	switch s {
	case "none":
		return ClientAuthNone, nil
	case "optional":
		return ClientAuthOptional, nil
	case "require":
		return ClientAuthRequire, nil
	}
	return 0, fmt.Errorf("tlsconfig: client auth %q: want require, optional or none", s)
}

// ParseVersion parses a minimum TLS version: "1.2" or "1.3".
func ParseVersion(s string) (uint16, error) {
	switch s {
	case "1.2":
		return tls.VersionTLS12, nil
	case "1.3":
		return tls.VersionTLS13, nil
	}
	return 0, fmt.Errorf("tlsconfig: TLS version %q: want 1.2 or 1.3", s)
}

// Options names the PEM files and the policy. The zero Options is "no TLS"
// (see Enabled).
type Options struct {
	// CAFile is a PEM bundle of the CAs that verify peers: client
	// certificates on a server, the server's certificate on a client. A
	// client without one uses the system roots.
	CAFile string
	// CertFile and KeyFile are this process's certificate chain and key
	// (PEM). A server needs them; a client presents them when asked
	// (mutual TLS).
	CertFile, KeyFile string
	// MinVersion is tls.VersionTLS12 (the default when 0) or
	// tls.VersionTLS13.
	MinVersion uint16
	// ReloadInterval is how often a handshake checks the files for changes
	// (size, mtime): default 10s; negative: only Reload re-reads them.
	ReloadInterval time.Duration
	// OnReloadError, when set, is told about a failed automatic reload
	// (the previous material stays in use). It must not block.
	OnReloadError func(error)
}

// Enabled reports whether o names any file.
func (o Options) Enabled() bool { return o.CAFile != "" || o.CertFile != "" || o.KeyFile != "" }

// Validate reports what is wrong with o's fields (without reading files).
func (o Options) Validate() error {
	var errs []error
	if (o.CertFile == "") != (o.KeyFile == "") {
		errs = append(errs, errors.New("tlsconfig: the certificate and key files go together"))
	}
	switch o.MinVersion {
	case 0, tls.VersionTLS12, tls.VersionTLS13:
	default:
		errs = append(errs, fmt.Errorf("tlsconfig: MinVersion %#x: want TLS 1.2 or 1.3", o.MinVersion))
	}
	return errors.Join(errs...)
}

// material is one consistent load of the files.
type material struct {
	cert *tls.Certificate  // nil without CertFile
	leaf *x509.Certificate // cert's parsed leaf
	pool *x509.CertPool    // nil without CAFile
}

// stamp identifies a file's content cheaply.
type stamp struct {
	size  int64
	mtime time.Time
	ok    bool
}

// Loader holds the current TLS material and builds configs from it.
type Loader struct {
	opts Options
	cur  atomic.Pointer[material]

	mu        sync.Mutex // guards lastCheck and stamps; serialises reloads
	lastCheck time.Time
	stamps    [3]stamp // CAFile, CertFile, KeyFile as last loaded
}

// Load validates o and reads its files.
func Load(o Options) (*Loader, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if !o.Enabled() {
		return nil, errors.New("tlsconfig: no CA, certificate or key file given")
	}
	if o.MinVersion == 0 {
		o.MinVersion = tls.VersionTLS12
	}
	if o.ReloadInterval == 0 {
		o.ReloadInterval = 10 * time.Second
	}
	l := &Loader{opts: o}
	if err := l.Reload(); err != nil {
		return nil, err
	}
	return l, nil
}

// Reload re-reads the files now. On error the previous material stays in
// use and the error names the file.
func (l *Loader) Reload() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.reloadLocked()
}

func (l *Loader) reloadLocked() error {
	stamps := l.statAll()
	m := &material{}
	if l.opts.CAFile != "" {
		pemBytes, err := os.ReadFile(l.opts.CAFile)
		if err != nil {
			return fmt.Errorf("tlsconfig: CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pemBytes) {
			return fmt.Errorf("tlsconfig: CA file %s: no PEM certificates", l.opts.CAFile)
		}
		m.pool = pool
	}
	if l.opts.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(l.opts.CertFile, l.opts.KeyFile)
		if err != nil {
			return fmt.Errorf("tlsconfig: certificate %s and key %s: %w", l.opts.CertFile, l.opts.KeyFile, err)
		}
		leaf := cert.Leaf
		if leaf == nil {
			if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
				return fmt.Errorf("tlsconfig: certificate %s: %w", l.opts.CertFile, err)
			}
			cert.Leaf = leaf
		}
		m.cert, m.leaf = &cert, leaf
	}
	l.cur.Store(m)
	l.stamps = stamps
	l.lastCheck = time.Now()
	return nil
}

func (l *Loader) statAll() [3]stamp {
	var out [3]stamp
	for i, p := range [3]string{l.opts.CAFile, l.opts.CertFile, l.opts.KeyFile} {
		if p == "" {
			continue
		}
		if fi, err := os.Stat(p); err == nil {
			out[i] = stamp{size: fi.Size(), mtime: fi.ModTime(), ok: true}
		}
	}
	return out
}

// maybeReload re-reads the files when the reload interval has passed and
// one of them changed. It never blocks a handshake behind another reload.
func (l *Loader) maybeReload() {
	if l.opts.ReloadInterval < 0 || !l.mu.TryLock() {
		return
	}
	defer l.mu.Unlock()
	now := time.Now()
	if now.Sub(l.lastCheck) < l.opts.ReloadInterval {
		return
	}
	l.lastCheck = now
	if l.statAll() == l.stamps {
		return
	}
	if err := l.reloadLocked(); err != nil {
		l.lastCheck = now // try again after the interval, not at every handshake
		if l.opts.OnReloadError != nil {
			l.opts.OnReloadError(err)
		}
	}
}

func (l *Loader) material() *material {
	l.maybeReload()
	return l.cur.Load()
}

// HasCertificate reports whether the Loader holds a certificate (and so can
// serve, or present one as a client).
func (l *Loader) HasCertificate() bool { return l.cur.Load().cert != nil }

// HasCA reports whether the Loader holds a CA bundle (and so can verify
// client certificates).
func (l *Loader) HasCA() bool { return l.cur.Load().pool != nil }

// Identity returns the identity in this process's own certificate.
func (l *Loader) Identity() (Identity, error) {
	m := l.cur.Load()
	if m.leaf == nil {
		return Identity{}, errors.New("tlsconfig: no certificate loaded")
	}
	return IdentityFromCert(m.leaf)
}

// Server returns a server config: the current certificate, client
// certificates per auth verified against the current CA bundle, and, when
// roles are given, a presented client certificate must carry an identity
// with one of them (a handshake failure otherwise). It fails without a
// certificate, or with auth other than none and no CA bundle.
func (l *Loader) Server(auth ClientAuth, roles ...Role) (*tls.Config, error) {
	m := l.cur.Load()
	if m.cert == nil {
		return nil, errors.New("tlsconfig: a server needs a certificate and key")
	}
	if auth != ClientAuthNone && m.pool == nil {
		return nil, fmt.Errorf("tlsconfig: client auth %s needs a CA file", auth)
	}
	var ca tls.ClientAuthType
	switch auth {
	case ClientAuthNone:
		ca = tls.NoClientCert
	case ClientAuthOptional:
		ca = tls.VerifyClientCertIfGiven
	case ClientAuthRequire:
		ca = tls.RequireAndVerifyClientCert
	default:
		return nil, fmt.Errorf("tlsconfig: unknown client auth %d", auth)
	}
	roles = append([]Role(nil), roles...)
	minVersion := l.opts.MinVersion
	build := func() *tls.Config {
		m := l.material()
		c := &tls.Config{
			Certificates: []tls.Certificate{*m.cert},
			ClientAuth:   ca,
			MinVersion:   minVersion,
		}
		if ca != tls.NoClientCert {
			c.ClientCAs = m.pool
		}
		if len(roles) > 0 {
			c.VerifyConnection = verifyPeer("client", roles, nil)
		}
		return c
	}
	outer := build()
	outer.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) { return build(), nil }
	return outer, nil
}

// Client returns a client config for serverName ("" lets the caller, e.g.
// gRPC, fill it in from the address): the server's certificate is verified
// against the CA bundle (the system roots without one), the current
// certificate is presented when the server asks, and, when roles are
// given, the server's certificate must carry an identity with one of them.
// The CA bundle is the one loaded at the call; use ClientCredentials for
// gRPC connections that must follow a rotated bundle.
func (l *Loader) Client(serverName string, roles ...Role) *tls.Config {
	return l.ClientNamed(serverName, nil, roles...)
}

// ClientNamed is Client with, when names is non-empty, one more check of
// the server's certificate: its identity's Name must be one of names
// (compared exactly; a certificate without a name never matches), or the
// handshake fails with an error naming the certificate's identity. A
// server that presents no certificate fails too. With names empty it is
// Client.
func (l *Loader) ClientNamed(serverName string, names []string, roles ...Role) *tls.Config {
	m := l.material()
	c := &tls.Config{
		ServerName: serverName,
		RootCAs:    m.pool,
		MinVersion: l.opts.MinVersion,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if m := l.material(); m.cert != nil {
				return m.cert, nil
			}
			return &tls.Certificate{}, nil // none: the server decides
		},
	}
	if len(roles) > 0 || len(names) > 0 {
		c.VerifyConnection = verifyPeer("server", append([]Role(nil), roles...), append([]string(nil), names...))
	}
	return c
}

// verifyPeer checks, after chain verification, that the peer's verified
// certificate names one of roles (when given) and carries a Name in names
// (when given). A peer that presented no certificate passes when names is
// empty (the ClientAuth policy decides about that) and fails otherwise.
func verifyPeer(peer string, roles []Role, names []string) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			if len(names) > 0 {
				return fmt.Errorf("tlsconfig: %s presented no certificate, want one named %s", peer, strings.Join(names, ","))
			}
			return nil
		}
		if len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
			return fmt.Errorf("tlsconfig: %s certificate not verified", peer)
		}
		id, err := IdentityFromCert(cs.VerifiedChains[0][0])
		if err != nil {
			return fmt.Errorf("tlsconfig: %s certificate: %w", peer, err)
		}
		if len(roles) > 0 && !id.Is(roles...) {
			return fmt.Errorf("tlsconfig: %s certificate is %s, want role %v", peer, id, roles)
		}
		if len(names) > 0 && (id.Name == "" || !slices.Contains(names, id.Name)) {
			return fmt.Errorf("tlsconfig: %s certificate is %s, not one of the allowed names %s", peer, id, strings.Join(names, ","))
		}
		return nil
	}
}

// PeerIdentity returns the identity of a verified peer certificate in cs
// (the zero Identity and no error when the peer presented none).
func PeerIdentity(cs tls.ConnectionState) (Identity, error) {
	if len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		if len(cs.PeerCertificates) > 0 {
			return Identity{}, errors.New("tlsconfig: peer certificate not verified")
		}
		return Identity{}, nil
	}
	return IdentityFromCert(cs.VerifiedChains[0][0])
}

// ClientCredentials returns gRPC transport credentials that build a fresh
// Client(serverName, roles...) config at each handshake, so rotated files
// (CA bundle included) apply to every new connection.
func (l *Loader) ClientCredentials(serverName string, roles ...Role) credentials.TransportCredentials {
	return l.ClientCredentialsNamed(serverName, nil, roles...)
}

// ClientCredentialsNamed is ClientCredentials with ClientNamed's check:
// when names is non-empty, a server whose certificate's Name is not one of
// them fails the handshake (gRPC reports the error, which names the
// certificate, as the connection's failure: Unavailable).
func (l *Loader) ClientCredentialsNamed(serverName string, names []string, roles ...Role) credentials.TransportCredentials {
	return &clientCreds{l: l, serverName: serverName, names: append([]string(nil), names...), roles: append([]Role(nil), roles...)}
}

type clientCreds struct {
	l          *Loader
	serverName string
	names      []string
	roles      []Role
}

func (c *clientCreds) creds() credentials.TransportCredentials {
	return credentials.NewTLS(c.l.ClientNamed(c.serverName, c.names, c.roles...))
}

func (c *clientCreds) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return c.creds().ClientHandshake(ctx, authority, conn)
}

func (c *clientCreds) ServerHandshake(net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("tlsconfig: client credentials cannot serve")
}

func (c *clientCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls", SecurityVersion: "1.2", ServerName: c.serverName}
}

func (c *clientCreds) Clone() credentials.TransportCredentials {
	cp := *c
	return &cp
}

// OverrideServerName implements a deprecated gRPC method.
func (c *clientCreds) OverrideServerName(name string) error {
	c.serverName = name
	return nil
}
