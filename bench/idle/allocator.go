package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/internal/proccpu"
	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// allocRules is the allocator mode's rule: 100 tokens a day per value, so
// that a key a grant debited stays tracked (its bucket is not full again
// for hours) after its lease ends, and the cluster keeps every key it was
// given through both windows.
const allocRules = `domain: idle
descriptors:
  - key: t
    rate_limit:
      unit: day
      requests_per_unit: 100
`

// allocOptions are the flags of the allocator mode.
type allocOptions struct {
	keys    int
	window  time.Duration
	settle  time.Duration
	bin     string
	profile string
	args    string
	env     string
}

// allocLoaders is how many agents load the keys at once; each sends its
// calls one after another (an agent's request ids must arrive in order).
const allocLoaders = 4

// keysPerCall is the most keys an Acquire call carries.
const keysPerCall = 1000

// runAllocator measures an idle allocator cluster: three cmd/allocator
// processes with the shipped defaults, given o.keys keys through Acquire
// (one lease of 5 tokens each, packed keys and grants as agents send
// them), then no traffic. It reads each process's CPU from /proc over
// o.window twice: while the leases are held (the window starts 3 s after
// the last grant), and after every lease has ended (o.settle after that). It prints each node's role,
// CPU as a share of one core, resident memory, and the keys and leases
// the leader tracks at the start and end of each window.
func runAllocator(o allocOptions) error {
	dir, bin, rulesPath, err := setup(o.bin, allocRules)
	if dir != "" {
		defer os.RemoveAll(dir)
	}
	if err != nil {
		return err
	}
	addrs, err := testproc.FreeLoopbackAddrs(9)
	if err != nil {
		return err
	}
	tokenArgs, token, err := testproc.AdminToken(dir)
	if err != nil {
		return err
	}
	nodes := make([]*testproc.Node, 3)
	for i := range nodes {
		n := &testproc.Node{ID: fmt.Sprintf("n%d", i), GRPC: addrs[3*i], Raft: addrs[3*i+1], HTTP: addrs[3*i+2]}
		n.Proc = testproc.NewProc(n.ID, dir, bin, "-node-id", n.ID, "-data-dir", filepath.Join(dir, n.ID),
			"-grpc-addr", n.GRPC, "-raft-addr", n.Raft, "-http-addr", n.HTTP, "-log-level", "warn")
		n.Proc.Args = append(append(n.Proc.Args, tokenArgs...), strings.Fields(o.args)...)
		if o.env != "" {
			n.Proc.Env = strings.Split(o.env, ",")
		}
		if i == 0 {
			n.Proc.Args = append(n.Proc.Args, "-bootstrap", "-rules", rulesPath)
		} else {
			n.Proc.Args = append(n.Proc.Args, "-join", nodes[0].GRPC)
		}
		nodes[i] = n
	}
	defer func() {
		for _, n := range nodes {
			n.Proc.Terminate(10 * time.Second)
		}
	}()
	ctx := context.Background()
	for _, n := range nodes {
		if err := n.Proc.Run(); err != nil {
			return err
		}
		if err := n.WaitReady(ctx, 60*time.Second); err != nil {
			return err
		}
	}
	leader, err := waitLeader(nodes, 3, 60*time.Second)
	if err != nil {
		return err
	}
	cc, err := grpc.NewClient(nodes[leader].GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer cc.Close()

	start := time.Now()
	minTTL, err := loadKeys(ctx, allotv1.NewAllocatorClient(cc), o.keys)
	if err != nil {
		return err
	}
	fmt.Printf("3 allocators, leader %s; %d keys leased in %v through Acquire (%d keys a call), shortest lease %v; args %q env %q\n",
		nodes[leader].ID, o.keys, time.Since(start).Round(time.Millisecond), keysPerCall, minTTL, o.args, o.env)

	time.Sleep(3 * time.Second)
	if err := idleWindow(nodes, o.window, "leases held", "", ""); err != nil {
		return err
	}
	// Every lease ends within its TTL (the loading agents are forgotten
	// after the agent TTL, 2 min by default: one Expire entry, in or
	// after the second window).
	if err := waitDrained(nodes, 10*time.Minute); err != nil {
		return err
	}
	time.Sleep(o.settle)
	return idleWindow(nodes, o.window, "leases ended", o.profile, token)
}

// loadKeys leases keys t=0 … t=n-1 through Acquire calls from
// allocLoaders agents and returns the shortest lease granted. Every key
// must be granted.
func loadKeys(ctx context.Context, c allotv1.AllocatorClient, n int) (time.Duration, error) {
	var (
		mu     sync.Mutex
		minTTL = time.Duration(1<<63 - 1)
		wg     sync.WaitGroup
		errs   = make([]error, allocLoaders)
	)
	for w := range allocLoaders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			agent := fmt.Sprintf("idle-load-%d-%d", w, time.Now().UnixNano())
			keys := make([]*allotv1.KeyAcquire, 0, keysPerCall)
			var reqID uint64
			for lo := w * keysPerCall; lo < n; lo += allocLoaders * keysPerCall {
				keys = keys[:0]
				for i := lo; i < min(lo+keysPerCall, n); i++ {
					keys = append(keys, &allotv1.KeyAcquire{Domain: "idle",
						Entries: []*allotv1.Entry{{Key: "t", Value: strconv.Itoa(i)}}, Want: 5})
				}
				reqID++
				req := &allotv1.AcquireRequest{AgentId: agent, RequestId: reqID, PackedGrants: true,
					PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
				ttl, err := acquireAll(ctx, c, req, len(keys))
				if err != nil {
					errs[w] = err
					return
				}
				mu.Lock()
				minTTL = min(minTTL, ttl)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return minTTL, errors.Join(errs...)
}

// acquireAll sends req (retrying it, with the same request id, while the
// cluster is Unavailable or the agent is throttled) and checks that each
// of its want keys was granted; it returns the shortest lease.
func acquireAll(ctx context.Context, c allotv1.AllocatorClient, req *allotv1.AcquireRequest, want int) (time.Duration, error) {
	var resp *allotv1.AcquireResponse
	var err error
	for try := 0; try < 50; try++ {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		resp, err = c.Acquire(cctx, req)
		cancel()
		if err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return 0, fmt.Errorf("acquire: %w", err)
	}
	grants, err := allotv1.GrantsOf(resp)
	if err != nil {
		return 0, err
	}
	if len(grants) != want {
		return 0, fmt.Errorf("acquire: %d grants for %d keys", len(grants), want)
	}
	ttl := time.Duration(1<<63 - 1)
	for _, g := range grants {
		if g.GetStatus() != allotv1.KeyStatus_KEY_STATUS_OK || g.GetGranted() <= 0 {
			return 0, fmt.Errorf("acquire: a key answered %v with %d tokens", g.GetStatus(), g.GetGranted())
		}
		ttl = min(ttl, time.Duration(g.GetLeaseTtlMs())*time.Millisecond)
	}
	return ttl, nil
}

// idleWindow reads every node's CPU over d with no traffic and prints it
// per node with its resident memory, and the leader's keys and leases at
// the start and end (and whether leadership moved in the window). With
// profile set it also saves a CPU profile of the leader over the window.
func idleWindow(nodes []*testproc.Node, d time.Duration, what, profile, token string) error {
	leader, err := findLeader(nodes)
	if err != nil {
		return err
	}
	m0, err := testproc.Scrape("http://" + nodes[leader].HTTP + "/metrics")
	if err != nil {
		return err
	}
	load0 := proccpu.LoadAvg()
	c0 := make([]time.Duration, len(nodes))
	for i, n := range nodes {
		if c0[i], err = proccpu.Of(n.Proc.Pid()); err != nil {
			return err
		}
	}
	t0 := time.Now()
	profiled := func() error { return nil }
	if profile != "" {
		if profiled, err = saveProfile(nodes[leader], token, int(d.Seconds()), profile); err != nil {
			return err
		}
	}
	time.Sleep(time.Until(t0.Add(d)))
	if err := profiled(); err != nil {
		return err
	}
	secs := time.Since(t0).Seconds()
	var parts []string
	var total time.Duration
	for i, n := range nodes {
		c1, err := proccpu.Of(n.Proc.Pid())
		if err != nil {
			return err
		}
		role := "follower"
		if i == leader {
			role = "leader"
		}
		total += c1 - c0[i]
		parts = append(parts, fmt.Sprintf("%s (%s) %.2f%% of a core, RSS %s", n.ID, role, 100*(c1-c0[i]).Seconds()/secs, rss(n.Proc.Pid())))
	}
	m1, err := testproc.Scrape("http://" + nodes[leader].HTTP + "/metrics")
	if err != nil {
		return err
	}
	if l, err := findLeader(nodes); err != nil || l != leader {
		fmt.Printf("leadership moved in the window (now: %v, %v)\n", l, err)
	}
	fmt.Printf("idle allocators, %s, over %v: %s; three nodes %.2f%%; leader tracks %.0f→%.0f keys, %.0f→%.0f leases, %.0f→%.0f agents; load %s → %s\n",
		what, d, strings.Join(parts, "; "), 100*total.Seconds()/secs,
		m0.Get("allot_allocator_keys"), m1.Get("allot_allocator_keys"),
		m0.Get("allot_allocator_leases"), m1.Get("allot_allocator_leases"),
		m0.Get("allot_allocator_agents"), m1.Get("allot_allocator_agents"), load0, proccpu.LoadAvg())
	return nil
}

// waitLeader returns the index of the node that reports itself leader,
// once the leader's configuration lists members nodes.
func waitLeader(nodes []*testproc.Node, members int, within time.Duration) (int, error) {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if l, err := findLeader(nodes); err == nil {
			m, err := testproc.Scrape("http://" + nodes[l].HTTP + "/metrics")
			if err == nil && m.Get("allot_allocator_raft_applied_index") > 0 && countReady(nodes) == members {
				return l, nil
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	return 0, errors.New("no leader with every node ready")
}

func countReady(nodes []*testproc.Node) int {
	n := 0
	for _, x := range nodes {
		if x.Ready() {
			n++
		}
	}
	return n
}

// findLeader returns the index of the node whose /metrics says it leads.
func findLeader(nodes []*testproc.Node) (int, error) {
	for i, n := range nodes {
		m, err := testproc.Scrape("http://" + n.HTTP + "/metrics")
		if err == nil && m.Get("allot_allocator_is_leader") == 1 {
			return i, nil
		}
	}
	return 0, errors.New("no node leads")
}

// waitDrained waits until no node holds a lease.
func waitDrained(nodes []*testproc.Node, within time.Duration) error {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		left := 0.0
		for _, n := range nodes {
			m, err := testproc.Scrape("http://" + n.HTTP + "/metrics")
			if err != nil {
				return err
			}
			left += m.Get("allot_allocator_leases")
		}
		if left == 0 {
			return nil
		}
		time.Sleep(time.Second)
	}
	return errors.New("leases still live")
}

// saveProfile starts a CPU profile of n over secs seconds, written to
// path; the returned function waits for it to be saved.
func saveProfile(n *testproc.Node, token string, secs int, path string) (func() error, error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { // waited for by the returned function; ends within secs+30 s
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(secs+30)*time.Second)
		defer cancel()
		resp, err := testproc.GetWithToken(ctx, fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", n.HTTP, max(secs-1, 1)), token)
		if err == nil {
			_, err = io.Copy(f, resp.Body)
			resp.Body.Close()
		}
		done <- errors.Join(err, f.Close())
	}()
	return func() error { return <-done }, nil
}

// rss is a process's resident memory from /proc/<pid>/status.
func rss(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return fmt.Sprintf("%d MiB", kb>>10)
		}
	}
	return "?"
}
