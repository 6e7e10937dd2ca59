package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// cluster models a 3-node allocator cluster around the real replicated
// state (allocator/state): every grant is computed by state.Apply
// on commands stamped with virtual time, exactly as the FSM applies them.
// What is modelled rather than run: Raft (a commit latency per log entry,
// leader election as an unavailability window; since grants exist only once
// committed and every replica holds the same state, one State stands for
// all replicas), the leader's batcher (one entry in flight, everything that
// queued meanwhile goes into the next entry, as allocator/batcher.go does),
// follower forwarding (one extra hop), the periodic Expire command, the
// WatchRules streams (see watch), and the leader's CPU (see cpuModel): an
// entry occupies the leader for the CPU it costs the real allocator, so a
// group offered more than it can apply queues calls, and past the real
// batcher's queue bound refuses them as overloaded.
type cluster struct {
	w  *world
	st *state.State

	alive  [3]bool
	leader int    // -1 while an election runs
	term   uint64 // bumped when the leader dies: its in-flight answers are lost

	commit   logNormal // Raft commit latency of one entry
	maxKeys  int       // keys per Acquire entry (allocator MaxBatchKeys)
	maxQueue int       // Acquire calls that may wait (allocator MaxQueuedAcquires)
	queue    []*rpc    // Acquire calls waiting for the next entry
	inflight bool
	cpu      cpuModel
	cpuFree  int64 // virtual time the leader's CPU is next free

	killedAt   int64 // the last leader kill
	recoveryAt int64 // the first Acquire answered by a new leader after it

	ruleSet *allotv1.RuleSet // the committed rules, for WatchRules
	watches []*watch         // one per lease agent

	// Counters.
	calls       int64 // calls sent by agents (Acquire and Release, retries included)
	entries     int64 // Raft entries committed (Acquire batches, Release, PutRules)
	acquireRPCs int64 // Acquire calls answered by the state (replays of lost answers included)
	keyAcquires int64 // keys in those calls
	releaseRPCs int64
	unavailable int64 // calls answered Unavailable (no leader)
	refused     int64 // Acquire calls refused as overloaded (queue full)
	leaderCPU   int64 // ns of leader CPU the committed Acquire entries cost
	groupCPU    int64 // the same summed over the three replicas
	demandCPU   int64 // ns of leader CPU the Acquire calls that reached it would cost (refused ones included), and the entries' own
	replays     int64 // Acquire calls that repeated the agent's last request id (answered from the record)

	lastID map[string]uint64 // per agent, the last Acquire request id applied
}

// counters is a copy of the cluster's counters (to subtract the warm-up).
type counters struct {
	calls, entries, acquireRPCs, keyAcquires, releaseRPCs, unavailable, refused, leaderCPU, groupCPU, demandCPU int64
}

func (c *cluster) counters() counters {
	return counters{c.calls, c.entries, c.acquireRPCs, c.keyAcquires, c.releaseRPCs, c.unavailable, c.refused, c.leaderCPU, c.groupCPU, c.demandCPU}
}

func (a counters) minus(b counters) counters {
	return counters{a.calls - b.calls, a.entries - b.entries, a.acquireRPCs - b.acquireRPCs,
		a.keyAcquires - b.keyAcquires, a.releaseRPCs - b.releaseRPCs, a.unavailable - b.unavailable,
		a.refused - b.refused, a.leaderCPU - b.leaderCPU, a.groupCPU - b.groupCPU, a.demandCPU - b.demandCPU}
}

// cpuModel is the CPU one Acquire entry costs the real allocator, per
// entry and per key, on the leader and summed over the three replicas,
// as bench/acquire measures it (docs/performance.md, the summary's
// allocator CPU row): three cmd/allocator processes and the load client on one
// 2-core machine, -target all (two calls in three forwarded). The
// per-entry part is the Raft entry's own cost (log append with fsync,
// replication); the per-key part the call's (gRPC, forwarding, the state
// machine).
type cpuModel struct {
	leaderEntry, leaderKey time.Duration
	groupEntry, groupKey   time.Duration
	// cores is the CPU the leader can spend: one core (the replicas and
	// the clients share the machine's others).
	cores float64
}

// maxQueuedAcquires is the allocator's default MaxQueuedAcquires.
var maxQueuedAcquires = 4096

// measuredCPU is fitted to bench/acquire -mode grants on this tree at
// 20,000 and 60,000 key-grants/s offered (the runs that kept up: 128 to
// 1,225 keys per entry; bench/acquire/results/capacity-*): the leader's
// CPU per key-grant went from 9.9 µs at 128 keys per entry to 3.8 µs at
// 1,225, the three replicas' from 24.1 to 9.7 µs, at load average 16-22
// on the 2 cores (other work contending for them inflates CPU per key).
var measuredCPU = cpuModel{
	leaderEntry: 870 * time.Microsecond, leaderKey: 3100 * time.Nanosecond,
	groupEntry: 2060 * time.Microsecond, groupKey: 8000 * time.Nanosecond,
	cores: 1,
}

// entry returns what an entry of keys keys costs the leader and the group.
func (m cpuModel) entry(keys int) (leader, group int64) {
	k := int64(keys)
	return int64(m.leaderEntry) + k*int64(m.leaderKey), int64(m.groupEntry) + k*int64(m.groupKey)
}

func newCluster(w *world, cfg state.Config) *cluster {
	return &cluster{
		w:        w,
		st:       state.New(cfg),
		alive:    [3]bool{true, true, true},
		leader:   0,
		commit:   newLogNormal(5*time.Millisecond, 20*time.Millisecond),
		maxKeys:  20000,
		maxQueue: maxQueuedAcquires,
		cpu:      measuredCPU,
	}
}

// bootstrap applies the initial rules (as the bootstrap node does) and
// starts the leader's Expire ticker.
func (c *cluster) bootstrap(files []*allotv1.RuleFile) error {
	res := c.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_PutRules{
		PutRules: &allotv1.PutRulesRequest{Files: files, ReplaceAll: true}}})
	if err, ok := res.(error); ok {
		return fmt.Errorf("sim: bootstrap rules: %w", err)
	}
	c.ruleSet = c.st.RuleSet()
	c.w.eng.after(time.Second, c.expireTick)
	return nil
}

func (c *cluster) expireTick() {
	if c.leader >= 0 {
		c.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}})
	}
	c.w.eng.after(time.Second, c.expireTick)
}

// call is an agent's RPC leaving its refill goroutine at the current
// virtual time: it times out after the agent's CallTimeout unless answered.
func (c *cluster) call(r *rpc) {
	w := c.w
	if w.closing {
		w.settle(r, rpcResult{err: status.Error(codes.Unavailable, "sim: shut down")})
		return
	}
	c.calls++
	r.sent = w.eng.now
	w.eng.atFunc(r.sent+int64(w.cfg.callTimeout), func() {
		w.settle(r, rpcResult{err: context.DeadlineExceeded})
	})
	d, ok := w.net.send(r.an.idx, w.eng.now)
	if !ok {
		return
	}
	w.eng.after(time.Duration(d), func() { c.arrive(r) })
}

func (c *cluster) arrive(r *rpc) {
	if !c.alive[r.node] {
		return // a dead node is a black hole: the agent times out
	}
	if c.leader < 0 {
		c.unavailable++
		c.reply(r, rpcResult{err: status.Error(codes.Unavailable, "sim: no leader")}, 0)
		return
	}
	if r.node == c.leader {
		c.atLeader(r, 0)
		return
	}
	hop := c.w.net.forward()
	c.w.eng.after(time.Duration(hop), func() {
		if c.leader < 0 {
			c.unavailable++
			c.reply(r, rpcResult{err: status.Error(codes.Unavailable, "sim: leader lost")}, hop)
			return
		}
		c.atLeader(r, hop)
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

func (c *cluster) atLeader(r *rpc, hop int64) {
	r.hop = hop
	if r.rel != nil {
		// Release goes through raft.Apply on its own, not the batcher.
		term := c.term
		c.w.eng.after(time.Duration(c.commit.sample(c.w.rng)), func() {
			c.entries++
			c.releaseRPCs++
			res := c.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_Release{Release: r.rel}})
			if term != c.term {
				return
			}
			switch v := res.(type) {
			case error:
				c.reply(r, rpcResult{err: grpcError(v)}, hop)
			case *allotv1.ReleaseResponse:
				c.reply(r, rpcResult{rel: v}, hop)
			}
		})
		return
	}
	c.demandCPU += int64(len(r.acq.Keys)) * int64(c.cpu.leaderKey)
	if len(c.queue) >= c.maxQueue {
		c.refused++
		c.reply(r, rpcResult{err: status.Error(codes.ResourceExhausted, "sim: acquire queue full")}, hop)
		return
	}
	c.queue = append(c.queue, r)
	if !c.inflight {
		c.formEntry()
	}
}

// formEntry drains the queue into one AcquireBatch entry stamped with the
// leader's clock and commits it after a sampled Raft latency.
func (c *cluster) formEntry() {
	n, keys := 0, 0
	for n < len(c.queue) && (n == 0 || keys+len(c.queue[n].acq.Keys) <= c.maxKeys) {
		keys += len(c.queue[n].acq.Keys)
		n++
	}
	calls := append([]*rpc(nil), c.queue[:n]...)
	c.queue = append(c.queue[:0], c.queue[n:]...)
	batch := &allotv1.AcquireBatch{Requests: make([]*allotv1.AcquireRequest, n)}
	for i, r := range calls {
		batch.Requests[i] = r.acq
	}
	stamp, term := c.w.eng.now, c.term
	c.inflight = true
	// The entry commits after the Raft latency, or once the leader's CPU
	// has worked through it, whichever is later.
	lead, group := c.cpu.entry(keys)
	c.leaderCPU += lead
	c.groupCPU += group
	c.demandCPU += int64(c.cpu.leaderEntry)
	c.cpuFree = max(c.cpuFree, c.w.eng.now) + int64(float64(lead)/c.cpu.cores)
	done := max(c.w.eng.now+c.commit.sample(c.w.rng), c.cpuFree)
	c.w.eng.atFunc(done, func() { c.commitEntry(batch, calls, stamp, term) })
}

func (c *cluster) commitEntry(batch *allotv1.AcquireBatch, calls []*rpc, stamp int64, term uint64) {
	// A committed entry is applied even if its leader died meanwhile: the
	// new leader holds it too. Only its answers are lost.
	c.entries++
	res := c.st.Apply(&allotv1.Command{NowUnixNanos: stamp, Cmd: &allotv1.Command_Acquire{Acquire: batch}})
	br, _ := res.(*state.AcquireBatchResult)
	for i, r := range calls {
		if br == nil {
			break
		}
		if c.lastID == nil {
			c.lastID = make(map[string]uint64)
		}
		if id, ok := c.lastID[r.acq.AgentId]; ok && id == r.acq.RequestId {
			c.replays++
		}
		c.lastID[r.acq.AgentId] = r.acq.RequestId
		if br.Errs[i] == nil {
			c.acquireRPCs++
			c.keyAcquires += int64(len(r.acq.Keys))
		}
		if term != c.term {
			continue
		}
		if br.Errs[i] != nil {
			c.reply(r, rpcResult{err: grpcError(br.Errs[i])}, r.hop)
		} else {
			c.reply(r, rpcResult{acq: br.Responses[i]}, r.hop)
		}
	}
	if term != c.term {
		return
	}
	if c.killedAt != 0 && c.recoveryAt == 0 && len(calls) > 0 {
		c.recoveryAt = c.w.eng.now
	}
	c.inflight = false
	if len(c.queue) > 0 {
		c.formEntry()
	}
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

// killLeader stops the leader abruptly. The survivors elect a new leader
// after elect; the dead node stays down (a black hole) until restart.
func (c *cluster) killLeader(elect time.Duration) {
	old := c.leader
	if old < 0 {
		return
	}
	c.alive[old] = false
	c.leader = -1
	c.killedAt, c.recoveryAt = c.w.eng.now, 0
	c.cpuFree = 0 // the next leader starts idle
	c.term++
	c.queue = nil
	c.inflight = false
	for _, wt := range c.watches {
		if wt.node == old && wt.up {
			wt.broken()
		}
	}
	c.w.eng.after(elect, func() {
		for i := 1; i <= 3; i++ {
			if n := (old + i) % 3; c.alive[n] {
				c.leader = n
				return
			}
		}
	})
}

// restart brings a stopped node back as a follower.
func (c *cluster) restart(node int) { c.alive[node] = true }

// putRules commits a PutRules entry after one Raft latency, then pushes the
// new set to every WatchRules stream. done, if set, gets the version.
func (c *cluster) putRules(files []*allotv1.RuleFile, done func(version uint64, err error)) {
	if c.leader < 0 {
		if done != nil {
			done(0, errors.New("sim: no leader"))
		}
		return
	}
	c.w.eng.after(time.Duration(c.commit.sample(c.w.rng)), func() {
		c.entries++
		res := c.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_PutRules{
			PutRules: &allotv1.PutRulesRequest{Files: files}}})
		if err, ok := res.(error); ok {
			if done != nil {
				done(0, err)
			}
			return
		}
		c.ruleSet = c.st.RuleSet()
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
	if wt.node != c.leader {
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
		wt.node = (wt.node + 1) % 3
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
