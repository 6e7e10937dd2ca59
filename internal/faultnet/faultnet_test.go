package faultnet

import (
	"bufio"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echoServer answers every line with the same line, prefixed by the
// connection's first line (its "name") once one was read.
type echoServer struct {
	ln net.Listener
	wg sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]bool
}

func newEcho(t *testing.T) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &echoServer{ln: ln, conns: make(map[net.Conn]bool)}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns[c] = true
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				_, _ = io.Copy(c, c) // echo until EOF, then close (FIN)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *echoServer) addr() string { return s.ln.Addr().String() }

func newProxy(t *testing.T, cfg Config) *Proxy {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip writes line and reads one line back within d.
func roundTrip(c net.Conn, r *bufio.Reader, line string, d time.Duration) (string, error) {
	_ = c.SetDeadline(time.Now().Add(d))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		return "", err
	}
	got, err := r.ReadString('\n')
	return strings.TrimSuffix(got, "\n"), err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// waitFor polls cond every 5ms until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestForwardAndStats(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr()})
	c := dial(t, p.Addr())
	r := bufio.NewReader(c)
	for i, msg := range []string{"a", "hello", strings.Repeat("x", 100_000)} {
		got, err := roundTrip(c, r, msg, 5*time.Second)
		if err != nil || got != msg {
			t.Fatalf("round trip %d: got %d bytes, %v; want %d bytes", i, len(got), err, len(msg))
		}
	}
	// The counters move just after each write, so the echo's answer can
	// reach the client before the bytes toward the target are counted: wait
	// for both.
	want := int64(len("a\nhello\n") + 100_001)
	waitFor(t, 5*time.Second, "the byte counters", func() bool {
		st := p.Stats()
		return st.Forwarded[ToClient] == want && st.Forwarded[ToTarget] == want
	})
	if st := p.Stats(); st.Accepted != 1 || st.Active != 1 || st.Forwarded[ToTarget] != want {
		t.Errorf("stats %+v, want 1 accepted, 1 active, %d bytes each way", st, want)
	}
	if p.Target() != echo.addr() {
		t.Errorf("Target %q", p.Target())
	}
}

// TestHalfClose: a client's FIN reaches the target, whose answer and FIN
// come back.
func TestHalfClose(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr()})
	c := dial(t, p.Addr())
	if _, err := io.WriteString(c, "bye"); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil || string(b) != "bye" {
		t.Fatalf("read %q, %v; want \"bye\" then EOF", b, err)
	}
	waitFor(t, 5*time.Second, "the link to close", func() bool { return p.Stats().Active == 0 })
}

func TestPartitionBlackholesThenHeal(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr()})
	old := dial(t, p.Addr())
	oldR := bufio.NewReader(old)
	if _, err := roundTrip(old, oldR, "before", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	idle := dial(t, p.Addr()) // opened before, silent during the partition
	idleR := bufio.NewReader(idle)
	if _, err := roundTrip(idle, idleR, "idle", 5*time.Second); err != nil {
		t.Fatal(err)
	}

	p.Partition()
	// An open connection: the request vanishes, the client hits its deadline.
	if got, err := roundTrip(old, oldR, "during", 150*time.Millisecond); !isTimeout(err) {
		t.Fatalf("open conn during partition: %q, %v; want a timeout", got, err)
	}
	// A new connection is accepted (no refusal) but never answered.
	fresh := dial(t, p.Addr())
	if got, err := roundTrip(fresh, bufio.NewReader(fresh), "new", 150*time.Millisecond); !isTimeout(err) {
		t.Fatalf("new conn during partition: %q, %v; want a timeout", got, err)
	}
	if st := p.Stats(); st.Dropped[ToTarget] < int64(len("during\nnew\n")) {
		t.Errorf("dropped %v bytes to target, want ≥ %d", st.Dropped, len("during\nnew\n"))
	}

	p.Heal()
	// The connections that lost data are closed: their streams have gaps.
	for name, c := range map[string]net.Conn{"old": old, "fresh": fresh} {
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 16)); err == nil || isTimeout(err) {
			t.Errorf("%s conn after heal: %v, want closed", name, err)
		}
	}
	// The idle one lost nothing and goes on.
	if got, err := roundTrip(idle, idleR, "after", 5*time.Second); err != nil || got != "after" {
		t.Errorf("idle conn after heal: %q, %v", got, err)
	}
	// New connections work.
	c := dial(t, p.Addr())
	if got, err := roundTrip(c, bufio.NewReader(c), "healed", 5*time.Second); err != nil || got != "healed" {
		t.Fatalf("after heal: %q, %v", got, err)
	}
}

func TestDelay(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr()})
	c := dial(t, p.Addr())
	r := bufio.NewReader(c)
	const d = 80 * time.Millisecond
	p.Delay(ToTarget, d)
	p.Delay(ToClient, d)
	start := time.Now()
	if got, err := roundTrip(c, r, "slow", 5*time.Second); err != nil || got != "slow" {
		t.Fatalf("%q, %v", got, err)
	}
	// A lower bound only: the delay is a correctness property of the proxy.
	if el := time.Since(start); el < 2*d {
		t.Errorf("round trip took %v, want ≥ %v", el, 2*d)
	}
	// Pipelined: many chunks in flight take about one delay, and arrive in
	// order.
	var sb strings.Builder
	for i := range 50 {
		sb.WriteString(strings.Repeat(string(rune('a'+i%26)), 10) + "\n")
	}
	go func() { _, _ = io.WriteString(c, sb.String()) }()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, sb.Len())
	if _, err := io.ReadFull(r, got); err != nil || string(got) != sb.String() {
		t.Fatalf("pipelined read: %v (in order: %v)", err, string(got) == sb.String())
	}
	p.Delay(ToTarget, 0)
	p.Delay(ToClient, 0)
	p.Delay(Direction(9), time.Second) // ignored
}

func TestReset(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr()})
	c := dial(t, p.Addr())
	r := bufio.NewReader(c)
	if _, err := roundTrip(c, r, "x", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	p.Reset()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := r.ReadByte()
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("read after Reset: %v, want ECONNRESET", err)
	}
	c2 := dial(t, p.Addr())
	if got, err := roundTrip(c2, bufio.NewReader(c2), "again", 5*time.Second); err != nil || got != "again" {
		t.Fatalf("after Reset: %q, %v", got, err)
	}
}

// lineName identifies a sender by its first line.
func lineName(r io.Reader) (string, error) {
	var b []byte
	one := make([]byte, 1)
	for {
		if _, err := io.ReadFull(r, one); err != nil {
			return "", err
		}
		if one[0] == '\n' {
			return string(b), nil
		}
		b = append(b, one[0])
	}
}

func TestIsolateOneSender(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr(), Identify: lineName})
	a := dial(t, p.Addr())
	aR := bufio.NewReader(a)
	b := dial(t, p.Addr())
	bR := bufio.NewReader(b)
	// The identifying line is forwarded too: the echo sends it back.
	for name, c := range map[string]net.Conn{"a": a, "b": b} {
		r := map[string]*bufio.Reader{"a": aR, "b": bR}[name]
		if got, err := roundTrip(c, r, name, 5*time.Second); err != nil || got != name {
			t.Fatalf("%s hello: %q, %v", name, got, err)
		}
	}
	waitFor(t, 5*time.Second, "both senders named", func() bool { return len(p.SenderNames()) == 2 })
	if got := p.SenderNames(); got[0] != "a" || got[1] != "b" {
		t.Fatalf("senders %v", got)
	}

	p.Isolate("a")
	if got, err := roundTrip(a, aR, "x", 150*time.Millisecond); !isTimeout(err) {
		t.Fatalf("isolated sender: %q, %v; want a timeout", got, err)
	}
	if got, err := roundTrip(b, bR, "y", 5*time.Second); err != nil || got != "y" {
		t.Fatalf("other sender: %q, %v", got, err)
	}
	// A new connection from the isolated sender is black-holed from its
	// first bytes.
	a2 := dial(t, p.Addr())
	if got, err := roundTrip(a2, bufio.NewReader(a2), "a", 150*time.Millisecond); !isTimeout(err) {
		t.Fatalf("new conn of the isolated sender: %q, %v", got, err)
	}
	// Heal does not end an isolation.
	p.Heal()
	if got, err := roundTrip(a2, bufio.NewReader(a2), "z", 100*time.Millisecond); err == nil {
		t.Fatalf("isolated sender answered after Heal: %q", got)
	}

	p.Rejoin("a")
	_ = a.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := a.Read(make([]byte, 8)); err == nil || isTimeout(err) {
		t.Errorf("a's cut conn after Rejoin: %v, want closed", err)
	}
	a3 := dial(t, p.Addr())
	if got, err := roundTrip(a3, bufio.NewReader(a3), "a", 5*time.Second); err != nil || got != "a" {
		t.Fatalf("after Rejoin: %q, %v", got, err)
	}
	if n := p.Senders()["a"]; n != 3 {
		t.Errorf("a opened %d conns, want 3", n)
	}
}

// TestIdentifyFailure: a connection Identify rejects is closed, never
// forwarded.
func TestIdentifyFailure(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr(), IdentifyTimeout: 100 * time.Millisecond,
		Identify: func(r io.Reader) (string, error) { return lineName(r) }})
	c := dial(t, p.Addr()) // says nothing: Identify times out
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("silent conn: %v, want closed by the proxy", err)
	}
	if st := p.Stats(); st.Forwarded[ToTarget] != 0 {
		t.Errorf("forwarded %d bytes", st.Forwarded[ToTarget])
	}
}

// TestTargetDown: the proxy accepts, the dial fails, the client's
// connection is closed.
func TestTargetDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	p := newProxy(t, Config{Target: addr, DialTimeout: time.Second})
	c := dial(t, p.Addr())
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("read: %v, want closed", err)
	}
}

func TestCloseTwiceAndRefuses(t *testing.T) {
	echo := newEcho(t)
	p, err := Listen(echo.addr())
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	r := bufio.NewReader(c)
	if _, err := roundTrip(c, r, "x", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	p.Partition()
	blackholed := dial(t, p.Addr())
	_, _ = io.WriteString(blackholed, "lost\n")
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		t.Error("dial after Close succeeded")
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.ReadByte(); err == nil {
		t.Error("conn still open after Close")
	}
	if _, err := New(Config{}); err == nil {
		t.Error("New without a target succeeded")
	}
	if _, err := New(Config{Target: "x", ListenAddr: "256.0.0.1:0"}); err == nil {
		t.Error("New on a bad listen address succeeded")
	}
}

func TestDirectionString(t *testing.T) {
	for d, want := range map[Direction]string{ToTarget: "to-target", ToClient: "to-client", 7: "Direction(7)"} {
		if d.String() != want {
			t.Errorf("%d: %q", d, d.String())
		}
	}
}

func TestCloseWithOpenClients(t *testing.T) {
	// Clients the test leaves open do not keep proxy goroutines alive past
	// Close (goleak in TestMain checks the rest).
	echo := newEcho(t)
	p, err := Listen(echo.addr())
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		c := dial(t, p.Addr())
		_, _ = io.WriteString(c, "hi\n")
	}
	waitFor(t, 5*time.Second, "5 links", func() bool { return p.Stats().Active == 5 })
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if p.Stats().Active != 0 {
		t.Errorf("%d links after Close", p.Stats().Active)
	}
}

// TestConcurrentControl: the controls race with connections being named
// and pumped (run with -race).
func TestConcurrentControl(t *testing.T) {
	echo := newEcho(t)
	p := newProxy(t, Config{Target: echo.addr(), Identify: lineName})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			switch i % 6 {
			case 0:
				p.Partition()
			case 1:
				p.Heal()
			case 2:
				p.Isolate("a")
			case 3:
				p.Rejoin("a")
			case 4:
				p.Delay(ToClient, time.Millisecond)
			case 5:
				p.Delay(ToClient, 0)
				_ = p.Stats()
				_ = p.Senders()
			}
		}
	}()
	for i := range 20 {
		c, err := net.DialTimeout("tcp", p.Addr(), 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		name := []string{"a", "b"}[i%2]
		_, _ = roundTrip(c, bufio.NewReader(c), name, 50*time.Millisecond)
		c.Close()
	}
	close(stop)
	wg.Wait()
	p.Heal()
	p.Rejoin("a")
	c := dial(t, p.Addr())
	if got, err := roundTrip(c, bufio.NewReader(c), "b", 5*time.Second); err != nil || got != "b" {
		t.Fatalf("after the storm: %q, %v", got, err)
	}
}
