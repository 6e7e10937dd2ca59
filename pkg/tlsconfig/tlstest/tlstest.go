// Package tlstest makes throw-away CAs and certificates for tests, in
// memory (ECDSA P-256), and writes them as PEM files for tlsconfig.Load.
// It mirrors deploy/certs/gen-dev-certs.sh: roles appear both as a
// spiffe://allot/<role>[/<name>] URI SAN and as the subject's OU.
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/allot/allot/pkg/tlsconfig"
)

// CA is a test certificate authority.
type CA struct {
	Cert *x509.Certificate
	key  *ecdsa.PrivateKey
	PEM  []byte
}

// NewCA makes a CA valid from an hour ago for a day.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{Organization: []string{"allot"}, CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &CA{Cert: cert, key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

// Spec describes a certificate to issue.
type Spec struct {
	// URI is the URI SAN ("" for none), e.g. "spiffe://allot/agent/gw-1".
	URI string
	// OU and CN are the subject's.
	OU, CN string
	// Server adds serverAuth and the SANs localhost, 127.0.0.1 and ::1.
	Server bool
	// IPs are more IP SANs (with Server), e.g. another loopback address.
	IPs []net.IP
	// Client adds clientAuth.
	Client bool
	// NotAfter overrides the expiry (default: a day from now).
	NotAfter time.Time
}

// Role returns the Spec gen-dev-certs.sh would issue for role and name
// (name "" for admin and allocator): URI SAN, OU and CN; allocators are
// server and client, gateways server, agents and admins client.
func Role(role tlsconfig.Role, name string) Spec {
	id := tlsconfig.Identity{Role: role, Name: name}
	cn := name
	if cn == "" {
		cn = string(role)
	}
	s := Spec{URI: "spiffe://allot/" + id.String(), OU: string(role), CN: cn}
	switch role {
	case tlsconfig.RoleAllocator:
		s.Server, s.Client = true, true
	case tlsconfig.RoleGateway:
		s.Server = true
	default:
		s.Client = true
	}
	return s
}

// Leaf is an issued certificate and its key.
type Leaf struct {
	Cert    *x509.Certificate
	TLS     tls.Certificate
	CertPEM []byte
	KeyPEM  []byte
}

// Issue signs a certificate for s.
func (ca *CA) Issue(t testing.TB, s Spec) *Leaf {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{Organization: []string{"allot"}, CommonName: s.CN},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageDigitalSignature,
	}
	if s.OU != "" {
		tmpl.Subject.OrganizationalUnit = []string{s.OU}
	}
	if !s.NotAfter.IsZero() {
		tmpl.NotAfter = s.NotAfter
	}
	if s.URI != "" {
		u, err := url.Parse(s.URI)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = []*url.URL{u}
	}
	if s.Server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		tmpl.DNSNames = []string{"localhost"}
		tmpl.IPAddresses = append([]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, s.IPs...)
	}
	if s.Client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	l := &Leaf{
		Cert:    cert,
		CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		KeyPEM:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}
	if l.TLS, err = tls.X509KeyPair(l.CertPEM, l.KeyPEM); err != nil {
		t.Fatal(err)
	}
	return l
}

// Files writes the CA bundle and (when leaf is non-nil) the leaf's
// certificate and key into dir under name and returns the Options naming
// them.
func Files(t testing.TB, dir, name string, ca *CA, leaf *Leaf) tlsconfig.Options {
	t.Helper()
	o := tlsconfig.Options{}
	if ca != nil {
		o.CAFile = filepath.Join(dir, name+"-ca.crt")
		write(t, o.CAFile, ca.PEM)
	}
	if leaf != nil {
		o.CertFile = filepath.Join(dir, name+".crt")
		o.KeyFile = filepath.Join(dir, name+".key")
		write(t, o.CertFile, leaf.CertPEM)
		write(t, o.KeyFile, leaf.KeyPEM)
	}
	return o
}

// Pool returns a pool holding the CAs.
func Pool(cas ...*CA) *x509.CertPool {
	p := x509.NewCertPool()
	for _, ca := range cas {
		p.AddCert(ca.Cert)
	}
	return p
}

func write(t testing.TB, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func serial(t testing.TB) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		t.Fatal(err)
	}
	return n
}
