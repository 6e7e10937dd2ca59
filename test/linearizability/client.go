package linearizability

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Recorder collects the ops of every client. It is safe for concurrent use.
type Recorder struct {
	mu  sync.Mutex // guards ops
	ops []Op
}

// Add records op.
func (r *Recorder) Add(op Op) {
	r.mu.Lock()
	r.ops = append(r.ops, op)
	r.mu.Unlock()
}

// Ops returns a copy of the recorded ops.
func (r *Recorder) Ops() []Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Op(nil), r.ops...)
}

// Node is one allocator a client may call.
type Node struct {
	Name   string
	Client allotv1.AllocatorClient
}

// Client drives one agent's Acquire/Release calls on one key and records
// each as an Op. It behaves as an agent: it holds what the allocator
// records, spends some of it between calls, returns some, charges a few
// tokens "admitted without a lease", sometimes releases, and retries a
// failed call with the same request id, rotating over Nodes, until it is
// answered. Run is not safe to call twice at once.
type Client struct {
	Index   int    // op Client index, < MaxClients
	Agent   string // agent id, unique per Client
	Key     string // history partition label, the same for every Client of the budget key
	Domain  string
	Entries []*allotv1.Entry
	Nodes   []Node
	// Pin, when set and ≥ 0, is the only node every attempt uses (the
	// client does not rotate away from it while it fails). Default: start
	// where the previous op succeeded, rotate on failure.
	Pin func() int
	// CallTimeout bounds each attempt (default 500ms); Interval is the
	// pause between ops (default 50ms); Seed seeds the op choices.
	CallTimeout, Interval time.Duration
	Seed                  uint64

	node  int
	held  int64
	reqID uint64
	rng   *rand.Rand
}

// ErrRejected wraps a call the allocator answered with an error that is
// not a transient one: a client bug or an allocator invariant broken.
var ErrRejected = errors.New("linearizability: call rejected")

// Run issues ops until ctx is done, then completes the op in flight,
// retrying until finish (a context the caller cancels when it gives up).
// It returns nil, or the first rejection, or finish's error when the last
// op could not be completed.
func (c *Client) Run(ctx, finish context.Context, rec *Recorder) error {
	if c.CallTimeout <= 0 {
		c.CallTimeout = 500 * time.Millisecond
	}
	if c.Interval <= 0 {
		c.Interval = 50 * time.Millisecond
	}
	if c.Index < 0 || c.Index >= MaxClients || len(c.Nodes) == 0 {
		return fmt.Errorf("linearizability: client %d with %d nodes", c.Index, len(c.Nodes))
	}
	c.rng = rand.New(rand.NewPCG(c.Seed, uint64(c.Index)))
	t := time.NewTicker(c.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if err := c.one(finish, rec); err != nil {
			return err
		}
	}
}

// one builds the next op and runs it to completion.
func (c *Client) one(finish context.Context, rec *Recorder) error {
	c.reqID++
	// Spend a little now and then (the budget refills at its rate; agents
	// that spent everything would leave a history of empty answers).
	var spend int64
	if c.held > 0 && c.rng.IntN(100) < 10 {
		spend = 1 + c.rng.Int64N(min(c.held, 3))
	}
	keep := c.held - spend
	key := &allotv1.KeyAcquire{Domain: c.Domain, Entries: c.Entries}
	op := Op{Client: c.Index, Agent: c.Agent, Key: c.Key, ReqID: c.reqID}
	if c.rng.IntN(100) < 8 {
		op.Kind = Release
		op.Returned = keep
		key.Returned = keep
		req := &allotv1.ReleaseRequest{AgentId: c.Agent, RequestId: c.reqID, Keys: []*allotv1.KeyAcquire{key}}
		var resp *allotv1.ReleaseResponse
		err := c.retry(finish, &op, func(ctx context.Context, n Node) (err error) {
			resp, err = n.Client.Release(ctx, req)
			return err
		})
		if err != nil {
			return err
		}
		op.Credited = resp.GetReturned()
		c.held = 0
		rec.Add(op)
		return nil
	}

	op.Kind = Acquire
	if keep > 0 && c.rng.IntN(100) < 30 {
		op.Returned = c.rng.Int64N(keep + 1)
	}
	op.Held = keep - op.Returned
	if c.rng.IntN(100) >= 10 {
		op.Want = 1 + c.rng.Int64N(15)
	}
	if c.rng.IntN(100) < 3 {
		op.Charged = 1 + c.rng.Int64N(2)
	}
	key.Want, key.Held, key.Returned, key.Charged = op.Want, op.Held, op.Returned, op.Charged
	key.Demand = float64(op.Want)
	req := &allotv1.AcquireRequest{AgentId: c.Agent, RequestId: c.reqID, Keys: []*allotv1.KeyAcquire{key}}
	var resp *allotv1.AcquireResponse
	err := c.retry(finish, &op, func(ctx context.Context, n Node) (err error) {
		resp, err = n.Client.Acquire(ctx, req)
		return err
	})
	if err != nil {
		return err
	}
	if len(resp.GetGrants()) != 1 {
		return fmt.Errorf("%w: %s#%d: %d grants for 1 key", ErrRejected, c.Agent, c.reqID, len(resp.GetGrants()))
	}
	g := resp.GetGrants()[0]
	switch g.GetStatus() {
	case allotv1.KeyStatus_KEY_STATUS_OK:
		op.Status = StatusOK
	case allotv1.KeyStatus_KEY_STATUS_EXHAUSTED:
		op.Status = StatusExhausted
	default:
		op.Status = StatusOther
	}
	op.Granted, op.Remaining, op.HeldAfter = g.GetGranted(), g.GetRemaining(), g.GetHeld()
	op.NowMs, op.LeaseTTLMs, op.Leader = resp.GetNowUnixMs(), g.GetLeaseTtlMs(), resp.GetLeaderId()
	c.held = g.GetHeld()
	rec.Add(op)
	return nil
}

// retry calls f on the current node until it succeeds, rotating to the next
// node after each failure. It sets op.Call (first attempt), op.Return and
// op.Node.
func (c *Client) retry(finish context.Context, op *Op, f func(context.Context, Node) error) error {
	op.Call = time.Now().UnixNano()
	wait := 5 * time.Millisecond
	for {
		if c.Pin != nil {
			if i := c.Pin(); i >= 0 {
				c.node = i % len(c.Nodes)
			}
		}
		n := c.Nodes[c.node]
		ctx, cancel := context.WithTimeout(finish, c.CallTimeout)
		err := f(ctx, n)
		cancel()
		if err == nil {
			op.Return = time.Now().UnixNano()
			op.Node = n.Name
			return nil
		}
		switch status.Code(err) {
		case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange, codes.PermissionDenied,
			codes.Unauthenticated, codes.Unimplemented, codes.NotFound, codes.AlreadyExists:
			return fmt.Errorf("%w: %s#%d via %s: %v", ErrRejected, c.Agent, op.ReqID, n.Name, err)
		}
		if finish.Err() != nil {
			return fmt.Errorf("linearizability: %s#%d never answered: %w (last: %v)", c.Agent, op.ReqID, finish.Err(), err)
		}
		c.node = (c.node + 1) % len(c.Nodes)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-finish.Done():
			t.Stop()
		}
		wait = min(2*wait, 100*time.Millisecond)
	}
}
