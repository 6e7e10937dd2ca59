package allocator

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
)

// serveTLS accepts TLS connections requiring a client certificate of ca
// and, like a gRPC server, writes first after the handshake; it runs until
// the test ends.
func serveTLS(t *testing.T, ca *tlstest.CA) string {
	t.Helper()
	srv := ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{srv.TLS},
		ClientCAs:    tlstest.Pool(ca),
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS13,
	})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if c.(*tls.Conn).Handshake() == nil {
					_, _ = c.Write([]byte{0})
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// A server that refuses the client's certificate after a TLS 1.3
// handshake is found out by probeRefusal, and the call's bare error is
// named as that refusal; a certificate the server accepts, a server that
// does not answer and errors that cannot be a refusal are left alone.
func TestProbeRefusal(t *testing.T) {
	ca, rogue := tlstest.NewCA(t, "cluster CA"), tlstest.NewCA(t, "another CA")
	addr := serveTLS(t, ca)
	client := func(by *tlstest.CA) *tls.Config {
		leaf := by.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))
		return &tls.Config{RootCAs: tlstest.Pool(ca), Certificates: []tls.Certificate{leaf.TLS}, MinVersion: tls.VersionTLS13}
	}
	ctx := context.Background()
	alert := probeRefusal(ctx, client(rogue), addr)
	if alert == nil || !strings.Contains(alert.Error(), "remote error: tls:") {
		t.Fatalf("probeRefusal with a certificate of another CA = %v, want the server's alert", alert)
	}
	if err := probeRefusal(ctx, client(ca), addr); err != nil {
		t.Errorf("probeRefusal with an accepted certificate = %v, want nil", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	if err := probeRefusal(ctx, client(rogue), closed); err != nil {
		t.Errorf("probeRefusal of a closed port = %v, want nil", err)
	}

	broken := status.Error(codes.Unavailable, "write tcp 127.0.0.1:1->127.0.0.1:2: write: broken pipe")
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{broken, true},
		{status.Error(codes.Unavailable, "connection error: desc = \"transport: Error while dialing: dial tcp: connection refused\""), false},
		{status.Error(codes.Unavailable, "connection error: desc = \"transport: authentication handshake failed: x509: certificate signed by unknown authority\""), false},
		{status.Error(codes.DeadlineExceeded, "context deadline exceeded"), false},
		{errors.New("not a status"), false},
	} {
		if got := maybeRefused(tc.err); got != tc.want {
			t.Errorf("maybeRefused(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	named := refusedError(alert, broken)
	if !errors.Is(named, broken) || !strings.Contains(named.Error(), "client certificate was refused") {
		t.Errorf("refusedError = %v, want the refusal wrapping the call's error", named)
	}
}
