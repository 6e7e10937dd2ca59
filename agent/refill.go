package agent

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/breaker"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const (
	// demandTau is the time constant of the per-key demand EWMA.
	demandTau = time.Second
	// leaseHorizon is the period a want is sized for: one refresh interval
	// of demand, the allocator's default RefreshInterval (docs/leases.md:
	// want = demand × F, plus the low watermark, minus what is held).
	leaseHorizon = time.Second
	// minRateWindow keeps a fresh key's demand estimate from overshooting:
	// tokens seen since the previous scan are spread over at least this.
	minRateWindow = 250 * time.Millisecond
	// notLeasedRetry: how long a key the allocator does not lease (NO_RULE,
	// UNLIMITED, NOT_LEASED: a rules version skew) waits before asking again.
	notLeasedRetry = 5 * time.Second
	// maxLeaseMargin caps the safety margin taken off each lease's TTL.
	maxLeaseMargin = 250 * time.Millisecond
)

// refiller is the refill loop's state. It is owned by the refill goroutine
// (and by Close once that goroutine has stopped): no locks.
type refiller struct {
	nextID   uint64           // next request id; ids increase strictly per agent ID
	unacked  *batch           // sent and not acknowledged: retried with the same id first
	addr     int              // index of the allocator to call
	br       *breaker.Breaker // consecutive failed calls; open: wait for the next probe
	lastScan int64
	latency  float64 // EWMA of Acquire round trips, seconds
	// latencyMax is the largest latency so far: sleeping keys wake in
	// time for a renewal whatever the estimate does (see restUntil).
	latencyMax float64
	pick       []*keyState
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
	fbKeys      int // keys decided by their fallback bucket between the last two scans
	// The allocator refused the last call as overloaded (ResourceExhausted:
	// refused before any work, so not applied): wait until throttledUntil,
	// then retry the same batch. It is not a failure: the breaker stays
	// closed and leases keep being spent.
	throttledUntil int64
	throttle       time.Duration
}

// batch is one Acquire request and the key states its entries belong to.
type batch struct {
	req       *allotv1.AcquireRequest
	keys      []*keyState
	spent     []int64 // ks.spent when built (becomes spentAtAcq on success)
	denied    []int64
	lent      []int64 // a first use's charge, lent by the fallback bucket (see firstUse)
	firstSent int64   // Unix nanos of the first attempt: leases are measured from it
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

// refillOnce is one tick of the refill loop: a periodic scan of every key,
// then (allocator permitting) the queued and selected keys sent in batches.
func (a *Agent) refillOnce(ctx context.Context) {
	now := a.now()
	rf := &a.rf
	rf.pick = rf.pick[:0]
	if rf.lastScan == 0 || now-rf.lastScan >= int64(a.cfg.ScanInterval) || now < rf.lastScan {
		a.scan(now)
	}
	if a.standalone {
		return
	}
	if !rf.br.Allow(now) {
		// Waiting to probe: leave the queued keys for later, and release
		// the ones the scan picked (the next scan finds them again).
		a.unpick()
		return
	}
	if now < rf.throttledUntil {
		a.unpick()
		return
	}
	if rf.unacked != nil {
		if !a.send(ctx, rf.unacked) {
			a.unpick()
			return
		}
	}
	a.drainPending(now)
	if len(rf.pick) == 0 {
		if rf.br.Open() {
			// Probe with an empty Acquire: nothing needs the allocator,
			// but the breaker must learn whether it is back.
			a.send(ctx, a.build(now, nil))
		}
		return
	}
	if a.cfg.Manual {
		// The scan walks Go maps, whose order is random: a Manual agent
		// sends its keys in key order, so that how they are split into
		// batches is a function of its inputs.
		slices.SortFunc(rf.pick, func(x, y *keyState) int { return strings.Compare(x.key, y.key) })
	}
	// Keys from a rejected batch go alone, so that one key the allocator
	// refuses cannot hold back the others.
	slices.SortStableFunc(rf.pick, func(x, y *keyState) int {
		switch {
		case x.suspect == y.suspect:
			return 0
		case y.suspect:
			return -1
		}
		return 1
	})
	for i := 0; i < len(rf.pick); {
		n := 1
		for i+n < len(rf.pick) && n < maxBatchKeys && !rf.pick[i+n].suspect {
			n++
		}
		b := a.build(now, rf.pick[i:i+n])
		i += n
		if !a.send(ctx, b) {
			rf.pick = append(rf.pick[:0], rf.pick[i:]...)
			a.unpick()
			return
		}
	}
	clear(rf.pick)
	rf.pick = rf.pick[:0]
}

// unpick releases picked keys that were not sent.
func (a *Agent) unpick() {
	for _, ks := range a.rf.pick {
		ks.inflight = false
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
			if ks.inflight || ks.local.Load() || now < ks.holdUntil || ks.paced && now < ks.refreshAt {
				continue // a paced key is sent by the scan at its time
			}
			if ks.charged.Load() <= 0 && (now < ks.deniedUntil.Load() || ks.notLeased.Load() && now < ks.retryAt) {
				continue // nothing to report, and asking again is pointless yet
			}
			ks.inflight = true
			a.rf.awaken(ks)
			a.rf.pick = append(a.rf.pick, ks)
		default:
			return
		}
	}
}

// scan visits the awake keys (see due.go): updates their demand EWMAs,
// picks the keys that need the allocator, forgets idle keys that owe
// nothing, and puts the keys at rest to sleep until their next deadline.
func (a *Agent) scan(now int64) {
	rf := &a.rf
	var dt float64
	if rf.lastScan != 0 && now > rf.lastScan {
		dt = float64(now-rf.lastScan) / float64(time.Second)
	}
	alpha := 0.0
	if dt > 0 {
		alpha = 1 - math.Exp(-dt/demandTau.Seconds())
	}
	rf.lastScan = now
	a.collect(now, dt)
	if dt > 0 {
		rf.record(now, dt, alpha)
	}
	fbKeys := 0
	var idle []*keyState
	awake := rf.awake[:0]
	for _, ks := range rf.awake {
		r := readRest(ks)
		s, seen := r.spent, ks.spentSeen
		fell := false
		if dt > 0 {
			delta := max(s-ks.spentSeen, 0)
			// While requests are denied, a fall in what a scan admits
			// is the limiter's doing, not the traffic's (a key over its
			// limit waits for its next grant): it is left to the EWMA.
			fell = r.denied == ks.deniedSent && demandFell(ks.demand, delta, dt)
			if fell {
				ks.demand = float64(delta) / dt
			} else {
				ks.demand += alpha * (float64(delta)/dt - ks.demand)
			}
			if ks.demand < 1e-3 {
				ks.demand = 0
			}
			if delta > 0 {
				if ks.activeAt != 0 && now > ks.activeAt {
					ks.gap = gapAvg(ks.gap, now-ks.activeAt, delta)
				}
				ks.activeAt = now
			}
		}
		ks.spentSeen = s
		if ks.fbUsed.Load() {
			ks.fbUsed.Store(false)
			fbKeys++
		}
		if r.local {
			if now-r.lastUse >= int64(a.cfg.IdleTimeout) {
				idle = append(idle, ks)
				continue
			}
		} else {
			if !a.standalone && !ks.inflight && (fell && a.reportFall(ks, now) || a.needsAcquire(ks, now)) {
				ks.inflight = true
				rf.pick = append(rf.pick, ks)
				awake = append(awake, ks)
				continue
			}
			if a.forgettable(ks, now) {
				idle = append(idle, ks)
				continue
			}
		}
		if !ks.inflight && s == seen && a.sleep(ks, r, now) {
			continue
		}
		awake = append(awake, ks)
	}
	clear(rf.awake[len(awake):])
	rf.awake = awake
	for _, ks := range idle {
		if a.keys.shard(ks.hash).remove(ks, func(ks *keyState) bool { return !a.forgettable(ks, now) }) {
			ks.awake = false
			rf.tracked--
		} else {
			rf.awake = append(rf.awake, ks)
		}
	}
	a.met.keys.Set(float64(rf.tracked))
	rf.fbKeys = fbKeys
	a.met.fallbackKeys.Set(float64(fbKeys))
}

// Demand falls. A load balancer that moves a key's traffic from one
// gateway to another leaves the first holding about a second of its old
// rate, and an EWMA with a 1 s time constant takes 0.7 s to halve.
// Meanwhile the gateway asks for nothing, and the allocator weighs its old
// demand against the gateway the traffic went to, whose allowance then
// falls short of its new rate (bench/load -workload skew: the false
// rejects were the first second after each switch). So a scan whose count
// leaves no doubt that the rate fell by more than shiftFactor sets the
// demand to the scan's rate, and the key is reported at once
// (reportFall), its excess holding returned. A rise is left to the EWMA
// and the recent rate (demandOf): a key whose grants come in bursts (paced,
// or over its limit) admits at its full offered rate right after each
// grant, and taking such a scan's rate as its demand overstated it
// (bench/sim hot-key: 0% → 0.78% false rejects).
const (
	// shiftFactor: the rate over one scan must be this many times below
	// the EWMA.
	shiftFactor = 4
	// shiftMinTokens: the EWMA's expected count over the scan must be at
	// least this, so that a Poisson key's noise never reads as a fall:
	// P(X ≤ 10 | mean 40) ≈ 2·10⁻⁸.
	shiftMinTokens = 40
)

// demandFell reports whether a scan that counted delta tokens over dt
// seconds, for a key whose demand EWMA is d, shows the key's rate fell:
// the scan's count is at most 1/shiftFactor of the expected d·dt, and that
// is at least shiftMinTokens.
func demandFell(d float64, delta int64, dt float64) bool {
	expected := d * dt
	return expected >= shiftMinTokens && float64(delta)*shiftFactor <= expected
}

// reportFall decides whether a key whose demand the scan just lowered is
// sent now rather than at its next refill: when it holds a live lease and
// more than its new target (it would ask for nothing while it spends that,
// up to a second at its old rate, and the allocator would weigh its old
// demand against the others' until then).
func (a *Agent) reportFall(ks *keyState, now int64) bool {
	if now < ks.holdUntil || ks.notLeased.Load() || !ks.leased.Load() || now >= ks.expiry.Load() {
		return false
	}
	return ks.balance.Load() > wantFor(ks.demand, a.cfg.RefillInterval, a.rf.latency)
}

// excessOf returns what a key holding bal tokens against a target of
// target hands back: the holding beyond twice its target, down to the
// target, when that is at least shiftMinTokens (a few tokens beyond are not
// worth the churn). A gateway whose load balancer moved the key's traffic
// away holds up to a second of its old rate; that holding counts in the
// other agents' hold caps on the key and would take ten seconds or more to
// spend at its new rate.
func excessOf(bal, target int64) int64 {
	if bal <= 2*target || bal-target < shiftMinTokens {
		return 0
	}
	return bal - target
}

// forgettable: idle for IdleTimeout and owing nothing (checked again under
// the shard's write lock before the key is dropped).
func (a *Agent) forgettable(ks *keyState, now int64) bool {
	if ks.inflight || ks.queued.Load() || now-ks.lastUse.Load() < int64(a.cfg.IdleTimeout) {
		return false
	}
	if ks.local.Load() || ks.refused() {
		return true
	}
	return ks.charged.Load() <= 0 && (ks.balance.Load() == 0 || now >= ks.expiry.Load())
}

// renewMargin is how long before a lease's expiry the loop renews it: two
// ticks plus the round trip.
func (a *Agent) renewMargin() int64 {
	return int64(2*a.cfg.RefillInterval) + int64(a.rf.latency*float64(time.Second))
}

// needsAcquire decides whether the scan sends ks now.
func (a *Agent) needsAcquire(ks *keyState, now int64) bool {
	if now < ks.holdUntil {
		return false
	}
	exp := ks.expiry.Load()
	if ks.paced && now < ks.refreshAt && now < exp-a.renewMargin() {
		return false // its share is spent: ask at the paced time, charges included
	}
	if ks.charged.Load() > 0 {
		return true
	}
	active := ks.spent.Load() != ks.spentAtAcq || ks.denied.Load() != ks.deniedSent
	if ks.notLeased.Load() {
		return active && now >= ks.retryAt
	}
	if now < ks.deniedUntil.Load() && !ks.paced {
		return false
	}
	if !ks.leased.Load() || now >= exp {
		return active
	}
	bal := ks.balance.Load()
	idle := now-ks.lastUse.Load() >= int64(a.cfg.IdleTimeout)
	switch {
	case idle:
		return bal > 0 // hand it back
	case now >= exp-a.renewMargin():
		return active || bal > 0 // renew, or hand back before it is lost
	case !active:
		return false
	case bal < ks.lowWater.Load(), now >= ks.refreshAt:
		return true
	}
	return false
}

// demandOf estimates ks's tokens/s: the EWMA, or the rate since the last
// scan when that is higher (a key that just woke up).
//
// A sparse key (under sparseTokens per lease horizon) that has been used
// before reports at most its rate from the smoothed gaps between uses: one
// token every 4 s is 0.25/s, where one token since the last scan read as
// 4/s, and the EWMA (time constant 1 s) jumps to about 1/s just after a use
// (it has decayed to about 0.02/s just before the next; the lower of the
// two is reported, because the allocator rounds each agent's claim up to a
// whole token per interval). The demand is what the allocator weighs
// against the other agents' on the key; overstating it at every lightly
// used agent of a low-rate key starved the busy one (bench/sim
// unreachable, skewed keys). A sparse key used only once reports 0. A
// recent rate above the EWMA (a key that wakes up) counts only from
// sparseTokens tokens since the last scan, spread over the time since the
// key's previous use (at least minRateWindow).
func (a *Agent) demandOf(ks *keyState, now int64) float64 {
	d := ks.demand
	pending := max(ks.spent.Load()-ks.spentSeen, 0)
	// A key that was used before spreads its new tokens over the time since
	// that use: two requests of a 0.25/s key landing in one scan are not a
	// key waking up at 8/s (they claimed 9 tokens of a 20/s key).
	since := a.rf.lastScan
	if ks.activeAt != 0 {
		since = ks.activeAt // a scan time: ≤ lastScan, equal for a busy key
	}
	elapsed := max(now-since, int64(minRateWindow))
	if recent := float64(pending) / (float64(elapsed) / float64(time.Second)); recent > d && pending >= sparseTokens {
		d = recent
	}
	if ks.activeAt == 0 || d*leaseHorizon.Seconds() >= sparseTokens {
		return d
	}
	g := ks.gap
	if pending > 0 && now > ks.activeAt {
		g = gapAvg(g, now-ks.activeAt, pending) // the gap ending now counts too
	}
	if g == 0 {
		// Used once so far: no gap to measure a rate from. Just after the
		// use the EWMA reads about 1/s whatever the key's rate, which asked
		// for two tokens and made each of 199 gateways that saw a 20/s key
		// once weigh 2 tokens in the busy agent's share (bench/sim
		// unreachable, full scale). Report no demand: the agent still
		// wants its one token, and the allocator weighs a one-token lease
		// without demand at almost nothing for the others.
		return 0
	}
	return min(d, 1/g)
}

// gapAvg folds a gap of span nanoseconds over tokens uses into avg, the
// smoothed seconds per token (0: none yet). One gap is a poor estimate of
// a Poisson rate (1/gap has no mean), so gaps are averaged, weight 1/4.
func gapAvg(avg float64, span, tokens int64) float64 {
	g := float64(span) / float64(time.Second) / float64(tokens)
	if avg == 0 {
		return g
	}
	return avg + 0.25*(g-avg)
}

// sparseTokens: a key expected to spend fewer tokens than this in a lease
// horizon is sparse (see demandOf).
const sparseTokens = 2

// build makes the Acquire for keys, moving their charges and returned
// balances out of the check path's reach (the batch owns them until the
// allocator acknowledges or rejects it). It takes the next request id.
func (a *Agent) build(now int64, keys []*keyState) *batch {
	rf := &a.rf
	b := &batch{
		req: &allotv1.AcquireRequest{
			AgentId:      a.cfg.ID,
			RequestId:    rf.nextID,
			Keys:         make([]*allotv1.KeyAcquire, 0, len(keys)),
			FallbackKeys: uint32(min(rf.fbKeys, math.MaxUint32)),
		},
		keys:   append([]*keyState(nil), keys...),
		spent:  make([]int64, len(keys)),
		denied: make([]int64, len(keys)),
		lent:   make([]int64, len(keys)),
	}
	rf.nextID++
	if s := a.rules.Load(); s != nil && a.rulesFromAllocator.Load() {
		b.req.RulesVersion = s.Version()
	}
	renew := a.renewMargin()
	for i, ks := range b.keys {
		exp := ks.expiry.Load()
		live := now < exp
		if !live {
			ks.balance.Store(0) // an expired lease's tokens are gone
		}
		idle := now-ks.lastUse.Load() >= int64(a.cfg.IdleTimeout)
		active := ks.spent.Load() != ks.spentAtAcq || ks.denied.Load() != ks.deniedSent
		d := a.demandOf(ks, now)
		charged := ks.charged.Swap(0)
		if charged < 0 || charged > maxWant {
			// Negative: a refund arrived after its charge was sent; keep
			// the credit for the next report. Beyond the protocol's
			// bound: send the bound, keep the rest.
			keep := charged - min(max(charged, 0), maxWant)
			ks.charged.Add(keep)
			charged -= keep
		}
		var returned, want int64
		switch {
		case live && (idle || (!active && now >= exp-renew)):
			// Idle, or the lease is ending unused: hand it back rather
			// than let it expire (expired tokens are not credited).
			returned = ks.balance.Swap(0)
		case !idle && firstUse(d, charged, ks.spent.Load(), ks.balance.Load()) && thinShare(ks):
			b.lent[i] = charged // want 0: see firstUse
		case !idle:
			lw := lowWaterFor(d, a.cfg.RefillInterval, a.rf.latency)
			ks.lowWater.Store(lw)
			target := max(wantFor(d, a.cfg.RefillInterval, a.rf.latency), 1)
			if live {
				returned = returnExcess(&ks.balance, target)
			}
			want = min(max(target-ks.balance.Load(), 0), maxWant)
		}
		b.spent[i] = ks.spent.Load()
		b.denied[i] = ks.denied.Load()
		b.req.Keys = append(b.req.Keys, &allotv1.KeyAcquire{
			Domain:   ks.domain,
			Entries:  toProtoEntries(ks.entries),
			Want:     want,
			Held:     min(max(ks.balance.Load(), 0), maxWant),
			Returned: min(returned, maxWant),
			Charged:  charged,
			Demand:   min(d, maxWant),
			Denied:   min(max(b.denied[i]-ks.deniedSent, 0), maxWant),
		})
	}
	return b
}

// firstUse reports whether a key is reported for the first time after a
// single use that its fallback bucket admitted: it has no demand (a key
// used once reports none, see demandOf), holds nothing, and every token it
// ever admitted is in this report's charge. Such a key of a thin share
// (thinShare) asks for no token. Asking for one cost the key two tokens
// for each gateway's first use, the charge and the prefetched token, and
// the token is often handed back unused after IdleTimeout: with 199
// gateways each using a 20/s key once every 41 s, 20.8/s against the
// key's 20/s refill for the first seconds, and the gateway carrying most
// of its traffic came up short (bench/sim unreachable, full scale).
// Instead the token the fallback bucket lent for the use is given back to
// it once the allocator has debited the charge (apply), so a second use is
// admitted as the first was, and charged.
func firstUse(d float64, charged, spent, balance int64) bool {
	return d == 0 && charged > 0 && spent == charged && balance <= 0
}

// thinShare reports whether the key's fallback bucket is a share of a
// limit shared by several agents that is under one token per lease
// horizon (R/N·F_h < 1): then one prefetched token at each gateway's first
// use is more than that gateway's share of the key, and N of them a
// sizeable part of its refill. A key alone at this agent (N = 1, or a
// consistent-hash rule) keeps prefetching.
func thinShare(ks *keyState) bool {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	if ks.fbRule == nil || ks.fbN < 2 || ks.fbLimit.Window() <= 0 {
		return false
	}
	return float64(ks.fbLimit.Quota())*leaseHorizon.Seconds() < ks.fbLimit.Window().Seconds()
}

// maxWant is the allocator's bound on want (and on returned and charged).
const maxWant = 1_000_000_000_000

// wantFor is what a key with demand d (tokens/s) aims to hold after a
// refill: one lease horizon of demand plus what it spends while the next
// refill is collected and answered, rounded up once (build asks for at
// least one token). Rounding the two up separately, the low watermark to at
// least one token, made every lightly used agent ask for two, and on a
// low-rate key spread over many gateways those needs added up past the
// key's capacity: the water-filling then starved the busy agent.
func wantFor(d float64, tick time.Duration, latency float64) int64 {
	w := d * (leaseHorizon.Seconds() + 2*tick.Seconds() + latency)
	if w > maxWant {
		return maxWant
	}
	return int64(math.Ceil(w))
}

// lowWaterFor is the balance below which a key is refilled: what demand d
// (tokens/s) spends while a refill is collected (two ticks) and answered
// (the round-trip EWMA), at least one token.
func lowWaterFor(d float64, tick time.Duration, latency float64) int64 {
	w := d * (2*tick.Seconds() + latency)
	if w < 1 {
		return 1
	}
	if w > maxWant {
		return maxWant
	}
	return int64(math.Ceil(w))
}

func toProtoEntries(es []rules.Entry) []*allotv1.Entry {
	out := make([]*allotv1.Entry, len(es))
	for i, e := range es {
		out[i] = &allotv1.Entry{Key: e.Key, Value: e.Value}
	}
	return out
}

// send calls Acquire for b (b.firstSent is set on the first attempt) and
// applies the answer. It reports whether the loop may go on sending: false
// after a transport failure, when b stays unacknowledged and is retried,
// with the same request id, before anything else.
func (a *Agent) send(ctx context.Context, b *batch) bool {
	rf := &a.rf
	sent := a.now()
	if b.firstSent == 0 {
		b.firstSent = sent
	}
	rf.unacked = b
	cctx, cancel := context.WithTimeout(ctx, a.cfg.CallTimeout)
	start := time.Now()
	resp, err := a.clients[rf.addr].Acquire(cctx, b.req)
	cancel()
	a.met.callSeconds.Observe(time.Since(start).Seconds())
	recv := a.now()
	if err != nil {
		if unencodable := encodeFailed(err); unencodable || !retryable(err) {
			a.met.callsRejected.Inc()
			a.logs.log(a.log, "acquire_rejected", "agent: allocator rejected an Acquire; its keys are reported again later",
				"request_id", b.req.RequestId, "keys", len(b.keys), "err", err)
			a.reject(b, unencodable, status.Code(err) == codes.InvalidArgument)
			if !unencodable {
				a.callSucceeded(recv) // the allocator is reachable
			}
			return true
		}
		if ctx.Err() != nil {
			return false // shutting down: the batch stays for Close to deliver
		}
		if status.Code(err) == codes.ResourceExhausted {
			a.throttled(recv, err)
			return false
		}
		a.met.callsFailed.Inc()
		a.callFailed(recv, err)
		return false
	}
	a.met.callsOK.Inc()
	rtt := float64(recv-sent) / float64(time.Second)
	if rf.latency == 0 {
		rf.latency = rtt
	} else {
		rf.latency += 0.2 * (rtt - rf.latency)
	}
	rf.latencyMax = max(rf.latencyMax, rf.latency)
	a.talked.Store(true)
	a.callSucceeded(recv)
	a.apply(b, resp, recv)
	a.noteRulesVersion(resp.GetRulesVersion(), recv)
	return true
}

// retryable reports whether a failed call may have been lost in transit (so
// it must be retried with the same id) rather than answered with an error.
func retryable(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	switch status.Code(err) {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange,
		codes.PermissionDenied, codes.Unauthenticated, codes.Unimplemented, codes.NotFound, codes.AlreadyExists:
		return false
	}
	return true
}

// encodeFailed reports whether err is the gRPC codec's refusal to encode
// the call (a string field that is not valid UTF-8): the content, not the
// transport, failed, so it never counts toward the breaker.
func encodeFailed(err error) bool {
	s, ok := status.FromError(err)
	return ok && s.Code() == codes.Internal && strings.Contains(s.Message(), "error while marshaling")
}

// refusedForever in keyState.holdUntil marks a key that is never sent.
const refusedForever = math.MaxInt64

// refused reports whether ks is never sent to the allocator: it is decided
// by its fallback bucket, and forgotten when idle like a local key.
func (ks *keyState) refused() bool { return ks.holdUntil == refusedForever }

// reject undoes b's moves: the allocator applied nothing of it (it
// validates before applying, and answers a retry of an applied call from
// its record, invariant (b), so a rejected call was never applied). Its
// keys wait notLeasedRetry and are then sent one per call, so a key the
// allocator or the encoder refuses costs only itself. A key refused alone
// is counted and logged; one that could not be encoded (unencodable) never
// will be, and is never sent again. A key the allocator refused alone
// (invalid) is asked again after notLeasedRetry: the refusal may be about
// the call rather than the key.
func (a *Agent) reject(b *batch, unencodable, invalid bool) {
	a.rf.unacked = nil
	now := a.now()
	alone := len(b.keys) == 1 && b.keys[0].suspect
	for i, ks := range b.keys {
		k := b.req.Keys[i]
		ks.charged.Add(k.Charged)
		if k.Returned > 0 && now < ks.expiry.Load() {
			ks.balance.Add(k.Returned)
		}
		ks.inflight = false
		a.rf.awaken(ks)
		ks.suspect = true
		ks.holdUntil = now + int64(notLeasedRetry)
	}
	if alone && (unencodable || invalid) {
		if unencodable {
			b.keys[0].holdUntil = refusedForever
		}
		a.keyRefused(b.keys[0])
	}
}

// keyRefused counts and logs (rate-limited, by hash: never the key itself)
// a key that is never sent to the allocator.
func (a *Agent) keyRefused(ks *keyState) {
	a.met.keysRefused.Inc()
	a.logs.log(a.log, "key_refused", "agent: a key was refused by the allocator or the encoder; it is decided by its fallback bucket",
		"key_hash", strconv.FormatUint(ks.hash, 16))
}

// apply records the allocator's answer to b, received at recv.
func (a *Agent) apply(b *batch, resp *allotv1.AcquireResponse, recv int64) {
	a.rf.unacked = nil
	n := max(resp.GetLiveAgents(), 1)
	a.liveAgents.Store(n)
	grants := resp.GetGrants()
	if len(grants) != len(b.keys) {
		a.logs.log(a.log, "acquire_short", "agent: Acquire answer does not match the request",
			"keys", len(b.keys), "grants", len(grants))
	}
	var granted, charged, returned, paid int64
	for i, ks := range b.keys {
		ks.inflight = false
		a.rf.awaken(ks)
		ks.suspect = false
		k := b.req.Keys[i]
		charged += k.Charged
		returned += k.Returned
		ks.spentAtAcq = b.spent[i]
		ks.deniedSent = b.denied[i]
		if i >= len(grants) {
			continue
		}
		g := grants[i]
		switch g.GetStatus() {
		case allotv1.KeyStatus_KEY_STATUS_OK, allotv1.KeyStatus_KEY_STATUS_EXHAUSTED:
			ks.leased.Store(true)
			ks.notLeased.Store(false)
			ttl := time.Duration(g.GetLeaseTtlMs()) * time.Millisecond
			if g.GetGranted() > 0 || ttl > 0 {
				exp := b.firstSent + int64(ttl) - int64(leaseMargin(ttl))
				if g.GetGranted() > 0 {
					granted += g.GetGranted()
					// Fallback admissions made while this call was in
					// flight are owed to the global budget, and this
					// grant has already taken them from it: pay them out
					// of the grant instead of charging them later, or the
					// key is admitted past its budget (an 11th request
					// through a burst of 10 at cold start).
					pay := payOwed(&ks.charged, g.GetGranted())
					ks.paid += pay
					paid += pay
					ks.balance.Add(g.GetGranted() - pay)
				}
				ks.expiry.Store(exp)
			}
			ks.remaining.Store(g.GetRemaining())
			ks.resetAt.Store(b.firstSent + g.GetResetAfterMs()*int64(time.Millisecond))
			ks.refreshAt = b.firstSent + g.GetRefreshAfterMs()*int64(time.Millisecond)
			// Short: less than asked. The bucket is empty, or this agent
			// was granted its allowance for the refresh window (grant
			// pacing, docs/leases.md): either way asking again before the
			// paced time gets nothing more.
			short := k.Want > 0 && g.GetGranted() < k.Want
			if p, ok := a.pace(g, short); ok {
				// The budget, or this agent's share of it, is spent:
				// what this agent holds is what it may spend until it
				// asks again, at the paced time. Meanwhile a dry lease
				// denies (the lease says no) instead of admitting from
				// the fallback bucket and owing a charge every tick.
				ks.paced = true
				// Jittered (p/2 … p): agents that found the budget
				// spent together must not all come back together, or
				// the refill waits in the bucket between their waves.
				// Never before retry_after: no token exists before it.
				ks.refreshAt = b.firstSent + int64(max(a.jitter(p), time.Duration(g.GetRetryAfterMs())*time.Millisecond))
				ks.deniedUntil.Store(ks.refreshAt + a.paceGrace())
			} else {
				ks.paced = false
				if g.GetStatus() == allotv1.KeyStatus_KEY_STATUS_EXHAUSTED {
					ks.deniedUntil.Store(b.firstSent + g.GetRetryAfterMs()*int64(time.Millisecond))
				} else {
					ks.deniedUntil.Store(0)
				}
			}
			// The fallback bucket now starts from this agent's share of
			// what is left globally, so a lease that runs dry does not
			// get a second full burst. Rounded up: with more agents than
			// tokens left, rounding down emptied the fallback of every
			// agent that uses the key rarely and rejected its next
			// request; ⌈remaining/N⌉ is never more than the fallback's
			// burst ⌈B/N⌉, so the fail-open bound is unchanged.
			ks.mu.Lock()
			if lent := b.lent[i]; lent > 0 && g.GetGranted() == 0 && ks.fbRule != nil && ks.spent.Load() == b.spent[i] {
				// The allocator debited the first use's charge: the
				// global budget has paid for the token the fallback
				// bucket lent (firstUse). The rebase below still lowers
				// the bucket to this agent's share of what is left,
				// which is exact only when nothing was admitted while
				// the call was in flight (those admissions are not in
				// the remaining yet): then nothing is given back.
				// GiveBack caps at the bucket's capacity ⌈B/N⌉, so
				// the fail-open bound is unchanged.
				ks.fbLimit.GiveBack(&ks.fbState, recv, lent)
			}
			ks.fbRebase = true
			ks.fbAvail = ceilDiv(max(g.GetRemaining(), 0), int64(n))
			ks.fbAt = recv
			ks.mu.Unlock()
		case allotv1.KeyStatus_KEY_STATUS_NO_RULE, allotv1.KeyStatus_KEY_STATUS_UNLIMITED, allotv1.KeyStatus_KEY_STATUS_NOT_LEASED:
			// A rules version skew (or a backend change): decide
			// locally, uncharged, and ask again later.
			ks.leased.Store(true)
			ks.notLeased.Store(true)
			ks.retryAt = recv + int64(notLeasedRetry)
			a.logs.logLevel(a.log, slog.LevelInfo, "not_leased", "agent: the allocator does not lease a key this agent limits",
				"key", rules.RedactKey(g.GetKey()), "status", g.GetStatus().String())
		default:
			// Unknown status: try again at the next scan.
		}
	}
	a.met.granted.Add(float64(granted))
	a.met.charged.Add(float64(charged))
	a.met.paid.Add(float64(paid))
	a.met.returned.Add(float64(returned))
	a.met.keysSent.Add(float64(len(b.keys)))
}

// maxPace bounds how long a key whose grant fell short waits before asking
// again: the allocator's refresh under contention (F/2, F = 1 s by default).
const maxPace = 500 * time.Millisecond

// paceStep is the pace per agent on the key: k agents that each ask every
// k·paceStep leave the key's refill waiting about paceStep for its next
// ask.
const paceStep = 10 * time.Millisecond

// pace decides whether a key whose grant fell short of its want (short) or
// was EXHAUSTED is paced, and for how long: until the allocator's
// refresh_after (or retry_after when EXHAUSTED), but at most B/(2R), so that
// the global bucket, which holds B, cannot fill up and overflow between two
// of this agent's asks, at most k·paceStep with k agents on the key, and at
// most maxPace. Keys whose pace would be under two scans (a small B/R, or
// fewer than 20 agents on the key) are not paced: their asks must keep up
// with the bucket, and the fallback bucket decides between them as before.
func (a *Agent) pace(g *allotv1.KeyGrant, short bool) (time.Duration, bool) {
	exhausted := g.GetStatus() == allotv1.KeyStatus_KEY_STATUS_EXHAUSTED
	l := g.GetLimit()
	if !short && !exhausted || l == nil || l.GetRequestsPerUnit() == 0 || l.GetWindowSeconds() <= 0 {
		return 0, false
	}
	burst := l.GetBurst()
	if burst <= 0 {
		burst = int64(l.GetRequestsPerUnit())
	}
	// B/(2R) in seconds, computed in float64 and clamped before it becomes
	// a Duration (burst and window can be large).
	half := float64(burst) * float64(l.GetWindowSeconds()) / float64(l.GetRequestsPerUnit()) / 2
	p := maxPace
	if half < maxPace.Seconds() {
		p = time.Duration(half * float64(time.Second))
	}
	// The budget's refill waits in the global bucket for the next ask of
	// any agent on the key, about pace/k with k agents asking in turn:
	// requests denied meanwhile are false rejects. Keep that about
	// paceStep (0.1% of the key's rate over a 10 s window). 20 ms made the
	// 10-agent long tail of bench/load reject 0.49% of in-quota requests
	// (0.14% at 10 ms) for no fewer calls.
	p = min(p, time.Duration(max(g.GetAgents(), 1))*paceStep)
	if exhausted {
		p = max(p, time.Duration(g.GetRetryAfterMs())*time.Millisecond)
	} else {
		p = min(p, time.Duration(g.GetRefreshAfterMs())*time.Millisecond)
	}
	if p < 2*a.cfg.ScanInterval {
		return 0, false
	}
	return p, true
}

// paceGrace is how long past a paced key's ask its dry lease keeps
// denying: the ask goes at the first scan after refreshAt and its answer
// takes a round trip. An answer that is later than that (a slow or
// unreachable allocator) leaves the key to its fallback bucket.
func (a *Agent) paceGrace() int64 {
	return int64(a.cfg.ScanInterval+a.cfg.RefillInterval) + int64(2*a.rf.latency*float64(time.Second))
}

// leaseMargin is taken off a lease's TTL: clocks drift and the allocator's
// expiry command runs on its own schedule.
func leaseMargin(ttl time.Duration) time.Duration {
	return min(ttl/10, maxLeaseMargin)
}

// callFailed counts a transport failure: rotate to the next allocator and,
// after FailureThreshold in a row, open the breaker (or back off further).
func (a *Agent) callFailed(now int64, err error) {
	rf := &a.rf
	wasOpen := rf.br.Open()
	opened := rf.br.Failure(now) // opens it, or doubles the wait while open
	if len(a.clients) > 0 {
		rf.addr = (rf.addr + 1) % len(a.clients)
	}
	switch {
	case opened:
		a.breakerOpen.Store(true)
		a.met.fallback.Set(1)
		a.met.toOpen.Inc()
		a.logs.log(a.log, "breaker_open", "agent: allocator unreachable; deciding from fallback buckets",
			"failures", rf.br.Failures(), "err", err)
	case !wasOpen:
		return
	}
	a.nextProbe.Store(rf.br.NextProbe())
}

// throttled records an overload refusal: the batch stays unacknowledged and
// is retried, with the same request id, after the allocator's RetryInfo
// delay (or a doubling backoff from 20 ms up to 1 s), jittered.
func (a *Agent) throttled(now int64, err error) {
	rf := &a.rf
	a.met.callsThrottled.Inc()
	rf.throttle = min(max(2*rf.throttle, minThrottle), maxThrottle)
	wait := rf.throttle
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			wait = min(max(ri.GetRetryDelay().AsDuration(), minThrottle), maxThrottle)
		}
	}
	rf.throttledUntil = now + int64(a.jitter(wait))
	a.logs.log(a.log, "acquire_throttled", "agent: the allocator is overloaded; retrying the refill later",
		"retry_in", wait, "err", err)
}

const (
	minThrottle = 20 * time.Millisecond
	maxThrottle = time.Second
)

// callSucceeded closes the breaker.
func (a *Agent) callSucceeded(now int64) {
	rf := &a.rf
	rf.throttle, rf.throttledUntil = 0, 0
	if !rf.br.Success() {
		return
	}
	a.breakerOpen.Store(false)
	a.nextProbe.Store(0)
	a.met.fallback.Set(0)
	a.met.toClosed.Inc()
	a.logs.logLevel(a.log, slog.LevelInfo, "breaker_closed", "agent: allocator reachable again; leasing resumed")
}

// jitter is "equal jitter": d/2 + uniform(0, d/2), drawn from Config.Rand
// when set.
func (a *Agent) jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	if a.rng == nil {
		return d/2 + rand.N(d/2)
	}
	a.rngMu.Lock()
	defer a.rngMu.Unlock()
	return d/2 + time.Duration(a.rng.Int64N(int64(d/2)))
}

// returnExcess takes excessOf(balance, target) tokens out of *balance (the
// hot path spends from it concurrently, hence the CAS loop) and returns
// how many.
func returnExcess(balance *atomic.Int64, target int64) int64 {
	for {
		b := balance.Load()
		x := excessOf(b, target)
		if x <= 0 {
			return 0
		}
		if balance.CompareAndSwap(b, b-x) {
			return x
		}
	}
}

// payOwed settles up to grant tokens of the charge owed in *charged (tokens
// admitted from the fallback bucket and not yet reported) and returns how
// many it settled. The hot path adds to *charged concurrently, hence the
// CAS loop.
func payOwed(charged *atomic.Int64, grant int64) int64 {
	for {
		c := charged.Load()
		if c <= 0 || grant <= 0 {
			return 0
		}
		pay := min(c, grant)
		if charged.CompareAndSwap(c, c-pay) {
			return pay
		}
	}
}
