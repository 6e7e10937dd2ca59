package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// cluster models an allocator cluster of nodes nodes (3 unless -nodes
// says otherwise) hosting one or more Raft groups (raftGroup), each around
// the real replicated state (allocator/state): every grant is computed by
// state.Apply on commands stamped with virtual time, exactly as the FSM
// applies them. Keys map to groups by their slot (pkg/slots: the low bits
// of the canonical key's hash), the slots spread evenly over the groups.
//
// Leaders. Group i is led by node i mod nodes, so each node leads ⌊G/N⌋ or
// ⌈G/N⌉ of G groups: the even spread the allocator's meta group keeps by
// leadership transfers (allocator/spread.go, meta.PlanLeaders, which plans
// no transfer for it). Each leader has its own cores (cpuModel.cores), so a
// node leading k groups spends up to k leaders' cores.
//
// What is modelled rather than run: Raft (see raftGroup), the leader's
// batcher and CPU (see raftGroup and cpuModel), the front door of every
// node (allocator/guard.go, one per node's gRPC server, shared by every
// group the node hosts: at most maxInflight calls served at once and a
// token bucket of calls per agent, keyed by the agent, not by group; the
// excess refused ResourceExhausted at once), follower forwarding (one extra hop), the periodic Expire command
// and the WatchRules streams (see watch).
//
// Routing. With one group an agent calls its current node, which forwards
// to the leader if it is a follower. With several, an agent's Acquire is
// split by group and each part goes straight to its group's leader, all at
// once, as an agent that routes by slot sends one Acquire per group per
// tick; the agent sees one answer, when every part has answered, or the
// first part's error (it then retries the whole call with the same request
// id, and the groups that applied their part answer from their record).
type cluster struct {
	w      *world
	groups []*raftGroup
	slots  slots.Map

	nodes int
	alive []bool

	commit     logNormal // Raft commit latency of one entry
	maxKeys    int       // keys per Acquire entry (allocator MaxBatchKeys)
	maxQueue   int       // Acquire calls that may wait (allocator MaxQueuedAcquires)
	maxBatches int       // entries in Raft at once (allocator MaxInflightBatches)
	linger     int64     // least time between two entries (allocator BatchLinger)

	// The guard of each node.
	maxInflight int            // calls a node serves at once (allocator MaxInflight)
	inflight    []int          // calls each node is serving
	incarnation []int          // bumped when a node dies: its calls in flight are gone
	agentLimit  bucket.Limit   // calls per agent per node (allocator AgentRate, AgentBurst)
	agentCalls  []bucket.State // per agent and node: agentCalls[nodes*agent+node]
	node        []nodeCounters // per node
	nodeAt      []nodeCounters // node at the start of the measured period

	killedAt   int64 // the last leader kill
	recoveryAt int64 // the first Acquire answered by group 0's new leader after it

	ruleSet *allotv1.RuleSet // the committed rules, for WatchRules
	watches []*watch         // one per lease agent

	// Counters of the cluster as a whole; each group keeps its own.
	rounds      int64 // calls the agents made (Acquire and Release, retries included), however many groups each went to
	calls       int64 // calls sent to the nodes: an agent's call is one per group it has keys in (with one group, rounds)
	unavailable int64 // calls answered Unavailable (no leader)
	throttled   int64 // calls the guard refused (a node's in-flight cap, an agent's call rate)

	ents []rules.Entry // scratch for key hashes
}

// nodeCounters are one node's guard counters.
type nodeCounters struct {
	calls       int64 // calls that reached the node's guard
	rateRefused int64 // refused for the agent's call rate
	fullRefused int64 // refused at the in-flight cap
	peak        int   // most calls in flight at once
}

// counters is a copy of the cluster's counters (to subtract the warm-up).
type counters struct {
	rounds, calls, entries, acquireRPCs, keyAcquires, releaseRPCs, unavailable, refused, throttled, leaderCPU, groupCPU, demandCPU int64
}

func (c *cluster) counters() counters {
	n := counters{rounds: c.rounds, calls: c.calls, unavailable: c.unavailable, throttled: c.throttled}
	for _, g := range c.groups {
		n.entries += g.entries
		n.acquireRPCs += g.acquireRPCs
		n.keyAcquires += g.keyAcquires
		n.releaseRPCs += g.releaseRPCs
		n.refused += g.refused
		n.leaderCPU += g.leaderCPU
		n.groupCPU += g.groupCPU
		n.demandCPU += g.demandCPU
	}
	return n
}

func (a counters) minus(b counters) counters {
	return counters{a.rounds - b.rounds, a.calls - b.calls, a.entries - b.entries, a.acquireRPCs - b.acquireRPCs,
		a.keyAcquires - b.keyAcquires, a.releaseRPCs - b.releaseRPCs, a.unavailable - b.unavailable,
		a.refused - b.refused, a.throttled - b.throttled, a.leaderCPU - b.leaderCPU, a.groupCPU - b.groupCPU, a.demandCPU - b.demandCPU}
}

// The allocator's defaults (allocator/config.go) that bound what one node
// and one group take on.
var (
	maxQueuedAcquires  = 4096 // MaxQueuedAcquires
	maxInflightCalls   = 1024 // MaxInflight
	maxInflightBatches = 2    // MaxInflightBatches
	batchLinger        = 4 * time.Millisecond
	agentRate          = 200 // AgentRate, calls/s per agent and node
	agentBurst         = 400 // AgentBurst
)

// markNodes starts the measured period of the nodes' counters.
func (c *cluster) markNodes() {
	c.nodeAt = slices.Clone(c.node)
	for i := range c.node {
		c.node[i].peak = c.inflight[i]
	}
}

// nodeMeasured is node n's counters since markNodes (peak: the most calls
// in flight since).
func (c *cluster) nodeMeasured(n int) nodeCounters {
	nc := c.node[n]
	if c.nodeAt != nil {
		at := c.nodeAt[n]
		nc.calls -= at.calls
		nc.rateRefused -= at.rateRefused
		nc.fullRefused -= at.fullRefused
	}
	return nc
}

// ledBy returns the groups node n leads, in id order.
func (c *cluster) ledBy(n int) []int {
	var out []int
	for _, g := range c.groups {
		if g.leader == n {
			out = append(out, g.id)
		}
	}
	return out
}

// newCluster returns a cluster of nodes nodes (at least 1) and groups
// groups (at least 1).
func newCluster(w *world, cfg state.Config, groups, nodes int) (*cluster, error) {
	groups, nodes = max(groups, 1), max(nodes, 1)
	ids := make([]slots.GroupID, groups)
	for i := range ids {
		ids[i] = slots.GroupID(i)
	}
	m, err := slots.Even(1, ids)
	if err != nil {
		return nil, fmt.Errorf("sim: %w", err)
	}
	lim, err := bucket.NewLimit(bucket.TokenBucket, int64(agentRate), time.Second, int64(agentBurst))
	if err != nil {
		return nil, fmt.Errorf("sim: agent rate: %w", err)
	}
	c := &cluster{
		w:           w,
		slots:       m,
		nodes:       nodes,
		alive:       make([]bool, nodes),
		inflight:    make([]int, nodes),
		incarnation: make([]int, nodes),
		node:        make([]nodeCounters, nodes),
		commit:      newLogNormal(5*time.Millisecond, 20*time.Millisecond),
		maxKeys:     20000,
		maxQueue:    maxQueuedAcquires,
		maxBatches:  maxInflightBatches,
		linger:      int64(batchLinger),
		maxInflight: maxInflightCalls,
		agentLimit:  lim,
		agentCalls:  make([]bucket.State, nodes*w.cfg.agents),
	}
	for n := range c.alive {
		c.alive[n] = true
	}
	for i := range groups {
		c.groups = append(c.groups, &raftGroup{c: c, id: i, st: state.New(cfg), leader: i % nodes})
	}
	return c, nil
}

// leader is the node that leads group 0 (the meta group: rules), -1 while
// it has none.
func (c *cluster) leader() int { return c.groups[0].leader }

// bootstrap applies the initial rules to every group (as the bootstrap
// node does) and starts the leaders' Expire ticker.
func (c *cluster) bootstrap(files []*allotv1.RuleFile) error {
	for _, g := range c.groups {
		res := g.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_PutRules{
			PutRules: &allotv1.PutRulesRequest{Files: files, ReplaceAll: true}}})
		if err, ok := res.(error); ok {
			return fmt.Errorf("sim: bootstrap rules: %w", err)
		}
	}
	if simStatic.slots > 0 {
		for _, g := range c.groups {
			res := g.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_Static{
				Static: &allotv1.StaticCommand{Slots: simStatic.slots, TtlMs: simStatic.ttl.Milliseconds()}}})
			if err, ok := res.(error); ok {
				return fmt.Errorf("sim: static shares: %w", err)
			}
		}
	}
	c.ruleSet = c.groups[0].st.RuleSet()
	c.w.eng.after(time.Second, c.expireTick)
	return nil
}

// simStatic is the allocator's -static-slots and -static-ttl in every
// scenario (docs/static-shares.md); slots 0: off.
var simStatic struct {
	slots uint32
	ttl   time.Duration
}

// staticNote is what a scenario's description says of static shares.
func staticNote() string {
	if simStatic.slots == 0 {
		return ""
	}
	return fmt.Sprintf(" static shares (docs/static-shares.md): %d slots, TTL %v;", simStatic.slots, simStatic.ttl)
}

// withStatic appends to a scenario's description a line on static shares
// when they are on.
func withStatic(what []string) []string {
	if simStatic.slots == 0 {
		return what
	}
	return append(what, fmt.Sprintf("The allocator gives static shares (docs/static-shares.md): %d slots, TTL %v.", simStatic.slots, simStatic.ttl))
}

func (c *cluster) expireTick() {
	for _, g := range c.groups {
		if g.leader >= 0 {
			g.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}})
		}
	}
	c.w.eng.after(time.Second, c.expireTick)
}

// groupOf is the group that owns k's slot.
func (c *cluster) groupOf(k *allotv1.KeyAcquire) int {
	if len(c.groups) == 1 {
		return 0
	}
	c.ents = c.ents[:0]
	for _, e := range k.Entries {
		c.ents = append(c.ents, rules.Entry{Key: e.Key, Value: e.Value})
	}
	return int(c.slots.OwnerOf(rules.KeyHash(nil, k.Domain, c.ents)))
}

// call is an agent's RPC leaving its refill goroutine at the current
// virtual time: it times out after the agent's CallTimeout unless answered.
func (c *cluster) call(r *rpc) {
	w := c.w
	if w.closing {
		w.settle(r, rpcResult{err: status.Error(codes.Unavailable, "sim: shut down")})
		return
	}
	r.sent = w.eng.now
	c.rounds++
	w.eng.atFunc(r.sent+int64(w.cfg.callTimeout), func() {
		w.settle(r, rpcResult{err: context.DeadlineExceeded})
	})
	if len(c.groups) > 1 {
		c.scatter(r)
		return
	}
	c.calls++
	d, ok := w.net.send(r.an.idx, w.eng.now)
	if !ok {
		return
	}
	w.eng.after(time.Duration(d), func() { c.arrive(r) })
}

// admit is a node's guard for a call from agent whose deadline is at
// deadline: it returns the refusal, or counts the call in flight until
// its answer (the returned done) or its deadline, whichever is first (the
// agent's cancellation ends the handler), and returns nil.
func (c *cluster) admit(node, agent int, deadline int64) (done func(), err error) {
	nc := &c.node[node]
	nc.calls++
	res := c.agentLimit.AllowN(&c.agentCalls[c.nodes*agent+node], c.w.eng.now, 1)
	if !res.Allowed {
		c.throttled++
		nc.rateRefused++
		return nil, exhausted("sim: agent over its call rate", res.RetryAfter)
	}
	if c.inflight[node] >= c.maxInflight {
		c.throttled++
		nc.fullRefused++
		return nil, exhausted("sim: overloaded: calls in flight", 100*time.Millisecond)
	}
	c.inflight[node]++
	nc.peak = max(nc.peak, c.inflight[node])
	inc, freed := c.incarnation[node], false
	done = func() {
		if !freed && inc == c.incarnation[node] {
			c.inflight[node]--
		}
		freed = true
	}
	c.w.eng.atFunc(deadline, done)
	return done, nil
}

// exhausted is a ResourceExhausted status with a RetryInfo delay, as the
// allocator refuses a call it is too busy for.
func exhausted(msg string, retry time.Duration) error {
	st := status.New(codes.ResourceExhausted, msg)
	if d, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(max(retry, time.Millisecond))}); err == nil {
		st = d
	}
	return st.Err()
}

func (c *cluster) arrive(r *rpc) {
	if !c.alive[r.node] {
		return // a dead node is a black hole: the agent times out
	}
	done, err := c.admit(r.node, r.an.idx, r.sent+int64(c.w.cfg.callTimeout))
	if err != nil {
		c.reply(r, rpcResult{err: err}, 0)
		return
	}
	g := c.groups[0]
	if g.leader < 0 {
		c.unavailable++
		done()
		c.reply(r, rpcResult{err: status.Error(codes.Unavailable, "sim: no leader")}, 0)
		return
	}
	if r.node == g.leader {
		c.atLeader(g, r, 0, done)
		return
	}
	hop := c.w.net.forward()
	c.w.eng.after(time.Duration(hop), func() {
		if g.leader < 0 {
			c.unavailable++
			done()
			c.reply(r, rpcResult{err: status.Error(codes.Unavailable, "sim: leader lost")}, hop)
			return
		}
		c.atLeader(g, r, hop, done)
	})
}

// reply sends a result back to the agent from the node it called (extra is
// the forwarding hop back from the leader, if any).
func (c *cluster) reply(r *rpc, res rpcResult, extra int64) {
	w := c.w
	d, ok := w.net.reply(r.an.idx, w.eng.now)
	if !ok {
		return
	}
	w.eng.after(time.Duration(d+extra), func() { w.settle(r, res) })
}

func (c *cluster) atLeader(g *raftGroup, r *rpc, hop int64, done func()) {
	answer := func(res rpcResult) {
		done()
		c.reply(r, res, hop)
	}
	if r.rel != nil {
		g.release(r.rel, answer)
		return
	}
	g.submit(r.acq, answer)
}

// scatter sends each group's part of an agent's call to that group's
// leader; gather puts the answers together.
func (c *cluster) scatter(r *rpc) {
	w := c.w
	var keys []*allotv1.KeyAcquire
	if r.acq != nil {
		keys = r.acq.Keys
	} else {
		keys = r.rel.Keys
	}
	idx := make([][]int, len(c.groups))
	for i, k := range keys {
		g := c.groupOf(k)
		idx[g] = append(idx[g], i)
	}
	if len(keys) == 0 {
		idx[0] = []int{} // a call with no keys goes to group 0
	}
	if r.acq != nil {
		r.grants = make([]*allotv1.KeyGrant, len(keys))
		r.merged = &allotv1.AcquireResponse{}
	} else {
		r.relSum = &allotv1.ReleaseResponse{}
	}
	for gi, ix := range idx {
		if ix == nil && !(r.rel != nil && r.rel.All) {
			continue
		}
		p := &part{r: r, g: c.groups[gi], idx: ix}
		sub := make([]*allotv1.KeyAcquire, len(ix))
		for j, i := range ix {
			sub[j] = keys[i]
		}
		if r.acq != nil {
			p.acq = &allotv1.AcquireRequest{AgentId: r.acq.AgentId, RequestId: r.acq.RequestId, Keys: sub,
				RulesVersion: r.acq.RulesVersion, FallbackKeys: r.acq.FallbackKeys}
		} else {
			p.rel = &allotv1.ReleaseRequest{AgentId: r.rel.AgentId, RequestId: r.rel.RequestId, Keys: sub, All: r.rel.All}
		}
		r.pending++
		c.calls++
		d, ok := w.net.send(r.an.idx, w.eng.now)
		if !ok {
			continue
		}
		w.eng.after(time.Duration(d), func() { c.arrivePart(p) })
	}
}

// part is one group's share of an agent's call.
type part struct {
	r   *rpc
	g   *raftGroup
	idx []int // positions of its keys in the agent's call
	acq *allotv1.AcquireRequest
	rel *allotv1.ReleaseRequest
}

// arrivePart: the part reaches its group's leader (the node the agent
// routes it to).
func (c *cluster) arrivePart(p *part) {
	g := p.g
	node := g.leader
	answer := func(res rpcResult) {
		d, ok := c.w.net.reply(p.r.an.idx, c.w.eng.now)
		if !ok {
			return
		}
		c.w.eng.after(time.Duration(d), func() { c.gather(p, res) })
	}
	if node < 0 {
		c.unavailable++
		answer(rpcResult{err: status.Error(codes.Unavailable, "sim: no leader")})
		return
	}
	if !c.alive[node] {
		return
	}
	free, err := c.admit(node, p.r.an.idx, p.r.sent+int64(c.w.cfg.callTimeout))
	if err != nil {
		answer(rpcResult{err: err})
		return
	}
	done := func(res rpcResult) {
		free()
		answer(res)
	}
	if p.rel != nil {
		g.release(p.rel, done)
		return
	}
	g.submit(p.acq, done)
}

func (c *cluster) gather(p *part, res rpcResult) {
	r := p.r
	if r.settled {
		return
	}
	if res.err != nil {
		c.w.settle(r, res)
		return
	}
	if r.acq != nil {
		grants, err := allotv1.GrantsOf(res.acq)
		if err != nil || len(grants) != len(p.idx) {
			c.w.fail(fmt.Errorf("sim: group %d answered %d grants for %d keys: %v", p.g.id, len(grants), len(p.idx), err))
			return
		}
		for j, i := range p.idx {
			r.grants[i] = grants[j]
		}
		m := r.merged
		m.LiveAgents = max(m.LiveAgents, res.acq.LiveAgents)
		m.RulesVersion = max(m.RulesVersion, res.acq.RulesVersion)
		if m.NowUnixMs == 0 || res.acq.NowUnixMs < m.NowUnixMs {
			m.NowUnixMs = res.acq.NowUnixMs // the earliest commit, as the allocator answers a split call
		}
	} else {
		r.relSum.Returned += res.rel.Returned
		r.relSum.LeasesEnded += res.rel.LeasesEnded
	}
	r.pending--
	if r.pending > 0 {
		return
	}
	if r.acq != nil {
		r.merged.Grants = r.grants
		c.w.settle(r, rpcResult{acq: r.merged})
		return
	}
	c.w.settle(r, rpcResult{rel: r.relSum})
}

// grpcError maps state errors to gRPC codes as allocator/errors.go does.
func grpcError(err error) error {
	switch {
	case errors.Is(err, state.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, state.ErrStaleRequest), errors.Is(err, state.ErrFailedPrecondition):
		return status.Error(codes.FailedPrecondition, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// killLeader stops group 0's leader node abruptly: every group it led
// elects a new leader among the survivors after elect; the dead node stays
// down (a black hole) until restart.
func (c *cluster) killLeader(elect time.Duration) {
	old := c.leader()
	if old < 0 {
		return
	}
	c.alive[old] = false
	c.killedAt, c.recoveryAt = c.w.eng.now, 0
	c.inflight[old] = 0
	c.incarnation[old]++
	for _, g := range c.groups {
		if g.leader == old {
			g.lose(elect)
		}
	}
	for _, wt := range c.watches {
		if wt.node == old && wt.up {
			wt.broken()
		}
	}
}

// restart brings a stopped node back as a follower.
func (c *cluster) restart(node int) { c.alive[node] = true }

// putRules commits a PutRules entry after one Raft latency (every group
// applies it then), then pushes the new set to every WatchRules stream.
// done, if set, gets the version.
func (c *cluster) putRules(files []*allotv1.RuleFile, done func(version uint64, err error)) {
	if c.leader() < 0 {
		if done != nil {
			done(0, errors.New("sim: no leader"))
		}
		return
	}
	c.w.eng.after(time.Duration(c.commit.sample(c.w.rng)), func() {
		for _, g := range c.groups {
			g.entries++
			res := g.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_PutRules{
				PutRules: &allotv1.PutRulesRequest{Files: files}}})
			if err, ok := res.(error); ok {
				if done != nil {
					done(0, err)
				}
				return
			}
		}
		c.ruleSet = c.groups[0].st.RuleSet()
		for _, wt := range c.watches {
			wt.push()
		}
		if done != nil {
			done(c.ruleSet.Version, nil)
		}
	})
}

// watch models one agent's WatchRules stream (agent/rulewatch.go): a stream
// to one node that delivers each committed rule set one hop later; when the
// node dies or the agent is cut off, the agent reconnects to the next node
// after a jittered exponential backoff (from ProbeBackoff, doubling to 5 s),
// and a new stream first sends the current set if it is newer.
type watch struct {
	c       *cluster
	an      *agentNode
	node    int
	up      bool
	backoff time.Duration
	known   uint64
	applied map[uint64]int64 // rules version → virtual time the agent got it
}

func (wt *watch) reachable() bool {
	return wt.c.alive[wt.node] && !wt.c.w.net.cut(wt.an.idx, wt.c.w.eng.now)
}

// push is called at commit: deliver the current set on a live stream.
func (wt *watch) push() {
	if !wt.up {
		return
	}
	if !wt.reachable() {
		wt.broken()
		return
	}
	wt.deliver()
}

func (wt *watch) deliver() {
	c := wt.c
	rs := c.ruleSet
	if rs.GetVersion() <= wt.known {
		return
	}
	d := c.w.net.oneWay.sample(c.w.rng)
	if wt.node != c.leader() {
		d += c.w.net.forward() // a follower applies the entry one hop after the leader
	}
	c.w.eng.after(time.Duration(d), func() {
		if rs.GetVersion() <= wt.known {
			return
		}
		if err := wt.an.a.ApplyRuleSet(rs); err != nil {
			c.w.fail(fmt.Errorf("sim: agent %d rejected rules version %d: %w", wt.an.idx, rs.GetVersion(), err))
			return
		}
		wt.known = rs.GetVersion()
		wt.applied[wt.known] = c.w.eng.now
	})
}

func (wt *watch) broken() {
	wt.up = false
	wt.backoff = max(wt.backoff, wt.c.w.cfg.probeBackoff)
	wt.retry()
}

func (wt *watch) retry() {
	c := wt.c
	d := wt.backoff/2 + time.Duration(c.w.rng.Int64N(int64(wt.backoff/2)+1))
	c.w.eng.after(d, func() {
		wt.node = (wt.node + 1) % c.nodes
		if wt.reachable() {
			wt.up = true
			wt.backoff = c.w.cfg.probeBackoff
			wt.deliver()
			return
		}
		wt.backoff = min(2*wt.backoff, 5*time.Second)
		wt.retry()
	})
}
