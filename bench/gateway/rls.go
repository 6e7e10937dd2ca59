package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/allot/allot/internal/proccpu"
	commonv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// runRLS is -mode rls: the gateway's Envoy RLS server against the gRPC
// health check on the same server. It builds cmd/gateway from this tree
// (or runs -gateway-bin), starts it once with leases from an allocator
// child process (the gateway's flags: -allocators, -rls-addr, -listen,
// -http-addr, -upstream), and drives both methods from this process over
// one connection: envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit
// (domain bench, one descriptor tier=free, api_key=k_bench_NN, 64 keys
// cycled, every check allowed from a lease) and grpc.health.v1.Health/Check
// (an empty service name). For each caller count in -rls-callers, each
// round runs the two targets back to back (the order flips every round) for
// -duration, closed loop, and reads the gateway's CPU time from
// /proc/<pid>/stat over the window. It prints the server's CPU per call for
// each and their ratio per round, then the median and range of the ratio.
func runRLS(o options) error {
	bin := o.gatewayBin
	if bin == "" {
		dir, err := os.MkdirTemp("", "allot-bench-rls-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		bin = filepath.Join(dir, "gateway")
		if out, err := exec.Command("go", "build", "-o", bin, "github.com/allot/allot/cmd/gateway").CombinedOutput(); err != nil {
			return fmt.Errorf("go build cmd/gateway: %v\n%s", err, out)
		}
	}
	allocAddr := o.allocator
	if allocAddr == "" {
		child, err := spawnAllocator(o.allocatorCPUs)
		if err != nil {
			return err
		}
		defer child.stop()
		allocAddr = child.addr
	}
	gw, err := startGateway(bin, o.gatewayCPUs, "-allocators", allocAddr, "-rls-addr", "127.0.0.1:0",
		"-listen", "127.0.0.1:0", "-http-addr", "127.0.0.1:0", "-upstream", "http://127.0.0.1:9", "-log-level", "warn")
	if err != nil {
		return err
	}
	defer gw.stop()

	cc, err := grpc.NewClient(gw.rls, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer cc.Close()
	rl := rlsv3.NewRateLimitServiceClient(cc)
	hc := healthpb.NewHealthClient(cc)
	ctx := context.Background()
	if err := waitServing(ctx, hc); err != nil {
		return err
	}
	reqs := make([]*rlsv3.RateLimitRequest, 64)
	for i := range reqs {
		reqs[i] = &rlsv3.RateLimitRequest{Domain: "bench", Descriptors: []*commonv3.RateLimitDescriptor{{
			Entries: []*commonv3.RateLimitDescriptor_Entry{{Key: "tier", Value: "free"}, {Key: "api_key", Value: fmt.Sprintf("k_bench_%02d", i)}},
		}}}
	}
	calls := map[string]func(int) error{
		"rls": func(i int) error {
			resp, err := rl.ShouldRateLimit(ctx, reqs[i%len(reqs)])
			if err == nil && resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
				err = fmt.Errorf("ShouldRateLimit: %v, want OK", resp.GetOverallCode())
			}
			return err
		},
		"health": func(int) error {
			resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
			if err == nil && resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
				err = fmt.Errorf("health: %v, want SERVING", resp.GetStatus())
			}
			return err
		},
	}
	// Lease every key, then let the refill loop settle.
	if _, err := driveCalls(calls["rls"], 64, o.warmup+time.Second); err != nil {
		return err
	}
	fmt.Printf("RLS vs gRPC health check: the gateway binary %s (pid %d, CPUs %q), leases from allocator %s, one client connection, %d rounds × %v per target, closed loop, GOMAXPROCS of this client %d, load average %s\n",
		bin, gw.cmd.Process.Pid, o.gatewayCPUs, allocAddr, o.rounds, o.duration, runtime.GOMAXPROCS(0), proccpu.LoadAvg())
	fmt.Println("server CPU/call: the gateway process's user+system time over the window (/proc/<pid>/stat) divided by the calls answered")
	fmt.Printf("%-6s %-8s %-8s %12s %16s %16s\n", "round", "callers", "target", "calls/s", "server CPU/call", "client CPU/call")
	type key struct {
		callers int
		target  string
	}
	perCall := map[key][]time.Duration{}
	for r := 1; r <= o.rounds; r++ {
		for _, c := range o.rlsCallers {
			order := []string{"rls", "health"}
			if r%2 == 0 {
				order = []string{"health", "rls"}
			}
			for _, target := range order {
				if _, err := driveCalls(calls[target], c, o.warmup); err != nil {
					return err
				}
				s0, err := procCPU(gw.cmd.Process.Pid)
				if err != nil {
					return err
				}
				c0 := cpuTime()
				n, err := driveCalls(calls[target], c, o.duration)
				cl := cpuTime() - c0
				s1, err2 := procCPU(gw.cmd.Process.Pid)
				if err := errors.Join(err, err2); err != nil {
					return fmt.Errorf("%s with %d callers: %w", target, c, err)
				}
				srv := (s1 - s0) / time.Duration(max(n, 1))
				perCall[key{c, target}] = append(perCall[key{c, target}], srv)
				fmt.Printf("%-6d %-8d %-8s %12.0f %16v %16v\n", r, c, target, float64(n)/o.duration.Seconds(),
					srv.Round(100*time.Nanosecond), (cl / time.Duration(max(n, 1))).Round(100*time.Nanosecond))
			}
		}
	}
	fmt.Println()
	for _, c := range o.rlsCallers {
		rs, hs := perCall[key{c, "rls"}], perCall[key{c, "health"}]
		ratios := make([]float64, len(rs))
		for i := range rs {
			ratios[i] = float64(rs[i]) / float64(max(hs[i], 1))
		}
		slices.Sort(ratios)
		fmt.Printf("%d callers: server CPU per call, ShouldRateLimit / health Check: median %.2f, range %.2f–%.2f over %d rounds (rls median %v, health median %v; target ≤ 1.2: %s)\n",
			c, median(ratios), ratios[0], ratios[len(ratios)-1], len(ratios), medianDur(rs).Round(100*time.Nanosecond),
			medianDur(hs).Round(100*time.Nanosecond), verdict(median(ratios) <= 1.2))
	}
	fmt.Printf("load average at the end: %s\n", proccpu.LoadAvg())
	return nil
}

// driveCalls runs call from callers goroutines, closed loop, for d, and
// returns the calls answered. The first error stops it.
func driveCalls(call func(int) error, callers int, d time.Duration) (int64, error) {
	var n atomic.Int64
	var failed atomic.Pointer[error]
	deadline := time.Now().Add(d)
	var wg sync.WaitGroup
	for g := range callers {
		wg.Go(func() {
			for i := g; time.Now().Before(deadline) && failed.Load() == nil; i += callers {
				if err := call(i); err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
				n.Add(1)
			}
		})
	}
	wg.Wait()
	if p := failed.Load(); p != nil {
		return n.Load(), *p
	}
	return n.Load(), nil
}

func waitServing(ctx context.Context, hc healthpb.HealthClient) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("gateway not serving after 30s: %v %v", resp.GetStatus(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// gatewayProc is a cmd/gateway process.
type gatewayProc struct {
	cmd *exec.Cmd
	rls string
}

// startGateway runs bin with args (under taskset -c cpus when cpus is set)
// and reads the RLS address from its "listening" line.
func startGateway(bin, cpus string, args ...string) (*gatewayProc, error) {
	argv := append([]string{bin}, args...)
	if cpus != "" {
		ts, err := exec.LookPath("taskset")
		if err != nil {
			return nil, fmt.Errorf("-gateway-cpus: %w", err)
		}
		argv = append([]string{ts, "-c", cpus}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	g := &gatewayProc{cmd: cmd}
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		for _, f := range strings.Fields(sc.Text()) {
			if a, ok := strings.CutPrefix(f, "rls="); ok {
				g.rls = a
			}
		}
		if g.rls != "" {
			go func() { // drain: the gateway must never block on stdout
				for sc.Scan() {
				}
			}()
			return g, nil
		}
	}
	g.stop()
	return nil, errors.New("gateway: exited before printing its RLS address")
}

// stop ends the gateway with SIGTERM (a graceful shutdown) and waits.
func (g *gatewayProc) stop() {
	_ = g.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = g.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = g.cmd.Process.Kill()
		<-done
	}
}

// parseCallers parses -rls-callers ("1,64").
func parseCallers(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 4096 {
			return nil, fmt.Errorf("-rls-callers %q: want a list of counts in [1, 4096]", s)
		}
		out = append(out, n)
	}
	return out, nil
}

func median(xs []float64) float64 {
	s := slices.Sorted(slices.Values(xs))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func medianDur(ds []time.Duration) time.Duration {
	s := slices.Sorted(slices.Values(ds))
	return s[len(s)/2]
}
