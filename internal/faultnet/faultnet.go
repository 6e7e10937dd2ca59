// Package faultnet is a fault-injecting TCP proxy for tests.
//
// A Proxy listens on a loopback port and forwards every connection to one
// target address. While it runs, a test can:
//
//   - Partition it: every byte in flight or arriving, in both directions, is
//     dropped, and new connections are accepted but never answered, so
//     clients block until their own deadlines (a black hole, as a real
//     partition looks to TCP, not a refused connection). Heal ends the
//     partition and closes the connections that lost data, since their byte
//     streams have gaps; clients reconnect.
//   - Isolate one sender: with Config.Identify, the proxy names the sender of
//     each connection from the first bytes it sends (for example the node id
//     in a Raft RPC header), and Isolate(name) black-holes only that
//     sender's connections. Several proxies, one per destination, then cut a
//     node off from its peers in both directions while the others still
//     talk, which a proxy per destination alone cannot do.
//   - Delay one direction: each chunk is delivered d after it was read,
//     pipelined (a delay adds latency, not a throughput cap).
//   - Reset every connection (an RST to both ends).
//
// Every goroutine belongs to the Proxy and ends by Close, which is safe to
// call twice. A Proxy is safe for concurrent use.
package faultnet

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// Direction is one half of a proxied connection.
type Direction uint8

const (
	// ToTarget carries what the client sends to the target.
	ToTarget Direction = iota
	// ToClient carries the target's answers back to the client.
	ToClient
)

func (d Direction) String() string {
	switch d {
	case ToTarget:
		return "to-target"
	case ToClient:
		return "to-client"
	}
	return fmt.Sprintf("Direction(%d)", uint8(d))
}

// Config configures a Proxy. Target is required; the rest is optional.
type Config struct {
	// Target is the address every accepted connection is forwarded to.
	Target string
	// ListenAddr is where the proxy listens. Default "127.0.0.1:0".
	ListenAddr string
	// Identify, when set, names the sender of each accepted connection: it
	// reads the start of the client's stream (everything it reads is still
	// forwarded, in order) and returns the sender's name, which Isolate
	// matches. An error closes the connection. Nil: connections have no
	// name and only Partition cuts them.
	Identify func(r io.Reader) (string, error)
	// IdentifyTimeout bounds Identify's reads. Default 5s.
	IdentifyTimeout time.Duration
	// DialTimeout bounds the dial to Target. Default 5s.
	DialTimeout time.Duration
}

// Stats counts a Proxy's traffic since it started.
type Stats struct {
	Accepted  int64    // connections accepted
	Active    int      // connections open now
	Forwarded [2]int64 // bytes delivered, by Direction
	Dropped   [2]int64 // bytes dropped by a partition or an isolation, by Direction
}

// Proxy is a fault-injecting TCP proxy. Create it with Listen or New.
type Proxy struct {
	cfg  Config
	ln   net.Listener
	stop chan struct{} // closed by Close
	wg   sync.WaitGroup

	// mu guards partitioned, isolated, delay, links, names and closed.
	mu          sync.Mutex
	partitioned bool
	isolated    map[string]bool
	delay       [2]time.Duration
	links       map[*link]struct{}
	names       map[string]int
	closed      bool

	accepted  atomic.Int64
	forwarded [2]atomic.Int64
	dropped   [2]atomic.Int64
}

// Listen starts a Proxy on 127.0.0.1:0 forwarding to target.
func Listen(target string) (*Proxy, error) {
	return New(Config{Target: target})
}

// New starts a Proxy configured by cfg.
func New(cfg Config) (*Proxy, error) {
	if cfg.Target == "" {
		return nil, errors.New("faultnet: Config.Target is required")
	}
	if cfg.ListenAddr == "" {
		cfg.ListenAddr = "127.0.0.1:0"
	}
	if cfg.IdentifyTimeout <= 0 {
		cfg.IdentifyTimeout = 5 * time.Second
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	ln, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("faultnet: listen %s: %w", cfg.ListenAddr, err)
	}
	p := &Proxy{
		cfg:      cfg,
		ln:       ln,
		stop:     make(chan struct{}),
		isolated: make(map[string]bool),
		links:    make(map[*link]struct{}),
		names:    make(map[string]int),
	}
	p.goFunc(p.acceptLoop)
	return p, nil
}

// Addr is the proxy's listening address (host:port): give it to clients
// instead of the target's.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is the address the proxy forwards to.
func (p *Proxy) Target() string { return p.cfg.Target }

// Partition drops all traffic in both directions, on open connections and
// on connections accepted from now on (accepted, never answered), until
// Heal.
func (p *Proxy) Partition() {
	p.mu.Lock()
	p.partitioned = true
	p.mu.Unlock()
}

// Heal ends a Partition (isolations stay). Connections that lost data to
// it are closed, so their clients reconnect to a clean stream.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.partitioned = false
	cut := p.cutLinksLocked(func(l *link) bool { return !p.isolated[l.name] })
	p.mu.Unlock()
	for _, l := range cut {
		l.close(false)
	}
}

// Isolate drops the traffic of every connection whose sender Config.Identify
// names name, both ways, until Rejoin(name). It needs Config.Identify.
func (p *Proxy) Isolate(name string) {
	p.mu.Lock()
	p.isolated[name] = true
	p.mu.Unlock()
}

// Rejoin ends Isolate(name) and closes that sender's connections that lost
// data.
func (p *Proxy) Rejoin(name string) {
	p.mu.Lock()
	delete(p.isolated, name)
	var cut []*link
	if !p.partitioned {
		cut = p.cutLinksLocked(func(l *link) bool { return l.name == name })
	}
	p.mu.Unlock()
	for _, l := range cut {
		l.close(false)
	}
}

// cutLinksLocked returns the links that lost data and match keep; p.mu is
// held.
func (p *Proxy) cutLinksLocked(match func(*link) bool) []*link {
	var out []*link
	for l := range p.links {
		if l.cut.Load() && match(l) {
			out = append(out, l)
		}
	}
	return out
}

// Delay makes dir deliver each chunk d after reading it (0: no delay). It
// applies to chunks read from now on.
func (p *Proxy) Delay(dir Direction, d time.Duration) {
	if dir > ToClient {
		return
	}
	p.mu.Lock()
	p.delay[dir] = max(d, 0)
	p.mu.Unlock()
}

// Reset aborts every open connection with an RST to both ends. New
// connections are served normally.
func (p *Proxy) Reset() {
	p.mu.Lock()
	ls := make([]*link, 0, len(p.links))
	for l := range p.links {
		ls = append(ls, l)
	}
	p.mu.Unlock()
	for _, l := range ls {
		l.close(true)
	}
}

// Stats returns the traffic counters.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	active := len(p.links)
	p.mu.Unlock()
	s := Stats{Accepted: p.accepted.Load(), Active: active}
	for d := range 2 {
		s.Forwarded[d] = p.forwarded[d].Load()
		s.Dropped[d] = p.dropped[d].Load()
	}
	return s
}

// Senders returns the sender names Config.Identify has reported, with the
// number of connections each opened.
func (p *Proxy) Senders() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]int, len(p.names))
	for k, v := range p.names {
		out[k] = v
	}
	return out
}

// SenderNames is Senders' keys, sorted.
func (p *Proxy) SenderNames() []string {
	m := p.Senders()
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Close stops the proxy: the listener and every connection close, and
// every goroutine has ended when it returns. Safe to call twice.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.wg.Wait()
		return nil
	}
	p.closed = true
	ls := make([]*link, 0, len(p.links))
	for l := range p.links {
		ls = append(ls, l)
	}
	p.mu.Unlock()
	close(p.stop)
	err := p.ln.Close()
	for _, l := range ls {
		l.close(false)
	}
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// goFunc runs f in a goroutine that Close waits for.
func (p *Proxy) goFunc(f func()) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		f()
	}()
}

func (p *Proxy) acceptLoop() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			select {
			case <-p.stop:
				return
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient accept error (EMFILE...): back off briefly.
			t := time.NewTimer(10 * time.Millisecond)
			select {
			case <-p.stop:
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		p.accepted.Add(1)
		l := &link{p: p, client: c, done: make(chan struct{})}
		if !p.register(l) {
			c.Close()
			return
		}
		p.goFunc(l.serve)
	}
}

// register adds l to the open links; false once the proxy is closed.
func (p *Proxy) register(l *link) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.links[l] = struct{}{}
	return true
}

func (p *Proxy) unregister(l *link) {
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

// blocked reports whether l's traffic is dropped now.
func (p *Proxy) blocked(l *link) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.partitioned || (l.name != "" && p.isolated[l.name])
}

func (p *Proxy) delayOf(dir Direction) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.delay[dir]
}

// named records l's sender (l.name is read under p.mu from then on).
func (p *Proxy) named(l *link, name string) {
	p.mu.Lock()
	l.name = name
	p.names[name]++
	p.mu.Unlock()
}

// link is one proxied connection: the accepted client side and, once
// dialed, the target side.
type link struct {
	p      *Proxy
	client net.Conn
	name   string // from Config.Identify; guarded by p.mu

	mu     sync.Mutex // guards target and closed
	target net.Conn
	closed bool

	cut  atomic.Bool   // data was dropped: Heal/Rejoin close the link
	done chan struct{} // closed by close: stops this link's pumps
}

// setTarget records the dialed target conn; false if the link was closed
// meanwhile (the conn is then closed here).
func (l *link) setTarget(c net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		c.Close()
		return false
	}
	l.target = c
	return true
}

// close closes both sides (with an RST when reset) and stops the pumps.
// Safe to call more than once.
func (l *link) close(reset bool) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	target := l.target
	l.mu.Unlock()
	close(l.done)
	for _, c := range []net.Conn{l.client, target} {
		if c == nil {
			continue
		}
		if tc, ok := c.(*net.TCPConn); ok && reset {
			_ = tc.SetLinger(0)
		}
		_ = c.Close()
	}
}

// serve runs one connection: identify the sender, black-hole it or dial
// the target, and pump both directions until either side ends.
func (l *link) serve() {
	p := l.p
	defer p.unregister(l)
	defer l.close(false)

	var head []byte // what Identify read, still to be forwarded
	if p.cfg.Identify != nil {
		var buf bytes.Buffer
		_ = l.client.SetReadDeadline(time.Now().Add(p.cfg.IdentifyTimeout))
		name, err := p.cfg.Identify(io.TeeReader(l.client, &buf))
		_ = l.client.SetReadDeadline(time.Time{})
		if err != nil {
			return
		}
		p.named(l, name)
		head = buf.Bytes()
	}
	if p.blocked(l) {
		l.cut.Store(true)
		p.dropped[ToTarget].Add(int64(len(head)))
		l.blackhole()
		return
	}

	d := net.Dialer{Timeout: p.cfg.DialTimeout}
	target, err := d.Dial("tcp", p.cfg.Target)
	if err != nil {
		return // the client sees its connection closed, as if refused late
	}
	if !l.setTarget(target) {
		return
	}

	var pumps sync.WaitGroup
	pumps.Add(2)
	go func() { defer pumps.Done(); l.pump(ToTarget, l.client, target, head) }()
	go func() { defer pumps.Done(); l.pump(ToClient, target, l.client, nil) }()
	pumps.Wait()
}

// blackhole reads and discards what the client sends until the link is
// closed (Heal, Reset, Close) or the client goes away.
func (l *link) blackhole() {
	buf := make([]byte, 32<<10)
	for {
		n, err := l.client.Read(buf)
		l.p.dropped[ToTarget].Add(int64(n))
		if err != nil {
			return
		}
	}
}

// chunk is one read, due for delivery at due.
type chunk struct {
	data []byte
	due  time.Time
}

// pump copies src to dst for dir: a reader stamps each chunk with its due
// time and a writer delivers it then (or drops it while blocked). On EOF
// the writer half-closes dst after delivering everything; on any error the
// whole link closes.
func (l *link) pump(dir Direction, src, dst net.Conn, head []byte) {
	p := l.p
	ch := make(chan chunk, 64)
	var readErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the reader; owned by pump
		defer wg.Done()
		defer close(ch)
		if len(head) > 0 {
			select {
			case ch <- chunk{data: head, due: time.Now().Add(p.delayOf(dir))}:
			case <-l.done:
				return
			}
		}
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				c := chunk{data: append([]byte(nil), buf[:n]...), due: time.Now().Add(p.delayOf(dir))}
				select {
				case ch <- c:
				case <-l.done:
					return
				}
			}
			if err != nil {
				readErr = err
				return
			}
		}
	}()

	ok := l.deliver(dir, dst, ch)
	// Let the reader finish: closing the link unblocks it on error; on a
	// clean EOF it has already returned.
	if !ok {
		l.close(false)
	}
	for range ch { // drain so the reader never blocks on a full channel
	}
	wg.Wait()
	switch {
	case !ok:
	case errors.Is(readErr, io.EOF):
		if p.blocked(l) {
			l.cut.Store(true) // the FIN is lost with the rest
			return
		}
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	default:
		l.close(false)
	}
}

// deliver writes ch's chunks to dst at their due times until ch closes
// (true) or a write fails or the link closes (false).
func (l *link) deliver(dir Direction, dst net.Conn, ch <-chan chunk) bool {
	p := l.p
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for c := range ch {
		if wait := time.Until(c.due); wait > 0 {
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
			select {
			case <-timer.C:
			case <-l.done:
				return false
			}
		}
		if p.blocked(l) {
			l.cut.Store(true)
			p.dropped[dir].Add(int64(len(c.data)))
			continue
		}
		if _, err := dst.Write(c.data); err != nil {
			return false
		}
		p.forwarded[dir].Add(int64(len(c.data)))
	}
	return true
}
