package fault

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"go.uber.org/goleak"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
	"github.com/allot/allot/test/linearizability"
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	testproc.RemoveBuilds()
	os.Exit(code)
}

// soak reports whether the long versions run (ALLOT_SOAK=1).
func soak() bool { return os.Getenv("ALLOT_SOAK") == "1" }

// logStoreArgs are the allocator flags every test's cluster starts with
// for ALLOT_FAULT_LOG_STORE (bolt or wal; unset: the allocator's default),
// so that the whole suite runs on either Raft log store.
func logStoreArgs() []string {
	if s := os.Getenv("ALLOT_FAULT_LOG_STORE"); s != "" {
		return []string{"-log-store", s}
	}
	return nil
}

// The gateways' rule: every API key has its own token bucket of R = 20/s,
// B = 20 (domain "fault").
const (
	keyRate  = 20.0
	keyBurst = 20
)

const faultRules = `domain: fault
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: second, requests_per_unit: 20, burst: 20}
`

// The linearizability clients' rule (domain "lin"): R = 20/s, B = 40.
var linParams = linearizability.Params{Quota: 20, Window: time.Second, Burst: 40, RefreshInterval: 200 * time.Millisecond}

const linRules = `domain: lin
descriptors:
  - key: k
    rate_limit: {name: lin, unit: second, requests_per_unit: 20, burst: 40}
`

// The snapshot scenario's slow rule (domain "slow"): 6/minute, burst 100,
// so a drained bucket is told apart from a fresh one long after.
const slowRules = `domain: slow
descriptors:
  - key: k
    rate_limit: {name: slow, unit: minute, requests_per_unit: 6, burst: 100}
`

func gatewayConfig(upstream string) string {
	return fmt.Sprintf(`upstream: %s
domain: fault
api_key: {headers: [X-API-Key]}
descriptors: [[api_key]]
`, upstream)
}

// checkLeaks fails the test if goroutines it started are still running
// when every other cleanup (processes, connections, servers) has run.
// Call it first.
func checkLeaks(t *testing.T) {
	t.Helper()
	before := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, before) })
}

// env is one scenario's world: an allocator cluster, gateways, load.
type env struct {
	t    *testing.T
	dir  string
	bins testproc.Binaries
	c    *testproc.Cluster
	up   *testproc.Upstream
	gws  []*testproc.Gateway
	load *testproc.Load
	keys []string
	// breakers watches the gateways' breakers while the load runs.
	breakers *breakerWatch
	// rules files for the bootstrap node.
	rules []string
	// groups is the cluster's number of data groups (-groups; 1: a
	// single-group cluster).
	groups int
	// owner is the slot map of a cluster with groups.
	owner slots.Map
}

type envConfig struct {
	bin       string   // allocator binary (default cmd/allocator)
	args      []string // extra allocator flags
	dataDir   func(i int) string
	advertise func(i int, raftBind string) string
	slowRules bool
	// faultRules replaces the gateways' rule (domain "fault") when set.
	faultRules string
	// groups > 1 bootstraps the cluster with -groups: the load's keys and
	// the linearizability clients' keys then cover every data group, and
	// the histories are checked group by group.
	groups int
}

func newEnv(t *testing.T, cfg envConfig) *env {
	t.Helper()
	e := &env{t: t, dir: t.TempDir(), bins: testproc.Build(t), groups: max(cfg.groups, 1)}
	e.rules = []string{
		testproc.WriteFile(t, e.dir, "fault.yaml", cmp.Or(cfg.faultRules, faultRules)),
		testproc.WriteFile(t, e.dir, "lin.yaml", linRules),
	}
	if cfg.slowRules {
		e.rules = append(e.rules, testproc.WriteFile(t, e.dir, "slow.yaml", slowRules))
	}
	bin := cfg.bin
	if bin == "" {
		bin = e.bins.Allocator
	}
	var boot []string
	if e.groups > 1 {
		boot = []string{"-groups", strconv.Itoa(e.groups)}
	}
	e.c = testproc.StartCluster(t, testproc.ClusterConfig{
		Bin: bin, Dir: e.dir, Rules: e.rules,
		Args:          append(append(append([]string{}, testproc.FastLeaseArgs...), logStoreArgs()...), cfg.args...),
		BootstrapArgs: boot,
		DataDir:       cfg.dataDir,
		Advertise:     cfg.advertise,
	})
	if e.groups > 1 {
		e.waitSpread(30 * time.Second)
	}
	args := append(logStoreArgs(), cfg.args...)
	for i, a := range args {
		if a == "-log-store" && i+1 < len(args) && args[i+1] == "wal" {
			e.wantWAL()
		}
	}
	e.up = testproc.StartUpstream(t)
	return e
}

// gateway starts a gateway named name whose agent talks to allocators.
func (e *env) gateway(name string, allocators []string) *testproc.Gateway {
	e.t.Helper()
	g := testproc.StartGateway(e.t, e.bins.Gateway, e.dir, name, gatewayConfig(e.up.URL), allocators)
	testproc.Eventually(e.t, 30*time.Second, name+" /readyz", g.Ready)
	e.gws = append(e.gws, g)
	return g
}

// startLoad sends rate requests/s over the gateways and nKeys fresh API
// keys, and stops it at cleanup (Stop is safe twice). With groups, the
// keys are spread evenly over the data groups (nKeys a multiple of them).
func (e *env) startLoad(rate float64, nKeys int) {
	prefix := strings.ToLower(e.t.Name()) + "-k"
	if e.groups > 1 {
		e.keys = append(e.keys, e.keysPerGroup("fault:api_key=", prefix, nKeys/e.groups)...)
	} else {
		for i := range nKeys {
			e.keys = append(e.keys, fmt.Sprintf("%s%d", prefix, i))
		}
	}
	proxies := make([]string, len(e.gws))
	for i, g := range e.gws {
		proxies[i] = g.Proxy
	}
	e.load = &testproc.Load{Proxies: proxies, Keys: e.keys, Rate: rate}
	e.load.Start()
	e.t.Cleanup(e.load.Stop)
	e.breakers = e.watchBreakers()
}

// runFor lets the load run for about d: it waits (on the load's progress,
// with a deadline) until d's worth of requests more have completed.
func (e *env) runFor(d time.Duration) {
	e.t.Helper()
	target := len(e.load.Results()) + int(e.load.Rate*d.Seconds())
	testproc.Eventually(e.t, 3*d+10*time.Second, fmt.Sprintf("%v of load", d), func() bool {
		return len(e.load.Results()) >= target
	})
}

// waitLeasing waits until every gateway admits from leases.
func (e *env) waitLeasing() {
	e.t.Helper()
	for _, g := range e.gws {
		testproc.Eventually(e.t, 30*time.Second, g.Name+" deciding from leases", func() bool {
			return g.Metric(`allot_agent_decisions_total{result="allowed",source="lease"}`) > 0
		})
	}
}

const (
	mLeaseAllowed = `allot_agent_decisions_total{result="allowed",source="lease"}`
	mFallback     = `allot_agent_fallback`
	mCallsOK      = `allot_agent_acquire_calls_total{result="ok"}`
	mToOpen       = `allot_agent_breaker_transitions_total{to="open"}`
)

// gwCounter samples one series on every gateway.
func (e *env) sample(series string) []float64 {
	out := make([]float64, len(e.gws))
	for i, g := range e.gws {
		out[i] = g.Metric(series)
	}
	return out
}

// waitRecovered waits until every gateway in gws has its breaker closed and
// has had at least two more successful Acquires than okBefore, and returns
// the time since from.
func (e *env) waitRecovered(gws []int, okBefore []float64, from time.Time, within time.Duration) time.Duration {
	e.t.Helper()
	testproc.Eventually(e.t, within, "every gateway leasing again", func() bool {
		for _, i := range gws {
			m, err := e.gws[i].Metrics()
			if err != nil || m.Get(mFallback) != 0 || m.Get(mCallsOK) < okBefore[i]+2 {
				return false
			}
		}
		return true
	})
	return time.Since(from)
}

func allGateways(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// liveAgents asks the cluster how many agents it counts (the N of the
// fallback share R/N).
func (e *env) liveAgents() int {
	e.t.Helper()
	for _, n := range e.c.Running() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := n.Admin(e.t).ListAgents(ctx, &allotv1.ListAgentsRequest{})
		cancel()
		if err == nil {
			return len(resp.GetAgents())
		}
	}
	e.t.Fatal("no node answers ListAgents")
	return 0
}

// admission is one key's admission over the load's span.
type admission struct {
	key       string
	admitted  int
	span      time.Duration
	ceiling   float64 // B + R·T: what the limiter alone admits
	bound     float64 // the documented bound for the fault
	overAdmit float64 // admitted − ceiling (≤ 0: none)
}

// failOpen is what agents admitted with their breaker open: per opening,
// one fallback burst, and the fallback rate for the time open.
type failOpen struct {
	openings int
	open     time.Duration // summed over the agents
}

// boundFor is the documented over-admission bound (docs/reliability.md):
// on top of the limiter's B + R·T,
//
//   - B: fallback admissions are charged after the fact, and a charge can
//     take the bucket down to its debt floor −B (this covers the cold start:
//     one fallback burst per agent that saw the key, ≤ B in total);
//   - fail open: each time an agent's breaker opens, its fallback bucket,
//     up to ⌈B/N⌉ at once and R/N while open (N the live agents it last
//     heard of), is not charged.
func boundFor(span time.Duration, fo failOpen, n int) float64 {
	ceiling := keyBurst + keyRate*span.Seconds()
	return ceiling + keyBurst + float64(fo.openings)*math.Ceil(float64(keyBurst)/float64(n)) +
		math.Ceil(keyRate*fo.open.Seconds()/float64(n))
}

// admissions computes every key's admission over the load's whole span.
func (e *env) admissions(rs []testproc.Request, fo failOpen, n int) []admission {
	first, last := testproc.Span(rs)
	span := time.Duration(last - first)
	var out []admission
	for k, key := range e.keys {
		tally := testproc.Count(rs, func(r testproc.Request) bool { return r.Key == k })
		ceiling := keyBurst + keyRate*span.Seconds()
		out = append(out, admission{
			key: key, admitted: tally.OK, span: span, ceiling: ceiling,
			bound:     boundFor(span, fo, n),
			overAdmit: float64(tally.OK) - ceiling,
		})
	}
	return out
}

// breakerWatch samples every gateway's allot_agent_fallback gauge every
// 100 ms and sums the time each spent with its breaker open (an interval
// in which the gauge was 1 at either end counts whole, so the sum bounds
// the true time from above).
type breakerWatch struct {
	stop chan struct{}
	done chan struct{}

	mu       sync.Mutex // guards open
	open     []time.Duration
	openings []float64 // allot_agent_breaker_transitions_total{to="open"} at the start
}

const watchEvery = 100 * time.Millisecond

func (e *env) watchBreakers() *breakerWatch {
	w := &breakerWatch{stop: make(chan struct{}), done: make(chan struct{}),
		open: make([]time.Duration, len(e.gws)), openings: e.sample(mToOpen)}
	gws := append([]*testproc.Gateway(nil), e.gws...)
	go func() {
		defer close(w.done)
		last := make([]bool, len(gws))
		prev := time.Now()
		t := time.NewTicker(watchEvery)
		defer t.Stop()
		for {
			select {
			case <-w.stop:
				return
			case <-t.C:
			}
			now := time.Now()
			for i, g := range gws {
				v := g.Metric(mFallback) == 1
				if v || last[i] {
					w.mu.Lock()
					w.open[i] += now.Sub(prev)
					w.mu.Unlock()
				}
				last[i] = v
			}
			prev = now
		}
	}()
	e.t.Cleanup(w.halt)
	return w
}

// halt stops the sampler; safe twice.
func (w *breakerWatch) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	<-w.done
}

// result stops the sampler and returns the fail-open exposure of the
// gateways since it started.
func (w *breakerWatch) result(e *env) failOpen {
	w.halt()
	now := e.sample(mToOpen)
	var fo failOpen
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := range now {
		k := int(now[i] - w.openings[i])
		fo.openings += k
		if k > 0 {
			fo.open += w.open[i] + watchEvery
		}
	}
	return fo
}

// report is the scenario's line for docs/reliability.md.
type report struct {
	fault     string
	bound     string
	worstOver float64 // worst key's admitted − (B + R·T)
	worstFrac float64 // … as a fraction of its ceiling
	recovery  time.Duration
	requests  int
	fiveXX    int
	failOpen  failOpen
}

// checkLoad stops the load and asserts zero 5xx and transport errors and
// every key within the bound for the breaker openings the watch saw; it
// logs the numbers for docs/reliability.md.
func (e *env) checkLoad(rep *report, n int) []testproc.Request {
	e.t.Helper()
	e.load.Stop()
	fo := e.breakers.result(e)
	rep.failOpen = fo
	rs := e.load.Results()
	tally := testproc.Count(rs, nil)
	rep.requests, rep.fiveXX = tally.Total, tally.FiveXX
	e.t.Logf("load: %d requests (%d skipped ticks): %d × 200, %d × 429, %d × 5xx, %d other, %d transport errors",
		tally.Total, e.load.Skipped(), tally.OK, tally.Denied, tally.FiveXX, tally.Other, tally.Transport)
	if tally.FiveXX != 0 || tally.Transport != 0 || tally.Other != 0 {
		e.t.Errorf("%d × 5xx, %d other codes, %d transport errors; want none", tally.FiveXX, tally.Other, tally.Transport)
	}
	if tally.OK == 0 || tally.Denied == 0 {
		e.t.Errorf("load admitted %d and denied %d: the keys were not driven past their limits", tally.OK, tally.Denied)
	}
	rep.worstOver = math.Inf(-1)
	e.t.Logf("breakers: %d openings, %v open in total (N = %d)", fo.openings, fo.open.Round(time.Millisecond), n)
	for _, a := range e.admissions(rs, fo, n) {
		e.t.Logf("key %s: admitted %d in %.1fs; limiter ceiling B+R·T = %.0f; over-admission %+.0f; bound %.0f",
			a.key, a.admitted, a.span.Seconds(), a.ceiling, a.overAdmit, a.bound)
		if float64(a.admitted) > a.bound {
			e.t.Errorf("key %s: admitted %d > bound %.0f", a.key, a.admitted, a.bound)
		}
		if a.overAdmit > rep.worstOver {
			rep.worstOver = a.overAdmit
			rep.worstFrac = a.overAdmit / a.ceiling
		}
	}
	return rs
}

func (rep *report) log(t *testing.T) {
	t.Logf("RELIABILITY | %s | %s | worst key %+.0f tokens (%+.1f%% of B+R·T) | breakers opened %d× (%v) | recovery %v | %d requests, %d × 5xx | %s",
		rep.fault, rep.bound, rep.worstOver, 100*rep.worstFrac, rep.failOpen.openings, rep.failOpen.open.Round(100*time.Millisecond),
		rep.recovery.Round(10*time.Millisecond), rep.requests, rep.fiveXX, t.Name())
}

// linRun drives linearizability clients against the cluster.
type linRun struct {
	t       *testing.T
	rec     *linearizability.Recorder
	cancel  context.CancelFunc
	finish  context.Context
	fcancel context.CancelFunc
	wg      sync.WaitGroup
	mu      sync.Mutex
	errs    []error
	stopped time.Time // when stop returned
}

// startLin starts n clients (plus extra, preconfigured ones) on one fresh
// key of the lin domain, each calling every node (rotating on failure).
// With groups, n clients on one key of each data group (linKey); an extra
// client keeps the key it was given.
func (e *env) startLin(n int, extra ...*linearizability.Client) *linRun {
	t := e.t
	l := &linRun{t: t, rec: &linearizability.Recorder{}}
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	l.finish, l.fcancel = context.WithCancel(context.Background())
	nodes := e.linNodes()
	clients := append([]*linearizability.Client(nil), extra...)
	for i := range n * e.groups {
		c := &linearizability.Client{Agent: fmt.Sprintf("lin-%d", i), Seed: uint64(time.Now().UnixNano())}
		if e.groups > 1 {
			c.Key, c.Entries = e.linKey(1 + i%e.groups)
		}
		clients = append(clients, c)
	}
	perKey := map[string]int{} // a client's index counts the clients of its key
	for _, c := range clients {
		c.Domain = "lin"
		if c.Key == "" {
			value := strings.ToLower(t.Name())
			c.Key, c.Entries = "lin:k="+value, []*allotv1.Entry{{Key: "k", Value: value}}
		}
		c.Index = perKey[c.Key]
		perKey[c.Key]++
		if c.Nodes == nil {
			c.Nodes = nodes
		}
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			if err := c.Run(ctx, l.finish, l.rec); err != nil {
				l.mu.Lock()
				l.errs = append(l.errs, err)
				l.mu.Unlock()
				cancel()
			}
		}()
	}
	t.Cleanup(func() { l.fcancel(); l.cancel(); l.wg.Wait() })
	return l
}

// linNodes returns a client per node, in the cluster's order.
func (e *env) linNodes() []linearizability.Node {
	var out []linearizability.Node
	for _, n := range e.c.Nodes {
		out = append(out, linearizability.Node{Name: n.ID, Client: n.Allocator(e.t)})
	}
	return out
}

// stop ends the clients: each completes its op in flight (within 30 s).
func (l *linRun) stop() []linearizability.Op {
	l.t.Helper()
	l.cancel()
	done := make(chan struct{})
	go func() { l.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		l.fcancel()
		<-done
	}
	l.fcancel()
	l.stopped = time.Now()
	for _, err := range l.errs {
		l.t.Errorf("linearizability client: %v", err)
	}
	return l.rec.Ops()
}

// checkLin checks the history; on a violation it writes porcupine's
// visualization next to the logs. With groups, the history is split by
// the group that owns each op's key and every group's history is checked
// on its own: each must be linearizable and none may be thin.
func (e *env) checkLin(ops []linearizability.Op) {
	e.t.Helper()
	if e.groups <= 1 {
		e.checkLinHistory(ops, "")
		return
	}
	byGroup := e.splitByGroup(ops)
	for g := 1; g <= e.groups; g++ {
		e.checkLinHistory(byGroup[g], fmt.Sprintf("group %d: ", g))
	}
}

// checkLinHistory checks one history (one group's, with groups); label
// starts its messages.
func (e *env) checkLinHistory(ops []linearizability.Op, label string) {
	t := e.t
	t.Helper()
	var granted, returned int64
	for _, op := range ops {
		granted += op.Granted
		returned += op.Credited
	}
	res, err := linearizability.Check(linParams, ops, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%slinearizability: %d ops (%d tokens granted, %d credited by releases) on %d key(s): %v",
		label, res.Ops, granted, returned, res.Keys, res.Outcome)
	if len(ops) < 50 || granted == 0 {
		t.Errorf("%slinearizability history too thin: %d ops, %d granted", label, len(ops), granted)
	}
	switch res.Outcome {
	case porcupine.Ok:
	case porcupine.Illegal:
		path := filepath.Join(e.dir, strings.NewReplacer(" ", "", ":", "-").Replace(label)+"linearizability.html")
		if err := porcupine.VisualizePath(linearizability.Model(linParams), res.Info, path); err == nil {
			t.Logf("visualization: %s", path)
		}
		t.Errorf("%shistory is not linearizable:\n%s", label, res.Explain)
	default:
		t.Errorf("%slinearizability check inconclusive: %v", label, res.Outcome)
	}
}

// firstGrantAfter returns how long after at the first op applied by a
// leader other than old answered (by its stamp), or -1.
func firstGrantAfter(ops []linearizability.Op, at time.Time, old string) time.Duration {
	atMs := at.UnixMilli()
	best := int64(-1)
	for _, op := range ops {
		if op.Kind != linearizability.Acquire || op.Leader == old || op.NowMs < atMs {
			continue
		}
		if best < 0 || op.NowMs < best {
			best = op.NowMs
		}
	}
	if best < 0 {
		return -1
	}
	return time.Duration(best-atMs) * time.Millisecond
}

// logFirstGrants logs how long after at the first grant by a leader other
// than old came (firstGrantAfter), in each group of led with groups.
func (e *env) logFirstGrants(ops []linearizability.Op, at time.Time, old string, led []int, who, after string) {
	if e.groups <= 1 {
		if fg := firstGrantAfter(ops, at, old); fg >= 0 {
			e.t.Logf("first grant by %s %v after %s", who, fg, after)
		}
		return
	}
	by := e.splitByGroup(ops)
	for _, g := range led {
		if fg := firstGrantAfter(by[g], at, old); fg >= 0 {
			e.t.Logf("group %d: first grant by %s %v after %s", g, who, fg, after)
		}
	}
}

// sortedKeys is for stable logs.
func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
