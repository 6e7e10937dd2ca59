// Command load is allot's end-to-end load harness: a three-node allocator
// cluster (cmd/allocator processes, Raft over TCP, bolt with fsync) and K
// agents in this process, driven by an open-loop workload, then the same
// workload against the Redis backend (a redis-server the harness starts):
// one Lua EVALSHA per check for the baseline and, with -redis-modes, also
// sharded sub-keys and batched mode, each in turn on the same requests,
// compared in one table (four rows: lease, eval, sharded,
// batched).
//
// Run it from the repository root. It builds cmd/allocator from the tree
// it runs in (Go's build cache makes that cheap) unless -allocator-bin names
// a binary; an old bin/allocator once hid a regression for hours:
//
//	make bench-load ARGS='-workload longtail -out longtail.json'
//	go run ./bench/load -workload hot
//	go run ./bench/load -workload skew -redis off
//	go run ./bench/load -workload longtail -redis-modes eval,sharded,batched
//	go run ./bench/load -allocators 10.0.0.1:7420,10.0.0.2:7420,10.0.0.3:7420
//
// The workload: requests for M keys chosen by Zipf(s), each key limited to
// R requests/s with a burst, at a target rate paced open-loop by -workers
// goroutines, each request routed to one of K agents (uniformly, or with
// -skew a share to one favored agent that changes every -skew-rotate). Every
// check's duration is measured around agent.Check and every decision is
// logged, so that the accuracy is computed afterwards from the global
// admission record: over-admission per key over sliding windows, and false
// rejects against an ideal central limiter fed the same requests.
// docs/performance.md defines every figure and records the measured runs.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/allot/allot/internal/cpuburn"
	"github.com/allot/allot/pkg/rules"
)

// options are the harness's flags.
type options struct {
	workload string

	keys       int
	zipfS      float64
	rate       float64
	limit      int
	burst      int
	agents     int
	skew       float64
	skewRotate time.Duration
	// staticSlots is the allocators' -static-slots (0: off).
	staticSlots int

	duration time.Duration
	window   time.Duration
	workers  int
	tick     time.Duration
	maxLag   time.Duration
	seed     uint64

	allocators   string
	allocatorBin string
	dir          string
	redis        string
	redisBin     string
	// redisModes are the Redis runs, in order (parsed from -redis-modes);
	// redisShards is the rule's shards for the sharded modes; redisDuration
	// is each Redis run's length (0: duration).
	redisModes    []redisMode
	redisShards   int
	redisDuration time.Duration
	out           string
	probe         bool
	quiet         bool
	refill        time.Duration
	callTimeout   time.Duration
	cpuProfile    string
	burn          int
	coldAgents    bool
	traceKey      string
	traceStep     time.Duration
}

// preset is a named workload: the flag values it sets unless the flag is
// given explicitly.
type preset struct {
	about  string
	values map[string]string
}

var presets = map[string]preset{
	"hot": {
		about: "8 keys, Zipf 1.1, 40,000 req/s over 10 agents, 5,000/s per key (burst 500): two keys over their limit, the rest under",
		values: map[string]string{"keys": "8", "zipf": "1.1", "rate": "40000", "limit": "5000", "burst": "500",
			"agents": "10", "skew": "0"},
	},
	"longtail": {
		about: "100,000 keys, Zipf 1.1, 50,000 req/s over 10 agents, 100/s per key (burst 100): ~18% of requests go to keys under 1 req/s",
		values: map[string]string{"keys": "100000", "zipf": "1.1", "rate": "50000", "limit": "100", "burst": "100",
			"agents": "10", "skew": "0"},
	},
	"skew": {
		about: "1 key, 4,000 req/s (80% of its 5,000/s limit, burst 500) over 10 agents, half of it to one agent that changes every 5 s",
		values: map[string]string{"keys": "1", "zipf": "1.1", "rate": "4000", "limit": "5000", "burst": "500",
			"agents": "10", "skew": "0.5", "skew-rotate": "5s"},
	},
}

func main() {
	o, err := parseFlags(flag.CommandLine, os.Args[1:])
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(2)
	}
	if o.burn < 0 || o.burn > 256 {
		fmt.Fprintln(os.Stderr, "load: -burn must be in [0, 256]")
		os.Exit(2)
	}
	burner := cpuburn.Start(o.burn)
	rep, err := run(o)
	burner.Stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "load:", err)
		os.Exit(1)
	}
	rep.Command = "go run ./bench/load " + strings.Join(os.Args[1:], " ")
	if o.out != "" {
		if err := rep.writeJSON(o.out); err != nil {
			fmt.Fprintln(os.Stderr, "load:", err)
			os.Exit(1)
		}
	}
	rep.print(os.Stdout)
}

// parseFlags parses args into options, applying the -workload preset to
// the flags not given explicitly.
func parseFlags(fs *flag.FlagSet, args []string) (options, error) {
	var o options
	var names []string
	for n := range presets {
		names = append(names, n)
	}
	fs.StringVar(&o.workload, "workload", "", "named preset: hot, longtail or skew (explicit flags override it); empty: the flags below")
	fs.IntVar(&o.keys, "keys", 10000, "distinct budget keys (M)")
	fs.Float64Var(&o.zipfS, "zipf", 1.1, "Zipf exponent s (> 1) of the key choice; 0: uniform")
	fs.Float64Var(&o.rate, "rate", 20000, "target request rate, req/s (open loop)")
	fs.IntVar(&o.limit, "limit", 100, "per-key limit R, requests per second")
	fs.IntVar(&o.burst, "burst", 100, "per-key burst (token bucket capacity)")
	fs.IntVar(&o.agents, "agents", 10, "agents (K), in this process")
	fs.Float64Var(&o.skew, "skew", 0, "share of requests routed to one favored agent (the rest spread uniformly over all agents)")
	fs.DurationVar(&o.skewRotate, "skew-rotate", 0, "the favored agent changes every this long (0: always agent 0)")
	fs.DurationVar(&o.duration, "duration", 15*time.Second, "length of each run (lease, then Redis)")
	fs.DurationVar(&o.window, "window", 10*time.Second, "accuracy window: over-admission over sliding windows, false rejects over tumbling windows of this length")
	fs.IntVar(&o.workers, "workers", 32, "load goroutines (each paced at rate/workers; Redis checks block, so this bounds its concurrency)")
	fs.DurationVar(&o.tick, "tick", time.Millisecond, "a worker sleeps at least this long between bursts of due requests")
	fs.DurationVar(&o.maxLag, "max-lag", time.Second, "a request not issued within this long of its scheduled time is dropped (counted)")
	fs.Uint64Var(&o.seed, "seed", 1, "workload seed (the same for both backends)")
	fs.StringVar(&o.allocators, "allocators", "", "gRPC addresses of a running cluster (comma-separated); empty: start 3 allocator processes")
	fs.IntVar(&o.staticSlots, "static-slots", 0, "the started allocators' -static-slots: static shares of each eligible rule (0: off; docs/static-shares.md)")
	fs.StringVar(&o.allocatorBin, "allocator-bin", "", "prebuilt cmd/allocator binary (default: go build it into the run directory, so it is never stale)")
	fs.StringVar(&o.dir, "dir", "", "directory for data dirs and logs (default: a new temp dir, removed after)")
	fs.StringVar(&o.redis, "redis", "auto", "Redis baseline: auto (start redis-server, skip if missing), off, or HOST:PORT of a running server (its data is not flushed)")
	fs.StringVar(&o.redisBin, "redis-bin", "redis-server", "redis-server binary")
	modes := fs.String("redis-modes", string(modeEval), "Redis runs after the lease run, in order, comma-separated: "+strings.Join(modeNames(), ", ")+
		" (eval: one EVALSHA per check; sharded: the rule has shards: -redis-shards; batched: redislimit.Batcher; sharded-batched: both)")
	fs.IntVar(&o.redisShards, "redis-shards", 4, "shards: N of the rule in the sharded Redis modes (capped at the limit and the burst)")
	fs.DurationVar(&o.redisDuration, "redis-duration", 0, "length of each Redis run (0: -duration); the requests are a prefix of the lease run's")
	fs.StringVar(&o.out, "out", "", "write the JSON report to this file")
	fs.BoolVar(&o.probe, "probe", true, "after the lease run, batch-time checks on a key with a live lease")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress lines on stderr")
	fs.DurationVar(&o.refill, "refill-interval", 0, "agent.Config.RefillInterval of the lease agents (0: the agent's default)")
	fs.BoolVar(&o.coldAgents, "cold-agents", false, "start the load on freshly started agents (no warm-up Acquire: they decide with N = 1 until their first answer)")
	fs.StringVar(&o.traceKey, "trace-key", "", "after the lease run, print one key's decisions per -trace-step on stderr (e.g. u0)")
	fs.DurationVar(&o.traceStep, "trace-step", 500*time.Millisecond, "time step of -trace-key")
	fs.DurationVar(&o.callTimeout, "call-timeout", 0, "agent.Config.CallTimeout of the lease agents (0: the agent's default, 200ms)")
	fs.IntVar(&o.burn, "burn", 0, "spin this many goroutines in this process for the whole run: a competing CPU burner on the machine's cores (0-256)")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of this process (agents and load) during the lease run to this file")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: go run ./bench/load [flags]\n\npresets (-workload):\n")
		for _, n := range []string{"hot", "longtail", "skew"} {
			fmt.Fprintf(fs.Output(), "  %-9s %s\n", n, presets[n].about)
		}
		fmt.Fprintf(fs.Output(), "\nflags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	var err error
	if o.redisModes, err = parseRedisModes(*modes); err != nil {
		return o, err
	}
	if o.workload != "" {
		p, ok := presets[o.workload]
		if !ok {
			return o, fmt.Errorf("unknown -workload %q (want one of %s)", o.workload, strings.Join(names, ", "))
		}
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for name, v := range p.values {
			if set[name] {
				continue
			}
			if err := fs.Set(name, v); err != nil {
				return o, fmt.Errorf("preset %s: -%s=%s: %w", o.workload, name, v, err)
			}
		}
	}
	return o, o.validate()
}

func (o options) validate() error {
	switch {
	case o.keys < 1 || o.keys > 1<<26:
		return fmt.Errorf("-keys must be in [1, %d], got %d", 1<<26, o.keys)
	case o.zipfS != 0 && o.zipfS <= 1:
		return fmt.Errorf("-zipf must be > 1 (or 0 for uniform), got %v", o.zipfS)
	case !(o.rate > 0) || o.rate > 1e7:
		return fmt.Errorf("-rate must be in (0, 1e7], got %v", o.rate)
	case o.limit < 1 || o.burst < 1:
		return errors.New("-limit and -burst must be ≥ 1")
	case o.agents < 1 || o.agents > 1000:
		return fmt.Errorf("-agents must be in [1, 1000], got %d", o.agents)
	case o.skew < 0 || o.skew > 1:
		return fmt.Errorf("-skew must be in [0, 1], got %v", o.skew)
	case o.skewRotate < 0:
		return errors.New("-skew-rotate must not be negative")
	case o.staticSlots < 0 || o.staticSlots > 65535:
		return fmt.Errorf("-static-slots must be in [0, 65535], got %d", o.staticSlots)
	case o.staticSlots > 0 && o.allocators != "":
		return errors.New("-static-slots applies to the allocators bench/load starts; set it on a running cluster's allocators instead")
	case o.duration < time.Second || o.duration > time.Hour:
		return fmt.Errorf("-duration must be in [1s, 1h], got %v", o.duration)
	case o.window < 100*time.Millisecond:
		return fmt.Errorf("-window must be at least 100ms, got %v", o.window)
	case o.workers < 1 || o.workers > 4096:
		return fmt.Errorf("-workers must be in [1, 4096], got %d", o.workers)
	case o.tick < 0 || o.maxLag <= 0:
		return errors.New("-tick must not be negative and -max-lag must be positive")
	case o.traceStep <= 0:
		return errors.New("-trace-step must be positive")
	case o.refill < 0 || o.callTimeout < 0:
		return errors.New("-refill-interval and -call-timeout must not be negative")
	case o.redisShards < 2 || o.redisShards > rules.MaxShards:
		return fmt.Errorf("-redis-shards must be in [2, %d], got %d", rules.MaxShards, o.redisShards)
	case o.redisDuration != 0 && (o.redisDuration < time.Second || o.redisDuration > time.Hour):
		return fmt.Errorf("-redis-duration must be 0 or in [1s, 1h], got %v", o.redisDuration)
	}
	if o.rate*o.duration.Seconds() > maxEvents {
		return fmt.Errorf("-rate × -duration = %.0f requests, more than the %d the harness records", o.rate*o.duration.Seconds(), maxEvents)
	}
	return nil
}

// redisMode is one way the Redis runs decide the workload's rule.
type redisMode string

const (
	modeEval           redisMode = "eval"            // one EVALSHA per check (the baseline)
	modeSharded        redisMode = "sharded"         // shards: N, one sub-key per check (a second when it denies)
	modeBatched        redisMode = "batched"         // redislimit.Batcher on the key
	modeShardedBatched redisMode = "sharded-batched" // redislimit.Batcher on one sub-key of N
)

var allModes = []redisMode{modeEval, modeSharded, modeBatched, modeShardedBatched}

func modeNames() []string {
	out := make([]string, len(allModes))
	for i, m := range allModes {
		out[i] = string(m)
	}
	return out
}

// sharded reports whether the mode's rule has shards: -redis-shards.
func (m redisMode) sharded() bool { return m == modeSharded || m == modeShardedBatched }

// batched reports whether the mode's agents use a Batcher.
func (m redisMode) batched() bool { return m == modeBatched || m == modeShardedBatched }

// backend is the mode's runResult.Backend: "redis" for eval (the name the
// reports have always used), "redis-" + mode otherwise.
func (m redisMode) backend() string {
	if m == modeEval {
		return "redis"
	}
	return "redis-" + string(m)
}

// parseRedisModes parses -redis-modes: known modes, comma-separated, each
// at most once, at least one.
func parseRedisModes(s string) ([]redisMode, error) {
	var out []redisMode
	for _, f := range strings.Split(s, ",") {
		m := redisMode(strings.TrimSpace(f))
		if !slices.Contains(allModes, m) {
			return nil, fmt.Errorf("-redis-modes: unknown mode %q (want %s)", m, strings.Join(modeNames(), ", "))
		}
		if slices.Contains(out, m) {
			return nil, fmt.Errorf("-redis-modes: %q given twice", m)
		}
		out = append(out, m)
	}
	return out, nil
}

// progress prints a progress line on stderr unless -quiet.
func (o options) progress(format string, args ...any) {
	if !o.quiet {
		fmt.Fprintf(os.Stderr, "load: "+format+"\n", args...)
	}
}
