package raftmux

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/raft"

	"github.com/allot/allot/pkg/tlsconfig"
)

// Defaults of Config.
const (
	DefaultHeaderTimeout = 10 * time.Second
	DefaultMaxPending    = 256
)

// Config configures a Mux. Listener is required; the rest is optional.
type Config struct {
	// Listener is the bound TCP listener. The Mux owns it from New on and
	// closes it in Close.
	Listener net.Listener
	// Advertise, when non-empty, is the host:port Addr reports (what Raft
	// puts in its configuration and peers dial) instead of the
	// listener's address. The host may be a DNS name.
	Advertise string
	// TLS, when non-nil, makes every connection, accepted and dialed,
	// mutual TLS between allocator-role certificates.
	TLS *tlsconfig.Loader
	// PeerNames, when non-empty (it needs TLS), are the allocator
	// certificate names (tlsconfig.Identity.Name) this Mux talks Raft
	// with: a connection, accepted or dialed, whose peer certificate names
	// another, or none, is closed after the handshake. Empty: any
	// allocator-role certificate.
	PeerNames []string
	// HeaderTimeout bounds an accepted connection's TLS handshake and
	// header, and its hand-off to its group; and a dialed connection's
	// TLS handshake and header write when Dial is given no timeout.
	// Default DefaultHeaderTimeout.
	HeaderTimeout time.Duration
	// MaxPending bounds the accepted connections still waiting for their
	// header; one more is closed at once. Default DefaultMaxPending.
	MaxPending int
	// Logger gets a line for every refused connection. Default: discard.
	Logger *slog.Logger
}

// Mux is one listening address shared by many Raft groups. Group registers
// a group and returns its raft.StreamLayer. See the package doc for the
// protocol.
type Mux struct {
	ln      net.Listener
	addr    net.Addr
	timeout time.Duration
	max     int
	log     *slog.Logger
	// server and client are nil for plain TCP; client builds a config for
	// a peer's host (its certificate must name it).
	server *tls.Config
	client func(host string) *tls.Config
	// peers are Config.PeerNames (nil: any allocator certificate).
	peers map[string]bool

	mu      sync.Mutex // guards groups, pending and closed
	groups  map[uint32]*Stream
	pending map[net.Conn]struct{}
	closed  bool

	done chan struct{} // closed by Close
	wg   sync.WaitGroup
}

// Listen binds addr and returns a Mux on it (cfg.Listener is ignored).
func Listen(addr string, cfg Config) (*Mux, error) {
	if cfg.TLS != nil {
		// Check the TLS material before binding.
		if _, err := cfg.TLS.Server(tlsconfig.ClientAuthRequire, tlsconfig.RoleAllocator); err != nil {
			return nil, fmt.Errorf("raftmux: TLS: %w", err)
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("raftmux: listen %s: %w", addr, err)
	}
	cfg.Listener = ln
	m, err := New(cfg)
	if err != nil {
		ln.Close()
		return nil, err
	}
	return m, nil
}

// New starts a Mux accepting on cfg.Listener.
func New(cfg Config) (*Mux, error) {
	if cfg.Listener == nil {
		return nil, errors.New("raftmux: Config.Listener is required")
	}
	m := &Mux{
		ln:      cfg.Listener,
		addr:    cfg.Listener.Addr(),
		timeout: cfg.HeaderTimeout,
		max:     cfg.MaxPending,
		log:     cfg.Logger,
		groups:  make(map[uint32]*Stream),
		pending: make(map[net.Conn]struct{}),
		done:    make(chan struct{}),
	}
	if cfg.Advertise != "" {
		if _, _, err := net.SplitHostPort(cfg.Advertise); err != nil {
			return nil, fmt.Errorf("raftmux: advertise address %q: %w", cfg.Advertise, err)
		}
		m.addr = advertisedAddr(cfg.Advertise)
	}
	if m.timeout <= 0 {
		m.timeout = DefaultHeaderTimeout
	}
	if m.max <= 0 {
		m.max = DefaultMaxPending
	}
	if m.log == nil {
		m.log = slog.New(slog.DiscardHandler)
	}
	if l := cfg.TLS; l != nil {
		srv, err := l.Server(tlsconfig.ClientAuthRequire, tlsconfig.RoleAllocator)
		if err != nil {
			return nil, fmt.Errorf("raftmux: TLS: %w", err)
		}
		m.server = srv
		m.client = func(host string) *tls.Config { return l.Client(host, tlsconfig.RoleAllocator) }
	}
	if len(cfg.PeerNames) > 0 {
		if cfg.TLS == nil {
			return nil, errors.New("raftmux: PeerNames needs TLS")
		}
		m.peers = make(map[string]bool, len(cfg.PeerNames))
		for _, n := range cfg.PeerNames {
			if _, err := tlsconfig.ParseIdentity(string(tlsconfig.RoleAllocator) + "/" + n); err != nil {
				return nil, fmt.Errorf("raftmux: peer name: %w", err)
			}
			m.peers[n] = true
		}
	}
	m.wg.Add(1)
	go m.acceptLoop()
	return m, nil
}

// Addr is the advertised address (the listener's unless
// Config.Advertise was given): every group's Stream reports it.
func (m *Mux) Addr() net.Addr { return m.addr }

// BoundAddr is the listener's address.
func (m *Mux) BoundAddr() net.Addr { return m.ln.Addr() }

// ErrClosed is returned by Group after Close.
var ErrClosed = errors.New("raftmux: closed")

// Group registers group id and returns its stream layer, for a
// raft.NetworkTransport. Connections for id that arrive before it is
// registered are refused. After the Stream's Close, id can be registered
// again.
func (m *Mux) Group(id uint32) (*Stream, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, ErrClosed
	}
	if _, dup := m.groups[id]; dup {
		return nil, fmt.Errorf("raftmux: group %d is already registered", id)
	}
	s := &Stream{
		m:      m,
		id:     id,
		accept: make(chan net.Conn),
		done:   make(chan struct{}),
		conns:  make(map[*trackedConn]struct{}),
	}
	m.groups[id] = s
	return s, nil
}

// Close stops accepting, closes every group's Stream and every connection
// still waiting for its header, and waits for the Mux's goroutines. Safe
// to call twice.
func (m *Mux) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		m.wg.Wait()
		return nil
	}
	m.closed = true
	groups := make([]*Stream, 0, len(m.groups))
	for _, s := range m.groups {
		groups = append(groups, s)
	}
	pending := m.pending
	m.pending = make(map[net.Conn]struct{})
	m.mu.Unlock()

	close(m.done)
	err := m.ln.Close()
	for c := range pending {
		c.Close()
	}
	for _, s := range groups {
		s.Close()
	}
	m.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

func (m *Mux) acceptLoop() {
	defer m.wg.Done()
	var backoff time.Duration
	for {
		c, err := m.ln.Accept()
		if err == nil {
			c = quiet(c)
		}
		if err != nil {
			select {
			case <-m.done:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient error (out of file descriptors): retry, backing
			// off as net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			m.log.Warn("raftmux: accept failed", "err", err, "retry_in", backoff)
			t := time.NewTimer(backoff)
			select {
			case <-m.done:
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		backoff = 0
		m.mu.Lock()
		switch {
		case m.closed:
			m.mu.Unlock()
			c.Close()
			return
		case len(m.pending) >= m.max:
			m.mu.Unlock()
			m.log.Warn("raftmux: connection refused: too many connections waiting for their header",
				"remote", c.RemoteAddr().String(), "max_pending", m.max)
			c.Close()
			continue
		}
		m.pending[c] = struct{}{}
		m.wg.Add(1)
		m.mu.Unlock()
		go m.serve(c)
	}
}

// serve reads c's header and hands it to its group.
func (m *Mux) serve(c net.Conn) {
	defer m.wg.Done()
	conn, id, err := m.readHeader(c)
	m.mu.Lock()
	_, mine := m.pending[c] // false once Close took it
	delete(m.pending, c)
	s := m.groups[id]
	m.mu.Unlock()
	switch {
	case !mine:
		c.Close()
		return
	case err != nil:
		m.log.Warn("raftmux: connection refused", "remote", c.RemoteAddr().String(), "err", err)
		c.Close()
		return
	case s == nil:
		m.log.Warn("raftmux: connection refused: no such group on this node",
			"remote", c.RemoteAddr().String(), "group", id)
		c.Close()
		return
	}
	t := time.NewTimer(m.timeout)
	defer t.Stop()
	select {
	case s.accept <- conn:
		return
	case <-s.done:
	case <-m.done:
	case <-t.C:
		m.log.Warn("raftmux: connection refused: its group did not accept it in time",
			"remote", c.RemoteAddr().String(), "group", id, "timeout", m.timeout)
	}
	c.Close()
}

// readHeader runs the TLS handshake, when the Mux speaks TLS, and reads
// the header, all within the header timeout. It returns the connection to
// hand on: the TLS one, and for an untagged connection one that replays
// its first byte.
func (m *Mux) readHeader(c net.Conn) (net.Conn, uint32, error) {
	if err := c.SetDeadline(time.Now().Add(m.timeout)); err != nil {
		return nil, 0, err
	}
	conn := c
	if m.server != nil {
		tc := tls.Server(c, m.server)
		if err := tc.Handshake(); err != nil {
			return nil, 0, fmt.Errorf("raftmux: TLS handshake: %w", err)
		}
		if err := m.checkPeer(tc.ConnectionState()); err != nil {
			return nil, 0, err
		}
		conn = tc
	}
	var h [HeaderLen]byte
	if _, err := io.ReadFull(conn, h[:1]); err != nil {
		return nil, 0, fmt.Errorf("raftmux: read header: %w", err)
	}
	var id uint32
	if Tagged(h[0]) {
		if _, err := io.ReadFull(conn, h[1:]); err != nil {
			return nil, 0, fmt.Errorf("raftmux: read header: %w", err)
		}
		var err error
		if id, err = ParseHeader(h[:]); err != nil {
			return nil, 0, err
		}
	} else {
		conn = &replayConn{Conn: conn, first: h[0]}
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		return nil, 0, err
	}
	return conn, id, nil
}

// checkPeer checks, after the TLS handshake, that the peer's certificate
// names one of Config.PeerNames (when set).
func (m *Mux) checkPeer(cs tls.ConnectionState) error {
	if m.peers == nil {
		return nil
	}
	id, err := tlsconfig.PeerIdentity(cs)
	if err != nil {
		return fmt.Errorf("raftmux: peer certificate: %w", err)
	}
	if !id.Is(tlsconfig.RoleAllocator) || !m.peers[id.Name] {
		return fmt.Errorf("raftmux: peer certificate %s is not one of the peer names", id)
	}
	return nil
}

// Stream is one group's raft.StreamLayer on a Mux: Accept returns the
// connections that named the group, Dial connects to a peer's Mux and
// names it. Addr is the Mux's.
type Stream struct {
	m      *Mux
	id     uint32
	accept chan net.Conn // unbuffered: a sent connection is Accept's
	done   chan struct{} // closed by Close

	mu     sync.Mutex // guards conns and closed
	conns  map[*trackedConn]struct{}
	closed bool
}

var _ raft.StreamLayer = (*Stream)(nil)

// ID is the group's id.
func (s *Stream) ID() uint32 { return s.id }

// Addr is the Mux's advertised address.
func (s *Stream) Addr() net.Addr { return s.m.addr }

// Accept returns the next connection for the group.
func (s *Stream) Accept() (net.Conn, error) {
	select {
	case c := <-s.accept:
		tc := &trackedConn{Conn: c, s: s}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.closed {
			c.Close()
			return nil, net.ErrClosed
		}
		s.conns[tc] = struct{}{}
		return tc, nil
	case <-s.done:
		return nil, net.ErrClosed
	}
}

// Close unregisters the group, so its id can be registered again, and
// closes every connection it accepted, so the transport's handlers end
// even when a peer keeps its pooled connection open. Safe to call twice.
func (s *Stream) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	conns := s.conns
	s.conns = nil
	s.mu.Unlock()
	close(s.done)

	s.m.mu.Lock()
	if s.m.groups[s.id] == s {
		delete(s.m.groups, s.id)
	}
	s.m.mu.Unlock()
	for c := range conns {
		c.Conn.Close()
	}
	return nil
}

// Dial connects to the Mux at address and names the group (group 0 sends
// no header). timeout bounds the connect, the TLS handshake and the
// header write together.
func (s *Stream) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	select {
	case <-s.done:
		return nil, net.ErrClosed
	default:
	}
	if timeout <= 0 {
		timeout = s.m.timeout
	}
	deadline := time.Now().Add(timeout)
	d := net.Dialer{Deadline: deadline}
	c, err := d.Dial("tcp", string(address))
	if err != nil {
		return nil, err
	}
	c = quiet(c)
	conn := c
	_ = c.SetDeadline(deadline)
	if s.m.client != nil {
		host, _, err := net.SplitHostPort(string(address))
		if err != nil {
			c.Close()
			return nil, err
		}
		tc := tls.Client(c, s.m.client(host))
		if err := tc.Handshake(); err != nil {
			c.Close()
			return nil, fmt.Errorf("raftmux: TLS handshake with %s: %w", address, err)
		}
		if err := s.m.checkPeer(tc.ConnectionState()); err != nil {
			c.Close()
			return nil, fmt.Errorf("raftmux: %s: %w", address, err)
		}
		conn = tc
	}
	if s.id != 0 {
		if _, err := conn.Write(AppendHeader(make([]byte, 0, HeaderLen), s.id)); err != nil {
			c.Close()
			return nil, fmt.Errorf("raftmux: write header to %s: %w", address, err)
		}
	}
	_ = c.SetDeadline(time.Time{})
	return conn, nil
}

// trackedConn removes itself from its Stream when closed.
type trackedConn struct {
	net.Conn
	s    *Stream
	once sync.Once
}

// Read reports a connection closed by its Stream's Close as io.EOF, the
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

// replayConn returns first before the rest of the connection: the byte
// read to tell an untagged connection from a tagged one.
type replayConn struct {
	net.Conn
	first  byte
	played bool
}

func (c *replayConn) Read(b []byte) (int, error) {
	if c.played || len(b) == 0 {
		return c.Conn.Read(b)
	}
	c.played = true
	b[0] = c.first
	return 1, nil
}

// advertisedAddr is a host:port as given (the host may be a DNS name,
// resolved by each peer when it dials).
type advertisedAddr string

func (a advertisedAddr) Network() string { return "tcp" }
func (a advertisedAddr) String() string  { return string(a) }
