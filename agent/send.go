package agent

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

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
	rf.lastCall = sent
	b.retried = b.sentID != 0 && b.sentID == b.req.RequestId
	b.sentID = b.req.RequestId
	cctx, cancel := context.WithTimeout(ctx, a.cfg.CallTimeout)
	start := time.Now()
	wire := a.wire(b.req)
	resp, err := a.callAcquire(cctx, wire) // to the leader: route.go
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
				a.reachable(rf.core.Reachable()) // the allocator is reachable
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
	if rf.packedKeys = resp.GetReadsPackedKeys(); !rf.packedKeys && len(wire.PackedKeys) > 0 {
		// An allocator that does not read packed keys applied a call
		// without keys: send them again, unpacked, under a new id.
		b.req.RequestId = rf.core.NextID()
		return a.send(ctx, b)
	}
	a.met.callsOK.Inc()
	a.talked.Store(true)
	a.reachable(rf.core.Answered(sent, recv))
	a.noteTopology(resp.GetTopology()) // groups.go
	a.apply(b, resp, recv)
	a.noteRulesVersion(resp.GetRulesVersion(), recv)
	return true
}

// wire returns req as sent: its keys packed (AcquireRequest.packed_keys)
// once the allocator has answered that it reads them, unless a key is not
// valid UTF-8 (sent unpacked, the codec refuses it: see encodeFailed).
// Every other field is copied (TestWireCopiesEveryField).
func (a *Agent) wire(req *allotv1.AcquireRequest) *allotv1.AcquireRequest {
	if !a.rf.packedKeys || !allotv1.KeysValidUTF8(req.Keys) {
		return req
	}
	return &allotv1.AcquireRequest{
		AgentId:         req.AgentId,
		RequestId:       req.RequestId,
		RulesVersion:    req.RulesVersion,
		FallbackKeys:    req.FallbackKeys,
		PackedGrants:    req.PackedGrants,
		Group:           req.Group,
		TopologyVersion: req.TopologyVersion,
		StaticShares:    req.StaticShares,
		HotVersion:      req.HotVersion,
		PackedKeys:      allotv1.AppendPackedKeys(make([]byte, 0, 32*len(req.Keys)), req.Keys),
	}
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

// reject undoes b's moves: the allocator applied nothing of it (it
// validates before applying, and answers a retry of an applied call from
// its record, invariant (b), so a rejected call was never applied). A
// rejected retry (b.retried) is the exception: its first attempt, whose
// answer was lost, may have been applied where the retry can no longer
// reach that record (a slot moved, the rules changed, credentials were
// rotated in between), so only its charges go back (at worst charged
// twice), not its returned tokens (at worst wasted), as for MOVED. Its
// keys wait policy.NotLeasedRetry and are then sent one per call, so a key
// the allocator or the encoder refuses costs only itself. A key refused
// alone is counted and logged; one that could not be encoded (unencodable)
// never will be, and is never sent again. A key the allocator refused alone
// (invalid) is asked again after policy.NotLeasedRetry: the refusal may be
// about the call rather than the key.
func (a *Agent) reject(b *batch, unencodable, invalid bool) {
	a.rf.unacked = nil
	a.ss.reportsRejected(b)
	now := a.loopNow()
	alone := len(b.keys) == 1 && b.keys[0].Suspect
	for i, ks := range b.keys {
		if b.retried {
			unsendRetried(ks, b.req.Keys[i])
		} else {
			unsend(ks, b.req.Keys[i], now)
		}
		if b.req.Keys[i].Promote {
			a.staticEnd(ks, false)
		}
		a.rf.core.Rejected(&ks.Key, now)
		a.rf.awaken(ks)
	}
	if alone && (unencodable || invalid) {
		if unencodable {
			b.keys[0].HoldUntil = policy.RefusedForever
		}
		a.keyRefused(b.keys[0])
	}
}

// unsend gives back to ks what its entry k of a call that was not
// applied took from it: its charges, and its returned tokens while its
// lease lives.
func unsend(ks *keyState, k *allotv1.KeyAcquire, now int64) {
	unsendRetried(ks, k)
	if k.Returned > 0 && now < ks.expiry.Load() {
		ks.balance.Add(k.Returned)
	}
}

// unsendRetried gives back to ks what its entry k of a call that may or
// may not have been applied took from it: its charges only (reported
// again: at worst charged twice), never its returned tokens (at worst
// wasted), so that no token is admitted twice either way.
func unsendRetried(ks *keyState, k *allotv1.KeyAcquire) {
	ks.charged.Add(k.Charged)
	ks.outage.Add(k.OutageCharged)
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
	grants, err := allotv1.GrantsOf(resp)
	if err != nil {
		a.logs.log(a.log, "acquire_short", "agent: Acquire answer does not decode", "err", err)
	}
	if len(grants) != len(b.req.Keys) {
		a.logs.log(a.log, "acquire_short", "agent: Acquire answer does not match the request",
			"keys", len(b.req.Keys), "grants", len(grants))
	}
	a.ss.reportsAnswered(b)
	for i, ks := range b.keys {
		if b.req.Keys[i].Promote {
			// Leased from this answer on, or sent again if moved: before
			// the answer's hot-key set, which reports a key that owes.
			a.staticEnd(ks, i >= len(grants) || grants[i].GetStatus() != allotv1.KeyStatus_KEY_STATUS_MOVED)
		}
	}
	a.applyStatic(b, resp.GetStatic(), recv)
	var granted, charged, returned, paid int64
	for i, ks := range b.keys {
		if i < len(grants) && grants[i].GetStatus() == allotv1.KeyStatus_KEY_STATUS_MOVED {
			a.moved(ks, b.req.Keys[i], b.retried) // groups.go
			continue
		}
		a.rf.core.Acked(&ks.Key, b.spent[i], b.denied[i])
		a.rf.awaken(ks)
		k := b.req.Keys[i]
		charged += k.Charged
		returned += k.Returned
		if i >= len(grants) {
			continue
		}
		g := grants[i]
		ans := answer(g)
		switch ans.Status {
		case policy.OK, policy.Exhausted:
			ks.leased.Store(true)
			ks.notLeased.Store(false)
			if ans.Granted > 0 {
				granted += ans.Granted
				// Fallback admissions made while this call was in flight
				// are owed to the global budget, and this grant has
				// already taken them from it: pay them out of the grant
				// instead of charging them later, or the key is admitted
				// past its budget (an 11th request through a burst of 10
				// at cold start).
				pay := payOwed(&ks.charged, ans.Granted)
				ks.Paid += pay
				paid += pay
				ks.balance.Add(ans.Granted - pay)
			}
		case policy.NotLeased:
			ks.leased.Store(true)
			ks.notLeased.Store(true)
			a.logs.logLevel(a.log, slog.LevelInfo, "not_leased", "agent: the allocator does not lease a key this agent limits",
				"key", rules.RedactKey(g.GetKey()), "status", g.GetStatus().String())
		}
		l := a.rf.core.Grant(&ks.Key, ans, k.Want, b.firstSent, recv)
		if !l.Rebase {
			continue
		}
		if l.Expiry != 0 {
			ks.expiry.Store(l.Expiry)
		}
		ks.remaining.Store(l.Remaining)
		ks.resetAt.Store(l.ResetAt)
		ks.deniedUntil.Store(l.DeniedUntil)
		// The fallback bucket now starts from this agent's share of what
		// is left globally, so a lease that runs dry does not get a
		// second full burst. Rounded up: with more agents than tokens
		// left, rounding down emptied the fallback of every agent that
		// uses the key rarely and rejected its next request;
		// ⌈remaining/N⌉ is never more than the fallback's burst ⌈B/N⌉, so
		// the fail-open bound is unchanged.
		ks.mu.Lock()
		if lent := b.lent[i]; lent > 0 && ans.Granted == 0 && ks.fbRule != nil && ks.spent.Load() == b.spent[i] {
			// The allocator debited the first use's charge: the global
			// budget has paid for the token the fallback bucket lent
			// (policy.FirstUse). The rebase below still lowers the bucket
			// to this agent's share of what is left, which is exact only
			// when nothing was admitted while the call was in flight
			// (those admissions are not in the remaining yet): then
			// nothing is given back. GiveBack caps at the bucket's
			// capacity ⌈B/N⌉, so the fail-open bound is unchanged.
			ks.fbLimit.GiveBack(&ks.fbState, recv, lent)
		}
		ks.fbRebase = true
		ks.fbAvail = ceilDiv(max(l.Remaining, 0), int64(n))
		ks.fbAt = l.RebaseAt
		// Agents counts the lease holders after this call, this agent
		// among them only while its lease lives (TTL > 0).
		ks.shared = ans.Agents > 1 || ans.Agents == 1 && ans.TTL == 0
		ks.mu.Unlock()
	}
	a.met.granted.Add(float64(granted))
	a.met.charged.Add(float64(charged))
	a.met.paid.Add(float64(paid))
	a.met.returned.Add(float64(returned))
	a.met.keysSent.Add(float64(len(b.keys)))
}

// answer is what the core reads of a key's grant.
func answer(g *allotv1.KeyGrant) policy.Answer {
	ms := func(v int64) time.Duration { return time.Duration(v) * time.Millisecond }
	var st policy.Status
	switch g.GetStatus() {
	case allotv1.KeyStatus_KEY_STATUS_OK:
		st = policy.OK
	case allotv1.KeyStatus_KEY_STATUS_EXHAUSTED:
		st = policy.Exhausted
	case allotv1.KeyStatus_KEY_STATUS_NO_RULE, allotv1.KeyStatus_KEY_STATUS_UNLIMITED, allotv1.KeyStatus_KEY_STATUS_NOT_LEASED:
		st = policy.NotLeased
	}
	l := g.GetLimit()
	return policy.Answer{
		Status: st, Granted: g.GetGranted(), Remaining: g.GetRemaining(), TTL: ms(int64(g.GetLeaseTtlMs())),
		RefreshAfter: ms(g.GetRefreshAfterMs()), RetryAfter: ms(g.GetRetryAfterMs()), ResetAfter: ms(g.GetResetAfterMs()),
		RequestsPerUnit: l.GetRequestsPerUnit(), WindowSeconds: l.GetWindowSeconds(), Burst: l.GetBurst(), Agents: g.GetAgents(),
	}
}

// callFailed counts a transport failure: rotate to the next allocator and,
// after FailureThreshold in a row, open the breaker (or back off further).
func (a *Agent) callFailed(now int64, err error) {
	rf := &a.rf
	opened, open := rf.core.Failed(now)
	if len(a.clients) > 0 {
		rf.addr = (rf.addr + 1) % len(a.clients)
	}
	if opened {
		a.breakerOpen.Store(true)
		a.met.fallback.Set(1)
		a.met.toOpen.Inc()
		a.logs.log(a.log, "breaker_open", "agent: allocator unreachable; deciding from fallback buckets",
			"failures", rf.core.Failures(), "err", err)
	}
	if !open {
		return
	}
	a.nextProbe.Store(rf.core.NextProbe())
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
	a.met.callsThrottled.Inc()
	var hint time.Duration
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			hint = max(ri.GetRetryDelay().AsDuration(), 1) // 0 is no hint: the shortest wait
		}
	}
	wait := a.rf.core.Throttled(now, hint)
	a.logs.log(a.log, "acquire_throttled", "agent: the allocator is overloaded; retrying the refill later",
		"retry_in", wait, "err", err)
}

// reachable publishes that the allocator answered: closed reports whether
// that closed the breaker.
func (a *Agent) reachable(closed bool) {
	if !closed {
		return
	}
	a.breakerOpen.Store(false)
	a.nextProbe.Store(0)
	a.met.fallback.Set(0)
	a.met.toClosed.Inc()
	a.logs.logLevel(a.log, slog.LevelInfo, "breaker_closed", "agent: allocator reachable again; leasing resumed")
}
