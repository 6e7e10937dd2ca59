// Command acquire benchmarks the allocator cluster: three cmd/allocator
// processes on loopback (Raft over TCP, bolt with fsync), client goroutines
// driving batched Acquire calls at a target rate of key-grants per second,
// then leader failovers by SIGKILL.
//
// Run from the repository root:
//
//	go run ./bench/acquire -duration 20s -rate 20000 -failovers 5
//
// The load is open loop: every call leaves at its slot in a fixed schedule,
// whether or not earlier calls have answered, and a client that falls
// behind never skips or resets its schedule. -mode grants (the default)
// renews leases on -keyspace keys; -mode fleet makes most keys of a call
// first uses of cold keys (a charge, no lease) over 5M distinct keys. The
// clients walk the keys in order; -key-order random draws each at random,
// as real calls come.
// Calls carry their keys packed (AcquireRequest.packed_keys) and ask for
// packed grants, as agents do; -packed-keys=false sends a KeyAcquire
// message per key, which a build that does not read packed keys needs.
//
// It reports offered and achieved key-grants/s; Acquire latency
// (p50/p99/p99.9, from HdrHistogram) both from the actual send of the
// attempt that succeeded and from the call's intended send time (so a call
// delayed by the client, the in-flight cap or a retry is counted, not
// omitted; calls unanswered at the end count with their age), the worst
// such latency of each second of the window, and how late sends left;
// leadership changes in the window; each allocator's CPU (from
// /proc/<pid>/stat over the measured window) in cores and µs per
// key-grant, and the load client's, and the allocators' CPU against the
// load client's (the client's work per call is fixed, so the ratio moves
// with the code, where on a shared machine a CPU-second is not a fixed
// amount of work); how long each allocator's threads and
// the load client's waited on a run queue for a core against their time on
// one (/proc/<pid>/task/*/schedstat), and the machine's idle, iowait and
// steal shares (/proc/stat): on a shared machine a goroutine whose thread
// waits for a core shows as running in Go's trace, so a stage's wall time
// can be mostly that wait; the load average; with -idle, the
// allocators' CPU with no traffic afterwards; Raft entries/s and keys per
// entry; the p50/p99 of each stage of an Acquire over the same window,
// read from the nodes' /metrics histograms (follower handler and hop,
// leader handler, batcher queue, raft.Apply, commit wait, FSM apply); with
// -gctrace, each node's GC cycles and stop-the-world pauses; and, per
// failover, the time from the kill to the next grant committed by a new
// leader. The load is bounded in time and sent only to 127.0.0.1. With -fsync-probe it also times an
// fsync in the data directory throughout the window, the disk's own tail.
// -burners N runs N processes beside the cluster that each spin one
// thread, a neighbour's load on the same cores, and reports their CPU.
// -leader-trace saves a Go execution trace of the leader over the window
// (go tool trace; with -leader-cpuprofile as well it carries CPU samples,
// which tell a goroutine on a core from one whose thread waits for one).
//
// Clients follow the leader as agents do (-target follow): a client starts
// on any node and moves to the address in a forwarded answer's leader
// header, so after the first call the leader serves every call.
//
// With -groups N the cluster is bootstrapped with N data groups
// (allocator -bootstrap -groups N). The load learns the topology from the
// rule watch stream and from Acquire answers, as agents do, splits each
// call's keys by the group that owns their slot and sends one Acquire per
// group (AcquireRequest.group) straight to that group's leader. It reports
// each group's achieved key-grants/s and latency besides the totals, and
// names the data groups each node leads beside its CPU (the CPU of a node
// is that of every group replica it hosts). A failover kills the node that
// leads the most data groups and times the kill to the first grant from a
// new leader of every group it led.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/internal/proccpu"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
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
	duration     time.Duration
	warmup       time.Duration
	rate         int
	keysPerCall  int
	clients      int
	keyspace     int
	keyOrder     string
	failovers    int
	target       string
	idleProfile  string
	bin          string
	dir          string
	inflight     int
	timeouts     string
	profile      string
	fprofile     string
	ltrace       string
	packed       bool
	packedKeys   bool
	env          string
	args         string
	gctrace      bool
	maxInflight  int
	mode         string
	hotKeys      int
	coldFraction float64
	idle         time.Duration
	fsyncProbe   time.Duration
	cprofile     string
	groups       int
	burners      int
}

func main() {
	burnIfAsked()
	var o options
	flag.DurationVar(&o.duration, "duration", 20*time.Second, "length of the throughput phase")
	flag.DurationVar(&o.warmup, "warmup", 2*time.Second, "load before the throughput phase, not measured")
	flag.IntVar(&o.rate, "rate", 20000, "target key-grants per second")
	flag.IntVar(&o.keysPerCall, "keys-per-call", 100, "keys per Acquire call")
	flag.IntVar(&o.clients, "clients", 16, "client goroutines (one agent id each)")
	flag.IntVar(&o.keyspace, "keyspace", 0, "distinct budget keys (-mode fleet: distinct cold keys) (default 100000; -mode fleet 5000000)")
	flag.StringVar(&o.keyOrder, "key-order", "walk", "walk (each client takes the keys after its last call's, and the cold keys of -mode fleet follow one another, so a cold cluster allocates the keys' entries in the order calls meet them) or random (each key drawn at random: a hot key from -hot-keys, a cold one from -keyspace)")
	flag.StringVar(&o.mode, "mode", "grants", "grants: every key a lease renewal (want 5); fleet: -cold-fraction of each call's keys are first uses of cold keys (one token charged, no lease), the rest renewals of -hot-keys keys that also charge")
	flag.IntVar(&o.hotKeys, "hot-keys", 10000, "-mode fleet: distinct leased (hot) keys")
	flag.Float64Var(&o.coldFraction, "cold-fraction", 0.85, "-mode fleet: share of each call's keys that are cold first uses")
	flag.IntVar(&o.maxInflight, "max-inflight-calls", 8192, "calls in flight at once over all clients; a call due beyond it waits (counted in its latency from the intended send)")
	flag.DurationVar(&o.idle, "idle", 0, "after the throughput phase, stop the load and measure the allocators' CPU with no traffic for this long")
	flag.StringVar(&o.idleProfile, "idle-cpuprofile", "", "with -idle: write a CPU profile of the leader, taken during the second half of the idle window, to this file")
	flag.IntVar(&o.failovers, "failovers", 5, "leader kills in the failover phase (0: none)")
	flag.BoolVar(&o.packed, "packed-grants", true, "ask for the grants packed (AcquireRequest.packed_grants), as agents do; false: one KeyGrant message per key")
	flag.BoolVar(&o.packedKeys, "packed-keys", true, "send the keys packed (AcquireRequest.packed_keys), as agents do once the allocator reads them; false: one KeyAcquire message per key (use false with -bin of a build that does not read them: it answers no grants)")
	flag.StringVar(&o.target, "target", "follow", "send calls to: follow (each client starts on a node and moves where a forwarded answer's leader header points, as agents do), all (round robin; followers forward), or leader")
	flag.StringVar(&o.bin, "bin", "", "prebuilt cmd/allocator binary (default: go build it)")
	flag.StringVar(&o.dir, "dir", "", "directory for data and logs (default: a new temp dir, removed after)")
	flag.IntVar(&o.inflight, "max-inflight-batches", 0, "passed to the allocators (0: their default)")
	flag.StringVar(&o.timeouts, "raft-timeouts", "500ms/500ms/500ms", "heartbeat/election/leader-lease timeouts (the allocator's defaults)")
	flag.StringVar(&o.profile, "leader-cpuprofile", "", "write a CPU profile of the leader, taken during the throughput phase, to this file")
	flag.StringVar(&o.ltrace, "leader-trace", "", "write a Go execution trace of the leader (runtime/trace, /debug/pprof/trace), taken over the same window as -leader-cpuprofile, to this file (go tool trace)")
	flag.StringVar(&o.fprofile, "follower-cpuprofile", "", "write a CPU profile of one follower, taken over the same window as -leader-cpuprofile, to this file")
	flag.StringVar(&o.env, "allocator-env", "", "comma-separated NAME=VALUE pairs added to the allocators' environment (e.g. GOGC=200)")
	flag.StringVar(&o.args, "allocator-args", "", "extra space-separated flags for every allocator")
	flag.StringVar(&o.cprofile, "client-cpuprofile", "", "write a CPU profile of this load client, taken over the throughput phase, to this file")
	flag.DurationVar(&o.fsyncProbe, "fsync-probe", 0, "every this often during the throughput phase, write 4 KB to a file in the data directory and fsync it, and report the fsync latency (0: off)")
	flag.IntVar(&o.groups, "groups", 1, "data groups the cluster is bootstrapped with (allocator -groups); more than 1: each call's keys go split by the group that owns their slot, one Acquire per group, straight to that group's leader, as agents send them")
	flag.IntVar(&o.burners, "burners", 0, "CPU burners to run beside the cluster: processes of this binary, each spinning one thread at this process's nice value from before the allocators start to the end of the run, a neighbour's load on the same cores (their CPU over the window is reported)")
	flag.BoolVar(&o.gctrace, "gctrace", false, "run the allocators with GODEBUG=gctrace=1 and report their GC pauses in the throughput phase")
	flag.Parse()
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "acquire:", err)
		os.Exit(1)
	}
}

// node is one allocator process.
type node = testproc.Node

func run(o options) error {
	if o.keyspace == 0 {
		o.keyspace = 100000
		if o.mode == "fleet" {
			o.keyspace = 5000000
		}
	}
	if o.rate <= 0 || o.keysPerCall <= 0 || o.clients <= 0 || o.keyspace <= 0 || o.maxInflight <= 0 || o.hotKeys <= 0 {
		return errors.New("rate, keys-per-call, clients, keyspace, hot-keys and max-inflight-calls must be positive")
	}
	if o.keyOrder != "walk" && o.keyOrder != "random" {
		return fmt.Errorf("-key-order %q: want walk or random", o.keyOrder)
	}
	if o.target != "all" && o.target != "leader" && o.target != "follow" {
		return fmt.Errorf("-target %q: want all, leader or follow", o.target)
	}
	if o.groups < 1 {
		return errors.New("-groups must be at least 1")
	}
	if o.burners < 0 {
		return errors.New("-burners must not be negative")
	}
	if o.groups > 1 && o.target == "leader" {
		return errors.New("-target leader names one leader: with -groups use follow or all")
	}
	if o.mode != "grants" && o.mode != "fleet" {
		return fmt.Errorf("-mode %q: want grants or fleet", o.mode)
	}
	if o.coldFraction < 0 || o.coldFraction > 1 {
		return errors.New("-cold-fraction must be in [0, 1]")
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
		if err := testproc.GoBuild(dir, false, "github.com/allot/allot/cmd/allocator"); err != nil {
			return err
		}
	}
	rulesPath := filepath.Join(dir, "bench.yaml")
	if err := os.WriteFile(rulesPath, []byte(benchRules), 0o600); err != nil {
		return err
	}
	ports, err := testproc.FreeLoopbackAddrs(9)
	if err != nil {
		return err
	}
	tokenArgs, token, err := testproc.AdminToken(dir)
	if err != nil {
		return err
	}
	burn, err := startBurners(o.burners)
	if err != nil {
		return err
	}
	defer burn.stop()
	nodes := make([]*node, 3)
	for i := range nodes {
		n := &node{ID: fmt.Sprintf("b%d", i), GRPC: ports[3*i], Raft: ports[3*i+1], HTTP: ports[3*i+2]}
		n.Proc = testproc.NewProc(n.ID, dir, bin)
		n.Proc.Args = []string{"-node-id", n.ID, "-data-dir", filepath.Join(dir, n.ID),
			"-grpc-addr", n.GRPC, "-raft-addr", n.Raft, "-http-addr", n.HTTP,
			"-heartbeat-timeout", tmo[0], "-election-timeout", tmo[1], "-leader-lease-timeout", tmo[2],
			"-log-level", "warn"}
		// The token is for pprof; the load's Acquire calls are anonymous
		// agents and its status reads need no admin.
		n.Proc.Args = append(append(n.Proc.Args, tokenArgs...), "-open-reads")
		if o.inflight > 0 {
			n.Proc.Args = append(n.Proc.Args, "-max-inflight-batches", strconv.Itoa(o.inflight))
		}
		n.Proc.Args = append(n.Proc.Args, strings.Fields(o.args)...)
		if o.env != "" {
			n.Proc.Env = strings.Split(o.env, ",")
		}
		if o.gctrace {
			n.Proc.Env = append(n.Proc.Env, "GODEBUG=gctrace=1")
		}
		if i == 0 {
			n.Proc.Args = append(n.Proc.Args, "-bootstrap", "-rules", rulesPath)
			if o.groups > 1 {
				n.Proc.Args = append(n.Proc.Args, "-groups", strconv.Itoa(o.groups))
			}
		} else {
			n.Proc.Args = append(n.Proc.Args, "-join", nodes[0].GRPC)
		}
		nodes[i] = n
	}
	defer func() {
		for _, n := range nodes {
			n.Proc.Kill()
		}
	}()
	// An interrupted run leaves no allocator behind.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	defer close(sig) // after Stop (deferred calls run last first)
	defer signal.Stop(sig)
	go func() {
		if _, ok := <-sig; !ok {
			return
		}
		for _, n := range nodes {
			n.Proc.Kill()
		}
		burn.stop()
		os.Exit(130)
	}()
	for _, n := range nodes {
		if err := n.Proc.Run(); err != nil {
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
	if o.groups > 1 {
		if err := waitGroups(admin, o.groups, 60*time.Second); err != nil {
			return err
		}
	}
	inflight := "the allocators' default"
	if o.inflight > 0 {
		inflight = strconv.Itoa(o.inflight)
	}
	fmt.Printf("3 allocators up (dir %s), %d group(s); load: mode %s, %d keys/s offered, %d keys/call, %d clients, %d keys (%s), %s, timeouts %s, max-inflight-batches %s, args %q, env %q; %d CPU burner(s) beside\n",
		dir, o.groups, o.mode, o.rate, o.keysPerCall, o.clients, o.keyspace, o.keyOrder, o.target, o.timeouts, inflight, o.args, o.env, o.burners)
	if o.mode == "fleet" {
		fmt.Printf("fleet shape: %.0f%% of each call's keys are first uses of cold keys (charged 1, no lease) over %d keys, the rest renewals of %d hot keys\n",
			100*o.coldFraction, o.keyspace, o.hotKeys)
	}

	lg := newLoad(o, conns)
	for _, n := range nodes {
		lg.addrs = append(lg.addrs, n.GRPC)
	}
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
	if o.groups > 1 {
		if lg.slotOf, lg.keySlot, err = keySlots(rulesPath, o.keyspace); err != nil {
			return err
		}
		lg.watch(ctx, &wg)
		if err := lg.waitTopology(30 * time.Second); err != nil {
			return err
		}
	}
	lg.start(ctx, &wg)

	// Warm up, then measure.
	time.Sleep(o.warmup)
	lg.reset()
	role, leaders, err := roles(admin, nodes, o.groups, leader)
	if err != nil {
		return err
	}
	if o.groups > 1 {
		// The node that leads the most data groups stands for "the leader"
		// in the profiles and the idle report.
		leader = leaders[0]
		for _, i := range leaders {
			if len(role[i]) > len(role[leader]) {
				leader = i
			}
		}
		fmt.Printf("measuring: %d data groups; %s\n", o.groups, describeRoles(nodes, role))
	} else {
		fmt.Printf("measuring: leader %s (pid %d)\n", nodes[leader].ID, nodes[leader].Proc.Pid())
	}
	m0, err := scrapeAll(nodes)
	if err != nil {
		return err
	}
	log0 := logSizes(nodes)
	load0 := proccpu.LoadAvg()
	cpu0 := sampleCPU(nodes, burn)
	start := time.Now()
	probe := startFsyncProbe(dir, o.fsyncProbe, start.Add(o.duration))
	if err := fetchProfiles(nodes, leader, token, max(int(o.duration.Seconds())-1, 1), o.profile, o.fprofile, o.ltrace); err != nil {
		return err
	}
	stopProfile, err := startClientProfile(o.cprofile)
	if err != nil {
		return err
	}
	time.Sleep(time.Until(start.Add(o.duration)))
	elapsed := time.Since(start)
	if err := stopProfile(); err != nil {
		return err
	}
	cpu1 := sampleCPU(nodes, burn)
	m1, err := scrapeAll(nodes)
	if err != nil {
		return err
	}
	keysOK := lg.report(elapsed, m0, m1)
	unit := "key-grant"
	if o.mode == "fleet" {
		unit = "key-update"
	}
	cpuReport(nodes, role, cpu0, cpu1, keysOK, unit)
	schedReport(nodes, role, cpu0, cpu1)
	fmt.Printf("load average: %s at the start, %s at the end\n", load0, proccpu.LoadAvg())
	if o.groups > 1 {
		// A node's allot_allocator_keys and _leases gauges read its
		// group-0 state, which holds no keys when data groups do.
		fmt.Println("tracked keys and live leases: not shown with -groups > 1 (a node's /metrics gauges read its group 0 only)")
	} else {
		fmt.Printf("tracked keys (leader): %.0f at the start of the window, %.0f at the end\n", m0[leader]["allot_allocator_keys"], m1[leader]["allot_allocator_keys"])
		fmt.Printf("live leases (leader): %.0f at the start of the window, %.0f at the end; %.0f ended by expiry in it (leases still building up make each grant an add, dearer than a renewal: -warmup)\n",
			m0[leader]["allot_allocator_leases"], m1[leader]["allot_allocator_leases"],
			m1[leader]["allot_allocator_leases_expired_total"]-m0[leader]["allot_allocator_leases_expired_total"])
	}
	breakdown(nodes, leaders, m0, m1)
	if err := probe.report(); err != nil {
		return err
	}
	if o.gctrace {
		gcReport(nodes, log0)
	}
	if o.idle > 0 {
		cancel()
		wg.Wait()
		if err := idleReport(nodes, leader, role, o.idle, token, o.idleProfile); err != nil {
			return err
		}
		ctx, cancel = context.WithCancel(context.Background())
		defer cancel()
		lg.start(ctx, &wg)
	}

	// Failovers: kill the leader (with groups, the node that leads the
	// most data groups), time the next grant from a new leader (of every
	// group it led), restart the killed node, let it catch up.
	var recov, elections []time.Duration
	for i := range o.failovers {
		var led []slots.GroupID
		if o.groups > 1 {
			leader, led, err = busiestLeader(admin, nodes)
		} else {
			leader, err = leaderIndex(admin, nodes)
		}
		if err != nil {
			return err
		}
		victim := nodes[leader]
		if o.target == "leader" {
			lg.pin(-1)
		}
		survivor := allotv1.NewAdminClient(conns[(leader+1)%3])
		killAt := lg.markKill(victim.ID, led)
		victim.Proc.Kill()
		elected := waitNewLeader(survivor, victim.ID, led, killAt, 30*time.Second)
		d, err := lg.waitRecovery(killAt, 30*time.Second)
		if err != nil {
			return fmt.Errorf("failover %d: %w", i+1, err)
		}
		recov = append(recov, d)
		elections = append(elections, elected)
		what := "leader " + victim.ID
		if len(led) > 0 {
			what = fmt.Sprintf("%s, leader of data groups %v", victim.ID, led)
		}
		fmt.Printf("failover %d: killed %s; new leader known to a survivor after %v, first grant from it after %v\n",
			i+1, what, elected.Round(time.Millisecond), d.Round(time.Millisecond))
		if err := victim.Proc.Run(); err != nil {
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
		by := "the new leader"
		if o.groups > 1 {
			by = "a new leader in every data group the killed node led"
		}
		fmt.Printf("failover: n=%d median %v max %v (kill → first grant committed by %s); election alone: median %v max %v\n",
			len(recov), recov[len(recov)/2].Round(time.Millisecond), recov[len(recov)-1].Round(time.Millisecond), by,
			elections[len(elections)/2].Round(time.Millisecond), elections[len(elections)-1].Round(time.Millisecond))
	}
	return nil
}

// load drives Acquire calls from o.clients goroutines, each paced to its
// share of the target rate. It is open loop: a client sends each call at
// its slot in the schedule whether or not its earlier calls have
// answered (each call in flight uses its own agent identity, since one
// agent's request ids must arrive in order), and a client that falls
// behind sends its overdue calls at once without skipping or resetting
// its schedule. Latency is measured from the slot (the intended send).
type load struct {
	o      options
	conns  []*grpc.ClientConn
	addrs  []string     // the nodes' gRPC addresses, as conns
	pinned atomic.Int32 // node index all calls go to, or -1
	sem    chan struct{}
	// ks builds the calls' keys from key numbers: -mode grants prebuilds
	// every budget key, -mode fleet the hot keys.
	ks *keySet
	// cold counts the fleet mode's first uses, so each cold key is new
	// until the key space wraps.
	cold atomic.Int64
	// With -groups: the slot of each grants-mode key (keySlot) and of any
	// key (slotOf), the newest topology (topoMu serialises its writers),
	// and the node each group's calls go to, by group id.
	keySlot   []slots.Slot
	slotOf    func(i int) slots.Slot
	topo      atomic.Pointer[topology]
	topoMu    sync.Mutex
	groupNode []atomic.Int32

	mu sync.Mutex // guards the fields below
	// hist is the round trip of the attempt that succeeded, from its
	// actual send; intended is from the call's intended send time (its
	// slot in the schedule), so it includes the client's own delays, the
	// in-flight cap and retries (no coordinated omission); lag is how late
	// the first attempt left relative to its slot.
	hist     *hdrhistogram.Histogram
	intended *hdrhistogram.Histogram
	lag      *hdrhistogram.Histogram
	from     time.Time // start of the measured window (reset)
	calls    int64
	keysOK   int64
	// ownOK counts the keys answered OK of the calls intended in the
	// window (from, from+duration): achieved against offered, with no
	// backlog from before the window counted.
	ownOK    int64
	granted  int64
	errs     int64
	inflight map[*call]struct{}
	// worst is the longest latency from the intended send of the calls
	// intended in each second of the window (index: seconds since from),
	// so a stall of a few seconds can be told from a spread tail.
	worst    []time.Duration
	killAt   time.Time
	killed   string
	recovery time.Duration // -1 until the first grant after killAt
	// unrecovered: with groups, the groups killed led that have had no
	// grant from another leader since killAt (recovery is set when the
	// last one has).
	unrecovered map[slots.GroupID]bool
	perGroup    map[slots.GroupID]*groupStats
}

// call is one Acquire in flight.
type call struct {
	intended time.Time
}

// agentID is one agent identity of a client; a call in flight owns it.
type agentID struct {
	id  string
	req uint64
}

func newLoad(o options, conns []*grpc.ClientConn) *load {
	l := &load{o: o, conns: conns, recovery: -1,
		sem:       make(chan struct{}, o.maxInflight),
		inflight:  map[*call]struct{}{},
		perGroup:  map[slots.GroupID]*groupStats{},
		groupNode: make([]atomic.Int32, o.groups+1),
		hist:      hdrhistogram.New(1, 600_000_000, 3),
		intended:  hdrhistogram.New(1, 600_000_000, 3),
		lag:       hdrhistogram.New(1, 600_000_000, 3)}
	l.pinned.Store(-1)
	if o.mode == "grants" {
		l.ks = newKeySet(o.keyspace, grantsKey)
	} else {
		l.ks = newKeySet(o.hotKeys, hotKey)
	}
	return l
}

func (l *load) pin(i int) { l.pinned.Store(int32(i)) }

func (l *load) start(ctx context.Context, wg *sync.WaitGroup) {
	callsPerSec := float64(l.o.rate) / float64(l.o.keysPerCall)
	interval := time.Duration(float64(time.Second) * float64(l.o.clients) / callsPerSec)
	t0 := time.Now()
	for c := range l.o.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.client(ctx, wg, c, t0.Add(time.Duration(c)*interval/time.Duration(l.o.clients)), interval)
		}()
	}
}

// client sends its calls at first, first+interval, ... until ctx ends.
func (l *load) client(ctx context.Context, wg *sync.WaitGroup, c int, first time.Time, interval time.Duration) {
	clients := make([]allotv1.AllocatorClient, len(l.conns))
	for i, cc := range l.conns {
		clients[i] = allotv1.NewAllocatorClient(cc)
	}
	var (
		poolMu sync.Mutex
		pool   []*agentID
		made   int
	)
	getAgent := func() *agentID {
		poolMu.Lock()
		defer poolMu.Unlock()
		if k := len(pool); k > 0 {
			a := pool[k-1]
			pool = pool[:k-1]
			return a
		}
		made++
		return &agentID{id: fmt.Sprintf("bench-%d-%d-%d", c, made, time.Now().UnixNano())}
	}
	putAgent := func(a *agentID) {
		poolMu.Lock()
		pool = append(pool, a)
		poolMu.Unlock()
	}
	node := c % len(clients)
	var follow atomic.Int32 // -target follow: the node this client calls
	follow.Store(int32(node))
	keyN := c * 7919
	// The key numbers and slots of the call being built (reused: a
	// call's parts are packed or made messages before the next call).
	var nums []int
	var sl []slots.Slot
	for n := int64(0); ctx.Err() == nil; n++ {
		intended := first.Add(time.Duration(n) * interval)
		if d := time.Until(intended); d > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(d):
			}
		}
		select {
		case l.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		nums, sl, keyN = l.keysFor(nums[:0], sl[:0], keyN)
		ag := getAgent()
		// One call per group that owns some of the keys, each with its
		// own request id (a group sees each agent's ids increase).
		parts := []part[int]{{keys: nums}}
		var topoVersion uint64
		if t := l.topo.Load(); t != nil {
			parts, topoVersion = split(t, nums, sl), t.version
		}
		var sent sync.WaitGroup
		var failed atomic.Bool
		for _, p := range parts {
			ag.req++
			req := &allotv1.AcquireRequest{AgentId: ag.id, RequestId: ag.req, PackedGrants: l.o.packed,
				Group: uint32(p.group), TopologyVersion: topoVersion}
			if l.o.packedKeys {
				req.PackedKeys = l.ks.packKeys(make([]byte, 0, packedSize(p.keys)), p.keys)
			} else {
				req.Keys = l.ks.keyMessages(p.keys)
			}
			fw := &follow
			if p.group != 0 {
				fw = &l.groupNode[p.group]
			}
			target := node
			switch l.o.target {
			case "all":
				node = (node + 1) % len(clients)
			case "follow":
				target = int(fw.Load())
			}
			sent.Go(func() {
				if !l.send(ctx, clients, target, req, intended, fw) {
					failed.Store(true)
				}
			})
		}
		wg.Go(func() {
			defer func() { <-l.sem }()
			sent.Wait()
			if !failed.Load() {
				putAgent(ag)
			}
		})
	}
}

// keysFor appends the key numbers of the next call (l.ks makes them
// keys), starting after keyN in the key space, to nums and their slots
// (with -groups) to sl, and returns both and the new keyN.
func (l *load) keysFor(nums []int, sl []slots.Slot, keyN int) ([]int, []slots.Slot, int) {
	nums = slices.Grow(nums, l.o.keysPerCall)[:l.o.keysPerCall]
	keys := nums
	if l.slotOf != nil {
		sl = slices.Grow(sl, len(keys))[:len(keys)]
	}
	if l.o.mode == "grants" {
		for k := range keys {
			if l.o.keyOrder == "random" {
				keyN = rand.IntN(l.o.keyspace)
			} else {
				keyN = (keyN + 1) % l.o.keyspace
			}
			keys[k] = keyN
			if sl != nil {
				sl[k] = l.keySlot[keyN]
			}
		}
		return keys, sl, keyN
	}
	// fleet: renewals of hot keys (a lease: want, demand) and charges
	// of first uses of cold keys (no lease wanted: one token admitted
	// locally and charged), as agents report keys most of which are
	// cold at any one gateway.
	for k := range keys {
		if float64(k) < l.o.coldFraction*float64(len(keys)) {
			var i int
			if l.o.keyOrder == "random" {
				i = l.o.hotKeys + rand.IntN(l.o.keyspace)
			} else {
				i = l.o.hotKeys + int(l.cold.Add(1)%int64(l.o.keyspace))
			}
			keys[k] = i
			if sl != nil {
				sl[k] = l.slotOf(i)
			}
			continue
		}
		if l.o.keyOrder == "random" {
			keyN = rand.IntN(l.o.hotKeys)
		} else {
			keyN = (keyN + 1) % l.o.hotKeys
		}
		keys[k] = keyN
		if sl != nil {
			sl[k] = l.slotOf(keyN)
		}
	}
	return keys, sl, keyN
}

// send sends req until it succeeds (retrying the same request id, which
// is idempotent, on the next node) and records it. It reports false when
// ctx ended first (the agent identity is then left unused: its last
// request may or may not have been applied).
func (l *load) send(ctx context.Context, clients []allotv1.AllocatorClient, node int, req *allotv1.AcquireRequest, intended time.Time, follow *atomic.Int32) bool {
	c := &call{intended: intended}
	l.mu.Lock()
	l.inflight[c] = struct{}{}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.inflight, c)
		l.mu.Unlock()
	}()
	first := true
	for ctx.Err() == nil {
		target := node
		if p := int(l.pinned.Load()); p >= 0 {
			target = p
		}
		t0 := time.Now()
		if first {
			first = false
			l.mu.Lock()
			_ = l.lag.RecordValue(max(t0.Sub(intended).Microseconds(), 0))
			l.mu.Unlock()
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		var md metadata.MD
		resp, err := clients[target].Acquire(cctx, req, grpc.Header(&md))
		cancel()
		if err == nil {
			now := time.Now()
			l.noteTopology(resp.GetTopology())
			l.record(now, now.Sub(t0), now.Sub(intended), slots.GroupID(req.GetGroup()), resp)
			if v := md.Get(allotv1.LeaderAddrHeader); len(v) > 0 && l.o.target == "follow" {
				if i := slices.Index(l.addrs, v[0]); i >= 0 {
					follow.Store(int32(i))
				}
			}
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		l.mu.Lock()
		l.errs++
		l.mu.Unlock()
		node = (node + 1) % len(clients)
		if l.o.target == "follow" {
			follow.Store(int32(node))
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
	return false
}

func (l *load) record(now time.Time, lat, fromIntended time.Duration, group slots.GroupID, resp *allotv1.AcquireResponse) {
	// Grants that do not decode count as no key answered OK: GrantTotals
	// returns zeros with its error.
	n, granted, _ := allotv1.GrantTotals(resp)
	ok := int64(n)
	l.mu.Lock()
	defer l.mu.Unlock()
	_ = l.hist.RecordValue(lat.Microseconds())
	_ = l.intended.RecordValue(fromIntended.Microseconds())
	l.noteWorst(now.Add(-fromIntended), fromIntended)
	l.calls++
	l.keysOK += ok
	gs := l.groupStat(group)
	gs.calls++
	if in := now.Add(-fromIntended); !in.Before(l.from) && in.Before(l.from.Add(l.o.duration)) {
		l.ownOK += ok
		gs.ownOK += ok
		_ = gs.intended.RecordValue(fromIntended.Microseconds())
	}
	l.granted += granted
	if !l.killAt.IsZero() && l.recovery < 0 && resp.GetLeaderId() != l.killed {
		l.noteRecovered(group)
	}
}

// noteWorst keeps d as the worst latency of the second of the window in
// which a call intended at intended falls; calls intended outside the
// window are left out (l.mu held).
func (l *load) noteWorst(intended time.Time, d time.Duration) {
	if intended.Before(l.from) || !intended.Before(l.from.Add(l.o.duration)) {
		return
	}
	i := int(intended.Sub(l.from) / time.Second)
	for len(l.worst) <= i {
		l.worst = append(l.worst, 0)
	}
	l.worst[i] = max(l.worst[i], d)
}

// reset starts the measured window.
func (l *load) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.hist.Reset()
	l.intended.Reset()
	l.lag.Reset()
	l.from = time.Now()
	l.worst = l.worst[:0]
	l.calls, l.keysOK, l.ownOK, l.granted, l.errs = 0, 0, 0, 0, 0
	clear(l.perGroup)
}

// markKill records the kill of victim, the leader of the data groups led
// (none: the single group's leader).
func (l *load) markKill(victim string, led []slots.GroupID) time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.killAt = time.Now()
	l.killed = victim
	l.recovery = -1
	l.unrecovered = map[slots.GroupID]bool{}
	for _, g := range led {
		l.unrecovered[g] = true
	}
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

func (l *load) report(elapsed time.Duration, nodes0, nodes1 []map[string]float64) (keysOK int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	// Calls still in flight at the end count with their age so far (a
	// lower bound of their latency), so a stalled cluster shows.
	now := time.Now()
	var open int
	for c := range l.inflight {
		if !c.intended.Before(l.from) {
			_ = l.intended.RecordValue(now.Sub(c.intended).Microseconds())
			l.noteWorst(c.intended, now.Sub(c.intended))
			open++
		}
	}
	secs := elapsed.Seconds()
	us := fmtUs
	offered := float64(l.o.rate)
	fmt.Printf("throughput: offered %.0f key-grants/s, achieved %.0f key-grants/s (%.1f%%; keys answered OK of the calls intended in the window), answered in the window %.0f key-grants/s (a backlog from before included; %.0f tokens/s granted), %.0f calls/s, %d failed calls, %d calls unanswered at the end, over %v\n",
		offered, float64(l.ownOK)/secs, 100*float64(l.ownOK)/secs/offered, float64(l.keysOK)/secs, float64(l.granted)/secs, float64(l.calls)/secs,
		l.errs, open, elapsed.Round(time.Millisecond))
	for _, h := range []struct {
		what string
		h    *hdrhistogram.Histogram
	}{
		{"acquire latency (from actual send)  ", l.hist},
		{"acquire latency (from intended send)", l.intended},
		{"client send lag (first attempt)     ", l.lag},
	} {
		fmt.Printf("%s: p50 %s  p99 %s  p99.9 %s  max %s  (n=%d)\n", h.what,
			us(h.h.ValueAtQuantile(50)), us(h.h.ValueAtQuantile(99)), us(h.h.ValueAtQuantile(99.9)), us(h.h.Max()), h.h.TotalCount())
	}
	worst := make([]string, 0, len(l.worst))
	for _, d := range l.worst {
		worst = append(worst, fmtMs(d))
	}
	fmt.Printf("worst latency from the intended send, per second of the window (ms): %s\n", strings.Join(worst, " "))
	if l.o.groups > 1 {
		l.reportGroups(secs)
	}
	// Only a group's leader batches and applies: summed over the nodes,
	// these count every group's entries.
	delta := func(metric string) float64 {
		var d float64
		for i := range nodes1 {
			d += nodes1[i][metric] - nodes0[i][metric]
		}
		return d
	}
	entries := delta(`allot_allocator_batch_keys_count`)
	keys := delta(`allot_allocator_batch_keys_sum`)
	reqs := delta(`allot_allocator_batch_requests_sum`)
	applyN := delta(`allot_allocator_raft_apply_seconds_count`)
	applyS := delta(`allot_allocator_raft_apply_seconds_sum`)
	if entries > 0 {
		fmt.Printf("raft: %.0f acquire entries/s, %.0f keys/entry, %.1f calls/entry, mean commit %.2f ms (leader's raft.Apply → applied; every group's)\n",
			entries/secs, keys/entries, reqs/entries, 1000*applyS/max(applyN, 1))
	}
	return l.keysOK
}

// startClientProfile starts a CPU profile of this process into path ("":
// none) and returns the function that ends it.
func startClientProfile(path string) (func() error, error) {
	if path == "" {
		return func() error { return nil }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}

// fsyncProbe times an fsync of a small write in the allocators' data
// directory at a fixed interval, so that a latency tail can be told apart
// from the disk's own at the same moment.
type fsyncProbe struct {
	done  chan struct{}
	hist  *hdrhistogram.Histogram
	err   error
	every time.Duration
	from  time.Time
	worst []time.Duration // the longest fsync begun in each second since from
	cpu   time.Duration   // the probe thread's CPU time in its fsyncs, summed
}

// startFsyncProbe runs the probe until end; every 0: none (report prints
// nothing).
func startFsyncProbe(dir string, every time.Duration, end time.Time) *fsyncProbe {
	p := &fsyncProbe{done: make(chan struct{}), hist: hdrhistogram.New(1, 60_000_000, 3), every: every, from: time.Now()}
	if every <= 0 {
		close(p.done)
		return p
	}
	go func() { // ends by end; report waits for it
		defer close(p.done)
		// On its own thread, so that the thread's CPU time around an
		// fsync is the fsync's.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		f, err := os.CreateTemp(dir, "fsync-probe-")
		if err != nil {
			p.err = err
			return
		}
		defer os.Remove(f.Name())
		defer f.Close()
		buf := make([]byte, 4096)
		for i := int64(0); time.Now().Before(end); i++ {
			if _, err := f.WriteAt(buf, (i%256)*4096); err != nil {
				p.err = err
				return
			}
			c0, _ := proccpu.Thread()
			t0 := time.Now()
			if err := f.Sync(); err != nil {
				p.err = err
				return
			}
			d := time.Since(t0)
			if c1, err := proccpu.Thread(); err == nil {
				p.cpu += c1 - c0
			}
			_ = p.hist.RecordValue(d.Microseconds())
			sec := int(t0.Sub(p.from) / time.Second)
			for len(p.worst) <= sec {
				p.worst = append(p.worst, 0)
			}
			p.worst[sec] = max(p.worst[sec], d)
			time.Sleep(every)
		}
	}()
	return p
}

// report waits for the probe and prints its fsync latencies.
func (p *fsyncProbe) report() error {
	<-p.done
	if p.err != nil {
		return fmt.Errorf("fsync probe: %w", p.err)
	}
	if p.hist.TotalCount() == 0 {
		return nil
	}
	us := func(v int64) string {
		return (time.Duration(v) * time.Microsecond).Round(10 * time.Microsecond).String()
	}
	fmt.Printf("disk: fsync of a 4 KB write in the data directory every %v, same window: p50 %s  p99 %s  p99.9 %s  max %s  (n=%d); CPU %s an fsync (the probe thread's, mean)\n",
		p.every, us(p.hist.ValueAtQuantile(50)), us(p.hist.ValueAtQuantile(99)), us(p.hist.ValueAtQuantile(99.9)), us(p.hist.Max()), p.hist.TotalCount(),
		(p.cpu / time.Duration(p.hist.TotalCount())).Round(time.Microsecond))
	worst := make([]string, len(p.worst))
	for i, d := range p.worst {
		worst[i] = fmtMs(d)
	}
	fmt.Printf("disk: worst fsync per second of the window (ms): %s\n", strings.Join(worst, " "))
	return nil
}

// cpuSample is the CPU time of each node and of this process at one
// instant.
type cpuSample struct {
	nodes []time.Duration
	self  time.Duration
	at    time.Time
	// run and wait are each node's threads' time on a core and waiting on
	// a run queue (last: this process's), from schedstat; mach the
	// machine's /proc/stat.
	run, wait []time.Duration
	mach      proccpu.Machine
	// burn is the -burners' CPU (burners nil: none).
	burn    time.Duration
	burners int
}

func sampleCPU(nodes []*node, b *burners) cpuSample {
	self, _ := proccpu.Of(0) // 0 if unreadable: the figures then show it
	s := cpuSample{nodes: make([]time.Duration, len(nodes)), self: self, at: time.Now(),
		run: make([]time.Duration, len(nodes)+1), wait: make([]time.Duration, len(nodes)+1)}
	for i, n := range nodes {
		s.nodes[i], _ = proccpu.Of(n.Proc.Pid())
		s.run[i], s.wait[i], _ = proccpu.Sched(n.Proc.Pid())
	}
	s.run[len(nodes)], s.wait[len(nodes)], _ = proccpu.Sched(0)
	s.mach, _ = proccpu.ReadMachine()
	if b != nil {
		s.burn, s.burners = b.cpu(), len(b.pids())
	}
	return s
}

// schedReport prints how long each node's threads (and this process's)
// waited on a run queue for a core between s0 and s1, against their time
// on one, and the machine's idle, iowait and steal shares: a goroutine
// whose thread waits for a core shows as running in Go's own trace.
func schedReport(nodes []*node, role []string, s0, s1 cpuSample) {
	fmt.Printf("run queue (/proc/<pid>/task/*/schedstat, threads summed, same window): ")
	for i := 0; i <= len(nodes); i++ {
		name := "load client"
		if i < len(nodes) {
			name = fmt.Sprintf("%s (%s)", nodes[i].ID, role[i])
		}
		run, wait := s1.run[i]-s0.run[i], s1.wait[i]-s0.wait[i]
		ratio := 0.0
		if run > 0 {
			ratio = wait.Seconds() / run.Seconds()
		}
		fmt.Printf("%s waited %.2f s for %.2f s on a core (%.2f s a CPU-second); ", name, wait.Seconds(), run.Seconds(), ratio)
	}
	idle, iowait, steal := proccpu.Share(s0.mach, s1.mach)
	fmt.Printf("machine (/proc/stat): idle %.1f%%, iowait %.1f%%, steal %.1f%%\n", 100*idle, 100*iowait, 100*steal)
}

// cpuReport prints the CPU each node (its role) and this process used
// between s0 and s1, in cores and in µs per key (keys answered OK; none:
// cores only).
func cpuReport(nodes []*node, role []string, s0, s1 cpuSample, keys int64, unit string) {
	secs := s1.at.Sub(s0.at).Seconds()
	var total time.Duration
	per := func(d time.Duration) string {
		if keys <= 0 {
			return ""
		}
		return fmt.Sprintf(", %.2f µs/%s", float64(d.Microseconds())/float64(keys), unit)
	}
	fmt.Printf("cpu (/proc/<pid>/stat over %.1f s):", secs)
	for i, n := range nodes {
		d := s1.nodes[i] - s0.nodes[i]
		total += d
		fmt.Printf(" %s (%s) %.3f cores%s;", n.ID, role[i], d.Seconds()/secs, per(d))
	}
	client := s1.self - s0.self
	ratio := ""
	if client > 0 && keys > 0 {
		ratio = fmt.Sprintf(" (the allocators' CPU %.2f× the load client's)", total.Seconds()/client.Seconds())
	}
	fmt.Printf(" allocators %.3f cores%s; load client %.3f cores%s", total.Seconds()/secs, per(total), client.Seconds()/secs, ratio)
	if s1.burners > 0 {
		fmt.Printf("; %d burner(s) %.3f cores", s1.burners, (s1.burn-s0.burn).Seconds()/secs)
	}
	fmt.Println()
}

// idleReport measures the allocators' CPU with no traffic over d, after
// the calls in flight have drained, with the tracked keys and leases at
// its start and end.
func idleReport(nodes []*node, leader int, role []string, d time.Duration, token, profile string) error {
	time.Sleep(2 * time.Second) // the last batches commit and apply everywhere
	m0, err := scrapeAll(nodes)
	if err != nil {
		return err
	}
	load0 := proccpu.LoadAvg()
	s0 := sampleCPU(nodes, nil)
	// Leases granted by the load end during the first seconds (their TTL)
	// and Go returns the load's memory: each tenth of the window is
	// reported too, so the settled cost can be told from that tail.
	profiled := make(chan error, 1)
	if profile != "" {
		go func() { // waited for below
			time.Sleep(time.Until(s0.at.Add(d / 2)))
			profiled <- fetchProfile(nodes[leader], token, "profile", max(int(d.Seconds())/2-1, 1), profile)
		}()
	} else {
		profiled <- nil
	}
	tenths := make([]string, 0, 10)
	prev := s0
	for i := range 10 {
		time.Sleep(time.Until(s0.at.Add(d * time.Duration(i+1) / 10)))
		cur := sampleCPU(nodes, nil)
		var all time.Duration
		for j := range nodes {
			all += cur.nodes[j] - prev.nodes[j]
		}
		secs := cur.at.Sub(prev.at).Seconds()
		tenths = append(tenths, fmt.Sprintf("%.1f/%.1f", 100*(cur.nodes[leader]-prev.nodes[leader]).Seconds()/secs, 100*all.Seconds()/secs))
		prev = cur
	}
	s1 := prev
	if err := <-profiled; err != nil {
		return err
	}
	m1, err := scrapeAll(nodes)
	if err != nil {
		return err
	}
	fmt.Printf("idle: no traffic for %v; leader tracks %.0f keys and %.0f leases at the start, %.0f keys and %.0f leases at the end\n",
		d, m0[leader]["allot_allocator_keys"], m0[leader]["allot_allocator_leases"], m1[leader]["allot_allocator_keys"], m1[leader]["allot_allocator_leases"])
	exp := `allot_allocator_fsm_apply_seconds_%s{type="expire"}`
	expN := m1[leader][fmt.Sprintf(exp, "count")] - m0[leader][fmt.Sprintf(exp, "count")]
	fmt.Printf("idle: the leader applied %.0f Expire entries (%.1f/s) taking %v in its FSM\n", expN, expN/d.Seconds(),
		time.Duration((m1[leader][fmt.Sprintf(exp, "sum")]-m0[leader][fmt.Sprintf(exp, "sum")])*float64(time.Second)).Round(time.Microsecond))
	fmt.Print("idle ")
	cpuReport(nodes, role, s0, s1, 0, "")
	fmt.Printf("idle cpu by tenths of the window (leader/allocators, %% of a core): %s\n", strings.Join(tenths, " "))
	fmt.Printf("idle load average: %s at the start, %s at the end\n", load0, proccpu.LoadAvg())
	return nil
}

// breakdown prints the p50/p99 of each stage of an Acquire over the
// measurement window, from the nodes' histograms (bucket counts at the end
// minus at the start; the quantile interpolates within a bucket, whose
// bounds are 25% apart). With several groups, leaders are the nodes that
// lead a data group and the leader stages sum over them.
func breakdown(nodes []*node, leaders []int, m0, m1 []map[string]float64) {
	var followers []int
	for i := range nodes {
		if !slices.Contains(leaders, i) {
			followers = append(followers, i)
		}
	}
	stages := []struct {
		what, metric, labels string
		on                   []int
	}{
		{"follower: Acquire handler, forwarded ", "allot_allocator_acquire_seconds", `path="forwarded"`, followers},
		{"follower: forward hop to the leader  ", "allot_allocator_forward_seconds", "", followers},
		{"leader:   Acquire handler, local     ", "allot_allocator_acquire_seconds", `path="local"`, leaders},
		{"leader:   queued in the batcher      ", "allot_allocator_batch_queue_seconds", "", leaders},
		{"leader:   raft.Apply → applied       ", "allot_allocator_raft_apply_seconds", "", leaders},
		{"leader:   append → FSM (commit)      ", "allot_allocator_raft_commit_seconds", "", leaders},
		{"leader:   FSM apply, Acquire entry   ", "allot_allocator_fsm_apply_seconds", `type="acquire"`, leaders},
		{"leader:   FSM apply, Expire entry    ", "allot_allocator_fsm_apply_seconds", `type="expire"`, leaders},
		{"follower: append → FSM               ", "allot_allocator_raft_commit_seconds", "", followers},
	}
	var changes float64
	for i := range nodes {
		changes += m1[i]["allot_allocator_leadership_changes_total"] - m0[i]["allot_allocator_leadership_changes_total"]
	}
	fmt.Printf("leadership changes in the window: %.0f (gains and losses, summed over the nodes)\n", changes)
	snaps := make([]string, len(nodes))
	for i, n := range nodes {
		d := func(m string) float64 { return m1[i][m] - m0[i][m] }
		snaps[i] = fmt.Sprintf("%s %.0f taken, %.0f written in %.2f s", n.ID,
			d("allot_allocator_snapshot_capture_seconds_count"), d("allot_allocator_snapshot_persist_seconds_count"), d("allot_allocator_snapshot_persist_seconds_sum"))
	}
	fmt.Printf("raft snapshots in the window: %s\n", strings.Join(snaps, "; "))
	fmt.Println("breakdown (server histograms, same window):")
	for _, st := range stages {
		b := histDelta(m0, m1, st.on, st.metric, st.labels)
		if b.count() == 0 {
			continue
		}
		fmt.Printf("  %s p50 %-9s p99 %-9s p99.9 %-9s (n=%d)\n", st.what,
			fmtSec(b.quantile(0.50)), fmtSec(b.quantile(0.99)), fmtSec(b.quantile(0.999)), int64(b.count()))
	}
}

// fmtMs is d in milliseconds, to two significant digits below 10.
func fmtMs(d time.Duration) string {
	ms := float64(d) / float64(time.Millisecond)
	if ms < 10 {
		return strconv.FormatFloat(ms, 'f', 1, 64)
	}
	return strconv.FormatFloat(ms, 'f', 0, 64)
}

// fmtUs is v µs, to 10 µs.
func fmtUs(v int64) string {
	return (time.Duration(v) * time.Microsecond).Round(10 * time.Microsecond).String()
}

func fmtSec(s float64) string {
	return time.Duration(s * float64(time.Second)).Round(10 * time.Microsecond).String()
}

// buckets is a cumulative histogram: upper bounds ascending, counts.
type buckets struct {
	le []float64
	n  []float64
}

func (b buckets) count() float64 {
	if len(b.n) == 0 {
		return 0
	}
	return b.n[len(b.n)-1]
}

// quantile interpolates linearly within the bucket that holds q (the
// +Inf bucket answers its lower bound).
func (b buckets) quantile(q float64) float64 {
	total := b.count()
	if total == 0 {
		return 0
	}
	rank := q * total
	lower, below := 0.0, 0.0
	for i, le := range b.le {
		if b.n[i] >= rank {
			if le > 1e300 || b.n[i] == below {
				return lower
			}
			return lower + (le-lower)*(rank-below)/(b.n[i]-below)
		}
		lower, below = le, b.n[i]
	}
	return lower
}

// histDelta sums the bucket counts of metric (with labels, if any, among
// its labels) over nodes on, end minus start.
func histDelta(m0, m1 []map[string]float64, on []int, metric, labels string) buckets {
	sum := map[float64]float64{}
	prefix := metric + "_bucket{"
	for _, i := range on {
		for k, v := range m1[i] {
			if !strings.HasPrefix(k, prefix) || (labels != "" && !strings.Contains(k, labels)) {
				continue
			}
			j := strings.Index(k, `le="`)
			if j < 0 {
				continue
			}
			le, err := strconv.ParseFloat(strings.TrimSuffix(k[j+4:], `"}`), 64)
			if err != nil {
				continue
			}
			sum[le] += v - m0[i][k]
		}
	}
	var b buckets
	for le := range sum {
		b.le = append(b.le, le)
	}
	slices.Sort(b.le)
	for _, le := range b.le {
		b.n = append(b.n, sum[le])
	}
	return b
}

// logSizes returns each node's log size, where the measurement window's
// gctrace lines start.
func logSizes(nodes []*node) []int64 {
	out := make([]int64, len(nodes))
	for i, n := range nodes {
		if fi, err := os.Stat(n.Proc.LogPath); err == nil {
			out[i] = fi.Size()
		}
	}
	return out
}

// gcReport prints each node's GC cycles and stop-the-world pauses in the
// log written since from (gctrace: "gc N @Ts P%: A+B+C ms clock, ..."; A
// and C are the two pauses).
func gcReport(nodes []*node, from []int64) {
	for i, n := range nodes {
		f, err := os.Open(n.Proc.LogPath)
		if err != nil {
			continue
		}
		if _, err := f.Seek(from[i], io.SeekStart); err != nil {
			f.Close()
			continue
		}
		var cycles int
		var pauses []float64
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line := sc.Text()
			if !strings.HasPrefix(line, "gc ") {
				continue
			}
			_, rest, ok := strings.Cut(line, "%: ")
			if !ok {
				continue
			}
			clock, _, _ := strings.Cut(rest, " ms clock")
			parts := strings.Split(clock, "+")
			if len(parts) != 3 {
				continue
			}
			cycles++
			for _, p := range []string{parts[0], parts[2]} {
				if v, err := strconv.ParseFloat(p, 64); err == nil {
					pauses = append(pauses, v)
				}
			}
		}
		f.Close()
		slices.Sort(pauses)
		var maxP, sum float64
		for _, p := range pauses {
			sum += p
			maxP = max(maxP, p)
		}
		fmt.Printf("gc %s: %d cycles, %d stop-the-world pauses, total %.2f ms, max %.3f ms\n", n.ID, cycles, len(pauses), sum, maxP)
	}
}

// scrapeAll scrapes every node (a node that does not answer gives an
// empty map).
func scrapeAll(nodes []*node) ([]map[string]float64, error) {
	out := make([]map[string]float64, len(nodes))
	for i, n := range nodes {
		m, err := scrape(n)
		if err != nil {
			return nil, err
		}
		out[i] = m
	}
	return out, nil
}

// fetchProfiles saves CPU profiles of the leader (to lpath) and of the
// first follower (to fpath), and an execution trace of the leader (to
// tpath), taken at once over secs seconds; an empty path skips that one.
func fetchProfiles(nodes []*node, leader int, token string, secs int, lpath, fpath, tpath string) error {
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i, path := range []string{lpath, fpath, tpath} {
		if path == "" {
			continue
		}
		n, kind := nodes[leader], "profile"
		switch i {
		case 1:
			n = nodes[(leader+1)%len(nodes)]
		case 2:
			kind = "trace"
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fetchProfile(n, token, kind, secs, path)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// fetchProfile saves n's /debug/pprof/<kind> (a CPU profile or an
// execution trace) taken over secs seconds.
func fetchProfile(n *node, token, kind string, secs int, path string) error {
	resp, err := testproc.GetWithToken(context.Background(), fmt.Sprintf("http://%s/debug/pprof/%s?seconds=%d", n.HTTP, kind, secs), token)
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
// victim (of every data group in led, if any), and returns the time since
// killAt (-1 on timeout).
func waitNewLeader(admin allotv1.AdminClient, victim string, led []slots.GroupID, killAt time.Time, timeout time.Duration) time.Duration {
	for time.Since(killAt) < timeout {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		cancel()
		ok := err == nil && st.GetLeaderId() != "" && st.GetLeaderId() != victim
		if ok && len(led) > 0 {
			ok = !slices.ContainsFunc(st.GetGroups(), func(g *allotv1.GroupStatus) bool {
				return slices.Contains(led, slots.GroupID(g.GetId())) && (g.GetLeaderId() == "" || g.GetLeaderId() == victim)
			})
		}
		if ok {
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
