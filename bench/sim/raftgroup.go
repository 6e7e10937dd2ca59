package main

import (
	"fmt"
	"time"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// cpuModel is the CPU the real allocator spends on Acquire entries: a cost
// per Raft entry and a cost per key-grant, both summed over the three
// replicas, of which the leader spends entryShare and keyShare; the leader
// has cores of CPU to spend. The defaults are docs/performance.md's
// measured rows (see measuredCPU); -raft-entry-cpu, -raft-key-cpu,
// -leader-entry-share, -leader-key-share and -leader-cores override them.
type cpuModel struct {
	entry, key           time.Duration // summed over the three replicas
	entryShare, keyShare float64       // the leader's part of each
	cores                float64
}

func (m cpuModel) String() string {
	return fmt.Sprintf("each group's CPU %.2f ms per Raft entry and %.2f µs per key-grant over its 3 replicas, the leader %.0f%% and %.0f%% of them on %g core(s)",
		float64(m.entry)/1e6, float64(m.key)/1e3, 100*m.entryShare, 100*m.keyShare, m.cores)
}

// measuredCPU: docs/performance.md's row "CPU per Raft entry and per
// key-grant, 10k–200k offered in 100- and 1000-key calls", least squares
// over 18 bench/acquire runs that vary Acquire entries/s (20–224) and
// key-grants/s (10k–200k) apart (go test -run TestCPUFit -v
// ./bench/acquire/): the three nodes 2.08 ms of CPU per entry plus
// 3.79 µs per key-grant (R² 0.98), the leader 1.17 ms plus 1.22 µs (R²
// 0.97). One core: the leader's FSM apply and Raft loop are one goroutine
// each, and the leader's node serves its clients too.
var measuredCPU = cpuModel{
	entry:      2080 * time.Microsecond,
	key:        3790 * time.Nanosecond,
	entryShare: 1.17 / 2.08,
	keyShare:   1.22 / 3.79,
	cores:      1,
}

// entryCost returns what an entry of keys keys costs the leader and the
// group, in nanoseconds of CPU.
func (m cpuModel) entryCost(keys int) (leader, group int64) {
	group = int64(m.entry) + int64(keys)*int64(m.key)
	return m.entryLeader() + int64(keys)*m.keyCost(), group
}

// entryLeader is what an entry's own part costs the leader.
func (m cpuModel) entryLeader() int64 { return int64(float64(m.entry) * m.entryShare) }

// keyCost is what one key of a call costs the leader.
func (m cpuModel) keyCost() int64 { return int64(float64(m.key) * m.keyShare) }

// capacity is the key-grants per second one group's leader can apply in
// entries of keysPerEntry keys.
func (m cpuModel) capacity(keysPerEntry float64) float64 {
	per := m.entryShare*float64(m.entry)/keysPerEntry + m.keyShare*float64(m.key)
	return m.cores * 1e9 / per
}

// raftGroup is one Raft group: its replicated state (since grants exist
// only once committed and every replica holds the same state, one State
// stands for all replicas), its leader, the leader's batcher and CPU.
//
// Raft is a commit latency per entry and leader election an
// unavailability window. The batcher is allocator/batcher.go's: calls
// queue while entries commit, each entry drains everything queued (up to
// maxKeys keys), at most maxBatches entries are in Raft at once, a new one
// no sooner than linger after the one before, and past maxQueue queued
// calls a call is refused ResourceExhausted at once. The leader's CPU
// (cpuModel) works through the entries one after another: an entry
// commits after its Raft latency or once the leader's CPU has worked
// through it, whichever is later, so a group offered more than its leader
// can apply queues calls, their latency grows, and past the queue bound it
// refuses them.
type raftGroup struct {
	c      *cluster
	id     int
	st     *state.State
	leader int    // node; -1 while an election runs
	term   uint64 // bumped when the leader dies: its in-flight answers are lost

	queue        []pending // Acquire calls waiting for the next entry
	inflight     int       // entries in Raft
	lastProposal int64
	lingering    bool  // a proposal is scheduled at lastProposal + linger
	lastCommit   int64 // entries commit in order
	cpuFree      int64 // virtual time the leader's CPU is next free

	// Counters.
	entries     int64 // Raft entries committed (Acquire batches, Release, PutRules)
	acquireRPCs int64 // Acquire calls answered by the state (replays of lost answers included)
	keyAcquires int64 // keys in those calls
	releaseRPCs int64
	refused     int64 // Acquire calls refused as overloaded (queue full)
	leaderCPU   int64 // ns of leader CPU the committed Acquire entries cost
	groupCPU    int64 // the same summed over the three replicas
	demandCPU   int64 // ns of leader CPU the Acquire calls that reached it would cost (refused ones included), and the entries' own
	replays     int64 // Acquire calls that repeated the agent's last request id (answered from the record)
	demandBins  []int64

	lastID map[string]uint64 // per agent, the last Acquire request id applied
}

// pending is an Acquire waiting in the batcher, and how to answer it.
type pending struct {
	req    *allotv1.AcquireRequest
	answer func(rpcResult)
}

// demand adds ns of leader CPU demanded now.
func (g *raftGroup) demand(ns int64) {
	g.demandCPU += ns
	s := int((g.c.w.eng.now - epoch) / int64(time.Second))
	for len(g.demandBins) <= s {
		g.demandBins = append(g.demandBins, 0)
	}
	g.demandBins[s] += ns
}

// peakDemand is the most leader CPU demanded in any whole second of
// [from, to), in cores.
func (g *raftGroup) peakDemand(from, to int64) float64 {
	var peak int64
	for s := int((from - epoch) / int64(time.Second)); s < int((to-epoch)/int64(time.Second)) && s < len(g.demandBins); s++ {
		peak = max(peak, g.demandBins[s])
	}
	return float64(peak) / 1e9
}

func (g *raftGroup) submit(req *allotv1.AcquireRequest, answer func(rpcResult)) {
	c := g.c
	g.demand(int64(len(req.Keys)) * c.cpuModel().keyCost())
	if len(g.queue) >= c.maxQueue {
		g.refused++
		answer(rpcResult{err: exhausted("sim: acquire queue full", 100*time.Millisecond)})
		return
	}
	g.queue = append(g.queue, pending{req, answer})
	g.propose()
}

func (c *cluster) cpuModel() cpuModel { return measuredCPU }

// propose forms entries while the batcher has a slot and calls queued.
func (g *raftGroup) propose() {
	c := g.c
	for g.inflight < c.maxBatches && len(g.queue) > 0 {
		if next := g.lastProposal + c.linger; c.linger > 0 && c.w.eng.now < next {
			if !g.lingering {
				g.lingering = true
				c.w.eng.atFunc(next, func() {
					g.lingering = false
					g.propose()
				})
			}
			return
		}
		g.formEntry()
	}
}

// formEntry drains the queue into one AcquireBatch entry stamped with the
// leader's clock and commits it after a sampled Raft latency.
func (g *raftGroup) formEntry() {
	c := g.c
	n, keys := 0, 0
	for n < len(g.queue) && (n == 0 || keys+len(g.queue[n].req.Keys) <= c.maxKeys) {
		keys += len(g.queue[n].req.Keys)
		n++
	}
	calls := append([]pending(nil), g.queue[:n]...)
	g.queue = append(g.queue[:0], g.queue[n:]...)
	batch := &allotv1.AcquireBatch{Requests: make([]*allotv1.AcquireRequest, n)}
	for i, p := range calls {
		batch.Requests[i] = p.req
	}
	now := c.w.eng.now
	stamp, term := now, g.term
	g.inflight++
	g.lastProposal = now
	m := c.cpuModel()
	lead, group := m.entryCost(keys)
	g.leaderCPU += lead
	g.groupCPU += group
	g.demand(m.entryLeader())
	g.cpuFree = max(g.cpuFree, now) + int64(float64(lead)/m.cores)
	done := max(now+c.commit.sample(c.w.rng), g.cpuFree, g.lastCommit)
	g.lastCommit = done
	c.w.eng.atFunc(done, func() { g.commitEntry(batch, calls, stamp, term) })
}

func (g *raftGroup) commitEntry(batch *allotv1.AcquireBatch, calls []pending, stamp int64, term uint64) {
	c := g.c
	// A committed entry is applied even if its leader died meanwhile: the
	// new leader holds it too. Only its answers are lost.
	g.entries++
	res := g.st.Apply(&allotv1.Command{NowUnixNanos: stamp, Cmd: &allotv1.Command_Acquire{Acquire: batch}})
	br, _ := res.(*state.AcquireBatchResult)
	for i, p := range calls {
		if br == nil {
			break
		}
		if g.lastID == nil {
			g.lastID = make(map[string]uint64)
		}
		if id, ok := g.lastID[p.req.AgentId]; ok && id == p.req.RequestId {
			g.replays++
		}
		g.lastID[p.req.AgentId] = p.req.RequestId
		if br.Errs[i] == nil {
			g.acquireRPCs++
			g.keyAcquires += int64(len(p.req.Keys))
		}
		if term != g.term {
			continue
		}
		if br.Errs[i] != nil {
			p.answer(rpcResult{err: grpcError(br.Errs[i])})
		} else {
			p.answer(rpcResult{acq: br.Responses[i]})
		}
	}
	if term != g.term {
		return
	}
	if g.id == 0 && c.killedAt != 0 && c.recoveryAt == 0 && len(calls) > 0 {
		c.recoveryAt = c.w.eng.now
	}
	g.inflight--
	g.propose()
}

// release applies a Release through raft.Apply on its own, not the
// batcher, after one Raft latency.
func (g *raftGroup) release(req *allotv1.ReleaseRequest, answer func(rpcResult)) {
	c := g.c
	term := g.term
	c.w.eng.after(time.Duration(c.commit.sample(c.w.rng)), func() {
		g.entries++
		g.releaseRPCs++
		res := g.st.Apply(&allotv1.Command{NowUnixNanos: c.w.eng.now, Cmd: &allotv1.Command_Release{Release: req}})
		if term != g.term {
			return
		}
		switch v := res.(type) {
		case error:
			answer(rpcResult{err: grpcError(v)})
		case *allotv1.ReleaseResponse:
			answer(rpcResult{rel: v})
		}
	})
}

// lose ends the group's leadership: its queue and the answers of its
// entries in flight are lost; the survivors elect a leader after elect.
func (g *raftGroup) lose(elect time.Duration) {
	c := g.c
	old := g.leader
	g.leader = -1
	g.cpuFree = 0 // the next leader starts idle
	g.term++
	g.queue = nil
	g.inflight = 0
	c.w.eng.after(elect, func() {
		for i := 1; i <= c.nodes; i++ {
			if n := (old + i) % c.nodes; c.alive[n] {
				g.leader = n
				return
			}
		}
	})
}
