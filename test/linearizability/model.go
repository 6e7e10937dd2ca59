// Package linearizability checks recorded Acquire/Release histories of the
// allot allocator against a sequential model of one budget key, with
// github.com/anishathalye/porcupine.
//
// A history is a list of Ops: each is one Acquire or Release of one key by
// one client (an agent id), with its call and return times (wall clock,
// Unix ns, on the machine that runs the allocators), what it asked and what
// the allocator answered. A client issues one op at a time and retries a
// failed call with the same request id until it is answered, so every
// recorded op is complete; the allocator answers a retry from its record
// (invariant (b)), so the answer is the one of the single application.
//
// # The model
//
// The state is what an observer can know about the key's token bucket
// (capacity B, refill R = quota/window) and the lease records:
//
//   - the bucket's tokens, as an interval [lo, hi] (the true value is a
//     real number; the allocator reports ⌊tokens⌋ as `remaining`);
//   - the stamp t (ms) of the last Acquire applied;
//   - per client, the tokens h the allocator records it as holding and its
//     lease expiry.
//
// An Acquire linearizes at its command time: the allocator stamps every
// committed command with the leader's clock and answers now_unix_ms, the
// applied time, which never decreases along the log. The model therefore
// requires the stamp T to lie within the op's [call, return] (±2 ms of clock
// granularity) and to be ≥ the previous Acquire's stamp, and applies, as the
// allocator's state machine does (docs/leases.md):
//
//  1. refill for the elapsed time, which is only known to ±1 ms per stamp:
//     lo grows by R·(T−t−1 ms), hi by R·(T−t+1 ms), both capped at B;
//  2. returned: r = min(returned, max(0, h − held)) is credited (capped at
//     B), h −= r, then h = min(h, held);
//  3. charged: debited, floored at −B;
//  4. the grant g must satisfy g ≤ min(want, C) with C = max(B, ⌈R·F⌉) the
//     key's capacity per refresh interval F, g ≤ C − h, and g ≤ ⌊hi⌋: no op
//     is granted tokens the bucket could not hold at that instant. This is
//     the "no double grant" check; the grant may be smaller (the fair-share
//     cap is not modelled);
//  5. the answer's `remaining` must equal ⌊tokens⌋ for some tokens in
//     [lo, hi] after the grant, and then narrows the interval to
//     [remaining, remaining+1). A return that was acknowledged but not
//     credited, or a grant answered but never applied (or applied twice),
//     moves the true value out of the interval: the "no lost return" and
//     "no phantom grant" check;
//  6. the answer's `held` must equal the model's h, and the status must be
//     EXHAUSTED exactly when tokens were wanted, none granted and fewer than
//     one remains.
//
// A Release carries no stamp; it linearizes anywhere in its interval. It
// must report returned == r (as in step 2) and ends the client's lease.
// Releases in a history must not charge (a charge is a debit, and a debit
// at an unknown time does not commute with the capped refill; credits do).
//
// Lease expiry is nondeterministic: the leader's periodic Expire ends a
// lease at some time after its expiry, and tokens of an expired lease are
// not credited. An op whose latest possible time is past the client's
// lease expiry is explored both with the lease alive and with it ended.
//
// Assumptions: the key is under a token-bucket rule that does not change
// during the history, the key is fresh (a full bucket) when the history
// starts, every op on the key is in the history, and the allocators run on
// the machine whose clock stamped call and return.
package linearizability

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Kind is an op's RPC.
type Kind uint8

const (
	// Acquire is Allocator.Acquire with one key.
	Acquire Kind = iota
	// Release is Allocator.Release with one key (not `all`).
	Release
)

func (k Kind) String() string {
	if k == Release {
		return "release"
	}
	return "acquire"
}

// Status is the KeyGrant status the model distinguishes.
type Status uint8

const (
	// StatusOther is any status but OK and EXHAUSTED (illegal for a leased key).
	StatusOther Status = iota
	// StatusOK is KEY_STATUS_OK.
	StatusOK
	// StatusExhausted is KEY_STATUS_EXHAUSTED.
	StatusExhausted
)

// MaxClients bounds the clients (agents) of one key in a history.
const MaxClients = 16

// Op is one completed Acquire or Release of one key.
type Op struct {
	Client int    // 0 ≤ Client < MaxClients: the agent, one op at a time
	Agent  string // the agent id (for messages)
	Key    string // the canonical budget key: histories are checked per key
	Kind   Kind
	Node   string // the node that answered (for messages)
	Leader string // AcquireResponse.leader_id: the leader that applied it
	ReqID  uint64

	// Input.
	Want, Held, Returned, Charged int64

	// Wall-clock Unix ns: the first attempt's call and the answer's return.
	Call, Return int64

	// Acquire's answer.
	Status     Status
	Granted    int64
	Remaining  int64
	HeldAfter  int64 // KeyGrant.held
	NowMs      int64 // AcquireResponse.now_unix_ms
	LeaseTTLMs int64
	// Release's answer.
	Credited int64 // ReleaseResponse.returned
}

func (o Op) String() string {
	if o.Kind == Release {
		return fmt.Sprintf("%s#%d release(held=%d returned=%d) → credited %d [via %s]",
			o.Agent, o.ReqID, o.Held, o.Returned, o.Credited, o.Node)
	}
	st := map[Status]string{StatusOK: "OK", StatusExhausted: "EXHAUSTED", StatusOther: "OTHER"}[o.Status]
	return fmt.Sprintf("%s#%d acquire(want=%d held=%d returned=%d charged=%d) → %s granted=%d remaining=%d held=%d at %d ms [via %s]",
		o.Agent, o.ReqID, o.Want, o.Held, o.Returned, o.Charged, st, o.Granted, o.Remaining, o.HeldAfter, o.NowMs, o.Node)
}

// Params are the key's rule and the allocator's refresh interval.
type Params struct {
	Quota           int64
	Window          time.Duration
	Burst           int64
	RefreshInterval time.Duration
}

// Validate reports a Params the model cannot use.
func (p Params) Validate() error {
	if p.Quota <= 0 || p.Window <= 0 || p.Burst <= 0 || p.RefreshInterval <= 0 {
		return fmt.Errorf("linearizability: quota, window, burst and refresh interval must be positive: %+v", p)
	}
	return nil
}

// perMs is the refill rate in tokens per millisecond.
func (p Params) perMs() float64 {
	return float64(p.Quota) / (float64(p.Window) / float64(time.Millisecond))
}

// Capacity is C = max(B, ⌈R·F⌉), the most an agent may hold.
func (p Params) Capacity() int64 {
	rf := int64(math.Ceil(float64(p.Quota) * float64(p.RefreshInterval) / float64(p.Window)))
	return max(p.Burst, rf)
}

// eps absorbs float rounding; tokens are whole numbers and fractions of
// R·1 ms, far above it.
const eps = 1e-6

// clockSlackMs: how far a stamp may lie outside [call, return] (the leader
// reads the same clock; ms truncation and the read granularity).
const clockSlackMs = 2

type client struct {
	h      int64 // tokens the allocator records this client as holding
	expiry int64 // its lease's expiry, ms; 0: no lease
}

// State is the model's state for one key. It is comparable (==).
type State struct {
	Lo, Hi  float64 // bucket tokens after the last op
	T       int64   // stamp (ms) of the last Acquire; 0 before the first
	Clients [MaxClients]client
}

func (s State) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "tokens ∈ [%.3f, %.3f] at %d ms; held:", s.Lo, s.Hi, s.T)
	for i, c := range s.Clients {
		if c.h != 0 || c.expiry != 0 {
			fmt.Fprintf(&b, " c%d=%d(exp %d)", i, c.h, c.expiry)
		}
	}
	return b.String()
}

// initial is a fresh key: a full bucket, no leases.
func (p Params) initial() State {
	return State{Lo: float64(p.Burst), Hi: float64(p.Burst)}
}

// Step applies op to s and returns the possible next states (none: the op
// cannot have happened from s) and, when there are none, why.
func (p Params) Step(s State, op Op) ([]State, string) {
	if op.Client < 0 || op.Client >= MaxClients {
		return nil, fmt.Sprintf("client %d out of range", op.Client)
	}
	// The client's lease may have expired before this op: explore both.
	c := s.Clients[op.Client]
	latest := op.Return/1e6 + clockSlackMs
	if op.Kind == Acquire {
		latest = op.NowMs + 1
	}
	var out []State
	var why string
	for _, expired := range []bool{false, true} {
		if expired && (c.expiry == 0 || latest < c.expiry) {
			continue
		}
		s2 := s
		if expired {
			s2.Clients[op.Client] = client{}
		}
		var next State
		var ok bool
		if op.Kind == Release {
			next, ok, why = p.release(s2, op)
		} else {
			next, ok, why = p.acquire(s2, op)
		}
		if ok {
			out = append(out, next)
		}
	}
	return out, why
}

func (p Params) credit(s *State, c *client, held, returned int64) int64 {
	r := min(returned, max(0, c.h-held))
	if r > 0 {
		b := float64(p.Burst)
		s.Lo = min(b, s.Lo+float64(r))
		s.Hi = min(b, s.Hi+float64(r))
		c.h -= r
	} else {
		r = 0
	}
	c.h = min(c.h, max(held, 0))
	return r
}

func (p Params) release(s State, op Op) (State, bool, string) {
	if op.Charged != 0 {
		return s, false, "a release in the history charges tokens (unsupported by the model)"
	}
	c := s.Clients[op.Client]
	r := p.credit(&s, &c, op.Held, op.Returned)
	if op.Credited != r {
		return s, false, fmt.Sprintf("release credited %d, the model credits %d (held on record %d)", op.Credited, r, s.Clients[op.Client].h)
	}
	s.Clients[op.Client] = client{}
	return s, true, ""
}

func (p Params) acquire(s State, op Op) (State, bool, string) {
	T := op.NowMs
	if T < op.Call/1e6-clockSlackMs || T > op.Return/1e6+clockSlackMs {
		return s, false, fmt.Sprintf("stamp %d ms outside the op's interval [%d, %d] ms", T, op.Call/1e6, op.Return/1e6)
	}
	if s.T != 0 && T < s.T {
		return s, false, fmt.Sprintf("stamp %d ms before the previous acquire's %d ms", T, s.T)
	}
	if op.Status == StatusOther {
		return s, false, "status is neither OK nor EXHAUSTED"
	}
	b := float64(p.Burst)
	// 1. refill.
	if s.T != 0 {
		lo := float64(max(T-s.T-1, 0)) * p.perMs()
		hi := float64(T-s.T+1) * p.perMs()
		s.Lo = min(b, s.Lo+lo)
		s.Hi = min(b, s.Hi+hi)
	}
	s.T = T
	c := s.Clients[op.Client]
	// 2. returned.
	p.credit(&s, &c, op.Held, op.Returned)
	// 3. charged.
	if op.Charged > 0 {
		s.Lo = debit(s.Lo, op.Charged, b)
		s.Hi = debit(s.Hi, op.Charged, b)
	}
	// 4. the grant.
	capacity := p.Capacity()
	want := min(max(op.Want, 0), capacity)
	g := op.Granted
	switch {
	case g < 0:
		return s, false, fmt.Sprintf("negative grant %d", g)
	case g > want:
		return s, false, fmt.Sprintf("granted %d > want %d (capacity %d)", g, want, capacity)
	case g > 0 && g > capacity-c.h:
		return s, false, fmt.Sprintf("granted %d on top of %d held > capacity %d", g, c.h, capacity)
	case g > 0 && float64(g) > math.Floor(s.Hi+eps):
		return s, false, fmt.Sprintf("granted %d but the bucket held at most %.3f tokens (double grant)", g, s.Hi)
	}
	s.Lo -= float64(g)
	s.Hi -= float64(g)
	c.h += g
	// 5. remaining, then narrow.
	rem := float64(op.Remaining)
	if rem < math.Floor(s.Lo+eps) || rem > math.Floor(s.Hi+eps) {
		return s, false, fmt.Sprintf("remaining %d, the model has tokens ∈ [%.3f, %.3f] (lost return or phantom grant)",
			op.Remaining, s.Lo, s.Hi)
	}
	s.Lo = max(s.Lo, rem)
	s.Hi = min(s.Hi, rem+1)
	// 6. held and status.
	exhausted := op.Want > 0 && g == 0 && op.Remaining < 1
	if exhausted != (op.Status == StatusExhausted) {
		return s, false, fmt.Sprintf("status exhausted=%v, want %v", op.Status == StatusExhausted, exhausted)
	}
	if op.Want > 0 || c.h > 0 {
		if op.HeldAfter != c.h {
			return s, false, fmt.Sprintf("allocator records held %d, the model %d", op.HeldAfter, c.h)
		}
		c.expiry = T + op.LeaseTTLMs
	} else {
		if op.HeldAfter != 0 {
			return s, false, fmt.Sprintf("lease ended but held %d", op.HeldAfter)
		}
		c = client{}
	}
	s.Clients[op.Client] = c
	return s, true, ""
}

// debit is Limit.Debit on a token count: down by n, floored at −b (a value
// already below the floor stays).
func debit(x float64, n int64, b float64) float64 {
	if x <= -b {
		return x
	}
	return max(x-float64(n), -b)
}

// Model is the porcupine model for histories of Ops with params p,
// partitioned by key.
func Model(p Params) porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: partitionByKey,
		Init:      func() []interface{} { return []interface{}{p.initial()} },
		Step: func(state, input, _ interface{}) []interface{} {
			next, _ := p.Step(state.(State), input.(Op))
			out := make([]interface{}, len(next))
			for i, s := range next {
				out[i] = s
			}
			return out
		},
		Equal:             func(a, b interface{}) bool { return a.(State) == b.(State) },
		DescribeOperation: func(input, _ interface{}) string { return input.(Op).String() },
		DescribeState:     func(s interface{}) string { return s.(State).String() },
	}
	return nm.ToModel()
}

func partitionByKey(history []porcupine.Operation) [][]porcupine.Operation {
	idx := map[string]int{}
	var out [][]porcupine.Operation
	for _, op := range history {
		k := op.Input.(Op).Key
		i, ok := idx[k]
		if !ok {
			i = len(out)
			idx[k] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], op)
	}
	return out
}

// Operations converts ops for porcupine: Input and Output are the Op.
func Operations(ops []Op) []porcupine.Operation {
	out := make([]porcupine.Operation, len(ops))
	for i, op := range ops {
		out[i] = porcupine.Operation{ClientId: op.Client, Input: op, Call: op.Call, Output: op, Return: op.Return}
	}
	return out
}

// Result is the outcome of Check.
type Result struct {
	Outcome porcupine.CheckResult
	Info    porcupine.LinearizationInfo
	Ops     int
	Keys    int
	// Explain, when the history is not linearizable, replays it in stamp
	// order and names the first op the model rejects (a hint: the checker
	// tried every order).
	Explain string
}

// Check checks ops against the model within timeout (0: none).
func Check(p Params, ops []Op, timeout time.Duration) (Result, error) {
	if err := p.Validate(); err != nil {
		return Result{}, err
	}
	keys := map[string]bool{}
	for _, op := range ops {
		if op.Client < 0 || op.Client >= MaxClients {
			return Result{}, fmt.Errorf("linearizability: op client %d out of [0, %d)", op.Client, MaxClients)
		}
		if op.Return < op.Call {
			return Result{}, fmt.Errorf("linearizability: op %v returns before its call", op)
		}
		keys[op.Key] = true
	}
	res, info := porcupine.CheckOperationsVerbose(Model(p), Operations(ops), timeout)
	r := Result{Outcome: res, Info: info, Ops: len(ops), Keys: len(keys)}
	if res == porcupine.Illegal {
		r.Explain = Explain(p, ops)
	}
	return r, nil
}

// Explain replays ops key by key in a plausible order (Acquires by stamp,
// Releases at their call) and reports the first op the model rejects, with
// the state before it. "" when the replay accepts everything.
func Explain(p Params, ops []Op) string {
	type keyed struct {
		at int64
		op Op
	}
	byKey := map[string][]keyed{}
	for _, op := range ops {
		at := op.Call
		if op.Kind == Acquire {
			at = op.NowMs * 1e6
		}
		byKey[op.Key] = append(byKey[op.Key], keyed{at, op})
	}
	var b strings.Builder
	for key, ks := range byKey {
		slices.SortStableFunc(ks, func(x, y keyed) int { return cmp.Compare(x.at, y.at) })
		states := []State{p.initial()}
		for n, k := range ks {
			var next []State
			var why string
			for _, s := range states {
				ns, w := p.Step(s, k.op)
				next = append(next, ns...)
				if w != "" {
					why = w
				}
			}
			if len(next) == 0 {
				fmt.Fprintf(&b, "key %s: op %d of %d rejected: %v\n  %s\n  state before: %v\n", key, n+1, len(ks), k.op, why, states[0])
				break
			}
			states = dedup(next)
		}
	}
	return b.String()
}

func dedup(ss []State) []State {
	out := ss[:0:0]
	for _, s := range ss {
		seen := false
		for _, o := range out {
			if o == s {
				seen = true
				break
			}
		}
		if !seen {
			out = append(out, s)
		}
	}
	return out
}
