// Command gateway measures what the gateway adds to a reverse proxy: the
// gateway library's reverse proxy is served twice on loopback, bare and as
// the handler cmd/gateway serves (body bound, httplimit.Middleware with an
// agent, the proxy), and a Go load
// generator drives each at a fixed concurrency for -duration, alternating
// between the two for -rounds rounds (the order flips every round so drift
// in the shared machine's load hits both alike). It reports throughput and
// latency percentiles per target and the verdict against the targets:
// p50 added latency ≤ 50 µs and throughput ≥ 90% of the bare proxy.
//
//	go run ./bench/gateway                       # 3 rounds × 10 s each, 16 workers, leases from an allocator child process
//	go run ./bench/gateway -mode standalone      # agent without allocator (local buckets)
//	go run ./bench/gateway -mode lease-inprocess # the allocator in this process (its CPU counts as the gateway's)
//	go run ./bench/gateway -duration 2s -rounds 1
//	go run ./bench/gateway -burn 4 -allocator-cpus 1  # also the limited proxy while the allocator's CPU is saturated
//	go run ./bench/gateway -allocator 127.0.0.1:7001  # an allocator already running (it must serve -print-rules)
//
// With -burn N the allocator child spins N goroutines (its flag
// -debug-burn-cpu, as cmd/allocator's) during two more targets,
// "bare+burnN" and "limited+burnN": the same proxies, agent, keys and live
// leases, measured while the allocator's CPU is saturated. The bare proxy
// under burn is the control (the burner takes a core from everything else
// on the machine), so the limited proxy under burn is compared with it.
// Each round runs the targets in a rotated order and switches the burn on
// and off through the child's stdin.
// -allocator-cpus runs the child under taskset (pin this process with
// "taskset -c 0 ..." to keep the load generator and the gateway apart from
// it). For every limited target the harness also reads the agent's metrics
// (the registry the gateway serves on /metrics): allot_agent_check_seconds
// (sampled, 1 check in 64) as p50/p99 the way histogram_quantile computes
// them, the Acquire calls by result and their latency, the tokens by kind,
// the descriptors decided by the fallback bucket, and the largest value of
// allot_agent_fallback seen (polled every 100 ms).
//
// Every request is allowed (the rule's limit is far above the offered
// load), so both targets do the same upstream work; the difference is the
// descriptor extraction, the check and the RateLimit fields. The requests
// carry 64 distinct API keys through the -dev descriptor configuration
// (three descriptors each). Both targets serve the gateway library's
// reverse proxy (gateway.NewProxy: Rewrite, transport, copy-buffer pool,
// ModifyResponse, ErrorHandler); the limited target is the exact handler
// cmd/gateway serves on its proxy listener (gateway.NewHandler: the 10 MiB
// body bound, then httplimit.Middleware with its metrics, then the proxy).
//
// Besides wall-clock throughput and latency, which other load on a shared
// machine disturbs, it reports CPU time per request, split by process. By
// default (-loadgen process) the load generator and the upstream run in a
// child process, so "CPU/req" is this process alone (the two proxies and
// the agent, with its refill loop and gRPC client) and "client CPU" is the
// generator's and upstream's; -loadgen-cpus pins the child (and "taskset -c
// 0" this process) so that the two sides do not share a core. -loadgen
// inprocess keeps everything in one process as the first measurements did
// (CPU/req then counts all of it). In the default agent mode the allocator
// runs in its own child process, as it would on other machines.
// -target-cpuprofile writes one CPU profile of this process per measured
// run, so the bare and limited targets can be compared function by
// function (go tool pprof -diff_base).
//
//	go run ./bench/gateway -rounds 6 -duration 4s -target-cpuprofile /tmp/gw
//	go tool pprof -top -diff_base /tmp/gw.bare.r1.prof /tmp/gw.limited.r1.prof
//	taskset -c 0 go run ./bench/gateway -loadgen-cpus 1   # gateway on core 0, load generator on core 1
//
// -mode rls measures the Envoy RLS server instead of the proxy: the
// cmd/gateway binary (built from this tree) with leases from an allocator
// child, ShouldRateLimit against grpc.health.v1 Check on the same server
// process from one client, the server's CPU per call from /proc/<pid>/stat
// at each count of -rls-callers (see runRLS).
//
//	go run ./bench/gateway -mode rls -rounds 6 -duration 5s
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/allocator"
	"github.com/allot/allot/gateway"
	"github.com/allot/allot/internal/cpuburn"
	"github.com/allot/allot/internal/proccpu"
	"github.com/allot/allot/pkg/rules"
)

const benchRules = `
domain: bench
descriptors:
  - key: tier
    value: free
    descriptors:
      - key: api_key
        rate_limit: {name: per_key, unit: second, requests_per_unit: 1000000, burst: 1000000}
      - key: route
        value: /v1/search
        descriptors:
          - key: api_key
            rate_limit: {name: per_key_search, unit: second, requests_per_unit: 1000000, burst: 1000000}
`

var exit int

// options are the command's flags.
type options struct {
	duration, warmup time.Duration
	rounds, conc     int
	rate             int // open-loop requests/s in all (0: closed loop)
	mode             string
	allocator        string // external allocator address ("" = start one)
	burn             int    // goroutines the allocator child spins during the "burn" target (0 = no such target)
	allocatorCPUs    string // taskset CPU list for the allocator child
	loadgen          string // "process" or "inprocess"
	loadgenCPUs      string // taskset CPU list for the load generator child
	targetProfiles   string // per-target CPU profile file prefix ("" = none)
	gatewayBin       string // -mode rls: a cmd/gateway binary ("" = build it)
	gatewayCPUs      string // -mode rls: taskset CPU list for the gateway
	rlsCallers       []int  // -mode rls: caller counts, each measured
}

func main() {
	defer func() { os.Exit(exit) }()
	var o options
	flag.DurationVar(&o.duration, "duration", 10*time.Second, "length of each run")
	flag.IntVar(&o.rounds, "rounds", 3, "rounds; each runs every target once (bare, limited, and with -burn the limited proxy under burn)")
	flag.IntVar(&o.conc, "c", 16, "concurrent workers (each with keep-alive connections)")
	flag.IntVar(&o.rate, "rate", 0, "open loop: send this many requests/s in all on a fixed schedule, latency from the scheduled send (0: closed loop, each worker sends when answered)")
	flag.StringVar(&o.mode, "mode", "lease", "agent mode: lease (single-node allocator in a child process), lease-inprocess (in this process: its CPU is counted) or standalone (no allocator); or rls: the cmd/gateway binary's Envoy RLS server against the gRPC health check on the same server (see -rls-callers)")
	flag.StringVar(&o.gatewayBin, "gateway-bin", "", "with -mode rls: the cmd/gateway binary to run (default: built from this tree)")
	flag.StringVar(&o.gatewayCPUs, "gateway-cpus", "", "with -mode rls: run the gateway under taskset -c LIST")
	rlsCallers := flag.String("rls-callers", "1,64", "with -mode rls: concurrent callers, each count measured in every round")
	flag.DurationVar(&o.warmup, "warmup", time.Second, "warm-up before each run (not measured)")
	flag.StringVar(&o.allocator, "allocator", "", "gRPC address of a running allocator to use instead of starting one (it must serve the rules -print-rules shows)")
	flag.IntVar(&o.burn, "burn", 0, "with -mode lease: add a target that measures the limited proxy while the allocator child spins this many goroutines (its -debug-burn-cpu)")
	flag.StringVar(&o.allocatorCPUs, "allocator-cpus", "", "with -mode lease: run the allocator child under taskset -c LIST (e.g. 1)")
	flag.StringVar(&o.loadgen, "loadgen", "process", "where the load generator and the upstream run: process (a child process: the gateway's CPU is measured apart from theirs) inprocess (in this process, as before: all CPU counted together) or wrk (the wrk binary, closed loop; the upstream in a child process)")
	flag.StringVar(&o.loadgenCPUs, "loadgen-cpus", "", "with -loadgen process: run the load generator child under taskset -c LIST (pin this process with \"taskset -c 0 ...\" to give each its own core)")
	flag.StringVar(&o.targetProfiles, "target-cpuprofile", "", "write a CPU profile of each measured run to PREFIX.<target>.r<round>.prof (this process only; merge a target's rounds with go tool pprof)")
	var (
		child      = flag.Bool("allocator-child", false, "internal: run the allocator and print its address")
		loadChild  = flag.Bool("loadgen-child", false, "internal: run the upstream and the load generator, commanded on stdin")
		childBurn  = flag.Int("debug-burn-cpu", 0, "with -allocator-child: goroutines spinning from the start (stdin \"burn N\" changes it)")
		cpuprofile = flag.String("cpuprofile", "", "write a CPU profile of the whole benchmark to this file")
		printRules = flag.Bool("print-rules", false, "print the benchmark's rule file (domain bench) and exit")
	)
	flag.Parse()
	var err error
	if o.rlsCallers, err = parseCallers(*rlsCallers); err != nil {
		log.Print(err)
		exit = 2
		return
	}
	if *printRules {
		fmt.Print(strings.TrimPrefix(benchRules, "\n"))
		return
	}
	if *loadChild {
		if err := runLoadChild(); err != nil {
			log.Print(err)
			exit = 1
		}
		return
	}
	if *child {
		if err := runAllocatorChild(*childBurn); err != nil {
			log.Print(err)
			exit = 1
		}
		return
	}
	if err := o.validate(); err != nil {
		log.Print(err)
		exit = 2
		return
	}
	if *cpuprofile != "" && o.targetProfiles != "" {
		log.Print("-cpuprofile and -target-cpuprofile: choose one")
		exit = 2
		return
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	run := run
	if o.mode == "rls" {
		run = runRLS
	}
	if err := run(o); err != nil {
		log.Print(err)
		exit = 1
	}
}

func (o options) validate() error {
	switch o.mode {
	case "lease", "lease-inprocess", "standalone":
	case "rls":
		if o.burn > 0 || o.loadgen != "process" || o.loadgenCPUs != "" || o.rate > 0 {
			return errors.New("-mode rls: -burn, -loadgen, -loadgen-cpus and -rate do not apply")
		}
	default:
		return fmt.Errorf("-mode %q: want lease, lease-inprocess, standalone or rls", o.mode)
	}
	if (o.gatewayBin != "" || o.gatewayCPUs != "") && o.mode != "rls" {
		return errors.New("-gateway-bin and -gateway-cpus need -mode rls")
	}
	if o.burn < 0 || o.burn > 256 {
		return errors.New("-burn must be in [0, 256]")
	}
	if (o.burn > 0 || o.allocatorCPUs != "") && ((o.mode != "lease" && o.mode != "rls") || o.allocator != "") {
		return errors.New("-burn and -allocator-cpus need -mode lease and no -allocator (they act on the allocator child)")
	}
	if o.allocator != "" && o.mode == "standalone" {
		return errors.New("-allocator needs -mode lease")
	}
	switch o.loadgen {
	case "process", "inprocess":
	case "wrk":
		if o.rate > 0 {
			return errors.New("-loadgen wrk is closed loop: -rate needs -loadgen process or inprocess")
		}
	default:
		return fmt.Errorf("-loadgen %q: want process, inprocess or wrk", o.loadgen)
	}
	if o.loadgenCPUs != "" && o.loadgen != "process" {
		return errors.New("-loadgen-cpus needs -loadgen process")
	}
	if o.rounds < 1 || o.conc < 1 || o.duration <= 0 || o.rate < 0 {
		return errors.New("-rounds, -c and -duration must be positive")
	}
	return nil
}

func serve(h http.Handler) (string, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	return "http://" + ln.Addr().String(), func() { srv.Close(); <-done }, nil
}

func run(o options) error {
	quiet := slog.New(slog.DiscardHandler)
	var lg loadGen
	var err error
	switch o.loadgen {
	case "process":
		lg, err = spawnLoad(o.loadgenCPUs)
	case "wrk":
		lg, err = newWrkLoad()
	default:
		lg, err = newInprocLoad()
	}
	if err != nil {
		return err
	}
	defer lg.close()
	target, err := url.Parse(lg.upstream())
	if err != nil {
		return err
	}

	files := []rules.File{{Name: "bench.yaml", Source: []byte(benchRules)}}
	reg := prometheus.NewRegistry()
	acfg := agent.DefaultConfig()
	acfg.Logger = quiet
	acfg.Registerer = reg
	var child *allocatorChild
	switch {
	case o.mode == "standalone":
		set, err := rules.Compile(1, files)
		if err != nil {
			return err
		}
		acfg.Rules = set
	case o.allocator != "":
		acfg.Allocators = []string{o.allocator}
	case o.mode == "lease":
		child, err = spawnAllocator(o.allocatorCPUs)
		if err != nil {
			return err
		}
		defer child.stop()
		acfg.Allocators = []string{child.addr}
	default: // lease-inprocess
		addr, stopAlloc, err := startAllocator(files, quiet)
		if err != nil {
			return err
		}
		defer stopAlloc()
		acfg.Allocators = []string{addr}
	}
	ag, err := agent.New(acfg)
	if err != nil {
		return err
	}
	defer ag.Close(context.Background())
	deadline := time.Now().Add(30 * time.Second)
	for !ag.Ready() {
		if time.Now().After(deadline) {
			return errors.New("agent not ready")
		}
		time.Sleep(10 * time.Millisecond)
	}

	ex, err := httplimit.NewExtractor(httplimit.Config{
		Domain: "bench",
		APIKey: httplimit.APIKeyConfig{Headers: []string{"Authorization", "X-API-Key"}},
		Tier:   httplimit.TierConfig{Default: "free"},
		Routes: httplimit.RoutesConfig{Paths: []string{"/v1/search"}, Default: "other"},
		Descriptors: []httplimit.DescriptorConfig{
			{{Source: httplimit.SourceTier}, {Source: httplimit.SourceAPIKey}},
			{{Source: httplimit.SourceTier}, {Source: httplimit.SourceRoute}, {Source: httplimit.SourceAPIKey}},
			{{Source: httplimit.SourceAPIKey}},
		},
	})
	if err != nil {
		return err
	}
	var denied atomic.Int64
	hm, err := httplimit.NewMetrics(reg) // as cmd/gateway counts requests
	if err != nil {
		return err
	}
	mw := &httplimit.Middleware{Checker: ag, Extractor: ex, Logger: quiet, Metrics: hm,
		OnDenied: func(w http.ResponseWriter, r *http.Request, d agent.Decision) {
			denied.Add(1)
			httplimit.WriteDenied(w, r, d)
		}}
	// Both targets are the gateway library's reverse proxy; the limited one
	// is the handler cmd/gateway serves (gateway.NewHandler: the body
	// bound, the middleware, the proxy).
	bareURL, stopBare, err := serve(gateway.NewProxy(target, nil, quiet))
	if err != nil {
		return err
	}
	defer stopBare()
	limitedURL, stopLimited, err := serve(gateway.NewHandler(mw, gateway.NewProxy(target, nil, quiet), gateway.DefaultMaxRequestBodyBytes, gateway.DefaultRequestBodyTimeout))
	if err != nil {
		return err
	}
	defer stopLimited()

	// A target is a proxy (bare or limited) and a burn level; "+burnN"
	// targets run while the allocator child spins N goroutines. The bare
	// proxy under burn is the control: the burner shares the machine, so
	// the added latency under burn is limited+burnN minus bare+burnN.
	names := []string{"bare", "limited"}
	burnSuffix := fmt.Sprintf("+burn%d", o.burn)
	if o.burn > 0 {
		names = append(names, "bare"+burnSuffix, "limited"+burnSuffix)
	}
	baseOf := func(name string) string { // the bare target measured alike
		if strings.HasSuffix(name, burnSuffix) {
			return "bare" + burnSuffix
		}
		return "bare"
	}
	isBare := func(name string) bool { return strings.HasPrefix(name, "bare") }
	burning := func(name string) bool { return o.burn > 0 && strings.HasSuffix(name, burnSuffix) }
	where := o.mode
	if o.allocator != "" {
		where += " (allocator " + o.allocator + ")"
	}
	loop := "closed loop"
	if o.rate > 0 {
		loop = fmt.Sprintf("open loop at %d req/s (latency from the scheduled send; throughput is the offered rate unless a target saturates)", o.rate)
	}
	fmt.Printf("gateway overhead: %d rounds × %v per target, %d workers, %s, agent mode %s, load generator %s (CPUs %q), GOMAXPROCS %d, allocator CPUs %q, load average %s\n",
		o.rounds, o.duration, o.conc, loop, where, o.loadgen, o.loadgenCPUs, runtime.GOMAXPROCS(0), o.allocatorCPUs, proccpu.LoadAvg())
	switch o.loadgen {
	case "process":
		fmt.Println("CPU/req: this process (proxies, agent); client CPU/req: the load generator and upstream process")
	case "wrk":
		fmt.Println("CPU/req: this process (proxies, agent); client CPU/req: wrk and the upstream process; latency percentiles from wrk (µs resolution)")
	default:
		fmt.Println("CPU/req: this process (proxies, agent, load generator and upstream together)")
	}
	fmt.Printf("%-6s %-14s %12s %10s %10s %10s %10s %12s %12s %s\n", "round", "target", "req/s", "p50", "p90", "p99", "p99.9", "CPU/req", "client CPU", "agent (limited targets)")
	total := map[string]*hdrhistogram.Histogram{}
	stats := map[string]*agentStats{}
	for _, n := range names {
		total[n] = hdrhistogram.New(1, int64(10*time.Second/time.Nanosecond), 3)
		stats[n] = &agentStats{}
	}
	count := map[string]int64{}
	cpu := map[string]time.Duration{}
	clientCPU := map[string]time.Duration{}
	for r := 1; r <= o.rounds; r++ {
		order := make([]string, len(names)) // rotate so that drift hits every target alike
		for i := range names {
			order[i] = names[(i+r-1)%len(names)]
		}
		for _, name := range order {
			u := limitedURL
			if isBare(name) {
				u = bareURL
			}
			if burning(name) {
				if err := child.setBurn(o.burn); err != nil {
					return err
				}
			}
			// Warm connections and caches (and, under burn, let the leases feel it).
			if _, err := lg.run(u, o.warmup, o.conc, o.rate); err != nil {
				return err
			}
			before, err := gatherAgent(reg)
			if err != nil {
				return err
			}
			poll := pollFallback(reg)
			stopProfile, err := startTargetProfile(o.targetProfiles, name, r)
			if err != nil {
				return err
			}
			c0 := cpuTime()
			res, err := lg.run(u, o.duration, o.conc, o.rate)
			c := cpuTime() - c0
			stopProfile()
			maxFallback := poll()
			if err != nil {
				return err
			}
			h, n, errs := res.h, res.n, res.errs
			after, err := gatherAgent(reg)
			if err != nil {
				return err
			}
			if burning(name) {
				if err := child.setBurn(0); err != nil {
					return err
				}
			}
			if errs > 0 {
				return fmt.Errorf("%s: %d failed requests", name, errs)
			}
			d := after.sub(before)
			d.maxFallback = maxFallback
			total[name].Merge(h)
			count[name] += n
			cpu[name] += c
			clientCPU[name] += res.cpu
			stats[name].add(d)
			note := ""
			if !isBare(name) {
				note = d.String()
			}
			printRow(fmt.Sprint(r), name, h, float64(n)/o.duration.Seconds(), c/time.Duration(max(n, 1)), res.cpu/time.Duration(max(n, 1)), note)
		}
	}
	secs := o.duration.Seconds() * float64(o.rounds)
	fmt.Println()
	perReq := func(n string) time.Duration { return cpu[n] / time.Duration(max(count[n], 1)) }
	for _, n := range names {
		note := ""
		if !isBare(n) {
			note = stats[n].String()
		}
		printRow("all", n, total[n], float64(count[n])/secs, perReq(n), clientCPU[n]/time.Duration(max(count[n], 1)), note)
	}
	fmt.Println()
	for _, n := range names {
		if isBare(n) {
			continue
		}
		b := baseOf(n)
		h, bare := total[n], total[b]
		added := time.Duration(h.ValueAtQuantile(50) - bare.ValueAtQuantile(50))
		added99 := time.Duration(h.ValueAtQuantile(99) - bare.ValueAtQuantile(99))
		ratio := float64(count[n]) / float64(count[b])
		fmt.Printf("%s vs %s: p50 added latency %v (target ≤ 50µs: %s), p99 added %v, throughput %.1f%% (target ≥ 90%%: %s), CPU/req added %v (%.1f%%)\n",
			n, b, added, verdict(added <= 50*time.Microsecond), added99, 100*ratio, verdict(ratio >= 0.9),
			perReq(n)-perReq(b), 100*float64(perReq(n)-perReq(b))/float64(perReq(b)))
	}
	if o.burn > 0 {
		l, b := stats["limited"], stats["limited"+burnSuffix]
		fmt.Printf("agent check latency (allot_agent_check_seconds, histogram_quantile over %d and %d samples): limited p50 %v p99 %v; limited%s p50 %v p99 %v\n",
			l.checks.count(), b.checks.count(), l.checks.quantile(0.5), l.checks.quantile(0.99), burnSuffix, b.checks.quantile(0.5), b.checks.quantile(0.99))
	}
	fmt.Printf("load average at the end: %s\n", proccpu.LoadAvg())
	if d := denied.Load(); d > 0 {
		fmt.Printf("warning: %d requests were denied (the rule should admit everything)\n", d)
	}
	return nil
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}

func printRow(round, name string, h *hdrhistogram.Histogram, rps float64, cpuPerReq, clientPerReq time.Duration, note string) {
	q := func(p float64) time.Duration { return time.Duration(h.ValueAtQuantile(p)).Round(time.Microsecond) }
	client := "-"
	if clientPerReq > 0 {
		client = clientPerReq.Round(100 * time.Nanosecond).String()
	}
	fmt.Printf("%-6s %-14s %12.0f %10v %10v %10v %10v %12v %12s %s\n", round, name, rps, q(50), q(90), q(99), q(99.9),
		cpuPerReq.Round(100*time.Nanosecond), client, note)
}

// startTargetProfile starts a CPU profile of one measured run into
// prefix.<target>.r<round>.prof and returns its stop function (a no-op
// without a prefix).
func startTargetProfile(prefix, target string, round int) (func(), error) {
	if prefix == "" {
		return func() {}, nil
	}
	f, err := os.Create(fmt.Sprintf("%s.%s.r%d.prof", prefix, target, round))
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// cpuTime is the process's user+system CPU time so far. Unlike wall-clock
// throughput it is barely affected by other processes on a shared machine.
func cpuTime() time.Duration {
	d, _ := proccpu.Self()
	return d
}

// startAllocator runs a single-node allocator with the benchmark rules in
// this process.
func startAllocator(files []rules.File, logger *slog.Logger) (string, func(), error) {
	dir, err := os.MkdirTemp("", "allot-bench-gateway-")
	if err != nil {
		return "", nil, err
	}
	cfg := allocator.DefaultConfig()
	cfg.NodeID, cfg.DataDir = "bench", dir
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0", ""
	cfg.Bootstrap, cfg.InitialRules, cfg.Logger = true, files, logger
	srv, err := allocator.New(cfg)
	if err != nil {
		os.RemoveAll(dir)
		return "", nil, err
	}
	stop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		os.RemoveAll(dir)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.WaitReady(ctx); err != nil {
		stop()
		return "", nil, err
	}
	return srv.GRPCAddr(), stop, nil
}

// runAllocatorChild is the child process of -mode lease: it runs the
// allocator, prints "allocator <grpc addr>", then reads commands from
// stdin: "burn N" makes N goroutines spin (replacing the previous ones) and
// is answered "burn N". It exits when stdin closes (the parent ended,
// however it ended).
func runAllocatorChild(burn int) error {
	if burn < 0 || burn > 256 {
		return errors.New("-debug-burn-cpu must be in [0, 256]")
	}
	files := []rules.File{{Name: "bench.yaml", Source: []byte(benchRules)}}
	addr, stop, err := startAllocator(files, slog.New(slog.DiscardHandler))
	if err != nil {
		return err
	}
	defer stop()
	b := cpuburn.Start(burn)
	defer func() { b.Stop() }()
	fmt.Printf("allocator %s\n", addr)
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		var n int
		if _, err := fmt.Sscanf(sc.Text(), "burn %d", &n); err != nil || n < 0 || n > 256 {
			fmt.Printf("error %q\n", sc.Text())
			continue
		}
		b.Stop()
		b = cpuburn.Start(n)
		fmt.Printf("burn %d\n", n)
	}
	return nil
}

// allocatorChild is the allocator process of -mode lease.
type allocatorChild struct {
	addr  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
}

// spawnAllocator re-executes this program as an allocator child, so that
// the allocator's CPU is not counted as the gateway's; with cpus it runs
// under taskset -c cpus.
func spawnAllocator(cpus string) (*allocatorChild, error) {
	cmd, stdin, out, err := spawnChild("-allocator-child", "-allocator-cpus", cpus, 4096)
	if err != nil {
		return nil, err
	}
	c := &allocatorChild{cmd: cmd, stdin: stdin, out: out}
	line, err := c.out.ReadString('\n')
	if _, serr := fmt.Sscanf(line, "allocator %s", &c.addr); err != nil || serr != nil {
		c.stop()
		return nil, fmt.Errorf("allocator child: %q: %v %v", line, err, serr)
	}
	return c, nil
}

// setBurn makes the child spin n goroutines and waits for its answer.
func (c *allocatorChild) setBurn(n int) error {
	if _, err := fmt.Fprintf(c.stdin, "burn %d\n", n); err != nil {
		return fmt.Errorf("allocator child: %w", err)
	}
	line, err := c.out.ReadString('\n')
	if err != nil || line != fmt.Sprintf("burn %d\n", n) {
		return fmt.Errorf("allocator child: burn %d answered %q: %v", n, line, err)
	}
	return nil
}

func (c *allocatorChild) stop() { c.stdin.Close(); _ = c.cmd.Wait() }
