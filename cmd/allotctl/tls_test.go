package main

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
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/credentials"
)

// testPKI is a throwaway CA with a server and a client certificate, written
// as PEM files.
type testPKI struct {
	caFile, certFile, keyFile string // client cert and key
	server                    tls.Certificate
	pool                      *x509.CertPool
}

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	dir := t.TempDir()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "allot test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	issue := func(serial int64, cn string, usage x509.ExtKeyUsage, ips []net.IP, dns []string) ([]byte, []byte) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature,
			IPAddresses: ips, DNSNames: dns,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kder, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
			pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})
	}
	srvCert, srvKey := issue(2, "allocator", x509.ExtKeyUsageServerAuth, []net.IP{net.ParseIP("127.0.0.1")}, []string{"allocator.test"})
	cliCert, cliKey := issue(3, "operator", x509.ExtKeyUsageClientAuth, nil, nil)
	p := &testPKI{
		caFile:   filepath.Join(dir, "ca.pem"),
		certFile: filepath.Join(dir, "client.pem"),
		keyFile:  filepath.Join(dir, "client-key.pem"),
		pool:     x509.NewCertPool(),
	}
	p.pool.AddCert(caCert)
	for path, data := range map[string][]byte{
		p.caFile:   pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		p.certFile: cliCert, p.keyFile: cliKey,
	} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if p.server, err = tls.X509KeyPair(srvCert, srvKey); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestTLS(t *testing.T) {
	pki := newTestPKI(t)
	tlsAddr := startFake(t, newFakeAdmin(), credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{pki.server}, MinVersion: tls.VersionTLS12}))
	mtlsAddr := startFake(t, newFakeAdmin(), credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{pki.server}, MinVersion: tls.VersionTLS12,
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pki.pool}))

	cases := []struct {
		name      string
		args      []string
		code      int
		stderrHas string
	}{
		{"tls with CA", []string{"--addr", tlsAddr, "--tls-ca", pki.caFile}, 0, ""},
		{"tls with server name", []string{"--addr", tlsAddr, "--tls-ca", pki.caFile, "--tls-server-name", "allocator.test"}, 0, ""},
		{"wrong server name", []string{"--addr", tlsAddr, "--tls-ca", pki.caFile, "--tls-server-name", "other.test"}, 1,
			"cannot reach allocator at " + tlsAddr + ": authentication handshake failed"},
		{"untrusted server", []string{"--addr", tlsAddr, "--tls-server-name", "allocator.test"}, 1,
			"certificate signed by unknown authority"},
		{"plaintext to a TLS server", []string{"--addr", tlsAddr, "--timeout", "2s"}, 1, "allotctl: "},
		{"mtls with client cert", []string{"--addr", mtlsAddr, "--tls-ca", pki.caFile, "--tls-cert", pki.certFile, "--tls-key", pki.keyFile}, 0, ""},
		{"mtls without client cert", []string{"--addr", mtlsAddr, "--tls-ca", pki.caFile}, 1, "allotctl: "},
		{"bad CA file", []string{"--addr", tlsAddr, "--tls-ca", pki.keyFile}, 1, "no PEM certificates found"},
		{"bad key pair", []string{"--addr", tlsAddr, "--tls-cert", pki.caFile, "--tls-key", pki.keyFile}, 1, "load --tls-cert/--tls-key"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := runCLI(t, append(tc.args, "status")...)
			if r.code != tc.code {
				t.Fatalf("exit %d, want %d (stderr %q)", r.code, tc.code, r.stderr)
			}
			if tc.code == 0 && !strings.Contains(r.stdout, "alloc-1") {
				t.Errorf("stdout lacks the status:\n%s", r.stdout)
			}
			if !strings.Contains(r.stderr, tc.stderrHas) {
				t.Errorf("stderr %q does not contain %q", r.stderr, tc.stderrHas)
			}
			if tc.code != 0 && strings.Count(r.stderr, "\n") != 1 {
				t.Errorf("want one short error line, got %q", r.stderr)
			}
		})
	}
}
