package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/agentsim"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// domain is the rules domain every simulated request names.
const domain = "sim"

// group is one rule: every key of the group has its own budget of quota per
// unit with the given burst (a key-only descriptor, as `api_key` in the
// example rules, pkg/rules/example.yaml).
type group struct {
	name    string // descriptor key and policy name
	quota   int64
	unit    time.Duration // time.Second or time.Minute
	burst   int64
	routing string // "" (spread) or "consistent_hash"

	limit bucket.Limit // the exact limiter: what "the limit" means
}

func (g *group) rate() float64 { return float64(g.quota) / g.unit.Seconds() }

func (g *group) compile() error {
	l, err := bucket.NewLimit(bucket.TokenBucket, g.quota, g.unit, g.burst)
	g.limit = l
	return err
}

// yaml renders the group's rule for a backend.
func (g *group) yaml(backend string) string {
	unit := "second"
	if g.unit == time.Minute {
		unit = "minute"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "  - key: %s\n    rate_limit:\n      name: %s\n      unit: %s\n      requests_per_unit: %d\n      burst: %d\n",
		g.name, g.name, unit, g.quota, g.burst)
	if backend != "" {
		fmt.Fprintf(&b, "      backend: %s\n", backend)
	}
	if g.routing != "" {
		fmt.Fprintf(&b, "      routing: %s\n", g.routing)
	}
	return b.String()
}

func rulesFile(groups []*group) *allotv1.RuleFile {
	var b strings.Builder
	b.WriteString("domain: " + domain + "\ndescriptors:\n")
	for _, g := range groups {
		b.WriteString(g.yaml(""))
	}
	return &allotv1.RuleFile{Name: domain + ".yaml", Domain: domain, Yaml: []byte(b.String())}
}

// worldConfig describes one simulation run: the fleet, the key space, the
// systems compared side by side on the same arrivals, and what to measure.
type worldConfig struct {
	name    string // the scenario, for progress lines
	seed    uint64
	agents  int
	keys    int
	groups  []*group
	groupOf func(key int) int // nil: every key is in group 0

	lease     bool // the lease system (real agents + real allocator state)
	redis     bool // Redis per request
	baselines bool // no coordination (N×R) and a static R/N split
	redisOps  float64
	shards    int

	warmup, duration time.Duration
	window           time.Duration // over-admission windows (10 s)
	bin              time.Duration // plot resolution
	track            []int         // keys with a per-bin series

	refill, callTimeout, probeBackoff time.Duration
	state                             state.Config
	raftGroups                        int // allocator Raft groups (0: one)
	nodes                             int // allocator nodes (0: 3)
}

func (c *worldConfig) defaults() {
	if c.window == 0 {
		c.window = 10 * time.Second
	}
	if c.bin == 0 {
		c.bin = 100 * time.Millisecond
	}
	d := agent.DefaultConfig()
	if c.refill == 0 {
		c.refill = d.RefillInterval
	}
	if c.callTimeout == 0 {
		c.callTimeout = d.CallTimeout
	}
	if c.probeBackoff == 0 {
		c.probeBackoff = d.ProbeBackoff
	}
	if c.redisOps == 0 {
		c.redisOps = 100_000
	}
	if c.shards == 0 {
		c.shards = 16
	}
}

// progress, when set (-v), receives a line every 5 virtual seconds of every
// world. It must be safe for concurrent use (scenarios run in parallel).
var progress func(string)

// world is one simulation: engine, models, systems, measurements.
type world struct {
	cfg worldConfig
	eng *engine
	rng *rand.Rand // the models' randomness (network, Raft, jitter)
	net *netModel

	cl          *cluster
	leaseAgents []*agentNode
	redis       *redisModel
	systems     []*system
	truth       []bucket.State // the exact limiter per key, fed every arrival

	measureFrom, end int64
	bins             int

	atMeasure counters // the cluster's counters when the warm-up ended
	redisAt   [2]int64 // Redis ops and calls when the warm-up ended

	closing bool // shutting down: calls fail at once

	wg  sync.WaitGroup // the agents' driver goroutines
	err error          // the first model failure

	buf   []byte
	descs [1]agent.Descriptor
	ents  [1]rules.Entry
}

func newWorld(cfg worldConfig) (*world, error) {
	cfg.defaults()
	w := &world{
		cfg: cfg,
		eng: newEngine(),
		rng: newRand(cfg.seed, "model"),
	}
	w.net = newNetModel(newRand(cfg.seed, "net"))
	w.measureFrom = epoch + int64(cfg.warmup)
	w.end = epoch + int64(cfg.warmup+cfg.duration)
	w.bins = int((cfg.warmup+cfg.duration)/cfg.bin) + 1
	for _, g := range cfg.groups {
		if err := g.compile(); err != nil {
			return nil, fmt.Errorf("sim: group %s: %w", g.name, err)
		}
	}
	w.truth = make([]bucket.State, cfg.keys)
	if cfg.lease {
		if err := w.startLease(); err != nil {
			w.shutdown()
			return nil, err
		}
	}
	if cfg.redis {
		w.redis = newRedisModel(w, cfg.shards, cfg.redisOps)
		w.addSystem(newRedisSystem(w))
	}
	if cfg.baselines {
		w.addSystem(newLocalSystem(w, "no coordination (N×R)", false))
		w.addSystem(newLocalSystem(w, "static R/N split", true))
	}
	if progress != nil {
		var tick func()
		tick = func() {
			progress(fmt.Sprintf("%s: t=%s of %s", w.cfg.name, w.eng.since().Round(time.Second), time.Duration(w.end-epoch)))
			if w.eng.now+int64(5*time.Second) < w.end {
				w.eng.after(5*time.Second, tick)
			}
		}
		w.eng.after(5*time.Second, tick)
	}
	w.eng.atFunc(w.measureFrom, func() {
		if w.cl != nil {
			w.atMeasure = w.cl.counters()
			w.cl.markNodes()
		}
		if w.redis != nil {
			w.redisAt = [2]int64{w.redis.ops, w.redis.calls}
			w.redis.lat = newHistogram()
		}
	})
	return w, nil
}

func (w *world) addSystem(s *system) {
	s.rec = newRecorder(w)
	w.systems = append(w.systems, s)
}

func (w *world) fail(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *world) group(key int) *group {
	if w.cfg.groupOf == nil {
		return w.cfg.groups[0]
	}
	return w.cfg.groups[w.cfg.groupOf(key)]
}

// startLease bootstraps the cluster and starts the lease agents.
func (w *world) startLease() error {
	nodes := w.cfg.nodes
	if nodes == 0 {
		nodes = 3
	}
	cl, err := newCluster(w, w.cfg.state, w.cfg.raftGroups, nodes)
	if err != nil {
		return err
	}
	w.cl = cl
	if err := w.cl.bootstrap([]*allotv1.RuleFile{rulesFile(w.cfg.groups)}); err != nil {
		return err
	}
	phase := newRand(w.cfg.seed, "phase")
	for i := range w.cfg.agents {
		an := newAgentNode(w, i)
		w.leaseAgents = append(w.leaseAgents, an)
		acfg := agent.DefaultConfig()
		acfg.ID = fmt.Sprintf("agent-%03d", i)
		for n := range nodes {
			acfg.Clients = append(acfg.Clients, &simClient{an: an, node: (i + n) % nodes})
		}
		acfg.Now = func() int64 { return w.eng.now }
		acfg.Rand = newRand(w.cfg.seed, acfg.ID)
		acfg.RefillInterval = w.cfg.refill
		acfg.CallTimeout = w.cfg.callTimeout
		acfg.ProbeBackoff = w.cfg.probeBackoff
		a, err := agentsim.New(acfg)
		if err != nil {
			return fmt.Errorf("sim: agent %d: %w", i, err)
		}
		an.a = a
		// What the WatchRules stream delivers on connect.
		if err := a.ApplyRuleSet(w.cl.ruleSet); err != nil {
			return fmt.Errorf("sim: agent %d: initial rules: %w", i, err)
		}
		wt := &watch{c: w.cl, an: an, node: i % nodes, up: true, known: w.cl.ruleSet.Version,
			applied: map[uint64]int64{w.cl.ruleSet.Version: w.eng.now}}
		w.cl.watches = append(w.cl.watches, wt)
		w.eng.at(w.eng.now+phase.Int64N(int64(w.cfg.refill)), an, 0)
	}
	w.addSystem(newLeaseSystem(w))
	return nil
}

// desc renders key's descriptor into the world's scratch (valid until the
// next call; agents copy what they keep).
func (w *world) desc(key int) []agent.Descriptor {
	g := w.group(key)
	w.buf = strconv.AppendInt(append(w.buf[:0], 'k'), int64(key), 10)
	w.ents[0] = rules.Entry{Key: g.name, Value: unsafe.String(unsafe.SliceData(w.buf), len(w.buf))}
	w.descs[0] = agent.Descriptor{Entries: w.ents[:]}
	return w.descs[:]
}

// arrive is one request for key at agent ag: every system decides it, and
// the exact limiter says whether it was within the limit.
func (w *world) arrive(key, ag int) {
	now := w.eng.now
	g := w.group(key)
	inQuota := g.limit.AllowN(&w.truth[key], now, 1).Allowed
	descs := w.desc(key)
	for _, s := range w.systems {
		ok, _ := s.check(ag, key, descs)
		s.rec.observe(key, g, now, ok, inQuota)
	}
}

// runEnded, when set (-memprofile), is called when a world's run has
// reached its end, before its results are computed and its state freed. It
// must be safe for concurrent use.
var runEnded func()

// run advances the simulation to its end.
func (w *world) run() error {
	w.eng.run(w.end)
	if runEnded != nil {
		runEnded()
	}
	for _, s := range w.systems {
		s.rec.finish()
	}
	return w.err
}

// shutdown closes the lease agents and ends their goroutines. Calls made
// while closing (the agents' Release) fail at once: the run is over.
func (w *world) shutdown() {
	w.closing = true
	for _, an := range w.leaseAgents {
		if an.a != nil {
			an.stop()
		} else {
			close(an.cmd)
		}
	}
	w.leaseAgents = nil
	w.wg.Wait()
}

// measured returns the cluster's counters since the warm-up.
func (w *world) measured() counters { return w.cl.counters().minus(w.atMeasure) }

// seconds is the measured duration.
func (w *world) seconds() float64 { return float64(w.end-w.measureFrom) / 1e9 }

// system is one rate limiter design under test.
type system struct {
	name  string
	check func(ag, key int, descs []agent.Descriptor) (allowed bool, retryAfter time.Duration)
	rec   *recorder

	sources [agent.SourceStatic + 1]int64 // lease system: decisions by source, after the warm-up
}

func newLeaseSystem(w *world) *system {
	ctx := context.Background()
	s := &system{name: "allot leases"}
	s.check = func(ag, _ int, descs []agent.Descriptor) (bool, time.Duration) {
		if w.closing || w.leaseAgents[ag].a == nil {
			// shutdown steps the engine to finish the agents' calls in
			// flight; an arrival it reaches meanwhile is past the run
			// and may find its agent already closed.
			return false, 0
		}
		d, err := w.leaseAgents[ag].a.Check(ctx, domain, descs, 0)
		if err != nil {
			w.fail(fmt.Errorf("sim: Check: %w", err))
			return false, 0
		}
		if w.eng.now >= w.measureFrom {
			s.sources[d.Source]++
		}
		return d.Allowed, d.RetryAfter
	}
	return s
}

// localBuckets are per-(agent, key) token buckets: what an agent's local
// bucket does. Buckets that are full again are dropped, as an agent forgets
// idle keys and Redis expires a full bucket's key.
type localBuckets struct {
	w      *world
	limits []bucket.Limit // per group
	m      map[uint64]bucket.State
	next   int64
}

func newLocalBuckets(w *world, split bool) *localBuckets {
	lb := &localBuckets{w: w, m: make(map[uint64]bucket.State)}
	n := int64(w.cfg.agents)
	for _, g := range w.cfg.groups {
		l := g.limit
		if split && n > 1 {
			// R/N and ⌈B/N⌉ per agent, as the agent's fallback sizes it.
			var err error
			l, err = bucket.NewLimit(bucket.TokenBucket, g.quota, g.unit*time.Duration(n), max((g.burst+n-1)/n, 1))
			if err != nil {
				l = g.limit
			}
		}
		lb.limits = append(lb.limits, l)
	}
	return lb
}

func (lb *localBuckets) allow(ag, key int, now int64) bucket.Result {
	gi := 0
	if lb.w.cfg.groupOf != nil {
		gi = lb.w.cfg.groupOf(key)
	}
	id := uint64(ag)<<40 | uint64(key)
	st := lb.m[id]
	res := lb.limits[gi].AllowN(&st, now, 1)
	lb.m[id] = st
	if now >= lb.next {
		lb.next = now + int64(2*time.Second)
		for k, s := range lb.m {
			g := 0
			if lb.w.cfg.groupOf != nil {
				g = lb.w.cfg.groupOf(int(k & (1<<40 - 1)))
			}
			l := lb.limits[g]
			if l.Peek(s, now).Remaining >= l.Peek(bucket.State{}, now).Remaining {
				delete(lb.m, k)
			}
		}
	}
	return res
}

func newLocalSystem(w *world, name string, split bool) *system {
	lb := newLocalBuckets(w, split)
	return &system{
		name: name,
		check: func(ag, key int, _ []agent.Descriptor) (bool, time.Duration) {
			r := lb.allow(ag, key, w.eng.now)
			return r.Allowed, r.RetryAfter
		},
	}
}

// newRedisSystem: each agent checks Redis per request; when the call fails
// (timeout, dead primary, open breaker) it fails open onto its local bucket
// at the full rate R, as agent.Agent does for backend: redis.
func newRedisSystem(w *world) *system {
	clients := make([]*redisClient, w.cfg.agents)
	for i := range clients {
		clients[i] = &redisClient{m: w.redis}
	}
	fallback := newLocalBuckets(w, false)
	byGroup := make(map[*group]*rules.Rule, len(w.cfg.groups))
	for _, g := range w.cfg.groups {
		byGroup[g] = ruleFor(g)
	}
	var key []byte
	ctx := context.Background()
	return &system{
		name: "Redis per request",
		check: func(ag, k int, descs []agent.Descriptor) (bool, time.Duration) {
			key = rules.AppendKey(key[:0], nil, domain, descs[0].Entries)
			res, err := clients[ag].AllowN(ctx, byGroup[w.group(k)], key, 1)
			if err != nil {
				res = fallback.allow(ag, k, w.eng.now)
			}
			return res.Allowed, res.RetryAfter
		},
	}
}

// ruleFor is the compiled rule the Redis model checks a group's keys under.
func ruleFor(g *group) *rules.Rule { return &rules.Rule{Name: g.name, Limit: g.limit} }
