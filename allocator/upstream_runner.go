package allocator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/allocator/upstream"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/rules/rulespb"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// regional is a regional cluster's link to its global cluster
// (Config.Region). Its runner (run) works while this node leads: every
// Tick it reads the regional ledger (the pools of the global keys the
// region's gateways use, with their demand), drives each key's policy
// (allocator/upstream), commits what the policy decides through Raft and
// makes the upstream calls. It is owned by the leader's duties: started
// after the term's Barrier, stopped when leadership ends.
//
// One upstream call is in flight at a time: the ledger records one
// pending send, which a new leader makes again. A call carries at most
// maxKeys keys (the protocol's bound). When more are due, the keys are
// evaluated in turn from where the last full call stopped (in key hash
// order, wrapping around), and the next call follows as soon as the last
// is answered, so that every key is evaluated within ⌈due/maxKeys⌉ calls.
type regional struct {
	s       *Server
	name    string
	agent   string // the region's agent id at the global cluster
	cfg     upstream.Config
	addrs   []string
	maxKeys int // keys per upstream call

	calls   *prometheus.CounterVec // result
	tokens  *prometheus.CounterVec // kind: received, returned, minted
	fbKeys  prometheus.Gauge       // global keys served from their fallback share now
	refused refusals               // global allocators refusing this node's certificate

	mu       sync.Mutex // guards the fields below
	goodIdx  int        // the global allocator that answered last
	verified bool       // an upstream answered the cycle check
	state    string     // connected | cut_off | connecting | none | not_leader | cycle
	since    time.Time
	err      string
	keys     map[uint64]keyView           // by key hash, as of the runner's last Tick
	warned   map[uint64]state.GlobalLimit // the mismatch last logged, by key hash

	// unsettled is the entry that settles the last call in the ledger
	// (its fail or grant) when its commit failed: until it is committed
	// the call stays the ledger's pending send, and a new send would
	// replace it, with the outage charges that entry owes again owed
	// nowhere. The runner commits it again before it sends anything
	// (settle). Owned by the runner's goroutine; reset at each term.
	unsettled []byte
	// settleCommit commits the entries that settle a call (a give-up, a
	// fail, a grant); nil: commit. A test's seam, read only by the
	// runner's goroutine.
	settleCommit func([]byte) error
}

// keyView is what the runner knows of a key beyond the ledger.
type keyView struct {
	share, fallback float64
	cutOff          bool
	// notLeased: how the global cluster answered a key it does not lease
	// (KEY_STATUS_NO_RULE, _NOT_LEASED, _UNLIMITED); "" when it leases it.
	notLeased string
}

// regKey is one global key at the runner.
type regKey struct {
	k         *upstream.Key
	notLeased string // as keyView.notLeased
	warned    bool   // the no-upstream warning was logged
}

// newRegional returns the region's link (nil for a cluster that is not a
// region) with its metrics registered.
func (s *Server) newRegional() (*regional, error) {
	r := s.cfg.Region
	if r.Name == "" {
		return nil, nil
	}
	g := &regional{
		s: s, name: r.Name, agent: regionAgentPrefix + r.Name, cfg: r.Upstream, addrs: r.GlobalAllocators,
		maxKeys: allotv1.MaxKeysPerCall, state: "not_leader", since: time.Now(), keys: map[uint64]keyView{},
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: metricsNamespace, Name: "upstream_calls_total",
			Help: "Calls of this regional leader to the global cluster, by result (ok, error, cycle)."}, []string{"result"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: metricsNamespace, Name: "upstream_tokens_total",
			Help: "Tokens of global keys: received from the global cluster, returned to it, minted at the fallback share while cut off or without an upstream."},
			[]string{"kind"}),
		fbKeys: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: metricsNamespace, Name: "upstream_fallback_keys",
			Help: "Global keys this regional leader serves from their fallback share (cut off from the global cluster, or no -global-allocators)."}),
	}
	if len(g.addrs) == 0 {
		g.state = "none"
	}
	if err := s.register(g.calls, g.tokens, g.fbKeys); err != nil {
		return nil, err
	}
	return g, nil
}

func (g *regional) setState(st string, err error) {
	g.mu.Lock()
	cut := st == "cut_off" && st != g.state && err != nil
	if st != g.state {
		g.state, g.since = st, time.Now()
	}
	if err != nil {
		g.err = err.Error()
	}
	g.mu.Unlock()
	if cut {
		g.s.log.Warn("cut off from the global cluster: global keys are served from what the region holds, then from their fallback share",
			"region", g.name, "err", err)
	}
}

// run is the runner of one term; it returns when ctx ends.
func (g *regional) run(ctx context.Context) {
	s := g.s
	g.unsettled = nil // the pending send is the ledger's, recovered below
	keys := map[uint64]*regKey{}
	upstreamOK := len(g.addrs) > 0
	if upstreamOK && !g.isVerified() {
		g.setState("connecting", nil)
		if err := g.verify(ctx); err != nil {
			if errors.Is(err, errCycle) {
				s.log.Error("refusing to lease from the global allocators", "err", err)
				g.calls.WithLabelValues("cycle").Inc()
				g.setState("cycle", err)
				upstreamOK = false
			}
		}
	} else {
		s.log.Warn("region has no -global-allocators: scope: global keys are served from their fallback share",
			"region", g.name)
	}
	if upstreamOK {
		g.recover(ctx)
	}
	defer g.setState("not_leader", nil)
	if ctx.Err() != nil {
		return // a pending send may stand: the next leader recovers it
	}
	tick := g.cfg.Tick
	if tick <= 0 {
		tick = upstream.DefaultConfig().Tick
	}
	t := time.NewTicker(tick)
	defer t.Stop()
	// One upstream call in flight at a time, in a goroutine owned by this
	// loop: the Ticks go on meanwhile (a cut-off region mints its share
	// while its calls time out).
	results := make(chan callResult, 1)
	var calls sync.WaitGroup
	defer calls.Wait()
	inflight := false
	// cursor: the key the next evaluation starts from; more: the last
	// one left keys unevaluated, for want of room in its call.
	var cursor uint64
	more := false
	call := func(due []due) {
		if len(due) == 0 {
			return
		}
		c, ok := g.send(ctx, due)
		if !ok {
			return
		}
		inflight = true
		calls.Add(1)
		go func() {
			defer calls.Done()
			// No global allocator answered the cycle check yet: the
			// first to answer is checked before it is leased from.
			if !g.isVerified() {
				if err := g.verify(ctx); errors.Is(err, errCycle) {
					c.err = err
					results <- c
					return
				}
			}
			c.resp, c.err = g.acquire(ctx, c.req)
			results <- c // buffered for the one call in flight
		}()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case res := <-results:
			inflight = false
			g.finish(ctx, res)
			if errors.Is(res.err, errCycle) {
				s.log.Error("refusing to lease from the global allocators", "err", res.err)
				upstreamOK = false
			}
			if more && upstreamOK && ctx.Err() == nil && g.unsettled == nil {
				// The keys the last call had no room for: now, not at
				// the next Tick.
				var due []due
				due, more = g.tick(ctx, keys, upstreamOK, true, &cursor)
				call(due)
			}
		case <-t.C:
			if inflight || !g.settle(ctx) {
				g.tick(ctx, keys, upstreamOK, false, &cursor)
				continue
			}
			var due []due
			due, more = g.tick(ctx, keys, upstreamOK, true, &cursor)
			call(due)
		}
	}
}

// verify checks that an answering global allocator is neither a region
// nor this cluster: at the start of each term and before each call until
// one has answered. Unreachable ones are not an error.
func (g *regional) verify(ctx context.Context) error {
	for _, addr := range g.addrs {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		st, err := g.s.upstreamStatus(cctx, addr)
		cancel()
		if err != nil {
			continue
		}
		err = g.s.cycleError(addr, st)
		if err == nil {
			g.mu.Lock()
			g.verified = true
			g.mu.Unlock()
		}
		return err
	}
	return nil
}

func (g *regional) isVerified() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.verified
}

// recover makes the previous leader's unanswered call again, with its
// request id: the global cluster answers a repeated id with the answer it
// recorded, so a grant the previous leader never committed reaches the
// pools once. A call that fails again is given up (what it may have been
// granted is not admitted: the safe side), and what it reported as
// outage_charged is owed again. The give-up is committed again and again
// (after giveUpRetry) until it is, or the term ends: until then the call
// stays the ledger's pending send, and a new send would replace it with
// its outage charges owed nowhere (the term's per-key policies were
// built from the ledger, which lacks them).
func (g *regional) recover(ctx context.Context) {
	s := g.s
	seq, raw := s.st.PendingUpstream()
	if raw == nil {
		return
	}
	req := new(allotv1.AcquireRequest)
	if err := proto.Unmarshal(raw, req); err != nil {
		s.log.Error("pending upstream call does not decode; given up", "seq", seq, "err", err)
		return
	}
	set := s.st.Rules()
	giveUp := func(msg string, err error) {
		s.log.Warn(msg, "seq", seq, "err", err)
		charges := make([]state.UpstreamReturn, len(req.GetKeys()))
		for i, k := range req.GetKeys() {
			charges[i] = state.UpstreamReturn{Hash: keyHashOf(set, k), Charged: k.GetOutageCharged()}
		}
		for {
			err := g.commitSettle(state.AppendUpstreamFail(nil, s.stamp(), seq, charges))
			if err == nil || ctx.Err() != nil {
				return
			}
			s.log.Warn("given-up upstream call not committed; trying again", "seq", seq, "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(giveUpRetry):
			}
		}
	}
	resp, err := g.acquire(ctx, req)
	if err != nil {
		if ctx.Err() == nil {
			giveUp("previous leader's upstream call not answered; given up", err)
		}
		return
	}
	gs, err := allotv1.GrantsOf(resp)
	if err != nil {
		giveUp("previous leader's upstream call answered with grants that do not decode; given up", err)
		return
	}
	var grants []state.UpstreamGrant
	for i, k := range req.GetKeys() {
		if i >= len(gs) {
			break
		}
		share := -1.0 // the pool keeps the share it recorded
		if gs[i].Share != nil {
			share = gs[i].GetShare()
		}
		gr := state.UpstreamGrant{Hash: keyHashOf(set, k), Granted: gs[i].GetGranted(), Share: share,
			Limit: globalLimitOf(gs[i], resp.GetRulesVersion())}
		if moved(gs[i]) {
			gr.Granted, gr.Owed = 0, k.GetOutageCharged()
		}
		grants = append(grants, gr)
	}
	entry := state.AppendUpstreamGrant(nil, s.stamp(), seq, grants)
	if err := g.commitSettle(entry); err != nil {
		// Committed again before the term's first send (settle).
		s.log.Warn("recovered upstream grant not committed", "seq", seq, "err", err)
		g.unsettled = entry
		return
	}
	s.log.Info("previous leader's upstream call recovered", "seq", seq, "keys", len(grants))
}

// giveUpRetry is the wait before recover commits a give-up again.
const giveUpRetry = 100 * time.Millisecond

// keyHashOf returns the regional key hash of a key of an upstream call.
func keyHashOf(set *rules.Set, k *allotv1.KeyAcquire) uint64 {
	ents := make([]rules.Entry, len(k.GetEntries()))
	for i, e := range k.GetEntries() {
		ents[i] = rules.Entry{Key: e.GetKey(), Value: e.GetValue()}
	}
	return rules.KeyHash(set.Match(k.GetDomain(), ents), k.GetDomain(), ents)
}

// due is a key with an upstream call to make.
type due struct {
	p   state.Pool
	rk  *regKey
	req upstream.Request
}

// tick evaluates the global keys and returns those with an upstream call
// to make, at most maxKeys of them (none unless canCall: a call is in
// flight). With canCall, it evaluates the keys from *cursor on, in key
// hash order and wrapping around, until maxKeys are due; more reports
// that it stopped there, and *cursor is where the next evaluation starts.
// Every key's pool is read back, and its fallback minted, either way.
// Idle keys that hold nothing and owe nothing are forgotten (with
// canCall: no key of the last call is left to answer).
func (g *regional) tick(ctx context.Context, keys map[uint64]*regKey, upstreamOK, canCall bool, cursor *uint64) (calls []due, more bool) {
	s := g.s
	now := time.Now().UnixNano()
	set := s.st.Rules()
	pools := s.st.Pools(now)
	// From the cursor on, wrapping around.
	from := sort.Search(len(pools), func(i int) bool { return pools[i].Hash >= *cursor })
	pools = slices.Concat(pools[from:], pools[:from])
	var mints []state.UpstreamMint
	var forget []uint64
	views := make(map[uint64]keyView, len(pools))
	fallbackKeys := 0
	for _, p := range pools {
		rule := set.Match(p.Domain, p.Entries)
		if rule == nil || rule.Scope != rules.ScopeGlobal || rule.Backend != rules.BackendLease {
			continue // no longer global: its pool is not refilled
		}
		ur := upstream.RuleOf(rule, g.name)
		if gl := p.Global; gl != nil {
			// The global cluster's limit applies: it sizes the fallback
			// share (static_fraction of its rate) as it sizes the pool.
			ur.Rate, ur.Burst = float64(gl.RequestsPerUnit)/gl.Unit.Duration().Seconds(), gl.Burst
			g.noteMismatch(p, rule)
		}
		rk := keys[p.Hash]
		if rk == nil {
			k, err := upstream.NewKey(g.cfg, ur)
			if err != nil {
				s.log.Warn("global key skipped", "err", err)
				continue
			}
			share := p.Share
			if !upstreamOK && rule.GlobalFallback == rules.FallbackFairShare {
				// Without an upstream there is no share to fall to: the
				// region admits up to the rule's rate, as a regional rule.
				share = ur.Rate
			}
			k.Resume(p.Available, share, p.Owed)
			rk = &regKey{k: k}
			keys[p.Hash] = rk
		} else if err := rk.k.SetRule(ur); err != nil {
			s.log.Warn("global key's rule not applied", "err", err)
		}
		k := rk.k
		k.Sync(now, p.Available)
		// The pool cut a gateway's want: the region is short of tokens,
		// and what it sub-grants is no reading of its demand.
		k.Short(p.ShortAt)
		if canCall && !more && len(calls) == g.maxKeys {
			// No room left in this call: the next evaluation starts here.
			*cursor, more = p.Hash, true
		}
		if !canCall || more {
			// Left for the evaluation after the answer.
		} else if r, ok := k.Tick(now, p.Demand); ok {
			if upstreamOK {
				calls = append(calls, due{p: p, rk: rk, req: r})
			} else {
				_ = k.Failed(now, r.ID)
				if !rk.warned {
					rk.warned = true
					s.log.Warn("global key served from its fallback share: no global upstream",
						"key", redactKey(p.Key), "fallback", rule.GlobalFallback.String(),
						"tokens_per_second", k.Status().FallbackRt)
				}
			}
		}
		if n := k.Mint(now); n > 0 {
			mints = append(mints, state.UpstreamMint{Hash: p.Hash, Minted: n, Keep: keep(k, now, n, p.Debt, upstreamOK)})
			g.tokens.WithLabelValues("minted").Add(float64(n))
		}
		st := k.Status()
		// A key whose call is overdue is served from its fallback share
		// once spent, as a cut-off one is; the region is not cut off.
		if st.CutOff || st.Overdue || !upstreamOK {
			fallbackKeys++
		}
		views[p.Hash] = keyView{share: st.Share, fallback: st.FallbackRt, cutOff: st.CutOff || !upstreamOK, notLeased: rk.notLeased}
		if canCall && upstreamOK && forgettable(k, p, now) {
			forget = append(forget, p.Hash)
		}
	}
	g.fbKeys.Set(float64(fallbackKeys))
	if len(mints) > 0 {
		if err := g.commit(state.AppendUpstreamMint(nil, s.stamp(), mints)); err != nil && ctx.Err() == nil {
			s.log.Warn("fallback mint not committed", "err", err)
		}
	}
	if len(forget) > 0 {
		if err := g.commit(state.AppendUpstreamForget(nil, s.stamp(), forget)); err != nil && ctx.Err() == nil {
			s.log.Warn("idle global keys not forgotten", "keys", len(forget), "err", err)
		}
		for _, h := range forget {
			delete(views, h)
		}
	}
	// The keys whose pools are gone (forgotten, or no longer global):
	// a pool made again starts a new key from the ledger.
	for h := range keys {
		if _, ok := views[h]; !ok {
			delete(keys, h)
		}
	}
	g.mu.Lock()
	g.keys = views
	for h := range g.warned {
		if _, ok := views[h]; !ok {
			delete(g.warned, h)
		}
	}
	g.mu.Unlock()
	return calls, more
}

// forgettable reports whether the pool p of key k may be forgotten at
// now: the key is idle (upstream.Key.Idle) with no call in flight, and
// the pool holds nothing, owes no report, is owed no debt and no gateway
// holds an unexpired lease of it; the ledger checks the last three again
// when the forget applies. Its lease at the global cluster runs out
// unrefreshed: the region hands back what it held when the key turned
// idle, before it holds nothing.
func forgettable(k *upstream.Key, p state.Pool, now int64) bool {
	return k.Idle(now) && !k.Status().InFlight && p.Available == 0 && p.Owed == 0 && p.Debt == 0 && p.Leases == 0
}

// keep is what a mint of n keeps from the pool's debt for the gateways
// (upstream.Key.Keep). A region without an upstream pays its gateways'
// fallback admissions with all it mints: it has no grant to pay a debt
// out of later.
func keep(k *upstream.Key, now, n, debt int64, upstreamOK bool) int64 {
	if !upstreamOK {
		return 0
	}
	return k.Keep(now, n, debt)
}

// nextUpstreamSeq is the request id of the region's next upstream call,
// given the last one's and the leader's clock (Unix ns): the later of
// last+1 and the clock in microseconds. The global cluster answers a
// repeated id with its recorded answer to that id, whatever keys the call
// carries; ids that follow the clock keep rising past any the region sent
// before, even after it is restored from an older backup (whose ledger
// holds a lower last id), as long as its clock is not behind the time of
// its last call.
func nextUpstreamSeq(last uint64, nowNanos int64) uint64 {
	return max(last+1, uint64(max(nowNanos, 0)/1000))
}

// callResult is an upstream call and its outcome.
type callResult struct {
	seq  uint64
	due  []due
	req  *allotv1.AcquireRequest
	resp *allotv1.AcquireResponse
	err  error
}

// send commits the send of an upstream Acquire for the keys due (its
// request id and what it hands back) and returns the call to make.
func (g *regional) send(ctx context.Context, calls []due) (callResult, bool) {
	s := g.s
	last, _ := s.st.PendingUpstream()
	stamp := s.stamp()
	seq := nextUpstreamSeq(last, stamp)
	req, returns := g.request(seq, calls)
	res := callResult{seq: seq, due: calls, req: req}
	raw, err := proto.Marshal(req)
	if err == nil {
		err = g.commit(state.AppendUpstreamSend(nil, stamp, seq, raw, returns))
	}
	if err != nil {
		res.err = err
		g.failed(ctx, res)
		return res, false
	}
	for _, r := range returns {
		g.tokens.WithLabelValues("returned").Add(float64(r.Returned))
	}
	return res, true
}

// request is the upstream Acquire with request id seq for the keys due,
// and what it hands back and reports of each. The policy bounds every
// amount of a key (upstream.MaxWant); want adds the pool's debt, within
// the bound too.
func (g *regional) request(seq uint64, calls []due) (*allotv1.AcquireRequest, []state.UpstreamReturn) {
	req := &allotv1.AcquireRequest{AgentId: g.agent, RequestId: seq, Keys: make([]*allotv1.KeyAcquire, len(calls))}
	returns := make([]state.UpstreamReturn, len(calls))
	for i, c := range calls {
		ka := &allotv1.KeyAcquire{Domain: c.p.Domain, Entries: make([]*allotv1.Entry, len(c.p.Entries)),
			Want: min(c.req.Want+min(c.p.Debt, upstream.MaxWant), upstream.MaxWant), Held: c.req.Held, Returned: c.req.Returned,
			Demand: c.req.Demand, OutageCharged: c.req.OutageCharged, WantShare: true}
		for j, e := range c.p.Entries {
			ka.Entries[j] = &allotv1.Entry{Key: e.Key, Value: e.Value}
		}
		req.Keys[i] = ka
		returns[i] = state.UpstreamReturn{Hash: c.p.Hash, Returned: c.req.Returned, Charged: c.req.OutageCharged}
	}
	return req, returns
}

// failed ends a call that was not answered, or not made because the
// global allocator that answered the cycle check is a region or this
// cluster: its keys are cut off, and it is given up in the ledger, so
// that what it reported as outage_charged is owed again and goes with a
// later call. A call that reached the global cluster and whose answer
// was lost is then charged twice: the global bucket admits less, never
// more.
func (g *regional) failed(ctx context.Context, res callResult) {
	s := g.s
	now := time.Now().UnixNano()
	charges := make([]state.UpstreamReturn, len(res.due))
	for i, c := range res.due {
		_ = c.rk.k.Failed(now, c.req.ID)
		charges[i] = state.UpstreamReturn{Hash: c.p.Hash, Charged: c.req.OutageCharged}
	}
	entry := state.AppendUpstreamFail(nil, s.stamp(), res.seq, charges)
	if err := g.commitSettle(entry); err != nil {
		// Committed again before the next send (settle); a next leader
		// makes the call again (recover).
		g.unsettled = entry
		if ctx.Err() == nil {
			s.log.Warn("failed upstream call not given up in the ledger", "seq", res.seq, "err", err)
		}
	}
	result, st := "error", "cut_off"
	if errors.Is(res.err, errCycle) {
		result, st = "cycle", "cycle"
	}
	g.calls.WithLabelValues(result).Inc()
	g.setState(st, res.err)
	g.mu.Lock()
	for _, c := range res.due {
		v := g.keys[c.p.Hash]
		v.cutOff = true
		g.keys[c.p.Hash] = v
	}
	g.mu.Unlock()
}

// finish applies an upstream call's outcome: the grant goes into the
// ledger (which takes it only if it still answers the pending send), then
// into each key's policy.
func (g *regional) finish(ctx context.Context, res callResult) {
	s := g.s
	var gs []*allotv1.KeyGrant
	if res.err == nil {
		gs, res.err = allotv1.GrantsOf(res.resp)
	}
	if res.err == nil && len(gs) != len(res.due) {
		res.err = fmt.Errorf("allocator: the global cluster answered %d grants for %d keys", len(gs), len(res.due))
	}
	if res.err != nil {
		if ctx.Err() == nil {
			g.failed(ctx, res)
		}
		return
	}
	now := time.Now().UnixNano()
	grants := make([]state.UpstreamGrant, len(res.due))
	for i, c := range res.due {
		gr := gs[i]
		g.checkLeased(c, gr.GetStatus())
		if moved(gr) {
			// The global cluster did not serve the key (its slot is
			// moving between groups): nothing granted, nothing charged.
			// As for a failed call, the key's outage charge is owed
			// again, in the policy and in the ledger, and a later call
			// reports it; the key is served from what it holds, then
			// from its fallback share, until a call is answered.
			_ = c.rk.k.Failed(now, c.req.ID)
			grants[i] = state.UpstreamGrant{Hash: c.p.Hash, Share: c.rk.k.Status().Share, Owed: c.req.OutageCharged}
			continue
		}
		// A reply after the key's CallTimeout is stale to the policy; the
		// ledger still takes the grant, and the next Sync reads it. The
		// policy owes the call's outage charge again (it failed the
		// call) and reports it twice: the safe direction.
		_ = c.rk.k.Granted(now, upstream.Grant{ID: c.req.ID, Granted: gr.GetGranted(),
			RefreshAfter: time.Duration(gr.GetRefreshAfterMs()) * time.Millisecond, Share: gr.GetShare(), HasShare: gr.Share != nil})
		grants[i] = state.UpstreamGrant{Hash: c.p.Hash, Granted: gr.GetGranted(), Share: c.rk.k.Status().Share,
			Limit: globalLimitOf(gr, res.resp.GetRulesVersion())}
		g.tokens.WithLabelValues("received").Add(float64(gr.GetGranted()))
	}
	g.calls.WithLabelValues("ok").Inc()
	g.setState("connected", nil)
	entry := state.AppendUpstreamGrant(nil, s.stamp(), res.seq, grants)
	if err := g.commitSettle(entry); err != nil {
		// Committed again before the next send (settle); a next leader
		// makes the call again (recover).
		g.unsettled = entry
		if ctx.Err() == nil {
			s.log.Warn("upstream grant not committed", "seq", res.seq, "err", err)
		}
	}
}

// moved reports whether the global cluster answered a key without serving
// it: a cluster of several groups answers KEY_STATUS_MOVED for a key whose
// slot is moving between groups (or that the addressed group does not
// own), with nothing granted, handed back or charged.
func moved(gr *allotv1.KeyGrant) bool {
	return gr.GetStatus() == allotv1.KeyStatus_KEY_STATUS_MOVED
}

// settle commits the entry that settles the last call (unsettled) if its
// commit failed, and reports whether the runner may send: nothing is left
// to settle.
func (g *regional) settle(ctx context.Context) bool {
	if g.unsettled == nil {
		return true
	}
	if err := g.commitSettle(g.unsettled); err != nil {
		if ctx.Err() == nil {
			g.s.log.Warn("upstream call not settled in the ledger; no new call until it is", "err", err)
		}
		return false
	}
	g.unsettled = nil
	return true
}

// commitSettle commits an entry that settles a call (settleCommit).
func (g *regional) commitSettle(data []byte) error {
	if g.settleCommit != nil {
		return g.settleCommit(data)
	}
	return g.commit(data)
}

// globalLimitOf is the global cluster's limit of a key as its grant
// carries it, for the ledger (nil: the grant carries none the region can
// apply, or the global cluster does not lease the key).
func globalLimitOf(gr *allotv1.KeyGrant, rulesVersion uint64) *state.GlobalLimit {
	switch gr.GetStatus() {
	case allotv1.KeyStatus_KEY_STATUS_OK, allotv1.KeyStatus_KEY_STATUS_EXHAUSTED:
	default:
		return nil
	}
	l, ok := state.GlobalLimitOf(gr.GetLimit(), rulesVersion)
	if !ok {
		return nil
	}
	return &l
}

// checkLeased notes a global key the global cluster does not lease (no
// rule there, unlimited, or another backend): the region receives
// nothing for it.
func (g *regional) checkLeased(c due, st allotv1.KeyStatus) {
	rk := c.rk
	switch st {
	case allotv1.KeyStatus_KEY_STATUS_NO_RULE, allotv1.KeyStatus_KEY_STATUS_NOT_LEASED, allotv1.KeyStatus_KEY_STATUS_UNLIMITED:
		if rk.notLeased == "" {
			g.s.log.Warn("the global cluster does not lease this global key; the region receives nothing for it",
				"key", redactKey(c.p.Key), "status", st.String())
		}
		rk.notLeased = st.String()
	default:
		rk.notLeased = ""
	}
}

// noteMismatch logs, once per global limit, a global key whose rule in
// the region differs from the global cluster's (whose limit applies).
func (g *regional) noteMismatch(p state.Pool, rule *rules.Rule) {
	if p.Global.Same(rule) {
		return
	}
	g.mu.Lock()
	last, seen := g.warned[p.Hash]
	if !seen || last != *p.Global {
		if g.warned == nil {
			g.warned = map[uint64]state.GlobalLimit{}
		}
		g.warned[p.Hash] = *p.Global
	}
	g.mu.Unlock()
	if seen && last == *p.Global {
		return
	}
	gl := p.Global
	g.s.log.Warn("global key's rule in this region differs from the global cluster's; the global cluster's limit applies",
		"key", redactKey(p.Key), "region_requests_per_unit", rule.RequestsPerUnit, "region_unit", rule.Unit.String(),
		"region_burst", rule.Burst, "global_requests_per_unit", gl.RequestsPerUnit, "global_unit", gl.Unit.String(),
		"global_burst", gl.Burst, "global_rules_version", gl.RulesVersion)
}

// acquire sends req to the global cluster: to the allocator that answered
// last, then to the others, within the policy's CallTimeout. Followers
// forward to their leader; a repeated request id is answered with the
// recorded answer, so trying another address is safe.
func (g *regional) acquire(term context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	timeout := g.cfg.CallTimeout
	if timeout <= 0 {
		timeout = upstream.DefaultConfig().CallTimeout
	}
	ctx, cancel := context.WithTimeout(term, timeout)
	defer cancel()
	var errs []error
	var tried []string
	for i := range g.addrs {
		addr := g.addrs[(g.good()+i)%len(g.addrs)]
		cc, err := g.s.up.conn(addr)
		if err == nil {
			var resp *allotv1.AcquireResponse
			resp, err = allotv1.NewAllocatorClient(cc).Acquire(ctx, req)
			if err == nil {
				g.setGood((g.good() + i) % len(g.addrs))
				g.refused.ok(addr)
				return resp, nil
			}
		}
		errs, tried = append(errs, err), append(tried, addr)
		if ctx.Err() != nil {
			break
		}
	}
	// Every address failed: name a refusal of this node's certificate
	// (tlsrefusal.go) only now, so that probing delays no other address.
	for i, err := range errs {
		errs[i] = fmt.Errorf("%s: %w", tried[i], g.refused.explain(term, g.s, tried[i], err))
	}
	return nil, errors.Join(errs...)
}

// good is the index of the global allocator that answered last (guarded
// by mu).
func (g *regional) good() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.goodIdx
}

func (g *regional) setGood(i int) {
	g.mu.Lock()
	g.goodIdx = i
	g.mu.Unlock()
}

// commit proposes an upstream entry; a grant that no longer answers the
// pending send is not an error (the ledger ignored it).
func (g *regional) commit(data []byte) error {
	_, err := g.s.proposeData(data)
	return err
}

// status fills a ClusterStatus answer: the region, its upstream and the
// global keys it holds (from the ledger, with the runner's view on the
// leader).
func (g *regional) status(resp *allotv1.ClusterStatusResponse, redact bool) {
	if g == nil {
		return
	}
	resp.Region = g.name
	g.mu.Lock()
	u := &allotv1.UpstreamStatus{Addrs: g.addrs, State: g.state, SinceUnixMs: g.since.UnixMilli(), AgentId: g.agent, Error: g.err}
	views := g.keys
	g.mu.Unlock()
	set := g.s.st.Rules()
	for _, p := range g.s.st.Pools(time.Now().UnixNano()) {
		k := g.held(set, p, views[p.Hash])
		if redact {
			k.Key = redactKey(k.Key)
		}
		u.Keys = append(u.Keys, k)
	}
	resp.Upstream = u
}

// held is a pool as GlobalKeyHeld: with the region's copy of the rule
// (set's), the limit in force (the global cluster's, once recorded) and
// whether they differ.
func (g *regional) held(set *rules.Set, p state.Pool, v keyView) *allotv1.GlobalKeyHeld {
	k := &allotv1.GlobalKeyHeld{Key: p.Key, Available: p.Available, Demand: p.Demand, Share: v.share,
		FallbackRate: v.fallback, Received: p.Received, Returned: p.Returned, Minted: p.Minted,
		CutOff: v.cutOff, Debt: p.Debt, GlobalStatus: v.notLeased, RuleMismatch: v.notLeased != ""}
	rule := set.Match(p.Domain, p.Entries)
	base := rulespb.Limit(rule)
	k.RegionLimit = base
	if p.Global != nil {
		if base == nil {
			base = &allotv1.Limit{}
		}
		k.Limit = p.Global.Msg(base)
		k.GlobalRulesVersion = p.Global.RulesVersion
		k.RuleMismatch = k.RuleMismatch || !p.Global.Same(rule)
	}
	return k
}

// inspect adds both levels to an InspectKey answer for a global key on a
// region: what the region holds, and the global cluster's view of the key
// (its bucket and each region's lease).
func (g *regional) inspect(ctx context.Context, req *allotv1.InspectKeyRequest, resp *allotv1.InspectKeyResponse) {
	if g == nil || resp.GetKey() == "" {
		return
	}
	h := xxhash.Sum64String(resp.GetKey())
	p, ok := g.s.st.PoolOf(h, time.Now().UnixNano())
	if !ok {
		return
	}
	g.mu.Lock()
	v := g.keys[h]
	g.mu.Unlock()
	resp.Pool = g.held(g.s.st.Rules(), p, v)
	if len(g.addrs) == 0 {
		resp.GlobalError = "no -global-allocators"
		return
	}
	var errs []error
	for _, addr := range g.addrs {
		cc, err := g.s.up.conn(addr)
		if err == nil {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			var gr *allotv1.InspectKeyResponse
			gr, err = allotv1.NewAdminClient(cc).InspectKey(g.s.withJoinToken(cctx), req)
			cancel()
			if err == nil {
				resp.Global = gr
				return
			}
		}
		errs = append(errs, fmt.Errorf("%s: %w", addr, err))
	}
	resp.GlobalError = errors.Join(errs...).Error()
}
