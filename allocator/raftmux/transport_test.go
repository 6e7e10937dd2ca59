package raftmux

import (
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"go.uber.org/goleak"

	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
)

func appendOnce(src *raft.NetworkTransport, dst raft.ServerAddress) error {
	var resp raft.AppendEntriesResponse
	return src.AppendEntries("peer", dst, &raft.AppendEntriesRequest{RPCHeader: raft.RPCHeader{Addr: []byte("x")}, Term: 1}, &resp)
}

// closeTransport closes tr as a node does: its pooled outgoing
// connections, then its stream.
func closeTransport(tr *raft.NetworkTransport) {
	tr.CloseStreams()
	tr.Close()
}

// Between raft.NetworkTransports, in the untagged group 0 (a single-group
// node's) and in a tagged group, only allocator-role certificates from
// the cluster's CA replicate, in both directions; a peer without a
// certificate, with one from another CA, with another role or in
// plaintext gets no RPC through, and a dialer refuses a listener whose
// certificate is not an allocator's.
func TestTLSTransportRefusesOtherPeers(t *testing.T) {
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
	gatewayClient := tlstest.Role(tlsconfig.RoleGateway, "")
	gatewayClient.Client = true
	good := load(tlstest.Files(t, dir, "alloc", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))))
	good2 := load(tlstest.Files(t, dir, "alloc2", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, "n2"))))
	agent := load(tlstest.Files(t, dir, "agent", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1"))))
	gateway := load(tlstest.Files(t, dir, "gateway", ca, ca.Issue(t, gatewayClient)))
	stranger := load(tlstest.Files(t, dir, "stranger", ca, other.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))))
	caOnly := load(tlstest.Files(t, dir, "caonly", ca, nil))

	for _, id := range []uint32{0, 3} {
		t.Run(fmt.Sprint("group ", id), func(t *testing.T) {
			server := muxTransport(t, id, Config{TLS: good})
			stop := make(chan struct{})
			done := serveRPCs(server, stop)
			var closers []*raft.NetworkTransport
			defer func() {
				for _, c := range closers {
					closeTransport(c)
				}
				close(stop)
				<-done
				closeTransport(server)
			}()
			client := func(l *tlsconfig.Loader) *raft.NetworkTransport {
				tr := muxTransport(t, id, Config{TLS: l})
				closers = append(closers, tr)
				return tr
			}

			if err := appendOnce(client(good2), server.LocalAddr()); err != nil {
				t.Fatalf("allocator to allocator over TLS: %v", err)
			}

			// A dialer with no certificate to present (Listen refuses
			// such a loader, so its client side is set by hand).
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			m, err := New(Config{Listener: ln})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Close() })
			m.client = func(host string) *tls.Config { return caOnly.Client(host, tlsconfig.RoleAllocator) }
			noCert := groupTransport(t, m, id)
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

			// The dialing side refuses a server whose certificate is not
			// an allocator's (a gateway's here).
			gw := client(gateway)
			stop2 := make(chan struct{})
			done2 := serveRPCs(gw, stop2)
			err = appendOnce(client(good2), gw.LocalAddr())
			close(stop2)
			<-done2
			if err == nil || !strings.Contains(err.Error(), "want role") {
				t.Errorf("allocator dialing a gateway's certificate: err = %v, want a role error", err)
			}
		})
	}
}

// Closing a transport ends its handlers for the connections it accepted
// while the peer keeps its pooled connection open: a node's stopping
// leaves no goroutine behind, with the Mux still open.
func TestTransportCloseEndsAcceptedConns(t *testing.T) {
	for _, id := range []uint32{0, 3} {
		t.Run(fmt.Sprint("group ", id), func(t *testing.T) {
			before := goleak.IgnoreCurrent()
			a, b := muxTransport(t, id, Config{}), muxTransport(t, id, Config{})
			stop := make(chan struct{})
			done := serveRPCs(a, stop)
			if err := appendOnce(b, a.LocalAddr()); err != nil {
				t.Fatal(err)
			}
			close(stop)
			<-done
			closeTransport(a)
			// b keeps its pooled connection open and its listener
			// running; both Muxes accept until the test ends.
			goleak.VerifyNone(t, before,
				goleak.IgnoreAnyFunction("github.com/allot/allot/allocator/raftmux.(*Mux).acceptLoop"),
				goleak.IgnoreAnyFunction("github.com/hashicorp/raft.(*NetworkTransport).listen"))
			closeTransport(b)
		})
	}
}
