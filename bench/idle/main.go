// Command idle measures what an idle gateway's agent costs: it starts a
// one-node allocator (cmd/allocator, built into a temporary directory),
// creates an agent against it with the gateway's IdleTimeout (120 s),
// checks -keys distinct keys once each, waits until every key has been
// reported, and then, with no traffic at all, reads the process's own CPU
// time from /proc/self/stat over -window. The allocator runs in its own
// process, so only the agent's cost is counted.
//
//	go run ./bench/idle -keys 100000 -window 30s
//
// It prints the CPU used as a fraction of one core. With -active and -rate
// the window carries steady traffic on -active of the keys instead:
//
//	go run ./bench/idle -keys 100000 -active 1000 -rate 2000
//
// Checks are far cheaper than the refill loop's work per key, so the
// difference such runs show is the loop's.
//
// With -allocator-keys it measures idle allocators instead: a cluster of
// three cmd/allocator processes with their default flags is given that
// many keys through Acquire (a lease each), and each process's CPU is
// read from /proc/<pid>/stat over -window twice, while the leases are
// held and after they (and the loading agents) have ended, with its
// resident memory:
//
//	go run ./bench/idle -allocator-keys 1000000 -window 30s
//
// -cpuprofile then profiles the leader over the second window, and
// -allocator-args / -allocator-env pass flags and environment to the
// three nodes.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
)

const rulesYAML = `domain: idle
descriptors:
  - key: k
    rate_limit:
      unit: second
      requests_per_unit: 100
`

func main() {
	keys := flag.Int("keys", 100_000, "distinct keys to check once each")
	window := flag.Duration("window", 30*time.Second, "idle window measured")
	settle := flag.Duration("settle", 10*time.Second, "time after the last check before the window starts")
	bin := flag.String("allocator-bin", "", "allocator binary (default: go build ./cmd/allocator)")
	profile := flag.String("cpuprofile", "", "write a CPU profile of the idle window to this file (with -allocator-keys: of the leader, over the window after the leases ended)")
	active := flag.Int("active", 0, "keys (of -keys) checked during the window, round robin")
	rate := flag.Int("rate", 0, "checks per second during the window, spread over -active keys")
	allocKeys := flag.Int("allocator-keys", 0, "measure three idle allocators holding this many keys instead of an agent (0: the agent)")
	allocArgs := flag.String("allocator-args", "", "with -allocator-keys: extra space-separated flags for every allocator")
	allocEnv := flag.String("allocator-env", "", "with -allocator-keys: comma-separated NAME=VALUE pairs added to the allocators' environment")
	flag.Parse()
	if *allocKeys > 0 {
		o := allocOptions{keys: *allocKeys, window: *window, settle: *settle, bin: *bin, profile: *profile, args: *allocArgs, env: *allocEnv}
		if err := runAllocator(o); err != nil {
			log.Fatal(err)
		}
		return
	}
	if err := run(*keys, *window, *settle, *bin, *profile, *active, *rate); err != nil {
		log.Fatal(err)
	}
}

func run(keys int, window, settle time.Duration, bin, profile string, active, rate int) error {
	dir, bin, rulesPath, err := setup(bin, rulesYAML)
	if dir != "" {
		defer os.RemoveAll(dir)
	}
	if err != nil {
		return err
	}
	addrs, err := testproc.FreeLoopbackAddrs(3)
	if err != nil {
		return err
	}
	n := &testproc.Node{ID: "n0", GRPC: addrs[0], Raft: addrs[1], HTTP: addrs[2]}
	n.Proc = testproc.NewProc(n.ID, dir, bin)
	n.Proc.Args = []string{"-node-id", n.ID, "-data-dir", filepath.Join(dir, "data"), "-grpc-addr", n.GRPC,
		"-raft-addr", n.Raft, "-http-addr", n.HTTP, "-log-level", "warn", "-bootstrap", "-rules", rulesPath}
	if err := n.Proc.Run(); err != nil {
		return err
	}
	defer n.Proc.Terminate(5 * time.Second)
	ctx := context.Background()
	if err := n.WaitReady(ctx, 60*time.Second); err != nil {
		return err
	}

	cfg := agent.DefaultConfig()
	cfg.Allocators = []string{n.GRPC}
	cfg.IdleTimeout = 120 * time.Second // cmd/gateway's
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	defer a.Close(ctx)
	deadline := time.Now().Add(30 * time.Second)
	for a.Rules() == nil || a.Rules().Version() == 0 || !a.Ready() {
		if time.Now().After(deadline) {
			return errors.New("the agent did not get the allocator's rules")
		}
		_, _ = a.Check(ctx, "idle", []agent.Descriptor{{Entries: []rules.Entry{{Key: "k", Value: "warmup"}}}}, 1)
		time.Sleep(50 * time.Millisecond)
	}
	start := time.Now()
	for i := range keys {
		d := []agent.Descriptor{{Entries: []rules.Entry{{Key: "k", Value: "key-" + strconv.Itoa(i)}}}}
		if _, err := a.Check(ctx, "idle", d, 1); err != nil {
			return err
		}
	}
	fmt.Printf("checked %d keys in %v\n", keys, time.Since(start).Round(time.Millisecond))
	time.Sleep(settle)
	if profile != "" {
		f, err := os.Create(profile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
	}
	c0, t0 := cpu(), time.Now()
	if active > 0 && rate > 0 {
		// Steady traffic on a few keys: a check every 1/rate, paced by
		// a ticker of 10 ms batches.
		descs := make([][]agent.Descriptor, active)
		for i := range descs {
			descs[i] = []agent.Descriptor{{Entries: []rules.Entry{{Key: "k", Value: "key-" + strconv.Itoa(i)}}}}
		}
		tk := time.NewTicker(10 * time.Millisecond)
		sent, next := 0, 0
		for time.Since(t0) < window {
			<-tk.C
			for due := int(time.Since(t0).Seconds() * float64(rate)); sent < due; sent++ {
				_, _ = a.Check(ctx, "idle", descs[next], 1)
				next = (next + 1) % active
			}
		}
		tk.Stop()
	} else {
		time.Sleep(window)
	}
	c1, t1 := cpu(), time.Now()
	if profile != "" {
		pprof.StopCPUProfile()
	}
	fmt.Printf("%d keys, %d active at %d checks/s: %.2f%% of a core over %v (load %s)\n", keys, active, rate,
		100*(c1-c0).Seconds()/t1.Sub(t0).Seconds(), window, loadavg())
	return nil
}

// setup makes a temporary directory (the caller removes it) holding the
// rules file and, unless bin names one, a fresh build of cmd/allocator;
// it returns the directory, the binary and the rules file.
func setup(bin, rules string) (dir, allocator, rulesPath string, err error) {
	if dir, err = os.MkdirTemp("", "allot-idle-"); err != nil {
		return "", "", "", err
	}
	if bin == "" {
		bin = filepath.Join(dir, "allocator")
		if err := testproc.GoBuild(dir, false, "github.com/allot/allot/cmd/allocator"); err != nil {
			return dir, "", "", err
		}
	}
	rulesPath = filepath.Join(dir, "rules.yaml")
	return dir, bin, rulesPath, os.WriteFile(rulesPath, []byte(rules), 0o600)
}

// cpu is this process's user+system time, from /proc/self/stat.
func cpu() time.Duration {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		log.Fatal(err)
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	const hz = 100 // USER_HZ
	return time.Duration(ut+st) * time.Second / hz
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.Join(strings.Fields(string(b))[:3], " ")
}
