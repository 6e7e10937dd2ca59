// Command sim is allot's deterministic fleet simulator: the real
// agent (hot path and refill logic, driven by agent/agentsim) and the real
// allocator grant code (allocator/state) run over an in-memory
// transport on a virtual clock, with the network, Raft and failures
// modelled, side by side with the baselines (no coordination, a static R/N
// split, Redis per request) on the same arrivals. Each scenario prints the
// bound the design promises next to the measured value; the exit status is
// 1 when a bound is broken. Same seed, same output.
//
// The allocator is one or more Raft groups over the slot space (pkg/slots),
// each a server with finite CPU: an entry and each of its keys cost the
// CPU docs/performance.md measured (-raft-entry-cpu, -raft-key-cpu,
// -leader-entry-share, -leader-key-share, -leader-cores override it), a
// group whose leader is behind queues its calls, and past the batcher's
// queue bound, a node's in-flight cap or an agent's call rate it refuses
// them ResourceExhausted, as the real allocator does. The fleet scenarios report every group's
// load and fail when one cannot carry it.
//
//	go run ./bench/sim -quick                 # make sim: every scenario, scaled down
//	go run ./bench/sim -scale full            # the reference sizing (200 gateways, 5M keys)
//	go run ./bench/sim -scenarios failover,hot-key -seed 7
//	go run ./bench/sim -quick -scenarios fleet-10x -groups-10x 4   # ten times the fleet (minutes)
//	go run ./bench/sim -scale full -scenarios fleet-10x -groups-10x 256 -nodes-10x 256 -sample-10x 2 -duration-10x 10s
//	    # 2,000 gateways, 50M keys, 10M req/s at peak on 256 groups led by 256 nodes, the keys of 2 of them simulated
//
// A fleet-10x run may be sampled by slot (-sample-10x m): every arrival of
// the whole fleet is drawn, and those on the keys of m of its groups are
// simulated, from every agent; the rest are dropped. A group's load, CPU
// and calls are then exact for the groups simulated, since no key is
// served by two groups. The sample takes the hottest key's group, then
// the other groups its leader leads: with a sample of at least the groups
// one node leads (⌈groups/nodes⌉), that node's guard (calls in flight,
// each agent's call rate) and leaders see every call the whole fleet sends
// them. What the sample cannot see is each agent's calls to the groups
// not simulated, which the guard's bound counts from the calls per group
// it measured.
//
// -nodes and -nodes-10x set the allocator's node count (default 3): group
// i is led by node i mod nodes, the even spread the allocator keeps, and
// every node has its own guard with the allocator's defaults.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/allot/allot/pkg/slots"
)

// scenario is one named simulation. An optIn scenario runs only when
// -scenarios names it (it takes minutes even at the quick scale).
type scenario struct {
	name  string
	run   func(sc scale, seed uint64) (*result, error)
	optIn bool
}

var scenarios = []scenario{
	{"fleet", runFleet, false},
	{"fleet-10x", runFleet10x, true},
	{"failover", runFailover, false},
	{"unreachable", runUnreachable, false},
	{"hot-key", runHotKey, false},
	{"churn", runChurn, false},
	{"rule-change", runRuleChange, false},
	{"retry-storm", runRetryStorm, false},
	{"regions", runRegions, false},
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// validShare reports whether a leader's share of a group's CPU is in (0, 1].
func validShare(f float64) bool { return f > 0 && f <= 1 }

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	quick := fs.Bool("quick", false, "shorthand for -scale quick (what `make sim` runs)")
	scaleName := fs.String("scale", "quick", "tiny, quick or full (the reference sizing: 200 gateways, 5M keys)")
	seed := fs.Uint64("seed", 1, "random seed: the same seed gives the same output")
	only := fs.String("scenarios", "", "comma-separated scenarios to run (default all but fleet-10x): "+names())
	plots := fs.String("plots", "bench/sim/out", "directory for PNG plots (\"\" = none)")
	md := fs.String("md", "", "also write the results as Markdown to this file")
	imgDir := fs.String("md-img", "img", "image directory the Markdown links to")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the run to this file")
	memProfile := fs.String("memprofile", "", "write a heap profile to this file when the first scenario's run ends (before its world is freed)")
	verbose := fs.Bool("v", false, "report progress (virtual time) on stderr")
	parallel := fs.Int("parallel", runtime.NumCPU(), "scenarios run at once (each is single-threaded)")
	groups := fs.Int("groups", 0, "allocator Raft groups of the fleet scenario (0: the scale's)")
	groups10 := fs.Int("groups-10x", 0, "allocator Raft groups of the fleet-10x scenario (0: the scale's)")
	nodes := fs.Int("nodes", 3, "allocator nodes of the fleet scenario: the groups' leaders spread evenly over them, each node with its own guard")
	nodes10 := fs.Int("nodes-10x", 3, "allocator nodes of the fleet-10x scenario")
	rate := fs.Int("agent-rate", agentRate, "the allocator's -agent-rate: calls per second per agent and node (burst the larger of 400 and the rate)")
	sample10 := fs.Int("sample-10x", -1, "groups of fleet-10x whose keys are simulated, the rest drawn and dropped (0: all; -1: the scale's)")
	duration10 := fs.Duration("duration-10x", 0, "measured time of fleet-10x (0: the scale's)")
	fs.DurationVar(&measuredCPU.entry, "raft-entry-cpu", measuredCPU.entry, "allocator CPU per Raft entry, summed over the 3 replicas (docs/performance.md)")
	fs.DurationVar(&measuredCPU.key, "raft-key-cpu", measuredCPU.key, "allocator CPU per key-grant, summed over the 3 replicas (docs/performance.md)")
	fs.Float64Var(&measuredCPU.entryShare, "leader-entry-share", measuredCPU.entryShare, "the leader's share of a group's CPU per Raft entry")
	fs.Float64Var(&measuredCPU.keyShare, "leader-key-share", measuredCPU.keyShare, "the leader's share of a group's CPU per key-grant")
	fs.Float64Var(&measuredCPU.cores, "leader-cores", measuredCPU.cores, "cores a group's leader can spend")
	staticSlots := fs.Uint("static-slots", 0, "the allocator's -static-slots: static shares of each eligible rule (0: off; docs/static-shares.md)")
	fs.DurationVar(&simStatic.ttl, "static-ttl", 2*time.Second, "the allocator's -static-ttl")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *staticSlots > 65535 || simStatic.ttl <= 0 {
		fmt.Fprintln(stderr, "sim: -static-slots must be at most 65535 and -static-ttl above 0")
		return 2
	}
	simStatic.slots = uint32(*staticSlots)
	if *quick {
		*scaleName = "quick"
	}
	sc, ok := scales[*scaleName]
	if !ok {
		fmt.Fprintf(stderr, "sim: unknown scale %q (tiny, quick, full)\n", *scaleName)
		return 2
	}
	if *groups < 0 || *groups > slots.Count || *groups10 < 0 || *groups10 > slots.Count {
		fmt.Fprintf(stderr, "sim: -groups and -groups-10x must be 1 to %d\n", slots.Count)
		return 2
	}
	if *nodes < 3 || *nodes > maxNodes || *nodes10 < 3 || *nodes10 > maxNodes {
		fmt.Fprintf(stderr, "sim: -nodes and -nodes-10x must be 3 to %d (the CPU model is of groups of 3 replicas)\n", maxNodes)
		return 2
	}
	sc.nodes, sc.nodes10 = *nodes, *nodes10
	if measuredCPU.entry < 0 || measuredCPU.key < 0 || !validShare(measuredCPU.entryShare) || !validShare(measuredCPU.keyShare) || measuredCPU.cores <= 0 {
		fmt.Fprintln(stderr, "sim: -raft-entry-cpu and -raft-key-cpu must not be negative, -leader-entry-share and -leader-key-share must be in (0, 1], -leader-cores above 0")
		return 2
	}
	if *groups > 0 {
		sc.groups = *groups
	}
	if *groups10 > 0 {
		sc.groups10 = *groups10
	}
	if *sample10 >= 0 {
		sc.sample10 = *sample10
	}
	if *rate <= 0 {
		fmt.Fprintln(stderr, "sim: -agent-rate must be above 0")
		return 2
	}
	agentRate, agentBurst = *rate, max(agentBurst, *rate)
	if *duration10 < 0 {
		fmt.Fprintln(stderr, "sim: -duration-10x must not be negative")
		return 2
	}
	if *duration10 > 0 {
		sc.fleet10 = *duration10
	}
	var pick []scenario
	for _, s := range scenarios {
		if *only == "" && !s.optIn || slices.Contains(strings.Split(*only, ","), s.name) {
			pick = append(pick, s)
		}
	}
	if len(pick) == 0 {
		fmt.Fprintf(stderr, "sim: no scenario matches %q (%s)\n", *only, names())
		return 2
	}
	if *plots != "" {
		if err := os.MkdirAll(*plots, 0o755); err != nil {
			fmt.Fprintf(stderr, "sim: %v\n", err)
			return 1
		}
	}
	if *verbose {
		start := time.Now()
		var mu sync.Mutex
		progress = func(s string) {
			mu.Lock()
			defer mu.Unlock()
			fmt.Fprintf(stderr, "sim: [%s] %s\n", time.Since(start).Round(time.Second), s)
		}
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintf(stderr, "sim: %v\n", err)
			return 1
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintf(stderr, "sim: %v\n", err)
			return 1
		}
		defer pprof.StopCPUProfile()
	}
	if *memProfile != "" {
		var once sync.Once
		runEnded = func() {
			once.Do(func() {
				f, err := os.Create(*memProfile)
				if err == nil {
					runtime.GC()
					err = pprof.WriteHeapProfile(f)
					if cerr := f.Close(); err == nil {
						err = cerr
					}
				}
				if err != nil {
					fmt.Fprintf(stderr, "sim: -memprofile: %v\n", err)
				}
			})
		}
	}
	fmt.Fprintf(stdout, "allot fleet simulation: scale %s, seed %d\n", sc.name, *seed)
	type outcome struct {
		res  *result
		err  error
		wall time.Duration
	}
	outs := make([]outcome, len(pick))
	done := make([]chan struct{}, len(pick))
	sem := make(chan struct{}, max(*parallel, 1))
	for i, s := range pick {
		done[i] = make(chan struct{})
		go func() {
			defer close(done[i])
			sem <- struct{}{}
			defer func() { <-sem }()
			start := time.Now()
			res, err := s.run(sc, *seed)
			outs[i] = outcome{res, err, time.Since(start)}
		}()
	}
	var mdBuf bytes.Buffer
	failed, errored := false, false
	for i, s := range pick {
		<-done[i]
		o := outs[i]
		if o.err != nil {
			fmt.Fprintf(stderr, "sim: %s: %v\n", s.name, o.err)
			errored = true
			continue
		}
		o.res.writeText(stdout)
		fmt.Fprintf(stderr, "sim: %s took %s of wall-clock time\n", s.name, o.wall.Round(time.Millisecond))
		if *plots != "" {
			for j := range o.res.plots {
				if err := o.res.plots[j].write(*plots); err != nil {
					fmt.Fprintf(stderr, "sim: %v\n", err)
					errored = true
				}
			}
		}
		o.res.writeMarkdown(&mdBuf, *imgDir)
		if len(o.res.broken()) > 0 {
			failed = true
		}
	}
	if errored {
		return 1
	}
	if *md != "" {
		if err := os.WriteFile(*md, mdBuf.Bytes(), 0o644); err != nil {
			fmt.Fprintf(stderr, "sim: %v\n", err)
			return 1
		}
	}
	if failed {
		fmt.Fprintln(stdout, "\nsim: a bound the design promises is broken (FAIL above)")
		return 1
	}
	fmt.Fprintln(stdout, "\nsim: every bound holds")
	return 0
}

// maxNodes bounds -nodes: every node has a guard bucket per agent.
const maxNodes = 1024

func names() string {
	var n []string
	for _, s := range scenarios {
		n = append(n, s.name)
	}
	return strings.Join(n, ", ")
}
