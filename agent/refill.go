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

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/breaker"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// notLeasedRetry: how long a key the allocator does not lease (NO_RULE,
// UNLIMITED, NOT_LEASED: a rules version skew) waits before asking again.
const notLeasedRetry = 5 * time.Second

// maxWant is the allocator's bound on want (and on returned and charged).
const maxWant = policy.MaxWant

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

// refillOnce is one tick of the refill loop: a periodic scan of the keys
// that need it (see due.go), then (allocator permitting) the queued and selected keys sent in batches.
func (a *Agent) refillOnce(ctx context.Context) {
	now := a.loopNow()
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
	if a.cfg.driven {
		// The scan walks Go maps, whose order is random: a driven agent
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
			if ks.charged.Load() <= 0 && ks.outage.Load() <= 0 && (now < ks.deniedUntil.Load() || ks.notLeased.Load() && now < ks.retryAt) {
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
	alpha := policy.Alpha(dt)
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
		s, seen := r.spent, ks.dem.SpentSeen
		fell := ks.dem.Scan(now, s, dt, alpha, r.denied == ks.deniedSent)
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

// reportFall decides whether a key whose demand the scan just lowered (see
// policy.Demand.Scan) is sent now rather than at its next refill: when it
// holds a live lease and more than its new target (it would ask for
// nothing while it spends that, up to a second at its old rate, and the
// allocator would weigh its old demand against the others' until then).
func (a *Agent) reportFall(ks *keyState, now int64) bool {
	if now < ks.holdUntil || ks.notLeased.Load() || !ks.leased.Load() || now >= ks.expiry.Load() {
		return false
	}
	return ks.balance.Load() > policy.Want(ks.dem.Rate, a.cfg.RefillInterval, a.rf.latency)
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
	return ks.charged.Load() <= 0 && ks.outage.Load() <= 0 && (ks.balance.Load() == 0 || now >= ks.expiry.Load())
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
	if ks.charged.Load() > 0 || ks.outage.Load() > 0 {
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

// demandOf estimates ks's tokens/s at now (see policy.Demand.Of).
func (a *Agent) demandOf(ks *keyState, now int64) float64 {
	return ks.dem.Of(now, ks.spent.Load(), a.rf.lastScan)
}

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
		charged := sendable(&ks.charged)
		outage := sendable(&ks.outage)
		var returned, want int64
		switch {
		case live && (idle || (!active && now >= exp-renew)):
			// Idle, or the lease is ending unused: hand it back rather
			// than let it expire (expired tokens are not credited).
			returned = ks.balance.Swap(0)
		case !idle && policy.FirstUse(d, charged, ks.spent.Load(), ks.balance.Load()) && thinShare(ks):
			b.lent[i] = charged // want 0: see firstUse
		case !idle:
			lw := policy.LowWater(d, a.cfg.RefillInterval, a.rf.latency)
			ks.lowWater.Store(lw)
			target := max(policy.Want(d, a.cfg.RefillInterval, a.rf.latency), 1)
			if live {
				returned = returnExcess(&ks.balance, target)
			}
			want = min(max(target-ks.balance.Load(), 0), maxWant)
		}
		b.spent[i] = ks.spent.Load()
		b.denied[i] = ks.denied.Load()
		b.req.Keys = append(b.req.Keys, &allotv1.KeyAcquire{
			Domain:        ks.domain,
			Entries:       toProtoEntries(ks.entries),
			Want:          want,
			Held:          min(max(ks.balance.Load(), 0), maxWant),
			Returned:      min(returned, maxWant),
			Charged:       charged,
			OutageCharged: outage,
			Demand:        min(d, maxWant),
			Denied:        min(max(b.denied[i]-ks.deniedSent, 0), maxWant),
		})
	}
	return b
}

// thinShare reports whether the key's fallback bucket is a thin share of a
// limit shared by several agents (see policy.ThinShare): its first use
// then asks for no token (policy.FirstUse).
func thinShare(ks *keyState) bool {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	return ks.fbRule != nil && policy.ThinShare(ks.fbLimit.Quota(), ks.fbLimit.Window(), ks.fbN)
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
	sent := a.loopNow()
	if b.firstSent == 0 {
		b.firstSent = sent
	}
	rf.unacked = b
	cctx, cancel := context.WithTimeout(ctx, a.cfg.CallTimeout)
	start := time.Now()
	resp, err := a.clients[rf.addr].Acquire(cctx, b.req)
	cancel()
	a.met.callSeconds.Observe(time.Since(start).Seconds())
	recv := a.loopNow()
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
	now := a.loopNow()
	alone := len(b.keys) == 1 && b.keys[0].suspect
	for i, ks := range b.keys {
		k := b.req.Keys[i]
		ks.charged.Add(k.Charged)
		ks.outage.Add(k.OutageCharged)
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
				exp := b.firstSent + int64(ttl) - int64(policy.LeaseMargin(ttl))
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

// pace decides whether a key whose grant fell short of its want (short) or
// was EXHAUSTED is paced, and for how long (see policy.Pace).
func (a *Agent) pace(g *allotv1.KeyGrant, short bool) (time.Duration, bool) {
	l := g.GetLimit()
	return policy.Pace(policy.Grant{
		Exhausted:       g.GetStatus() == allotv1.KeyStatus_KEY_STATUS_EXHAUSTED,
		Short:           short,
		RequestsPerUnit: l.GetRequestsPerUnit(),
		WindowSeconds:   l.GetWindowSeconds(),
		Burst:           l.GetBurst(),
		Agents:          g.GetAgents(),
		RefreshAfter:    time.Duration(g.GetRefreshAfterMs()) * time.Millisecond,
		RetryAfter:      time.Duration(g.GetRetryAfterMs()) * time.Millisecond,
	}, a.cfg.ScanInterval)
}

// paceGrace is how long past a paced key's ask its dry lease keeps
// denying: the ask goes at the first scan after refreshAt and its answer
// takes a round trip. An answer that is later than that (a slow or
// unreachable allocator) leaves the key to its fallback bucket.
func (a *Agent) paceGrace() int64 {
	return int64(a.cfg.ScanInterval+a.cfg.RefillInterval) + int64(2*a.rf.latency*float64(time.Second))
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
	if rf.unacked != nil {
		// The allocator is unreachable: when it is back, the call is
		// retried before anything else, and its wants, sized before the
		// outage, would take the refill the key gained meanwhile before
		// the fallback admissions of the outage are charged against it
		// (outage_charged). The retry asks for nothing: if the allocator
		// applied the call before it went down, it answers from its
		// record; otherwise it applies the same charges and returns, and
		// the next call asks, after its outage charge.
		for _, k := range rf.unacked.req.Keys {
			k.Want = 0
		}
	}
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

// returnExcess takes policy.Excess(balance, target) tokens out of *balance (the
// hot path spends from it concurrently, hence the CAS loop) and returns
// how many.
func returnExcess(balance *atomic.Int64, target int64) int64 {
	for {
		b := balance.Load()
		x := policy.Excess(b, target)
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
