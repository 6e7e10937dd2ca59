package redislimit

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
	"github.com/redis/go-redis/v9"
)

// TestRedisAtomicity: 64 concurrent clients on one key admit exactly the
// burst (no over-admission, no lost update), for each algorithm and for a
// sharded key (at most the burst).
func TestRedisAtomicity(t *testing.T) {
	srv := startRedis(t)
	b := newTestBackend(t, func(c *Config) { c.PoolSize = 64 }, srv.addr())
	const clients, attempts = 64, 24 // 1536 attempts for a budget of 500
	now := base                      // one instant: no refill during the test
	cases := []struct {
		name   string
		lim    bucket.Limit
		shards int
		exact  bool
	}{
		{"token_bucket", mustLimit(t, bucket.TokenBucket, 1, time.Hour, 500), 1, true},
		{"gcra", mustLimit(t, bucket.GCRA, 10, time.Hour, 500), 1, true},
		{"fixed_window", mustLimit(t, bucket.FixedWindow, 500, time.Hour, 500), 1, true},
		{"sliding_window", mustLimit(t, bucket.SlidingWindow, 500, time.Hour, 500), 1, true},
		{"token_bucket/4_shards", mustLimit(t, bucket.TokenBucket, 1000, time.Hour, 500), 4, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var admitted atomic.Int64
			var wg sync.WaitGroup
			errs := make(chan error, clients)
			for range clients {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range attempts {
						r, err := b.AllowNAt(bg, "atomic:"+c.name, c.lim, c.shards, now, 1)
						if err != nil {
							errs <- err
							return
						}
						if r.Allowed {
							admitted.Add(1)
						}
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			got := admitted.Load()
			switch {
			case got > c.lim.Burst():
				t.Fatalf("admitted %d of %d attempts, limit %d: over-admission", got, clients*attempts, c.lim.Burst())
			case c.exact && got != c.lim.Burst():
				t.Fatalf("admitted %d, want exactly %d (a lost update)", got, c.lim.Burst())
			}
			t.Logf("%d clients × %d attempts: admitted %d (limit %d)", clients, attempts, got, c.lim.Burst())
		})
	}
}

// TestRedisKilledMidTraffic kills redis-server (SIGKILL) under traffic:
// calls fail with ErrUnavailable, the breaker opens and fails calls without
// I/O, the caller's fallback bucket decides (fail open), and after a restart
// on the same port the backend recovers by itself.
func TestRedisKilledMidTraffic(t *testing.T) {
	srv := startRedis(t)
	b := newTestBackend(t, func(c *Config) {
		c.Timeout = 200 * time.Millisecond // generous for -race on a shared machine
		c.BreakerFailures = 3
		c.BreakerCooldown = 50 * time.Millisecond
	}, srv.addr())
	lim := mustLimit(t, bucket.TokenBucket, 1000, time.Second, 1000)
	fallback := bucket.NewLimiter(mustLimit(t, bucket.TokenBucket, 1000, time.Second, 1000))

	var remote, local, denied int
	check := func() error {
		r, err := b.AllowN(bg, "killed", lim, 1, 1)
		if err != nil {
			if !errors.Is(err, ErrUnavailable) {
				t.Fatalf("error does not wrap ErrUnavailable: %v", err)
			}
			// The caller's failure mode: open → the local fallback bucket.
			if fallback.AllowN(time.Now(), 1).Allowed {
				local++
			} else {
				denied++
			}
			return err
		}
		if r.Allowed {
			remote++
		}
		return nil
	}
	for range 200 {
		if err := check(); err != nil {
			t.Fatalf("before the kill: %v", err)
		}
	}

	srv.kill()
	// Traffic goes on; within a few failed calls the breaker opens.
	waitFor(t, 10*time.Second, "the breaker to open", func() bool { _ = check(); return !b.Healthy() })
	before := b.Stats()
	start := time.Now()
	const fastCalls = 500
	for range fastCalls {
		if err := check(); err == nil {
			t.Fatal("a call succeeded with redis-server killed")
		}
	}
	after := b.Stats()
	elapsed := time.Since(start)
	// While open, only a half-open probe per cooldown reaches the network.
	probes := after.Calls - before.Calls
	maxProbes := uint64(elapsed/(50*time.Millisecond)) + 1
	if probes > maxProbes {
		t.Errorf("%d of %d calls reached the network in %v with the breaker open (≤ %d probes expected)", probes, fastCalls, elapsed, maxProbes)
	}
	if ff := after.FastFails - before.FastFails; ff+probes < fastCalls {
		t.Errorf("fast fails %d + probes %d < %d calls", ff, probes, fastCalls)
	}
	if local == 0 {
		t.Error("the fallback bucket admitted nothing")
	}
	t.Logf("with redis down: %d calls, %d fast-failed by the breaker, %d probes; fallback admitted %d, denied %d",
		fastCalls, after.FastFails-before.FastFails, probes, local, denied)

	srv.restart()
	waitFor(t, 15*time.Second, "recovery after restart", func() bool { return check() == nil && b.Healthy() })
	for range 50 {
		if err := check(); err != nil {
			t.Fatalf("after recovery: %v", err)
		}
	}
	t.Logf("recovered: %d remote decisions in total", remote)
}

// startCluster starts a 3-master Redis Cluster (no replicas) and returns its
// nodes once every node reports cluster_state:ok.
func startCluster(t *testing.T) []*redisServer {
	t.Helper()
	var nodes []*redisServer
	var addrs []string
	for range 3 {
		s := startRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000")
		nodes = append(nodes, s)
		addrs = append(addrs, s.addr())
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, s := range nodes {
		waitFor(t, 20*time.Second, "cluster_state:ok on "+s.addr(), func() bool {
			return strings.Contains(s.cli("CLUSTER", "INFO"), "cluster_state:ok")
		})
	}
	return nodes
}

// TestRedisClusterShards creates a 3-master cluster and checks that the
// sub-keys of a hot key land on all three masters, that the package's slot
// computation matches Redis's, and that sharded checks never over-admit.
func TestRedisClusterShards(t *testing.T) {
	nodes := startCluster(t)
	var addrs []string
	for _, s := range nodes {
		addrs = append(addrs, s.addr())
	}
	b := newTestBackend(t, nil, addrs...)
	// The cluster client learns the slot map on first use; wait for a
	// successful call.
	waitFor(t, 20*time.Second, "a call through the cluster client", func() bool {
		_, err := b.AllowN(bg, "warmup", mustLimit(t, bucket.TokenBucket, 10, time.Second, 10), 1, 1)
		return err == nil
	})

	for _, shards := range []int{3, 6, 12} {
		lim := mustLimit(t, bucket.TokenBucket, 1200, time.Hour, 1200)
		key := fmt.Sprintf("api:route=/v1/search,user=hot%d", shards)
		admitted := 0
		for range 2000 {
			r, err := b.AllowNAt(bg, key, lim, shards, base, 1)
			if err != nil {
				t.Fatalf("sharded check: %v", err)
			}
			if r.Allowed {
				admitted++
			}
		}
		if admitted > 1200 {
			t.Fatalf("%d shards: admitted %d > limit 1200", shards, admitted)
		}
		// Where did each sub-key go?
		h := xxh64(key)
		perNode := make(map[string]int)
		for i := range shards {
			name := b.subKey(key, h, shards, i)
			slot, err := strconv.Atoi(nodes[0].cli("CLUSTER", "KEYSLOT", name))
			if err != nil || slot != keySlot(name) {
				t.Fatalf("CLUSTER KEYSLOT %q = %d (%v), package computes %d", name, slot, err, keySlot(name))
			}
			holders := 0
			for _, s := range nodes {
				if s.cli("-c", "EXISTS", name) == "1" && ownsSlot(s, slot) {
					perNode[s.addr()]++
					holders++
				}
			}
			if holders != 1 {
				t.Fatalf("sub-key %q (slot %d) found on %d masters", name, slot, holders)
			}
		}
		if len(perNode) != 3 {
			t.Fatalf("%d shards: sub-keys on %d masters, want all 3: %v", shards, len(perNode), perNode)
		}
		for addr, c := range perNode {
			if c != shards/3 {
				t.Errorf("%d shards: master %s holds %d sub-keys, want %d", shards, addr, c, shards/3)
			}
		}
		t.Logf("%d shards: admitted %d/1200 of 2000 checks; sub-keys per master %v", shards, admitted, perNode)
	}
}

// ownsSlot reports whether node s serves slot (CLUSTER SHARDS/NODES parsing
// kept minimal: "myself" line of CLUSTER NODES).
func ownsSlot(s *redisServer, slot int) bool {
	for _, line := range strings.Split(s.cli("CLUSTER", "NODES"), "\n") {
		f := strings.Fields(line)
		if len(f) < 9 || !strings.Contains(f[2], "myself") {
			continue
		}
		for _, r := range f[8:] {
			lo, hi, found := strings.Cut(r, "-")
			if !found {
				hi = lo
			}
			l, err1 := strconv.Atoi(lo)
			h, err2 := strconv.Atoi(hi)
			if err1 == nil && err2 == nil && l <= slot && slot <= h {
				return true
			}
		}
	}
	return false
}

// TestRedisFailoverFreeBurst measures the free burst of a failover: a
// primary (AOF everysec) with a replica; 16 clients spend a key's budget as
// fast as they can, the primary dies half-way, with writes in flight, the
// replica is promoted (REPLICAOF NO ONE) and the budget is drained on it.
// Tokens admitted beyond the budget are acknowledged writes the replica had
// not received. Two ways to die:
//
//   - process: the primary is killed (SIGKILL) with the replica linked
//     directly over loopback; the killed primary is also restarted from its
//     AOF and drained the same way;
//   - host: the replica is linked through a proxy that delays replication
//     by 2 ms (a replica in another zone), and the primary's host is lost:
//     the proxy drops what it has not delivered and the primary is killed.
//
// A negative figure means writes that executed but whose reply the killed
// server never sent (at most one per client). Only "measured and bounded by
// the budget" is asserted; the figures go to the log (and docs/redis.md).
func TestRedisFailoverFreeBurst(t *testing.T) {
	const budget, clients = 2000, 16
	lim := mustLimit(t, bucket.TokenBucket, 1, time.Hour, budget)
	drain := func(addr string) int64 {
		be := newTestBackend(t, nil, addr)
		var n int64
		for {
			r, err := be.AllowNAt(bg, "failover", lim, 1, base, 1)
			if err != nil {
				t.Fatalf("after failover: %v", err)
			}
			if !r.Allowed {
				return n
			}
			n++
		}
	}
	check := func(what string, free int64) {
		t.Helper()
		t.Logf("%s: free burst %d tokens (budget %d)", what, free, budget)
		if free < -clients || free > budget {
			t.Fatalf("%s: free burst %d outside [%d, %d]", what, free, -clients, budget)
		}
	}
	for round, mode := range []string{"process", "process", "host", "host"} {
		primary := startRedis(t, "--appendonly", "yes", "--appendfsync", "everysec", "--repl-diskless-sync-delay", "0")
		upstream := primary.addr()
		var proxy *lagProxy
		if mode == "host" {
			proxy = startLagProxy(t, upstream, 2*time.Millisecond)
			upstream = proxy.addr()
		}
		host, port, _ := strings.Cut(upstream, ":")
		replica := startRedis(t, "--replicaof", host, port)
		waitFor(t, 10*time.Second, "the replica to sync", func() bool {
			return strings.Contains(replica.cli("INFO", "replication"), "master_link_status:up")
		})
		// The primary must see the replica online and acknowledging writes.
		primary.cli("SET", "probe", "1")
		if got := primary.cli("WAIT", "1", "5000"); got != "1" {
			t.Fatalf("WAIT 1 = %s: the replica does not acknowledge writes", got)
		}
		onPrimary := newTestBackend(t, func(c *Config) { c.PoolSize = clients }, primary.addr())
		var admitted atomic.Int64
		var wg sync.WaitGroup
		var once sync.Once
		var died time.Time
		die := func() {
			died = time.Now()
			if proxy != nil {
				proxy.cut()
			}
			primary.kill()
		}
		start := time.Now()
		for range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					r, err := onPrimary.AllowNAt(bg, "failover", lim, 1, base, 1)
					if err != nil || !r.Allowed {
						return // the primary is gone (or, unexpectedly, the budget)
					}
					if admitted.Add(1) >= budget/2 {
						once.Do(die)
					}
				}
			}()
		}
		wg.Wait()
		before := admitted.Load()
		if before < budget/2 || before > budget {
			t.Fatalf("the primary admitted %d before it died, want within [%d, %d]", before, budget/2, budget)
		}
		rate := float64(before) / died.Sub(start).Seconds()
		replica.cli("REPLICAOF", "NO", "ONE")
		free := before + drain(replica.addr()) - budget
		check(fmt.Sprintf("round %d (%s): %d admitted at %.0f/s before the primary died (a free token is %.2f ms of lag); failover to the replica",
			round, mode, before, rate, 1000/rate), free)
		if mode == "process" {
			primary.restart()
			check(fmt.Sprintf("round %d (%s): restart of the killed primary from its AOF", round, mode),
				before+drain(primary.addr())-budget)
		}
		primary.kill()
		replica.kill()
	}
}

// lagProxy forwards TCP connections to target, delaying the target→client
// direction by delay; cut drops everything not yet delivered, as a lost host
// would.
type lagProxy struct {
	ln     net.Listener
	target string
	delay  time.Duration
	stop   chan struct{}
	once   sync.Once
	wg     sync.WaitGroup
	mu     sync.Mutex // guards conns
	conns  []net.Conn
}

func startLagProxy(t *testing.T, target string, delay time.Duration) *lagProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lagProxy{ln: ln, target: target, delay: delay, stop: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.cut)
	return p
}

func (p *lagProxy) addr() string { return p.ln.Addr().String() }

func (p *lagProxy) track(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

func (p *lagProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.track(c)
		p.track(u)
		type chunk struct {
			at   time.Time
			data []byte
		}
		q := make(chan chunk, 1<<16)
		p.wg.Add(3)
		go func() { // client → target, undelayed
			defer p.wg.Done()
			_, _ = io.Copy(u, c)
		}()
		go func() { // target → queue
			defer p.wg.Done()
			defer close(q)
			for {
				buf := make([]byte, 32<<10)
				n, err := u.Read(buf)
				if n > 0 {
					select {
					case q <- chunk{time.Now(), buf[:n]}:
					case <-p.stop:
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
		go func() { // queue → client, each chunk delay after it arrived
			defer p.wg.Done()
			for ch := range q {
				select {
				case <-time.After(time.Until(ch.at.Add(p.delay))):
				case <-p.stop:
					return
				}
				if _, err := c.Write(ch.data); err != nil {
					return
				}
			}
		}()
	}
}

// cut stops forwarding at once, dropping undelivered data, and closes every
// connection. Safe to call twice.
func (p *lagProxy) cut() {
	p.once.Do(func() {
		close(p.stop)
		_ = p.ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // RST: nothing buffered is flushed
			}
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
}

// TestRedisSentinelFailover runs the backend in sentinel mode: a primary, a
// replica and one Sentinel; the primary is killed, Sentinel promotes the
// replica, and the backend (failing fast meanwhile) recovers by itself on
// the new primary.
func TestRedisSentinelFailover(t *testing.T) {
	primary := startRedis(t, "--repl-diskless-sync-delay", "0")
	replica := startRedis(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.port), "--replica-announce-ip", "127.0.0.1")
	waitFor(t, 10*time.Second, "the replica to sync", func() bool {
		return strings.Contains(replica.cli("INFO", "replication"), "master_link_status:up")
	})
	sentinel := startSentinel(t, primary.port)
	waitFor(t, 10*time.Second, "the sentinel to find the replica", func() bool {
		return strings.Contains(sentinel.cli("SENTINEL", "replicas", "m"), strconv.Itoa(replica.port))
	})
	b := newTestBackend(t, func(c *Config) {
		c.Mode = ModeSentinel
		c.MasterName = "m"
		c.Timeout = 200 * time.Millisecond
		c.BreakerCooldown = 50 * time.Millisecond
	}, sentinel.addr())
	lim := mustLimit(t, bucket.TokenBucket, 100, time.Second, 100)
	for range 20 {
		if _, err := b.AllowN(bg, "sentinel", lim, 1, 1); err != nil {
			t.Fatalf("through the sentinel: %v", err)
		}
	}
	primary.kill()
	start := time.Now()
	var failed int
	waitFor(t, 30*time.Second, "recovery on the promoted replica", func() bool {
		_, err := b.AllowN(bg, "sentinel", lim, 1, 1)
		if err != nil {
			if !errors.Is(err, ErrUnavailable) {
				t.Fatalf("error does not wrap ErrUnavailable: %v", err)
			}
			failed++
		}
		return err == nil
	})
	if got := sentinel.cli("SENTINEL", "get-master-addr-by-name", "m"); !strings.Contains(got, strconv.Itoa(replica.port)) {
		t.Fatalf("sentinel reports master %q, want the replica's port %d", got, replica.port)
	}
	t.Logf("recovered on the promoted replica after %v; %d checks failed meanwhile (%d fast-failed by the breaker)",
		time.Since(start).Round(time.Millisecond), failed, b.Stats().FastFails)
}

// fakeNode is a Redis Cluster node on loopback that claims every slot and
// answers scripts (EVAL, EVALSHA) with onScript; anything else but CLUSTER
// SLOTS, PING and COMMAND gets an error. onScript returns the raw reply, or "" to
// close the connection without one (the reply lost after the script ran).
type fakeNode struct {
	ln       net.Listener
	scripts  atomic.Int64
	onScript func() string
	wg       sync.WaitGroup
}

func startFakeNode(t *testing.T, onScript func() string) *fakeNode {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n := &fakeNode{ln: ln, onScript: onScript}
	n.wg.Add(1)
	go n.accept()
	t.Cleanup(func() { _ = ln.Close(); n.wg.Wait() })
	return n
}

func (n *fakeNode) addr() string { return n.ln.Addr().String() }

func (n *fakeNode) accept() {
	defer n.wg.Done()
	for {
		c, err := n.ln.Accept()
		if err != nil {
			return
		}
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			defer c.Close()
			n.serve(c)
		}()
	}
}

func (n *fakeNode) serve(c net.Conn) {
	r := bufio.NewReader(c)
	for {
		args, err := readCommand(r)
		if err != nil {
			return
		}
		var reply string
		switch strings.ToLower(args[0]) {
		case "eval", "evalsha":
			n.scripts.Add(1)
			if reply = n.onScript(); reply == "" {
				return
			}
		case "cluster":
			host, port, _ := net.SplitHostPort(n.addr())
			reply = fmt.Sprintf("*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$%d\r\n%s\r\n:%s\r\n$40\r\n%s\r\n", len(host), host, port, strings.Repeat("a", 40))
		case "ping":
			reply = "+PONG\r\n"
		case "command":
			reply = "*0\r\n"
		default:
			reply = "-ERR unknown command\r\n"
		}
		if _, err := io.WriteString(c, reply); err != nil {
			return
		}
	}
}

// readCommand reads one RESP array of bulk strings.
func readCommand(r *bufio.Reader) ([]string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	count, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "*")))
	if err != nil || count < 1 {
		return nil, fmt.Errorf("bad command header %q", line)
	}
	args := make([]string, count)
	for i := range args {
		if line, err = r.ReadString('\n'); err != nil {
			return nil, err
		}
		size, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "$")))
		if err != nil || size < 0 {
			return nil, fmt.Errorf("bad bulk header %q", line)
		}
		buf := make([]byte, size+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return nil, err
		}
		args[i] = string(buf[:size])
	}
	return args, nil
}

// TestClusterScriptSentOnce: in cluster mode a script whose connection
// breaks after it was sent (it may have run) is not sent again, while a
// MOVED redirect, answered before anything ran, is followed.
func TestClusterScriptSentOnce(t *testing.T) {
	lim := mustLimit(t, bucket.TokenBucket, 10, time.Second, 10)
	newCluster := func(addr string) *Backend {
		b := newTestBackend(t, func(c *Config) { c.Mode = ModeCluster }, addr)
		cc, ok := b.Client().(*redis.ClusterClient)
		if !ok {
			t.Fatalf("cluster mode client is a %T", b.Client())
		}
		if o := cc.Options(); o.MaxRetries != -1 || o.MaxRedirects != maxRedirects {
			t.Fatalf("cluster options: MaxRetries %d, MaxRedirects %d; want -1, %d", o.MaxRetries, o.MaxRedirects, maxRedirects)
		}
		return b
	}

	lost := startFakeNode(t, func() string { return "" })
	_, err := newCluster(lost.addr()).AllowNAt(bg, "k", lim, 1, base, 1)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("reply lost: %v, want ErrUnavailable", err)
	}
	if got := lost.scripts.Load(); got != 1 {
		t.Fatalf("reply lost: the script was sent %d times, want once", got)
	}

	target := startFakeNode(t, func() string {
		return fmt.Sprintf("*4\r\n:1\r\n:%d\r\n:0\r\n:0\r\n", base/nsPerMs) // allowed, full
	})
	moved := startFakeNode(t, func() string { return "-MOVED 1 " + target.addr() + "\r\n" })
	r, err := newCluster(moved.addr()).AllowNAt(bg, "k", lim, 1, base, 1)
	if err != nil || !r.Allowed {
		t.Fatalf("after MOVED: %+v, %v; want allowed", r, err)
	}
	if m, tg := moved.scripts.Load(), target.scripts.Load(); m != 1 || tg != 1 {
		t.Fatalf("after MOVED: the script reached the first node %d times and the target %d, want once each", m, tg)
	}
}
