package agent

import (
	"context"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The refill loop is the driver of the refill policy (policy.Core): at
// each tick it reads what the check path published of the keys that need
// it, asks the core which keys go to the allocator and what each asks for,
// moves the tokens between the keys' counters accordingly, sends the
// batches (send.go) and feeds the answers back to the core. Which keys a
// scan visits is the business of due.go.

// maxWant is the allocator's bound on want (and on returned and charged).
const maxWant = policy.MaxWant

// refiller is the refill loop's state. It is owned by the refill goroutine
// (and by Close once that goroutine has stopped): no locks.
type refiller struct {
	core    *policy.Core
	unacked *batch // sent and not acknowledged: retried with the same id first
	addr    int    // index of the allocator to call
	pick    []*keyState
	// awake are the keys every scan visits; the others sleep in due
	// until a deadline or a check wakes them (see due.go).
	awake      []*keyState
	due        dueHeap
	hot        hotHeap
	wokenSpare []*keyState
	// scans since the oldest sleeping key with demand fell asleep (see
	// refiller.decay); scanSeq numbers them, scans[0] is scanBase.
	scans             []scanRec
	scanSeq, scanBase uint64
	decayHorizon      int64 // the longest decayTime so far
	tracked           int   // keys in the table the loop has seen (allot_agent_keys)
	// alwaysAwake, for tests, keeps every key awake: every scan visits
	// every key, as a scan of the whole table would.
	alwaysAwake bool
	fbKeys      int  // keys decided by their fallback bucket between the last two scans
	packedKeys  bool // the last answer said the allocator reads packed keys
	// lastCall is the loop time of the last Acquire sent (0: none yet).
	lastCall int64
}

// presenceEvery is how often an agent with the Redis backend that has
// nothing else to send calls the allocator with an empty Acquire (see
// presenceDue).
const presenceEvery = 30 * time.Second

// presenceDue reports whether the agent should send an empty Acquire to
// stay counted among the live gateways and learn their number: it talks
// to an allocator and has the Redis backend, whose rules it decides
// without one. Failing open on a Redis rule it decides from its R/N share,
// N being the live gateways the allocator counts (decide), and a gateway
// whose traffic is all on Redis rules would otherwise never call: its N
// would stay 1, and the other gateways' would not count it. Every
// presenceEvery keeps it well inside the allocator's agent TTL (2 minutes
// by default).
func (a *Agent) presenceDue(now int64) bool {
	return a.redis != nil && !a.standalone && (a.rf.lastCall == 0 || now-a.rf.lastCall >= int64(presenceEvery))
}

// batch is one Acquire request and the key states its entries belong to.
type batch struct {
	req       *allotv1.AcquireRequest
	keys      []*keyState
	spent     []int64 // ks.spent when built (becomes SpentAtAcq on success)
	denied    []int64
	lent      []int64 // a first use's charge, lent by the fallback bucket (see policy.FirstUse)
	firstSent int64   // Unix nanos of the first attempt: leases are measured from it
	// sentID is the request id of the last attempt, and retried whether
	// the answer being applied is to a second attempt under that id.
	sentID  uint64
	retried bool
	// reportsShort: a pending static report had no room in this call
	// (see buildReports).
	reportsShort bool
}

func (a *Agent) refillLoop() {
	t := time.NewTicker(a.cfg.RefillInterval)
	defer t.Stop()
	for {
		select {
		case <-a.stop:
			return
		case <-t.C:
			a.refillOnce(a.ctx)
		}
	}
}

// refillOnce is one tick of the refill loop: a periodic scan of the keys
// that need it (see due.go), then (allocator permitting) the queued and
// picked keys sent in batches.
func (a *Agent) refillOnce(ctx context.Context) {
	now := a.loopNow()
	rf := &a.rf
	rf.pick = rf.pick[:0]
	if scan, dt, alpha := rf.core.Tick(now); scan {
		a.scan(now, dt, alpha)
	}
	if a.standalone {
		return
	}
	if !rf.core.MaySend(now) {
		// Waiting to probe, or backing off an overloaded allocator:
		// leave the queued keys for later, and release the ones the scan
		// picked (the next scan finds them again).
		a.unpick()
		return
	}
	if rf.unacked != nil && !a.send(ctx, rf.unacked) {
		a.unpick()
		return
	}
	a.drainPending(now)
	if len(rf.pick) == 0 {
		if rf.core.Probing() || a.staticRenew(now) || a.presenceDue(now) {
			// Probe with an empty Acquire: nothing needs the allocator,
			// but the breaker must learn whether it is back; or renew
			// the static shares' permission (static.go); or stay
			// counted among the live gateways (presenceDue).
			a.send(ctx, a.build(now, nil))
		}
		return
	}
	if a.cfg.driven {
		// The scan walks Go maps, whose order is random: a driven agent
		// sends its keys in key order, so that how they are split into
		// batches is a function of its inputs.
		slices.SortFunc(rf.pick, func(x, y *keyState) int { return strings.Compare(x.key, y.key) })
	}
	policy.SortPicks(rf.pick, keyOfState)
	if t := a.rt.topo.Load(); t != nil {
		// Several groups: one call per group, to its leader (groups.go).
		if i, ok := a.sendGroups(ctx, now, t, a.splitByGroup(t, rf.pick)); !ok {
			rf.pick = append(rf.pick[:0], rf.pick[i:]...)
			a.unpick()
			return
		}
		clear(rf.pick)
		rf.pick = rf.pick[:0]
		return
	}
	short := false
	for i := 0; i < len(rf.pick); {
		n := policy.BatchLen(rf.pick[i:], keyOfState, maxBatchKeys)
		b := a.build(now, rf.pick[i:i+n])
		short = short || b.reportsShort
		i += n
		if !a.send(ctx, b) {
			rf.pick = append(rf.pick[:0], rf.pick[i:]...)
			a.unpick()
			return
		}
	}
	clear(rf.pick)
	rf.pick = rf.pick[:0]
	if short && len(a.ss.reports) > 0 {
		// The keys left no room for some static reports, which hold
		// back the calls' acknowledgement of the hot-key set: a call
		// without keys carries them.
		a.send(ctx, a.build(now, nil))
	}
}

// keyOfState is ks's refill policy state.
func keyOfState(ks *keyState) *policy.Key { return &ks.Key }

// unpick releases picked keys that were not sent.
func (a *Agent) unpick() {
	for _, ks := range a.rf.pick {
		ks.Inflight = false
		a.rf.awaken(ks)
	}
	a.rf.pick = a.rf.pick[:0]
}

// drainPending moves the keys queued by checks into the pick list.
func (a *Agent) drainPending(now int64) {
	for {
		select {
		case ks := <-a.pending:
			ks.queued.Store(false)
			if ks.dropped.Load() {
				continue // a check's hand-over that raced with the drop: nothing to ask for
			}
			if o := ks.obs(); a.rf.core.Queued(&ks.Key, &o, now) {
				a.rf.awaken(ks)
				a.rf.pick = append(a.rf.pick, ks)
			}
		default:
			return
		}
	}
}

// scan visits the awake keys (see due.go): the core updates their demand
// EWMAs and picks the keys that need the allocator; the keys it finds idle
// and owing nothing are forgotten, those at rest sleep until their next
// deadline.
func (a *Agent) scan(now int64, dt, alpha float64) {
	rf := &a.rf
	a.collect(now, dt)
	if dt > 0 {
		rf.record(now, dt, alpha)
	}
	rf.core.Keys = rf.tracked
	fbKeys := 0
	var idle []*keyState
	awake := rf.awake[:0]
	for _, ks := range rf.awake {
		if ks.sWait && a.tryStatic(ks, now) {
			ks.sWait = false
		}
		o := ks.obs()
		v := rf.core.Visit(&ks.Key, &o, now, dt, alpha)
		if ks.fbUsed.Load() {
			ks.fbUsed.Store(false)
			fbKeys++
		}
		switch {
		case v == policy.Pick:
			rf.pick = append(rf.pick, ks)
		case v == policy.Promote:
			a.handOver(ks)
			rf.pick = append(rf.pick, ks)
		case v == policy.Forget:
			idle = append(idle, ks)
			continue
		case v == policy.Rest && a.sleep(ks, &o, now):
			continue
		}
		awake = append(awake, ks)
	}
	clear(rf.awake[len(awake):])
	rf.awake = awake
	for _, ks := range idle {
		keep := func(ks *keyState) bool { o := ks.obs(); return !rf.core.Forgettable(&ks.Key, &o, now) }
		if a.keys.shard(ks.hash).remove(ks, keep) {
			if t := ks.outage.Load(); t > 0 && rf.core.OverKeys() {
				// Forgiven: the table was over MaxOutageKeys (policy.Core.Forgettable).
				a.met.outageForgiven.Add(float64(t))
			}
			ks.awake = false
			rf.tracked--
			if ks.staticable {
				a.ss.remove(ks)
			}
		} else {
			rf.awake = append(rf.awake, ks)
		}
	}
	a.met.keys.Set(float64(rf.tracked))
	a.met.staticKeys.Set(float64(a.ss.keys.Load()))
	rf.fbKeys = fbKeys
	a.met.fallbackKeys.Set(float64(fbKeys))
}

// build makes the Acquire for keys, moving their charges and returned
// balances out of the check path's reach (the batch owns them until the
// allocator acknowledges or rejects it). It takes the next request id.
// The call is addressed to no group.
func (a *Agent) build(now int64, keys []*keyState) *batch {
	return a.buildFor(now, keys, a.rt.topo.Load(), 0, false)
}

// buildFor is build for a call of topology t, addressed to group when
// addressed.
// After the keys' entries come the pending static reports (buildReports):
// entries past len(b.keys) are reports of keys not in the call.
func (a *Agent) buildFor(now int64, keys []*keyState, t *topology, group slots.GroupID, addressed bool) *batch {
	rf := &a.rf
	b := &batch{
		req: &allotv1.AcquireRequest{
			AgentId:      a.cfg.ID,
			RequestId:    rf.core.NextID(),
			Keys:         make([]*allotv1.KeyAcquire, 0, len(keys)),
			FallbackKeys: uint32(min(rf.fbKeys, math.MaxUint32)),
			PackedGrants: true,
			StaticShares: a.staticAllowed(),
		},
		keys:   append([]*keyState(nil), keys...),
		spent:  make([]int64, len(keys)),
		denied: make([]int64, len(keys)),
		lent:   make([]int64, len(keys)),
	}
	if s := a.rules.Load(); s != nil && a.rulesFromAllocator.Load() {
		b.req.RulesVersion = s.Version()
	}
	for i, ks := range b.keys {
		if now >= ks.expiry.Load() {
			ks.balance.Store(0) // an expired lease's tokens are gone
		}
		promote, left := a.staticPlan(ks, now)
		o := ks.obs()
		o.Charged = sendable(&ks.charged)
		o.Outage = sendable(&ks.outage)
		p := rf.core.Plan(&ks.Key, &o, now, ks.thinShare)
		var returned, want int64
		switch p.Entry {
		case policy.HandBack:
			returned = ks.balance.Swap(0)
		case policy.Lend:
			b.lent[i] = o.Charged // want 0: see policy.FirstUse
		case policy.Refill:
			ks.lowWater.Store(p.LowWater)
			if now < o.Expiry {
				returned = returnExcess(&ks.balance, p.Target)
			}
			want = policy.WantOf(p.Target, ks.balance.Load())
		}
		b.spent[i] = ks.spent.Load()
		b.denied[i] = ks.denied.Load()
		b.req.Keys = append(b.req.Keys, &allotv1.KeyAcquire{
			Domain:        ks.domain,
			Entries:       toProtoEntries(ks.entries),
			Want:          want,
			Held:          min(max(ks.balance.Load(), 0), maxWant),
			Returned:      min(returned, maxWant),
			Charged:       o.Charged,
			OutageCharged: o.Outage,
			Demand:        min(p.Demand, maxWant),
			Denied:        min(max(b.denied[i]-ks.DeniedSent, 0), maxWant),
			Promote:       promote,
			StaticLeft:    left,
		})
		if promote {
			a.met.staticPromotions.Inc()
		}
	}
	if addressed {
		b.req.Group = uint32(group)
		b.req.TopologyVersion = t.version
	}
	if b.req.StaticShares {
		a.buildReports(b, t, group, addressed, now)
	}
	return b
}

// handOver marks a static key the scan picked for promotion (its demand
// passed half its share's rate): the next build promotes it.
func (a *Agent) handOver(ks *keyState) {
	ks.mu.Lock()
	if ks.smode.Load() == staticOn {
		ks.smode.Store(staticPromote)
	}
	ks.mu.Unlock()
}

func toProtoEntries(es []rules.Entry) []*allotv1.Entry {
	out := make([]*allotv1.Entry, len(es))
	for i, e := range es {
		out[i] = &allotv1.Entry{Key: e.Key, Value: e.Value}
	}
	return out
}
