package allocator

import (
	"crypto/tls"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
)

// rpcServer answers every RPC arriving on trans's consumer channel with
// an empty AppendEntriesResponse until stop is closed.
func rpcServer(trans raft.Transport, stop <-chan struct{}) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case rpc := <-trans.Consumer():
				rpc.Respond(&raft.AppendEntriesResponse{Success: true}, nil)
			case <-stop:
				return
			}
		}
	}()
	return done
}

func testTransport(t *testing.T, l *tlsconfig.Loader) *raft.NetworkTransport {
	t.Helper()
	sl, err := newStreamLayer("127.0.0.1:0", "", l)
	if err != nil {
		t.Fatal(err)
	}
	return newTCPTransport(sl, hclog.NewNullLogger())
}

func appendOnce(src *raft.NetworkTransport, dst raft.ServerAddress) error {
	var resp raft.AppendEntriesResponse
	return src.AppendEntries("peer", dst, &raft.AppendEntriesRequest{RPCHeader: raft.RPCHeader{Addr: []byte("x")}, Term: 1}, &resp)
}

// TestRaftTLSStreamLayer: over the TLS stream layer only allocator-role
// certificates from the cluster's CA can replicate, in both directions; a
// peer without a certificate, with one from another CA, with another role
// or in plaintext gets no RPC through.
func TestRaftTLSStreamLayer(t *testing.T) {
	dir := t.TempDir()
	ca, other := tlstest.NewCA(t, "cluster CA"), tlstest.NewCA(t, "other CA")
	load := func(o tlsconfig.Options) *tlsconfig.Loader {
		t.Helper()
		l, err := tlsconfig.Load(o)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	good := load(tlstest.Files(t, dir, "alloc", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))))
	good2 := load(tlstest.Files(t, dir, "alloc2", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, "n2"))))
	agent := load(tlstest.Files(t, dir, "agent", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1"))))
	gateway := load(tlstest.Files(t, dir, "gateway", ca, ca.Issue(t, gatewayClient)))
	stranger := load(tlstest.Files(t, dir, "stranger", ca, other.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))))

	server := testTransport(t, good)
	stop := make(chan struct{})
	done := rpcServer(server, stop)
	var closers []*raft.NetworkTransport
	defer func() {
		for _, c := range closers {
			c.CloseStreams()
			c.Close()
		}
		close(stop)
		<-done
		server.CloseStreams()
		server.Close()
	}()
	client := func(l *tlsconfig.Loader) *raft.NetworkTransport {
		tr := testTransport(t, l)
		closers = append(closers, tr)
		return tr
	}

	if err := appendOnce(client(good2), server.LocalAddr()); err != nil {
		t.Fatalf("allocator to allocator over TLS: %v", err)
	}

	// A dialer with no certificate to present.
	caOnly := load(tlstest.Files(t, dir, "caonly", ca, nil))
	noCert := layerTransport(t, &streamLayer{client: func(host string) *tls.Config {
		return caOnly.Client(host, tlsconfig.RoleAllocator)
	}})
	closers = append(closers, noCert)
	for name, tr := range map[string]*raft.NetworkTransport{
		"no client certificate": noCert,
		"agent certificate":     client(agent),
		"gateway certificate":   client(gateway),
		"certificate, wrong CA": client(stranger),
		"plaintext":             client(nil),
	} {
		err := appendOnce(tr, server.LocalAddr())
		if err == nil {
			t.Errorf("%s: AppendEntries got through the TLS layer", name)
		}
		t.Logf("%s: %v", name, err)
	}

	// The dialing side refuses a server whose certificate is not an
	// allocator's (a gateway's here).
	gw := client(gateway)
	stop2 := make(chan struct{})
	done2 := rpcServer(gw, stop2)
	err := appendOnce(client(good2), gw.LocalAddr())
	close(stop2)
	<-done2
	if err == nil || !strings.Contains(err.Error(), "want role") {
		t.Errorf("allocator dialing a gateway's certificate: err = %v, want a role error", err)
	}
}

// layerTransport binds sl to a loopback port and wraps it in a transport.
func layerTransport(t *testing.T, sl *streamLayer) *raft.NetworkTransport {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	sl.ln, sl.conns = ln, make(map[net.Conn]struct{})
	return raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: sl, MaxPool: 1, Timeout: 5 * time.Second, Logger: hclog.NewNullLogger(),
	})
}

// TestStreamLayerCloseEndsAcceptedConns: Close ends the connections it
// accepted, so the transport's handlers for a peer's pooled connection end
// with the node (the goroutine leak fixed with CloseStreams in node.close).
func TestStreamLayerCloseEndsAcceptedConns(t *testing.T) {
	a, b := testTransport(t, nil), testTransport(t, nil)
	stop := make(chan struct{})
	done := rpcServer(a, stop)
	if err := appendOnce(b, a.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	close(stop)
	<-done
	// b keeps its pooled connection open; closing a must still end a's
	// handler (goleak in TestMain checks).
	a.CloseStreams()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	b.CloseStreams()
	b.Close()
}
