// Command acquire benchmarks the allocator cluster: three cmd/allocator
// processes on loopback (Raft over TCP, bolt with fsync), client goroutines
// driving batched Acquire calls at a target rate of key-grants per second,
// then leader failovers by SIGKILL.
//
// Run from the repository root:
//
//	go run ./bench/acquire -duration 20s -rate 20000 -failovers 5
//
// It reports achieved key-grants/s, Acquire latency (p50/p99/p99.9, from an
// HdrHistogram), Raft entries/s and keys per entry (from the leader's
// /metrics), and, per failover, the time from the kill to the next grant
// committed by a new leader. The load is bounded in time and sent only to
// 127.0.0.1.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/internal/allocproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The benchmark's rule: every user value has 1000 tokens/s with a burst of
// 1000, so that grants are not limited by the budget.
const benchRules = `domain: bench
descriptors:
  - key: user
    rate_limit:
      unit: second
      requests_per_unit: 1000
      burst: 1000
`

type options struct {
	duration    time.Duration
	rate        int
	keysPerCall int
	clients     int
	keyspace    int
	failovers   int
	target      string
	bin         string
	dir         string
	inflight    int
	timeouts    string
	profile     string
}

func main() {
	var o options
	flag.DurationVar(&o.duration, "duration", 20*time.Second, "length of the throughput phase")
	flag.IntVar(&o.rate, "rate", 20000, "target key-grants per second")
	flag.IntVar(&o.keysPerCall, "keys-per-call", 100, "keys per Acquire call")
	flag.IntVar(&o.clients, "clients", 16, "client goroutines (one agent id each)")
	flag.IntVar(&o.keyspace, "keyspace", 100000, "distinct budget keys")
	flag.IntVar(&o.failovers, "failovers", 5, "leader kills in the failover phase (0: none)")
	flag.StringVar(&o.target, "target", "all", "send calls to: all (round robin; followers forward) or leader")
	flag.StringVar(&o.bin, "bin", "", "prebuilt cmd/allocator binary (default: go build it)")
	flag.StringVar(&o.dir, "dir", "", "directory for data and logs (default: a new temp dir, removed after)")
	flag.IntVar(&o.inflight, "max-inflight-batches", 1, "passed to the allocators")
	flag.StringVar(&o.timeouts, "raft-timeouts", "500ms/500ms/250ms", "heartbeat/election/leader-lease timeouts")
	flag.StringVar(&o.profile, "leader-cpuprofile", "", "write a CPU profile of the leader, taken during the throughput phase, to this file")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "acquire:", err)
		os.Exit(1)
	}
}

// node is one allocator process.

// node is one allocator process.
type node = allocproc.Node

func run(o options) error {
	if o.rate <= 0 || o.keysPerCall <= 0 || o.clients <= 0 || o.keyspace <= 0 {
		return errors.New("rate, keys-per-call, clients and keyspace must be positive")
	}
	tmo := strings.Split(o.timeouts, "/")
	if len(tmo) != 3 {
		return errors.New("-raft-timeouts wants heartbeat/election/lease")
	}
	dir := o.dir
	if dir == "" {
		d, err := os.MkdirTemp("", "allot-bench-acquire-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	bin := o.bin
	if bin == "" {
		bin = filepath.Join(dir, "allocator")
		out, err := exec.Command("go", "build", "-o", bin, "github.com/allot/allot/cmd/allocator").CombinedOutput()
		if err != nil {
			return fmt.Errorf("go build: %v\n%s", err, out)
		}
	}
	rulesPath := filepath.Join(dir, "bench.yaml")
	if err := os.WriteFile(rulesPath, []byte(benchRules), 0o600); err != nil {
		return err
	}
	ports, err := allocproc.FreeAddrs(9)
	if err != nil {
		return err
	}
	nodes := make([]*node, 3)
	for i := range nodes {
		n := &node{ID: fmt.Sprintf("b%d", i), GRPC: ports[3*i], Raft: ports[3*i+1], HTTP: ports[3*i+2],
			LogPath: filepath.Join(dir, fmt.Sprintf("b%d.log", i))}
		n.Args = []string{"-node-id", n.ID, "-data-dir", filepath.Join(dir, n.ID),
			"-grpc-addr", n.GRPC, "-raft-addr", n.Raft, "-http-addr", n.HTTP,
			"-heartbeat-timeout", tmo[0], "-election-timeout", tmo[1], "-leader-lease-timeout", tmo[2],
			"-max-inflight-batches", strconv.Itoa(o.inflight), "-log-level", "warn"}
		if i == 0 {
			n.Args = append(n.Args, "-bootstrap", "-rules", rulesPath)
		} else {
			n.Args = append(n.Args, "-join", nodes[0].GRPC)
		}
		nodes[i] = n
	}
	defer func() {
		for _, n := range nodes {
			n.Kill()
		}
	}()
	for _, n := range nodes {
		if err := n.Start(bin); err != nil {
			return err
		}
	}
	for _, n := range nodes {
		if err := n.WaitReady(context.Background(), 30*time.Second); err != nil {
			return err
		}
	}
	conns := make([]*grpc.ClientConn, 3)
	for i, n := range nodes {
		cc, err := grpc.NewClient(n.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer cc.Close()
		conns[i] = cc
	}
	admin := allotv1.NewAdminClient(conns[0])
	if err := waitMembers(admin, 3, 30*time.Second); err != nil {
		return err
	}
	fmt.Printf("3 allocators up (dir %s); load: %d key-grants/s target, %d keys/call, %d clients, %d keys, %s, timeouts %s\n",
		dir, o.rate, o.keysPerCall, o.clients, o.keyspace, o.target, o.timeouts)

	lg := newLoad(o, conns)
	leader, err := leaderIndex(admin, nodes)
	if err != nil {
		return err
	}
	if o.target == "leader" {
		lg.pin(leader)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	lg.start(ctx, &wg)

	// Warm up, then measure.
	time.Sleep(2 * time.Second)
	lg.reset()
	m0, err := scrape(nodes[leader])
	if err != nil {
		return err
	}
	start := time.Now()
	if o.profile != "" {
		secs := max(int(o.duration.Seconds())-1, 1)
		if err := fetchProfile(nodes[leader], secs, o.profile); err != nil {
			return err
		}
	}
	time.Sleep(time.Until(start.Add(o.duration)))
	elapsed := time.Since(start)
	m1, err := scrape(nodes[leader])
	if err != nil {
		return err
	}
	lg.report(elapsed, m0, m1)

	// Failovers: kill the leader, time the next grant from a new leader,
	// restart the killed node, let it catch up.
	var recov, elections []time.Duration
	for i := range o.failovers {
		leader, err = leaderIndex(admin, nodes)
		if err != nil {
			return err
		}
		victim := nodes[leader]
		if o.target == "leader" {
			lg.pin(-1)
		}
		survivor := allotv1.NewAdminClient(conns[(leader+1)%3])
		killAt := lg.markKill(victim.ID)
		victim.Kill()
		elected := waitNewLeader(survivor, victim.ID, killAt, 30*time.Second)
		d, err := lg.waitRecovery(killAt, 30*time.Second)
		if err != nil {
			return fmt.Errorf("failover %d: %w", i+1, err)
		}
		recov = append(recov, d)
		elections = append(elections, elected)
		fmt.Printf("failover %d: killed leader %s; new leader known to a survivor after %v, first grant from it after %v\n",
			i+1, victim.ID, elected.Round(time.Millisecond), d.Round(time.Millisecond))
		if err := victim.Start(bin); err != nil {
			return err
		}
		if err := victim.WaitReady(context.Background(), 30*time.Second); err != nil {
			return err
		}
		time.Sleep(2 * time.Second)
		admin = allotv1.NewAdminClient(conns[(leader+1)%3])
		if o.target == "leader" {
			if l, err := leaderIndex(admin, nodes); err == nil {
				lg.pin(l)
			}
		}
	}
	cancel()
	wg.Wait()
	if len(recov) > 0 {
		slices.Sort(recov)
		slices.Sort(elections)
		fmt.Printf("failover: n=%d median %v max %v (kill → first grant committed by the new leader); election alone: median %v max %v\n",
			len(recov), recov[len(recov)/2].Round(time.Millisecond), recov[len(recov)-1].Round(time.Millisecond),
			elections[len(elections)/2].Round(time.Millisecond), elections[len(elections)-1].Round(time.Millisecond))
	}
	return nil
}

// load drives Acquire calls from o.clients goroutines, each paced to its
// share of the target rate (open loop: a slow call delays that client's
// next one only).
type load struct {
	o      options
	conns  []*grpc.ClientConn
	pinned atomic.Int32 // node index all calls go to, or -1

	mu       sync.Mutex // guards the fields below
	hist     *hdrhistogram.Histogram
	calls    int64
	keysOK   int64
	granted  int64
	errs     int64
	killAt   time.Time
	killed   string
	recovery time.Duration // -1 until the first grant after killAt
}

func newLoad(o options, conns []*grpc.ClientConn) *load {
	l := &load{o: o, conns: conns, hist: hdrhistogram.New(1, 60_000_000, 3), recovery: -1}
	l.pinned.Store(-1)
	return l
}

func (l *load) pin(i int) { l.pinned.Store(int32(i)) }

func (l *load) start(ctx context.Context, wg *sync.WaitGroup) {
	callsPerSec := float64(l.o.rate) / float64(l.o.keysPerCall)
	interval := time.Duration(float64(time.Second) * float64(l.o.clients) / callsPerSec)
	for c := range l.o.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.client(ctx, c, interval)
		}()
	}
}

func (l *load) client(ctx context.Context, c int, interval time.Duration) {
	agent := fmt.Sprintf("bench-%d-%d", c, time.Now().UnixNano())
	clients := make([]allotv1.AllocatorClient, len(l.conns))
	for i, cc := range l.conns {
		clients[i] = allotv1.NewAllocatorClient(cc)
	}
	next := time.Now().Add(time.Duration(c) * interval / time.Duration(l.o.clients))
	node := c % len(clients)
	var reqID uint64
	keyN := c * 7919
	for ctx.Err() == nil {
		if d := time.Until(next); d > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(d):
			}
		}
		next = next.Add(interval)
		if behind := time.Since(next); behind > time.Second {
			next = time.Now() // do not burst to catch up after a stall
		}
		reqID++
		req := &allotv1.AcquireRequest{AgentId: agent, RequestId: reqID, Keys: make([]*allotv1.KeyAcquire, l.o.keysPerCall)}
		for k := range req.Keys {
			keyN = (keyN + 1) % l.o.keyspace
			req.Keys[k] = &allotv1.KeyAcquire{Domain: "bench", Entries: []*allotv1.Entry{{Key: "user", Value: strconv.Itoa(keyN)}},
				Want: 5, Demand: 5}
		}
		// Retry the same request id (idempotent) on the next node until it
		// succeeds.
		for ctx.Err() == nil {
			target := node
			if p := int(l.pinned.Load()); p >= 0 {
				target = p
			}
			t0 := time.Now()
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			resp, err := clients[target].Acquire(cctx, req)
			cancel()
			if err == nil {
				l.record(time.Since(t0), resp, t0)
				if l.o.target == "all" {
					node = (node + 1) % len(clients)
				}
				break
			}
			if ctx.Err() != nil {
				return
			}
			l.mu.Lock()
			l.errs++
			l.mu.Unlock()
			node = (node + 1) % len(clients)
			select {
			case <-ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
}

func (l *load) record(lat time.Duration, resp *allotv1.AcquireResponse, sent time.Time) {
	var ok, granted int64
	for _, g := range resp.GetGrants() {
		if g.GetStatus() == allotv1.KeyStatus_KEY_STATUS_OK {
			ok++
			granted += g.GetGranted()
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	_ = l.hist.RecordValue(lat.Microseconds())
	l.calls++
	l.keysOK += ok
	l.granted += granted
	if !l.killAt.IsZero() && l.recovery < 0 && resp.GetLeaderId() != l.killed {
		l.recovery = time.Since(l.killAt)
	}
}

func (l *load) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.hist.Reset()
	l.calls, l.keysOK, l.granted, l.errs = 0, 0, 0, 0
}

func (l *load) markKill(victim string) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.killAt = time.Now()
	l.killed = victim
	l.recovery = -1
	return l.killAt
}

func (l *load) waitRecovery(killAt time.Time, timeout time.Duration) (time.Duration, error) {
	deadline := killAt.Add(timeout)
	for time.Now().Before(deadline) {
		l.mu.Lock()
		r := l.recovery
		l.mu.Unlock()
		if r >= 0 {
			return r, nil
		}
		time.Sleep(time.Millisecond)
	}
	return 0, fmt.Errorf("no grant within %v of the kill", timeout)
}

func (l *load) report(elapsed time.Duration, m0, m1 map[string]float64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	secs := elapsed.Seconds()
	q := func(p float64) string {
		return (time.Duration(l.hist.ValueAtQuantile(p)) * time.Microsecond).Round(10 * time.Microsecond).String()
	}
	fmt.Printf("throughput: %.0f key-grants/s (keys answered OK; %.0f tokens/s granted), %.0f calls/s, %d failed calls, over %v\n",
		float64(l.keysOK)/secs, float64(l.granted)/secs, float64(l.calls)/secs, l.errs, elapsed.Round(time.Millisecond))
	fmt.Printf("acquire latency: p50 %s  p99 %s  p99.9 %s  max %s  (n=%d)\n",
		q(50), q(99), q(99.9), (time.Duration(l.hist.Max()) * time.Microsecond).String(), l.hist.TotalCount())
	entries := m1[`allot_allocator_batch_keys_count`] - m0[`allot_allocator_batch_keys_count`]
	keys := m1[`allot_allocator_batch_keys_sum`] - m0[`allot_allocator_batch_keys_sum`]
	reqs := m1[`allot_allocator_batch_requests_sum`] - m0[`allot_allocator_batch_requests_sum`]
	applyN := m1[`allot_allocator_raft_apply_seconds_count`] - m0[`allot_allocator_raft_apply_seconds_count`]
	applyS := m1[`allot_allocator_raft_apply_seconds_sum`] - m0[`allot_allocator_raft_apply_seconds_sum`]
	if entries > 0 {
		fmt.Printf("raft: %.0f acquire entries/s, %.0f keys/entry, %.1f calls/entry, mean commit %.2f ms (leader's raft.Apply → applied)\n",
			entries/secs, keys/entries, reqs/entries, 1000*applyS/max(applyN, 1))
	}
}

// fetchProfile saves a CPU profile of n taken over secs seconds.
func fetchProfile(n *node, secs int, path string) error {
	resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", n.HTTP, secs))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// scrape reads a node's /metrics into name{labels} → value.
func scrape(n *node) (map[string]float64, error) {
	resp, err := http.Get("http://" + n.HTTP + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			out[line[:i]] = v
		}
	}
	return out, sc.Err()
}

func leaderIndex(admin allotv1.AdminClient, nodes []*node) (int, error) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		cancel()
		if err == nil {
			for i, n := range nodes {
				if n.ID == st.GetLeaderId() {
					return i, nil
				}
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return 0, errors.New("no leader")
}

// waitNewLeader polls a surviving node until it names a leader other than
// victim, and returns the time since killAt (-1 on timeout).
func waitNewLeader(admin allotv1.AdminClient, victim string, killAt time.Time, timeout time.Duration) time.Duration {
	for time.Since(killAt) < timeout {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		cancel()
		if err == nil && st.GetLeaderId() != "" && st.GetLeaderId() != victim {
			return time.Since(killAt)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return -1
}

func waitMembers(admin allotv1.AdminClient, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		st, err := admin.ClusterStatus(context.Background(), &allotv1.ClusterStatusRequest{})
		if err == nil && len(st.GetMembers()) == n {
			ok := true
			for _, m := range st.GetMembers() {
				ok = ok && m.GetGrpcAddr() != ""
			}
			if ok {
				return nil
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("cluster did not reach %d members", n)
}
