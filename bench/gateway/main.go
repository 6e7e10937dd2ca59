// Command gateway measures what the rate limiting middleware adds to a
// reverse proxy: the same httputil.ReverseProxy is served twice on loopback,
// bare and behind httplimit.Middleware with an agent, and a Go load
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
//
// Every request is allowed (the rule's limit is far above the offered
// load), so both targets do the same upstream work; the difference is the
// descriptor extraction, the check and the RateLimit fields. The requests
// carry 64 distinct API keys through the -dev descriptor configuration
// (three descriptors each). Besides wall-clock throughput and latency, which
// other load on a shared machine disturbs, it reports the process's CPU time
// per request (load generator, proxies and upstream all run in this process;
// in the default mode the allocator runs in a child process, as it would on
// other machines).
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
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/allocator"
	"github.com/allot/allot/pkg/httplimit"
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

func main() {
	defer func() { os.Exit(exit) }()
	var (
		duration    = flag.Duration("duration", 10*time.Second, "length of each run")
		rounds      = flag.Int("rounds", 3, "rounds; each runs the bare and the limited proxy once")
		concurrency = flag.Int("c", 16, "concurrent workers (each with keep-alive connections)")
		mode        = flag.String("mode", "lease", "agent mode: lease (single-node allocator in a child process), lease-inprocess (in this process: its CPU is counted) or standalone (no allocator)")
		child       = flag.Bool("allocator-child", false, "internal: run the allocator and print its address")
		warmup      = flag.Duration("warmup", time.Second, "warm-up before each run (not measured)")
		cpuprofile  = flag.String("cpuprofile", "", "write a CPU profile of the whole benchmark to this file")
	)
	flag.Parse()
	if *child {
		if err := runAllocatorChild(); err != nil {
			log.Print(err)
			exit = 1
		}
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
	if err := run(*duration, *warmup, *rounds, *concurrency, *mode); err != nil {
		log.Print(err)
		exit = 1
	}
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

func newProxy(target *url.URL) *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			pr.SetXForwarded()
		},
		Transport: &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, IdleConnTimeout: 90 * time.Second},
	}
}

func run(duration, warmup time.Duration, rounds, conc int, mode string) error {
	quiet := slog.New(slog.DiscardHandler)
	body := []byte(`{"ok":true,"message":"hello from the benchmark upstream"}`)
	upURL, stopUp, err := serve(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write(body)
	}))
	if err != nil {
		return err
	}
	defer stopUp()
	target, _ := url.Parse(upURL)

	files := []rules.File{{Name: "bench.yaml", Source: []byte(benchRules)}}
	acfg := agent.DefaultConfig()
	acfg.Logger = quiet
	switch mode {
	case "standalone":
		set, err := rules.Compile(1, files)
		if err != nil {
			return err
		}
		acfg.Rules = set
	case "lease", "lease-inprocess":
		var addr string
		var stopAlloc func()
		var err error
		if mode == "lease" {
			addr, stopAlloc, err = spawnAllocator()
		} else {
			addr, stopAlloc, err = startAllocator(files, quiet)
		}
		if err != nil {
			return err
		}
		defer stopAlloc()
		acfg.Allocators = []string{addr}
	default:
		return fmt.Errorf("-mode %q: want lease, lease-inprocess or standalone", mode)
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
	mw := &httplimit.Middleware{Checker: ag, Extractor: ex, Logger: quiet,
		OnDenied: func(w http.ResponseWriter, r *http.Request, d agent.Decision) {
			denied.Add(1)
			httplimit.WriteDenied(w, r, d)
		}}
	bareURL, stopBare, err := serve(newProxy(target))
	if err != nil {
		return err
	}
	defer stopBare()
	limitedURL, stopLimited, err := serve(mw.Wrap(newProxy(target)))
	if err != nil {
		return err
	}
	defer stopLimited()

	fmt.Printf("gateway overhead: %d rounds × %v per target, %d workers, agent mode %s, GOMAXPROCS %d\n",
		rounds, duration, conc, mode, runtime.GOMAXPROCS(0))
	fmt.Printf("%-8s %-8s %12s %10s %10s %10s %10s %12s\n", "round", "target", "req/s", "p50", "p90", "p99", "p99.9", "CPU/req")
	total := map[string]*hdrhistogram.Histogram{
		"bare":    hdrhistogram.New(1, int64(10*time.Second/time.Nanosecond), 3),
		"limited": hdrhistogram.New(1, int64(10*time.Second/time.Nanosecond), 3),
	}
	count := map[string]int64{}
	cpu := map[string]time.Duration{}
	for r := 1; r <= rounds; r++ {
		order := []string{"bare", "limited"}
		if r%2 == 0 {
			order = []string{"limited", "bare"}
		}
		for _, name := range order {
			u := bareURL
			if name == "limited" {
				u = limitedURL
			}
			load(u, warmup, conc) // warm connections and caches
			c0 := cpuTime()
			h, n, errs := load(u, duration, conc)
			c := cpuTime() - c0
			if errs > 0 {
				return fmt.Errorf("%s: %d failed requests", name, errs)
			}
			total[name].Merge(h)
			count[name] += n
			cpu[name] += c
			printRow(fmt.Sprint(r), name, h, float64(n)/duration.Seconds(), c/time.Duration(max(n, 1)))
		}
	}
	secs := duration.Seconds() * float64(rounds)
	bare, lim := total["bare"], total["limited"]
	fmt.Println()
	cpuBare := cpu["bare"] / time.Duration(max(count["bare"], 1))
	cpuLim := cpu["limited"] / time.Duration(max(count["limited"], 1))
	printRow("all", "bare", bare, float64(count["bare"])/secs, cpuBare)
	printRow("all", "limited", lim, float64(count["limited"])/secs, cpuLim)
	added := time.Duration(lim.ValueAtQuantile(50) - bare.ValueAtQuantile(50))
	ratio := float64(count["limited"]) / float64(count["bare"])
	fmt.Printf("\np50 added latency: %v (target ≤ 50µs: %s)\n", added, verdict(added <= 50*time.Microsecond))
	fmt.Printf("throughput limited/bare: %.1f%% (target ≥ 90%%: %s)\n", 100*ratio, verdict(ratio >= 0.9))
	fmt.Printf("CPU per request (load generator, proxy and upstream in this process): bare %v, limited %v, added %v (%.1f%%)\n",
		cpuBare, cpuLim, cpuLim-cpuBare, 100*float64(cpuLim-cpuBare)/float64(cpuBare))
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

func printRow(round, name string, h *hdrhistogram.Histogram, rps float64, cpuPerReq time.Duration) {
	q := func(p float64) time.Duration { return time.Duration(h.ValueAtQuantile(p)).Round(time.Microsecond) }
	fmt.Printf("%-8s %-8s %12.0f %10v %10v %10v %10v %12v\n", round, name, rps, q(50), q(90), q(99), q(99.9),
		cpuPerReq.Round(100*time.Nanosecond))
}

// cpuTime is the process's user+system CPU time so far. Unlike wall-clock
// throughput it is barely affected by other processes on a shared machine.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// load runs conc workers against base for d and returns the latency
// histogram, the completed requests and the failures.
func load(base string, d time.Duration, conc int) (*hdrhistogram.Histogram, int64, int64) {
	tr := &http.Transport{MaxIdleConns: conc * 2, MaxIdleConnsPerHost: conc * 2, IdleConnTimeout: 90 * time.Second}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	hs := make([]*hdrhistogram.Histogram, conc)
	var n, errs atomic.Int64
	stop := time.Now().Add(d)
	var wg sync.WaitGroup
	for w := 0; w < conc; w++ {
		hs[w] = hdrhistogram.New(1, int64(10*time.Second/time.Nanosecond), 3)
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			req, _ := http.NewRequest(http.MethodGet, base+"/v1/search", nil)
			for i := 0; ; i++ {
				t0 := time.Now()
				if t0.After(stop) {
					return
				}
				req.Header.Set("X-API-Key", fmt.Sprintf("k_bench_%02d", (w*7+i)%64))
				resp, err := client.Do(req)
				if err != nil {
					errs.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				_ = hs[w].RecordValue(int64(time.Since(t0)))
				n.Add(1)
			}
		}(w)
	}
	wg.Wait()
	h := hs[0]
	for _, o := range hs[1:] {
		h.Merge(o)
	}
	return h, n.Load(), errs.Load()
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
// allocator, prints "allocator <grpc addr>" and exits when stdin closes
// (the parent ended, however it ended).
func runAllocatorChild() error {
	files := []rules.File{{Name: "bench.yaml", Source: []byte(benchRules)}}
	addr, stop, err := startAllocator(files, slog.New(slog.DiscardHandler))
	if err != nil {
		return err
	}
	defer stop()
	fmt.Printf("allocator %s\n", addr)
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// spawnAllocator re-executes this program as an allocator child, so that
// the allocator's CPU is not counted as the gateway's.
func spawnAllocator() (string, func(), error) {
	cmd := exec.Command(os.Args[0], "-allocator-child")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop := func() { stdin.Close(); _ = cmd.Wait() }
	line, err := bufio.NewReader(stdout).ReadString('\n')
	var addr string
	if _, serr := fmt.Sscanf(line, "allocator %s", &addr); err != nil || serr != nil {
		stop()
		return "", nil, fmt.Errorf("allocator child: %q: %v %v", line, err, serr)
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	return addr, stop, nil
}
