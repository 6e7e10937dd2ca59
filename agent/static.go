package agent

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Static shares (docs/static-shares.md). With Config.StaticShares every
// Acquire asks for a slot (AcquireRequest.static_shares) and says which
// version of the hot-key set the agent has applied (hot_version). An answer
// whose StaticShares has slots N > 0 lets the agent decide keys from
// static shares until the call's first send plus valid_ms, less the lease
// safety margin (policy.LeaseMargin); each answer also brings the agent's
// hot-key set up to date.
//
// A key is static when its rule is static-eligible
// ((*rules.Rule).StaticShare(N)), its allocator hash (rules.KeyHash, taken
// once when the key is first seen, for eligible rules only) is not in the
// hot-key set, and it holds no lease and has nothing pending with the
// allocator. A static key is decided from its own bucket, the share's
// limit, in the fields of its fallback bucket (SourceStatic): no charge,
// nothing for the refill loop. When the share runs low (policy.StaticLow
// after a check, or policy.StaticBusy at a scan) the key is sent with
// promote and static_left, what its bucket holds when the call is built;
// it keeps deciding from its share until the answer, and what it admits
// after the build is charged (so nothing is admitted uncounted). From the
// answer on it is a leased key like any other.
//
// A key stops being static at once, and takes the path of a key's first
// use (a fresh fallback bucket, charge, want), when the hot-key set gains
// it, when the permission lapses (the allocator unreachable, the slot
// lost: the breaker's outage rules then apply), or when its rule is no
// longer eligible. A key the hot-key set loses becomes static again, with
// a full share, once it holds no lease and nothing is pending.
//
// The allocator counts the share of a holder that stops deciding a key
// as full unless the holder says otherwise. So a key that stops for any
// reason but the hot-key set (which reports it) owes its share's level:
// its next call is a promotion with static_left what the share holds then
// (staticPlan), or, if an answer makes the key hot first, a report of it
// (markHot). A rejected promotion, or one another group was asked, owes
// again (staticEnd). An owing key is not forgotten before its share would
// be full again.
//
// A key that turns hot while the agent decides it from its share is
// reported (KeyAcquire.static_report, with static_left, what the share
// held when the agent stopped) in the call that first acknowledges the
// version that made it hot: the allocator merges those tokens into the
// key's bucket. A call's hot_version stops short of a report it has no
// room for (buildReports).
//
// An agent that holds a slot and has nothing else to send sends an
// Acquire without keys once its permission is older than half valid_ms
// (refillOnce). An agent that routes to several data groups does not ask
// for a slot: the hot-key set is a group's, and the agent's keys span
// several.

// A key's static mode (keyState.smode).
const (
	staticOff     uint32 = iota // not static: decided as any leased key
	staticOn                    // decided from its static share
	staticPromote               // … and handed to the refill loop to be promoted
	staticSent                  // … and its promotion built: what it admits is charged
)

// staticShares is the agent's static state.
type staticShares struct {
	slots      atomic.Uint32 // N of the latest answer that gave a slot
	maxRefill  atomic.Int64  // its max_refill_ms, in ns: a longer-refilling share is not eligible
	held       atomic.Bool   // a slot was given since the start: new eligible keys are indexed
	closed     atomic.Bool   // Close has begun: no answer gives a permission any more
	validUntil atomic.Int64  // agent clock: static decisions while now < validUntil
	keys       atomic.Int64  // keys in a static mode (allot_agent_static_keys)
	hotLen     atomic.Int64  // the hot-key set's size

	// mu guards the hot-key set and the index of the eligible keys by
	// allocator hash. Lock order: a shard's lock, then mu, then a key's mu.
	mu      sync.Mutex
	hot     map[uint64]struct{}
	idx     map[uint64]*keyState // chained through keyState.snext
	version uint64               // the hot-key set's version (written by the refill loop)

	// Owned by the refill loop (and by Close once it has stopped).
	renewAt int64 // send an empty Acquire from then (0: no slot)
	half    int64 // half the latest valid_ms, ns
	// ttl is the valid_ms of the latest answer that gave a slot: the
	// static TTL the allocator's transitions last, also while its answers
	// give none (a settings change revokes every slot for a while, and
	// the revoked holders still count in transitions).
	ttl time.Duration
	// reports are the keys that turned hot while this agent decided them
	// from their shares, oldest version first, until a call that carries
	// each and acknowledges its version is answered (see buildReports).
	reports []*staticReport
	acked   uint64 // the hot_version of the latest answered call
}

// staticReport is a key that turned hot while the agent decided it from
// its static share: what the share held when the agent stopped, for the
// call that acknowledges version (KeyAcquire.static_report).
type staticReport struct {
	ks      *keyState // its domain and entries (even once dropped from the table)
	left    int64     // the share's level, 0..burst
	version uint64    // the oldest hot-set version that may have brought the key (see applyHot)
	until   int64     // agent clock: from then on it is moot (see buildReports)
	in      *batch    // the latest call built with it
}

// staticAllowed reports whether the agent asks for static shares now.
func (a *Agent) staticAllowed() bool {
	return a.cfg.StaticShares && !a.standalone && a.rt.topo.Load().dataGroupCount() <= 1
}

// staticEligible reports whether a new key under r may be decided from
// static shares (for some N; StaticShare(N) decides at each check). Keys
// first seen before the agent was ever given a slot are not: an agent
// whose allocator runs without static shares pays nothing for them.
func (a *Agent) staticEligible(r *rules.Rule) bool {
	if !a.ss.held.Load() || !a.leasing(r) || !a.staticAllowed() {
		return false
	}
	_, ok := r.StaticShare(1, time.Duration(math.MaxInt64))
	return ok
}

// staticAdd indexes a new eligible key by its allocator hash and makes it
// static unless that hash is hot. It runs before the key is published.
func (ss *staticShares) add(ks *keyState) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.idx == nil {
		ss.idx = make(map[uint64]*keyState)
	}
	ks.snext = ss.idx[ks.ahash]
	ss.idx[ks.ahash] = ks
	if _, hot := ss.hot[ks.ahash]; hot {
		ks.sHot = true
		return
	}
	ks.fbStatic = true
	ks.smode.Store(staticOn)
	ss.keys.Add(1)
}

// remove unindexes a key dropped from the table.
func (ss *staticShares) remove(ks *keyState) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	unlink(ss.idx, ks.ahash, ks, func(ks *keyState) **keyState { return &ks.snext })
	ks.mu.Lock()
	ss.offLocked(ks)
	ks.mu.Unlock()
}

// offLocked takes ks (whose mu is held) out of static decisions: its next
// check takes the path of a key's first use, from a fresh fallback bucket.
func (ss *staticShares) offLocked(ks *keyState) {
	if ks.smode.Load() == staticOff {
		return
	}
	ks.smode.Store(staticOff)
	ss.keys.Add(-1)
	ks.fbStatic = false
	ks.fbRule = nil // rebound, full, by decideBucket
}

// decideStatic decides a check of ks under r from its static share. ok is
// false, and the check takes the lease path, when the key is not (or no
// longer) static. The caller holds the shard's read lock.
func (a *Agent) decideStatic(ks *keyState, r *rules.Rule, now, n int64, consume bool) (st Status, oc outcome, ok bool) {
	ss := &a.ss
	slots := ss.slots.Load()
	valid := now < ss.validUntil.Load()
	ks.mu.Lock()
	m := ks.smode.Load()
	if m == staticOff {
		ks.mu.Unlock()
		return st, oc, false
	}
	if !valid || ks.sHot || now < ks.expiry.Load() || !a.bindShare(ks, r, slots, now) {
		ss.leaveLocked(ks)
		ks.mu.Unlock()
		a.enqueue(ks) // as a new key is
		return st, oc, false
	}
	var res bucket.Result
	if consume && n > 0 {
		res = ks.fbLimit.AllowN(&ks.fbState, now, n)
		if res.Allowed {
			oc = outcome{ks: ks, taken: n, kind: takeStatic}
			if m == staticSent {
				// Built into a promotion: its static_left is sent, so
				// what the share admits now is charged.
				oc.kind = takeStaticCharged
				ks.charged.Add(n)
			}
		}
	} else {
		cp := ks.fbState
		res = ks.fbLimit.AllowN(&cp, now, n)
		peek := ks.fbLimit.Peek(ks.fbState, now)
		res.Remaining, res.ResetAfter = peek.Remaining, peek.ResetAfter
	}
	promote := m == staticOn && consume && n > 0 && policy.StaticLow(res.Remaining, ks.fbLimit.Burst())
	if promote {
		ks.smode.Store(staticPromote)
	}
	next := ks.fbLimit.NextAfter(now, res.ResetAfter) // the share's rate, not the rule's
	if !res.Allowed {
		res.RetryAfter = shareRetryAfter(r, ks.fbLimit, now, n, res.RetryAfter)
	}
	ks.mu.Unlock()
	if promote {
		a.enqueue(ks)
	}
	if oc.taken > 0 {
		ks.spent.Add(n)
	}
	st = Status{Rule: r, Allowed: res.Allowed, Remaining: res.Remaining, ResetAfter: res.ResetAfter, NextAfter: next, Source: SourceStatic}
	if !res.Allowed {
		st.RetryAfter = res.RetryAfter
	}
	return st, oc, true
}

// leaveLocked takes ks (mu held) out of static decisions, as offLocked,
// noting that it owes its share's level (see above) unless the allocator
// learns it otherwise: a key in the hot-key set was reported (markHot), a
// promotion built carries it (staticSent: staticEnd owes it again if the
// call is not applied), and a share not bound yet is full, as the
// allocator counts it.
func (ss *staticShares) leaveLocked(ks *keyState) {
	if m := ks.smode.Load(); (m == staticOn || m == staticPromote) && !ks.sHot && ks.fbStatic && ks.fbRule != nil {
		ks.oweLim, ks.oweSt = ks.fbLimit, ks.fbState
		ks.owe = true
		ks.sOwe.Store(true)
	}
	ss.offLocked(ks)
}

// oweLevel is what the share ks owes holds at now, with no take since
// (mu held).
func (ks *keyState) oweLevel(now int64) int64 {
	return min(max(ks.oweLim.Peek(ks.oweSt, now).Remaining, 0), ks.oweLim.Burst())
}

// oweFullAt is when the share ks owes is full again (0: it is, or ks owes
// nothing): from then on the allocator's full share is exact, and ks may
// be forgotten.
func (ks *keyState) oweFullAt(now int64) int64 {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	if !ks.owe {
		return 0
	}
	if p := ks.oweLim.Peek(ks.oweSt, now); p.ResetAfter > 0 {
		return now + int64(p.ResetAfter)
	}
	return 0
}

// checkStaticHit is check's fast path for a request of one descriptor,
// found in the memo, on a key decided from its static share that admits
// it without asking for its promotion. It decides as decide and
// decideStatic do for that case (an allowed status from the share, counted
// the same way) without the shard lock, filling *dec; ok is false, with
// nothing changed (but a dropped key's lastUse), in any other case, and
// check goes on as usual.
//
// Without the shard lock a key may be dropped meanwhile: as spendLive, it
// takes from the share and changes the key's counters (spent, lastUse)
// before it reads dropped, and gives the take back when it is set; the
// refill loop sets dropped before it reads the counters again (shard.remove).
func (a *Agent) checkStaticHit(dec *Decision, me *memoEntry, set *rules.Set, d *Descriptor, hits uint32, t0 int64) (ok bool) {
	r, ks := me.rules[0], me.keys[0]
	n := hitsFor(d, hits)
	if r == nil || r.Unlimited || ks == nil || n <= 0 || !ks.staticable || ks.smode.Load() != staticOn || !a.leasing(r) {
		return false
	}
	now, ok := a.nowFast()
	if !ok {
		now = a.now()
	}
	ss := &a.ss
	if now >= ss.validUntil.Load() {
		return false
	}
	slots := ss.slots.Load()
	maxRefill := time.Duration(ss.maxRefill.Load())
	ks.mu.Lock()
	if ks.smode.Load() != staticOn || ks.sHot || ks.fbRule != r || ks.fbN != slots || !ks.fbStatic ||
		now < ks.expiry.Load() || ks.fbRefill > maxRefill {
		ks.mu.Unlock()
		return false
	}
	was := ks.fbState
	res := ks.fbLimit.AllowN(&ks.fbState, now, n)
	if !res.Allowed || policy.StaticLow(res.Remaining, ks.fbLimit.Burst()) {
		ks.fbState = was // a denial or a promotion: decideStatic's
		ks.mu.Unlock()
		return false
	}
	lim := ks.fbLimit // the share's NextAfter, computed after the unlock
	ks.mu.Unlock()
	next := lim.NextAfter(now, res.ResetAfter)
	ks.spent.Add(n)
	if ks.lastUse.Load() != now {
		ks.lastUse.Store(now)
	}
	if ks.dropped.Load() {
		// Dropped, or being dropped: undo, as refundStatic does.
		ks.mu.Lock()
		if ks.fbStatic {
			ks.fbLimit.GiveBack(&ks.fbState, now, n)
		}
		ks.mu.Unlock()
		ks.spent.Add(-n)
		return false
	}
	if ks.dormant.Load() {
		a.wake(ks) // after every change above: see due.go
	}
	a.allowedHit(dec, set, r, SourceStatic, res.Remaining, res.ResetAfter, next, t0)
	return true
}

// bindShare makes ks's bucket (fallback fields, mu held) the static share
// of r for slots; false when r is not eligible for it. A new share starts
// full; a change of rule or N keeps what the bucket holds, clamped to the
// new share (never a fresh burst), unless the algorithm changed.
func (a *Agent) bindShare(ks *keyState, r *rules.Rule, slots uint32, now int64) bool {
	maxRefill := time.Duration(a.ss.maxRefill.Load())
	if ks.fbRule == r && ks.fbN == slots && ks.fbStatic && ks.fbRefill <= maxRefill {
		return true
	}
	l, ok := r.StaticShare(slots, maxRefill)
	if !ok {
		return false
	}
	if ks.fbRule == nil || ks.fbLimit.Algorithm() != l.Algorithm() {
		ks.fbState = bucket.State{}
	} else {
		rebase(l, &ks.fbState, capacity(l, now), now, now)
	}
	ks.fbRule, ks.fbN, ks.fbLimit, ks.fbStatic = r, slots, l, true
	ks.fbRefill = rules.RefillTime(l)
	ks.fbRebase = false
	ks.sRate.Store(math.Float64bits(float64(l.Quota()) / time.Duration(l.Window()).Seconds()))
	return true
}

// shareFullAt is when ks's static share is full again (0: it is), given
// lastUse, its latest check: no take from it comes later.
func (ks *keyState) shareFullAt(lastUse int64) int64 {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	if !ks.fbStatic || ks.fbRule == nil {
		return 0 // a new share: full
	}
	if p := ks.fbLimit.Peek(ks.fbState, lastUse); p.ResetAfter > 0 {
		return lastUse + int64(p.ResetAfter)
	}
	return 0
}

// refundStatic gives back what a static decision took, for a request
// another descriptor denied.
func (a *Agent) refundStatic(oc *outcome, now int64) {
	ks, n := oc.ks, oc.taken
	ks.mu.Lock()
	if ks.fbStatic {
		ks.fbLimit.GiveBack(&ks.fbState, now, n)
	}
	ks.mu.Unlock()
	if oc.kind == takeStaticCharged {
		ks.charged.Add(-n)
	}
}

// staticPlan is the refill loop's part of building a call with ks: a key
// handed over for promotion is built into one (promote, with left, what
// its share holds), and so is a key that owes its share's level. A key
// that stopped being static meanwhile is sent as any key (the hot-key set
// reported it; an unbound share is full); one whose permission lapsed is
// promoted but decides nothing more from its share.
func (a *Agent) staticPlan(ks *keyState, now int64) (promote bool, left int64) {
	if ks.smode.Load() != staticPromote && !ks.sOwe.Load() {
		return false, 0
	}
	ss := &a.ss
	valid := now < ss.validUntil.Load()
	ks.mu.Lock()
	defer ks.mu.Unlock()
	if ks.owe {
		// Owed (its mode is off): oweLim and oweSt stay, for staticEnd.
		ks.owe = false
		ks.sOwe.Store(false)
		return true, ks.oweLevel(now)
	}
	switch {
	case ks.smode.Load() != staticPromote:
		return false, 0
	case ks.sHot || !ks.fbStatic || ks.fbRule == nil:
		ss.offLocked(ks)
		return false, 0
	}
	// The share as the call takes it: what the key admits from it after
	// the build is charged, so a call that is not applied owes this.
	ks.oweLim, ks.oweSt = ks.fbLimit, ks.fbState
	left = ks.oweLevel(now)
	if valid {
		ks.smode.Store(staticSent)
	} else {
		ss.offLocked(ks)
	}
	return true, left
}

// staticEnd ends the promotion of ks in a call: applied (the key is
// leased from its answer on) or not (rejected, or another group's: the
// key is sent again as any key, its charges with it, and owes its share
// as the call took it). Answers are applied in order and one call is in
// flight, so a promotion's key is not in the hot-key set when its call is
// rejected; one that a moved call's answer makes hot is reported, as the
// apply runs this before the answer's hot-key set (apply).
func (a *Agent) staticEnd(ks *keyState, applied bool) {
	ks.mu.Lock()
	defer ks.mu.Unlock()
	if ks.smode.Load() == staticSent {
		a.ss.offLocked(ks)
	}
	if !applied {
		ks.owe = true
		ks.sOwe.Store(true)
	}
}

// applyStatic applies an answer's static shares to a call b, first sent at
// b.firstSent: the permission and the hot-key set. The refill loop calls
// it for every answered call, after reportsAnswered.
//
// The pending reports are dropped when the agent no longer asks for a
// slot, is closing, or the allocator gives no static shares at all: its
// calls then acknowledge nothing, and the allocator merges nothing of a
// holder that stops acknowledging versions (its share lapses). An answer
// that gives no slot keeps them: a holder whose slot a settings change
// revokes still counts in transitions, and its acknowledgements still
// merge its shares, until the change takes force.
func (a *Agent) applyStatic(b *batch, s *allotv1.StaticShares, now int64) {
	ss := &a.ss
	if !b.req.StaticShares || s == nil || !a.staticAllowed() || ss.closed.Load() {
		ss.validUntil.Store(0)
		ss.renewAt = 0
		ss.dropReports()
		a.met.staticSlots.Set(0)
		return
	}
	slot := s.GetSlots() > 0 && s.GetValidMs() > 0
	if !slot {
		ss.validUntil.Store(0)
		ss.renewAt = 0
	} else {
		valid := time.Duration(s.GetValidMs()) * time.Millisecond
		ss.slots.Store(s.GetSlots())
		ss.maxRefill.Store(int64(time.Duration(max(s.GetMaxRefillMs(), 0)) * time.Millisecond))
		ss.held.Store(true)
		ss.validUntil.Store(b.firstSent + int64(valid-policy.LeaseMargin(valid)))
		ss.half = int64(valid / 2)
		ss.ttl = valid
		ss.renewAt = b.firstSent + ss.half
	}
	a.met.staticSlots.Set(float64(s.GetSlots()))
	a.applyHot(s, now)
}

// applyHot brings the hot-key set to the answer's version: hot keys stop
// static decisions at once (those the agent decided from their shares are
// reported: markHot); keys that left it become static again once they
// hold no lease and nothing is pending (tryStatic).
func (a *Agent) applyHot(s *allotv1.StaticShares, now int64) {
	ss := &a.ss
	var back []*keyState
	v := s.GetHotVersion()
	// A report is moot a static TTL after the answer that brought its key
	// (and the lease safety margin, for the clocks' rates): the key's
	// transition began before that answer was sent and ended a TTL after
	// it began, and the allocator merges no share once it has. An answer
	// without a slot gives no valid_ms: the TTL is the latest given.
	valid := time.Duration(max(s.GetValidMs(), 0)) * time.Millisecond
	if valid == 0 {
		valid = ss.ttl
	}
	until := now + int64(valid+policy.LeaseMargin(valid))
	ss.mu.Lock()
	// The allocator numbers each change of the set (one key each): an
	// answer taking the agent from version p to v made its keys hot at
	// versions p+1..v, which one it does not say. A report is tagged p+1,
	// so that a call acknowledging any of them carries it (buildReports).
	tag := min(ss.version+1, v)
	switch {
	case s.GetHotReset():
		old := ss.hot
		ss.hot = make(map[uint64]struct{}, len(s.GetHotAdded()))
		for _, h := range s.GetHotAdded() {
			ss.hot[h] = struct{}{}
			if _, was := old[h]; !was {
				ss.markHot(h, tag, now, until)
			}
		}
		for h := range old {
			if _, is := ss.hot[h]; !is {
				back = ss.markCold(h, back)
			}
		}
	case s.GetHotVersion() < ss.version:
		// Older than what is applied (cannot happen: calls are answered
		// in order); keep the newer set.
		ss.mu.Unlock()
		return
	default:
		if ss.hot == nil && len(s.GetHotAdded()) > 0 {
			ss.hot = make(map[uint64]struct{}, len(s.GetHotAdded()))
		}
		for _, h := range s.GetHotAdded() {
			if _, was := ss.hot[h]; !was {
				ss.hot[h] = struct{}{}
				ss.markHot(h, tag, now, until)
			}
		}
		for _, h := range s.GetHotRemoved() {
			if _, was := ss.hot[h]; was {
				delete(ss.hot, h)
				back = ss.markCold(h, back)
			}
		}
	}
	ss.version = s.GetHotVersion()
	ss.hotLen.Store(int64(len(ss.hot)))
	a.met.staticHotKeys.Set(float64(len(ss.hot)))
	ss.mu.Unlock()
	for _, ks := range back {
		if !a.tryStatic(ks, now) {
			ks.sWait = true
			a.rf.awaken(ks)
		}
	}
}

// markHot stops static decisions of the keys of allocator hash h (mu held),
// which the hot-key set brought at version or later, at now. A key decided from its
// share until now gets a pending report of what the share holds (as
// static_left is read for a promotion). None is needed for a key whose
// promotion is in flight (its static_left is sent), nor for one whose
// share is not bound yet (new, or static again after leaving the set): it
// is full, and the allocator merges a full share for a holder that
// acknowledges a key it sends no report for. A key that owes its share's
// level is reported with it.
func (ss *staticShares) markHot(h, version uint64, now, until int64) {
	for ks := ss.idx[h]; ks != nil; ks = ks.snext {
		ks.mu.Lock()
		ks.sHot = true
		if m := ks.smode.Load(); (m == staticOn || m == staticPromote) && ks.fbStatic && ks.fbRule != nil {
			left := min(max(ks.fbLimit.Peek(ks.fbState, now).Remaining, 0), ks.fbLimit.Burst())
			ss.reports = append(ss.reports, &staticReport{ks: ks, left: left, version: version, until: until})
		} else if ks.owe {
			ks.owe = false
			ks.sOwe.Store(false)
			ss.reports = append(ss.reports, &staticReport{ks: ks, left: ks.oweLevel(now), version: version, until: until})
		}
		ss.offLocked(ks)
		ks.mu.Unlock()
	}
}

// markCold notes that the keys of allocator hash h left the hot-key set
// (mu held) and appends them to back.
func (ss *staticShares) markCold(h uint64, back []*keyState) []*keyState {
	for ks := ss.idx[h]; ks != nil; ks = ks.snext {
		ks.mu.Lock()
		ks.sHot = false
		ks.mu.Unlock()
		back = append(back, ks)
	}
	return back
}

// tryStatic makes ks, which left the hot-key set, static again with a full
// share if it holds no lease and nothing is pending; it reports whether ks
// no longer waits for that (static, hot again, or dropped). The refill
// loop calls it; under the shard's write lock no check is deciding ks.
func (a *Agent) tryStatic(ks *keyState, now int64) bool {
	sh := a.keys.shard(ks.hash)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if ks.dropped.Load() {
		return true
	}
	if ks.Inflight || ks.queued.Load() || ks.charged.Load() != 0 || ks.outage.Load() != 0 || now < ks.expiry.Load() {
		return false
	}
	ks.mu.Lock()
	defer ks.mu.Unlock()
	if ks.sHot || ks.smode.Load() != staticOff {
		return true
	}
	ks.balance.Store(0) // an expired lease's tokens are gone
	ks.fbRule, ks.fbStatic, ks.fbRebase = nil, true, false
	ks.smode.Store(staticOn)
	a.ss.keys.Add(1)
	return true
}

// staticRenew reports whether the refill loop, with nothing else to send
// at now, sends an empty Acquire to renew its permission, and if so pushes
// the next renewal half a validity on (the answer sets it again).
func (a *Agent) staticRenew(now int64) bool {
	ss := &a.ss
	if ss.renewAt == 0 || now < ss.renewAt || !a.staticAllowed() {
		return false
	}
	ss.renewAt = now + ss.half
	return true
}

// buildReports sets b's hot_version and puts the pending reports into b,
// which build has filled with its keys (b.req.StaticShares set); t is the
// topology, and b is addressed to group when addressed.
//
// A report goes into the entry of its key when b has one that is not a
// promotion (its first use's want and charge), else into an entry of its
// own that wants nothing, while b has room (maxBatchKeys) and, with a
// topology, is addressed to the group that owns the key. A call carries
// one report a key (the oldest). Beside a promotion of the same key (a
// report from an earlier time the key was hot, not moot yet) it changes
// nothing: that transition is over, or the promotion's share merged
// first, and a share merges once. hot_version is the
// version the agent has applied when every pending report is in b;
// otherwise it stops short of the oldest left out (never below what was
// acknowledged already), so that the call that first acknowledges a
// report's version carries it. b carries only the reports whose version
// it acknowledges.
//
// A report is pending until a call that carries it is answered (a retry,
// under the same request id, carries it again; a rejected call applied
// nothing). One that reaches the allocator again in a later call whose
// hot_version acknowledged it already (a call sent again under a new id
// because the allocator that applied it did not read packed keys: send)
// is harmless: the allocator counts a report only in the call that first
// acknowledges its version.
func (a *Agent) buildReports(b *batch, t *topology, group slots.GroupID, addressed bool, now int64) {
	ss := &a.ss
	b.req.HotVersion = ss.version // applied by this loop before this call
	// Moot reports go, unless a call in flight carries them (its answer
	// drops them).
	ss.reports = slices.DeleteFunc(ss.reports, func(r *staticReport) bool { return r.in == nil && now >= r.until })
	if len(ss.reports) == 0 {
		return
	}
	first := make(map[string]*staticReport, len(ss.reports)) // each key's oldest report
	for _, r := range ss.reports {
		if first[r.ks.key] == nil {
			first[r.ks.key] = r
		}
	}
	merge := make(map[*staticReport]*allotv1.KeyAcquire)
	for i, ks := range b.keys {
		if r := first[ks.key]; r != nil && !b.req.Keys[i].Promote {
			merge[r] = b.req.Keys[i]
		}
	}
	room := maxBatchKeys - len(b.req.Keys)
	if len(b.keys) == 1 && b.keys[0].Suspect {
		room = 0 // a key sent alone to learn whether the allocator refuses it
	}
	var fit []*staticReport
	var lowest uint64 // the oldest version left out (0: none)
	routed := func(r *staticReport) bool { return t == nil || addressed && t.ownerOf(r.ks) == group }
	for _, r := range ss.reports {
		if now >= r.until {
			continue // moot, in flight in another call
		}
		if _, ok := merge[r]; !ok {
			if first[r.ks.key] != r || room == 0 || !routed(r) {
				if lowest == 0 || r.version < lowest {
					lowest = max(r.version, 1)
				}
				continue
			}
			room--
		}
		fit = append(fit, r)
	}
	if lowest != 0 {
		b.req.HotVersion = min(max(lowest-1, ss.acked), ss.version)
		// A call of its own follows when one without keys can carry every
		// report of the version held back.
		n := 0
		for _, r := range ss.reports {
			if r.version == lowest && now < r.until && first[r.ks.key] == r && routed(r) {
				n++
			}
		}
		b.reportsShort = n > 0 && n <= maxBatchKeys && len(b.keys) > 0
	}
	// More reports of one version than a call holds (maxBatchKeys) hold
	// the acknowledgement back until they are moot, a static TTL later: a
	// holder acknowledging a key it does not report merges a full share,
	// which would be more than its share held.
	for _, r := range fit {
		if r.version > b.req.HotVersion {
			continue // for a later call, which acknowledges its version
		}
		k := merge[r]
		if k == nil {
			k = &allotv1.KeyAcquire{Domain: r.ks.domain, Entries: toProtoEntries(r.ks.entries)}
			b.req.Keys = append(b.req.Keys, k)
		}
		k.StaticReport, k.StaticLeft = true, r.left
		r.in = b
	}
}

// reportsAnswered records that b was answered: its hot_version is
// acknowledged, and the reports it carried are done with. The refill loop
// calls it for every answered call, before applyStatic.
func (ss *staticShares) reportsAnswered(b *batch) {
	if !b.req.StaticShares {
		return
	}
	ss.acked = b.req.HotVersion
	ss.reports = slices.DeleteFunc(ss.reports, func(r *staticReport) bool { return r.in == b })
}

// reportsRejected records that b was rejected (nothing of it applied):
// the reports it carried are pending again, for the next call (or moot).
func (ss *staticShares) reportsRejected(b *batch) {
	for _, r := range ss.reports {
		if r.in == b {
			r.in = nil
		}
	}
}

// dropReports drops the pending reports: the agent's static shares have
// stopped.
func (ss *staticShares) dropReports() {
	clear(ss.reports)
	ss.reports = ss.reports[:0]
}
