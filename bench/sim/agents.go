package main

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/agent/agentsim"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// agentNode runs one real agent (agentsim: no goroutines of its own, the
// virtual clock as its Now hook) for the lease system.
//
// Checks run on the engine's goroutine. The refill tick runs on a driver
// goroutine owned by the agentNode, because agentsim's Refill makes blocking
// Acquire calls: simClient hands each call to the engine over calls and
// parks until the engine delivers the modelled answer (or timeout) at its
// virtual time. The engine waits for the driver to either park in a call or
// finish the tick, so exactly one goroutine runs at a time: the run is
// deterministic and the channel hand-offs order every memory access.
type agentNode struct {
	idx int
	a   *agentsim.Agent
	w   *world

	cmd   chan func()   // engine → driver: run this (a refill tick, Close)
	calls chan *rpc     // driver → engine: a call to model
	done  chan struct{} // driver → engine: the command finished
	busy  bool          // the driver is running a command (engine-owned)

	ctx context.Context
}

// rpc is one call from an agent, as the cluster model sees it.
type rpc struct {
	an      *agentNode
	node    int // the allocator node called
	acq     *allotv1.AcquireRequest
	rel     *allotv1.ReleaseRequest
	reply   chan rpcResult
	sent    int64
	settled bool

	// Split over several groups (cluster.scatter): parts not yet answered,
	// and the answer being put together.
	pending int
	grants  []*allotv1.KeyGrant
	merged  *allotv1.AcquireResponse
	relSum  *allotv1.ReleaseResponse
}

type rpcResult struct {
	acq *allotv1.AcquireResponse
	rel *allotv1.ReleaseResponse
	err error
}

func newAgentNode(w *world, idx int) *agentNode {
	an := &agentNode{
		idx:   idx,
		w:     w,
		cmd:   make(chan func()),
		calls: make(chan *rpc),
		done:  make(chan struct{}),
		ctx:   context.Background(),
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		for f := range an.cmd {
			f()
			an.done <- struct{}{}
		}
	}()
	return an
}

// run hands f to the driver and returns when it has finished or parked in
// a call (whose answer the engine will deliver later).
func (an *agentNode) run(f func()) {
	an.busy = true
	an.cmd <- f
	an.await()
}

func (an *agentNode) await() {
	select {
	case r := <-an.calls:
		an.w.cl.call(r)
	case <-an.done:
		an.busy = false
	}
}

// fire is the refill tick (a time.Ticker drops ticks while the loop is busy,
// and so does this).
func (an *agentNode) fire(int64) {
	if an.a == nil {
		return
	}
	w := an.w
	if !an.busy {
		an.run(func() { _ = an.a.Refill(an.ctx) })
	}
	w.eng.at(w.eng.now+int64(w.cfg.refill), an, 0)
}

// stop waits for the agent's call in flight, closes the agent, then ends the
// driver goroutine.
func (an *agentNode) stop() {
	w := an.w
	for an.busy && w.eng.step(1<<62) {
	}
	a := an.a
	an.a = nil
	an.run(func() { _ = a.Close(an.ctx) })
	for an.busy && w.eng.step(1<<62) {
	}
	close(an.cmd)
}

// settle delivers an answer or a timeout, whichever comes first.
func (w *world) settle(r *rpc, res rpcResult) {
	if r.settled {
		return
	}
	r.settled = true
	r.reply <- res
	r.an.await()
}

// simClient is the in-memory allotv1.AllocatorClient of one agent for one
// allocator node (agent.Config.Clients).
type simClient struct {
	an   *agentNode
	node int
}

func (c *simClient) Acquire(_ context.Context, req *allotv1.AcquireRequest, _ ...grpc.CallOption) (*allotv1.AcquireResponse, error) {
	r := &rpc{an: c.an, node: c.node, acq: req, reply: make(chan rpcResult, 1)}
	c.an.calls <- r
	res := <-r.reply
	return res.acq, res.err
}

func (c *simClient) Release(_ context.Context, req *allotv1.ReleaseRequest, _ ...grpc.CallOption) (*allotv1.ReleaseResponse, error) {
	r := &rpc{an: c.an, node: c.node, rel: req, reply: make(chan rpcResult, 1)}
	c.an.calls <- r
	res := <-r.reply
	return res.rel, res.err
}

// WatchRules is not called: Manual agents run no rule watch; the cluster
// model's watch delivers rule sets with agentsim's ApplyRuleSet.
func (c *simClient) WatchRules(context.Context, *allotv1.WatchRulesRequest, ...grpc.CallOption) (grpc.ServerStreamingClient[allotv1.RuleSet], error) {
	return nil, status.Error(codes.Unimplemented, "sim: rule sets are delivered by the cluster model")
}
