package raftmux

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/allot/allot/internal/faultnet"
	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
)

// logBuf is a slog handler's output, safe for concurrent use.
type logBuf struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuf) logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }

// expectClosed fails unless the Mux closes c (EOF or reset) within d.
func expectClosed(t *testing.T, c net.Conn, d time.Duration) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 16)
	for {
		_, err := c.Read(buf)
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("connection still open after %v", d)
		}
		return
	}
}

func dialRaw(t *testing.T, m *Mux) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", m.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Connections that cannot be handed to a group are closed with a log line
// and hold no goroutine (goleak, TestMain).
func TestRefusedConnections(t *testing.T) {
	var logs logBuf
	m, err := Listen("127.0.0.1:0", Config{HeaderTimeout: 300 * time.Millisecond, Logger: logs.logger()})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := m.Group(1); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Group(1); err == nil {
		t.Fatal("second Group(1): no error")
	}
	for _, tc := range []struct {
		name string
		send []byte
		log  string
	}{
		{"bad version", []byte{0xA7, 'r', 'g', 9, 0, 0, 0, 1}, "version 9"},
		{"bad magic", []byte{0xA7, 'x', 'g', 1, 0, 0, 0, 1}, "magic"},
		{"unknown group", AppendHeader(nil, 9), "group=9"},
		{"untagged without group 0", []byte{0, 1, 2}, "group=0"},
		{"silent", nil, "i/o timeout"},
		{"short header", []byte{0xA7, 'r'}, "i/o timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dialRaw(t, m)
			if _, err := c.Write(tc.send); err != nil {
				t.Fatal(err)
			}
			expectClosed(t, c, 3*time.Second)
			waitFor(t, 3*time.Second, "a log line with "+tc.log, func() bool {
				return strings.Contains(logs.String(), tc.log)
			})
		})
	}
}

// Beyond MaxPending, a connection is closed at once; Close ends the
// waiting ones without waiting for their timeout.
func TestMaxPendingAndClose(t *testing.T) {
	var logs logBuf
	m, err := Listen("127.0.0.1:0", Config{HeaderTimeout: time.Minute, MaxPending: 2, Logger: logs.logger()})
	if err != nil {
		t.Fatal(err)
	}
	a, b := dialRaw(t, m), dialRaw(t, m)
	waitFor(t, 3*time.Second, "two pending connections", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return len(m.pending) == 2
	})
	expectClosed(t, dialRaw(t, m), 3*time.Second)
	if !strings.Contains(logs.String(), "too many connections") {
		t.Fatalf("log = %q", logs.String())
	}
	done := make(chan struct{})
	go func() { m.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close blocked on pending connections")
	}
	expectClosed(t, a, time.Second)
	expectClosed(t, b, time.Second)
	if err := m.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := m.Group(3); !errors.Is(err, ErrClosed) {
		t.Fatalf("Group after Close: %v", err)
	}
}

// A closed Stream's Accept and Dial return net.ErrClosed, its accepted
// connections are closed, and its id can be registered again.
func TestStreamCloseAndReregister(t *testing.T) {
	m, err := Listen("127.0.0.1:0", Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	s, err := m.Group(4)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan net.Conn, 1)
	go func() {
		c, err := s.Accept()
		if err == nil {
			got <- c
		}
		close(got)
	}()
	peer, err := s.Dial(raft.ServerAddress(m.Addr().String()), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	if _, err := peer.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	c := <-got
	if c == nil {
		t.Fatal("no connection accepted")
	}
	buf := make([]byte, 2)
	if _, err := c.Read(buf); err != nil || string(buf) != "hi" {
		t.Fatalf("read %q, %v; want the bytes after the header", buf, err)
	}
	s.Close()
	s.Close()
	expectClosed(t, peer, 3*time.Second)
	if _, err := s.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Close: %v", err)
	}
	if _, err := s.Dial(raft.ServerAddress(m.Addr().String()), time.Second); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Dial after Close: %v", err)
	}
	if _, err := m.Group(4); err != nil {
		t.Fatalf("register again: %v", err)
	}
}

// tlsLoader writes a certificate for spec, signed by ca, and loads it.
func tlsLoader(t *testing.T, ca *tlstest.CA, name string, spec tlstest.Spec) *tlsconfig.Loader {
	t.Helper()
	l, err := tlsconfig.Load(tlstest.Files(t, t.TempDir(), name, ca, ca.Issue(t, spec)))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// Over mutual TLS, groups elect and replicate; a peer without an
// allocator certificate is refused in the handshake, and the header is
// read only after it.
func TestGroupsOverTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "raftmux")
	var logs logBuf
	c := newCluster(t, 3, []uint32{0, 5}, func(i int) Config {
		return Config{TLS: tlsLoader(t, ca, fmt.Sprint("n", i), tlstest.Role(tlsconfig.RoleAllocator, "")),
			HeaderTimeout: 2 * time.Second, Logger: logs.logger()}
	})
	for _, id := range c.ids {
		c.apply(id, "x")
		c.waitReplicated(id, []string{"x"})
	}

	agent := tlsLoader(t, ca, "agent", tlstest.Role(tlsconfig.RoleAgent, "gw-1"))
	conn, err := tls.Dial("tcp", c.nodes[0].mux.Addr().String(), agent.Client("127.0.0.1"))
	if err == nil {
		// TLS 1.3: the server's refusal arrives on the first read.
		_, _ = conn.Write(AppendHeader(nil, 5))
		_ = conn.SetReadDeadline(time.Now().Add(3 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
	}
	if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("agent certificate: err = %v, want a refused handshake", err)
	}
	waitFor(t, 3*time.Second, "a TLS refusal in the log", func() bool {
		return strings.Contains(logs.String(), "TLS handshake")
	})
	// A plain-TCP peer is refused too.
	raw := dialRaw(t, c.nodes[0].mux)
	_, _ = raw.Write(AppendHeader(nil, 5))
	expectClosed(t, raw, 5*time.Second)

	// Dialers with other certificates are refused; a dialer refuses a
	// listener whose certificate is not an allocator's.
	other := tlstest.NewCA(t, "other")
	target := raft.ServerAddress(c.nodes[0].mux.Addr().String())
	for name, l := range map[string]*tlsconfig.Loader{
		"wrong CA":            tlsLoader(t, other, "stranger", tlstest.Role(tlsconfig.RoleAllocator, "")),
		"gateway certificate": tlsLoader(t, ca, "gw", tlstest.Role(tlsconfig.RoleGateway, "gw-1")),
	} {
		m, err := Listen("127.0.0.1:0", Config{TLS: l})
		if err != nil {
			t.Fatal(err)
		}
		s, err := m.Group(5)
		if err != nil {
			t.Fatal(err)
		}
		if conn, err := s.Dial(target, 2*time.Second); err == nil {
			_, _ = conn.Write([]byte{0})
			expectClosed(t, conn, 5*time.Second)
			conn.Close()
		}
		good, err := c.nodes[1].mux.Group(77)
		if err != nil {
			t.Fatal(err)
		}
		if conn, err := good.Dial(raft.ServerAddress(m.Addr().String()), 2*time.Second); err == nil {
			conn.Close()
			if name == "gateway certificate" {
				t.Errorf("%s: an allocator dialed it", name)
			}
		} else {
			t.Logf("%s: dial refused: %v", name, err)
		}
		good.Close()
		m.Close()
	}
}

// Group 0 speaks the bare Raft protocol: a node on hashicorp/raft's own
// TCP transport and a node on a Mux form one group.
func TestGroupZeroInteroperatesWithBareTransport(t *testing.T) {
	logger := hclog.New(&hclog.LoggerOptions{Output: tWriter{t}, Level: hclog.Warn})
	bare, err := raft.NewTCPTransportWithLogger("127.0.0.1:0", nil, 3, 2*time.Second, logger)
	if err != nil {
		t.Fatal(err)
	}
	c := newCluster(t, 1, nil, func(int) Config { return Config{} })
	bareNode := &node{id: "bare", dir: t.TempDir(), groups: map[uint32]*group{}}
	// Both nodes bootstrap group 0 with the same two voters.
	servers := []raft.Server{
		{Suffrage: raft.Voter, ID: "n0", Address: raft.ServerAddress(c.nodes[0].mux.Addr().String())},
		{Suffrage: raft.Voter, ID: "bare", Address: bare.LocalAddr()},
	}
	c.startWith(c.nodes[0], 0, servers, nil)
	c.startWith(bareNode, 0, servers, bare)
	c.nodes = append(c.nodes, bareNode)
	for i, e := range []string{"a", "b", "c"} {
		c.apply(0, e)
		c.waitReplicated(0, []string{"a", "b", "c"}[:i+1])
	}
	// Fail over to the other node and commit there.
	l := c.leader(0)
	if err := c.nodes[l].groups[0].raft.LeadershipTransfer().Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "leadership moved", func() bool { return c.leader(0) != l })
	c.apply(0, "d")
	c.waitReplicated(0, []string{"a", "b", "c", "d"})
}

// A node whose Raft address is a faultnet proxy in front of its Mux: while
// the proxy is partitioned the node misses the entries of every group it
// follows in, and after Heal it catches up in all of them.
func TestGroupsThroughFaultnet(t *testing.T) {
	var proxy *faultnet.Proxy
	ids := []uint32{1, 2}
	c := newCluster(t, 3, ids, func(i int) Config {
		if i != 2 {
			return Config{}
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		if proxy, err = faultnet.Listen(ln.Addr().String()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { proxy.Close() })
		return Config{Listener: ln, Advertise: proxy.Addr()}
	})
	// Node 2 follows in both groups.
	for _, id := range ids {
		if l := c.leader(id); l == 2 {
			if err := c.nodes[2].groups[id].raft.LeadershipTransfer().Error(); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "leadership moved off node 2", func() bool { return c.leader(id) != 2 })
		}
	}
	proxy.Partition()
	for _, id := range ids {
		// Node 2 dials out directly: were it to lead (an election on a
		// loaded machine can give it the lead again), it would replicate
		// through the partition. So the entry goes in through another
		// leader.
		c.applyNotVia(id, "during", 2)
	}
	for _, id := range ids {
		if got := c.nodes[2].groups[id].fsm.get(); slices.Contains(got, "during") {
			t.Fatalf("group %d: the partitioned node applied %v", id, got)
		}
	}
	proxy.Heal()
	for _, id := range ids {
		c.waitReplicated(id, []string{"during"})
	}
}

// With PeerNames, a Mux talks Raft only with allocator certificates whose
// names are listed: it closes an accepted connection from another (an
// allocator certificate of the same CA with another name, or none) with a
// log line, and refuses to dial one; listed peers connect both ways.
func TestPeerNames(t *testing.T) {
	ca := tlstest.NewCA(t, "raftmux")
	var logs logBuf
	listen := func(name string, peers ...string) (*Mux, *Stream) {
		t.Helper()
		m, err := Listen("127.0.0.1:0", Config{TLS: tlsLoader(t, ca, "c-"+name, tlstest.Role(tlsconfig.RoleAllocator, name)),
			PeerNames: peers, HeaderTimeout: 2 * time.Second, Logger: logs.logger()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		s, err := m.Group(5)
		if err != nil {
			t.Fatal(err)
		}
		return m, s
	}
	a, sa := listen("n1", "n1", "n2")
	_, sb := listen("n2")
	x, sx := listen("eu-1")
	_, sNameless := listen("")
	addr := func(m *Mux) raft.ServerAddress { return raft.ServerAddress(m.Addr().String()) }
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := sa.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()

	// Listed: accepted and dialed.
	conn, err := sb.Dial(addr(a), 2*time.Second)
	if err != nil {
		t.Fatalf("n2 dials n1: %v", err)
	}
	select {
	case c := <-accepted:
		c.Close()
	case <-time.After(3 * time.Second):
		t.Fatal("n1 did not accept n2's connection")
	}
	conn.Close()

	// Unlisted: closed on accept, with a log line.
	for name, s := range map[string]*Stream{"allocator/eu-1": sx, "allocator": sNameless} {
		conn, err := s.Dial(addr(a), 2*time.Second)
		if err != nil {
			t.Fatalf("%s: dial: %v", name, err)
		}
		_, _ = conn.Write([]byte{0})
		expectClosed(t, conn, 5*time.Second)
		conn.Close()
		waitFor(t, 3*time.Second, "the refusal of "+name+" in the log", func() bool {
			return strings.Contains(logs.String(), "peer certificate "+name+" is not one of the peer names")
		})
	}
	select {
	case c := <-accepted:
		c.Close()
		t.Error("n1 accepted an unlisted peer's connection")
	default:
	}

	// Unlisted: refused on dial.
	if conn, err := sa.Dial(addr(x), 2*time.Second); err == nil {
		conn.Close()
		t.Error("n1 dialed allocator/eu-1")
	} else if !strings.Contains(err.Error(), "not one of the peer names") {
		t.Errorf("n1 dials allocator/eu-1: %v, want a peer-name refusal", err)
	}
}

func TestPeerNamesConfig(t *testing.T) {
	ca := tlstest.NewCA(t, "raftmux")
	l := tlsLoader(t, ca, "n1", tlstest.Role(tlsconfig.RoleAllocator, "n1"))
	for name, cfg := range map[string]Config{
		"no TLS":   {PeerNames: []string{"n1"}},
		"bad name": {TLS: l, PeerNames: []string{"n1", "a/b"}},
	} {
		if m, err := Listen("127.0.0.1:0", cfg); err == nil {
			m.Close()
			t.Errorf("%s: Listen succeeded", name)
		}
	}
}
