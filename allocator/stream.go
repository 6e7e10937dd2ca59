package allocator

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/raft"

	"github.com/allot/allot/pkg/tlsconfig"
)

// raftHandshakeTimeout bounds a Raft connection's TLS handshake, so a peer
// that connects and stays silent holds no goroutine for long.
const raftHandshakeTimeout = 10 * time.Second

// streamLayer is the raft.StreamLayer over a pre-bound TCP listener,
// optionally with mutual TLS. It tracks the connections it accepted and
// closes them in Close, so that the transport's connection handlers end
// with the node even when a peer keeps its pooled connection open.
//
// With TLS, both directions present this node's certificate and require
// the other end's to verify against the CA bundle and carry the allocator
// role (tlsconfig.RoleAllocator); a peer without one fails the handshake
// and can neither join nor replicate.
type streamLayer struct {
	ln net.Listener
	// advertise, when set, is what Addr reports instead of the bound
	// address: the transport's LocalAddr, which Raft puts in the
	// configuration and in every RPC it sends as this node's address.
	advertise net.Addr
	// server and client are nil for plain TCP. client builds a config for
	// a peer's host (its certificate must name it).
	server *tls.Config
	client func(host string) *tls.Config

	mu     sync.Mutex // guards conns and closed
	conns  map[net.Conn]struct{}
	closed bool
}

var _ raft.StreamLayer = (*streamLayer)(nil)

// newStreamLayer binds addr and reports advertise ("" for the bound
// address) as its Addr; with a non-nil loader the layer speaks mutual TLS
// between allocator-role certificates.
func newStreamLayer(addr, advertise string, l *tlsconfig.Loader) (*streamLayer, error) {
	s := &streamLayer{conns: make(map[net.Conn]struct{})}
	if advertise != "" {
		s.advertise = advertisedAddr(advertise)
	}
	if l != nil {
		srv, err := l.Server(tlsconfig.ClientAuthRequire, tlsconfig.RoleAllocator)
		if err != nil {
			return nil, fmt.Errorf("allocator: raft TLS: %w", err)
		}
		s.server = srv
		s.client = func(host string) *tls.Config { return l.Client(host, tlsconfig.RoleAllocator) }
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("allocator: listen raft %s: %w", addr, err)
	}
	s.ln = ln
	return s, nil
}

// Accept returns the next connection. A TLS connection's handshake runs
// on its first read or write, in the transport's per-connection goroutine
// (never in the accept loop), bounded by raftHandshakeTimeout.
func (s *streamLayer) Accept() (net.Conn, error) {
	c, err := s.ln.Accept()
	if err != nil {
		return nil, err
	}
	var conn net.Conn = c
	if s.server != nil {
		conn = &serverTLSConn{Conn: tls.Server(c, s.server)}
	}
	tc := &trackedConn{Conn: conn, s: s}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return nil, net.ErrClosed
	}
	s.conns[tc] = struct{}{}
	return tc, nil
}

// Close stops accepting and closes every accepted connection. Safe twice.
func (s *streamLayer) Close() error {
	s.mu.Lock()
	s.closed = true
	conns := s.conns
	s.conns = make(map[net.Conn]struct{})
	s.mu.Unlock()
	err := s.ln.Close()
	for c := range conns {
		c.(*trackedConn).Conn.Close()
	}
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// Addr is the advertised address (the bound one unless advertise was
// given); boundAddr is the listener's.
func (s *streamLayer) Addr() net.Addr {
	if s.advertise != nil {
		return s.advertise
	}
	return s.ln.Addr()
}

func (s *streamLayer) boundAddr() net.Addr { return s.ln.Addr() }

// advertisedAddr is a host:port as given (the host may be a DNS name,
// resolved by each peer when it dials).
type advertisedAddr string

func (a advertisedAddr) Network() string { return "tcp" }
func (a advertisedAddr) String() string  { return string(a) }

// Dial connects to a peer; with TLS the handshake completes within
// timeout before the connection is returned.
func (s *streamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout}
	c, err := d.Dial("tcp", string(address))
	if err != nil || s.client == nil {
		return c, err
	}
	host, _, err := net.SplitHostPort(string(address))
	if err != nil {
		c.Close()
		return nil, err
	}
	tc := tls.Client(c, s.client(host))
	if timeout <= 0 {
		timeout = raftHandshakeTimeout
	}
	_ = tc.SetDeadline(time.Now().Add(timeout))
	if err := tc.Handshake(); err != nil {
		c.Close()
		return nil, fmt.Errorf("allocator: raft TLS handshake with %s: %w", address, err)
	}
	_ = tc.SetDeadline(time.Time{})
	return tc, nil
}

// trackedConn removes itself from its layer when closed.
type trackedConn struct {
	net.Conn
	s    *streamLayer
	once sync.Once
}

// Read reports a connection closed by the layer's Close as io.EOF, the
// end the transport expects (it logs any other error).
func (c *trackedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if err != nil && errors.Is(err, net.ErrClosed) {
		c.s.mu.Lock()
		closed := c.s.closed
		c.s.mu.Unlock()
		if closed {
			err = io.EOF
		}
	}
	return n, err
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.s.mu.Lock()
		delete(c.s.conns, c)
		c.s.mu.Unlock()
	})
	return c.Conn.Close()
}

// serverTLSConn runs the server handshake, with a deadline, before the
// first read or write.
type serverTLSConn struct {
	*tls.Conn
	once sync.Once
	err  error
}

func (c *serverTLSConn) handshake() error {
	c.once.Do(func() {
		_ = c.Conn.SetDeadline(time.Now().Add(raftHandshakeTimeout))
		if c.err = c.Conn.Handshake(); c.err != nil {
			c.err = fmt.Errorf("allocator: raft TLS handshake from %s: %w", c.Conn.RemoteAddr(), c.err)
			return
		}
		_ = c.Conn.SetDeadline(time.Time{})
	})
	return c.err
}

func (c *serverTLSConn) Read(b []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Read(b)
}

func (c *serverTLSConn) Write(b []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}
