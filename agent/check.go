package agent

import (
	"context"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

// stackDescs descriptors are handled in arrays on the stack; larger requests
// borrow scratch space from a pool. Either way a check does not allocate.
const stackDescs = 4

// keyBufLen is the stack buffer for rendering a canonical key off the fast
// path (a hash hit with different entries, the Redis backend).
const keyBufLen = 256

// takeKind records what a descriptor took, so a later deny can give it back.
type takeKind uint8

const (
	takeNone          takeKind = iota
	takeLease                  // from the lease balance
	takeFallback               // from the fallback bucket, charged to the allocator
	takeBucket                 // from the fallback or local bucket, not charged
	takeRemote                 // from the Redis backend (Config.Redis)
	takePromise                // a denial's Retry-After kept (promise.go), charged to the allocator
	takeOutage                 // from the fallback bucket with the breaker open, reported as outage_charged
	takeStatic                 // from the static share (static.go), not charged
	takeStaticCharged          // from the static share after its promotion was built, charged to the allocator
)

// outcome is small on purpose: it is returned by value through every
// decide layer on the hot path (a takeRemote refund gets the rule and the
// descriptor from check, which has them). ks is the key decided on (nil for
// the Redis backend), whether or not it took anything.
type outcome struct {
	ks    *keyState
	taken int64
	kind  takeKind
}

type scratch struct {
	entries [][]rules.Entry
	matched []*rules.Rule
	outs    []outcome
}

var scratchPool = sync.Pool{New: func() any {
	return &scratch{
		entries: make([][]rules.Entry, 0, MaxDescriptors),
		matched: make([]*rules.Rule, 0, MaxDescriptors),
		outs:    make([]outcome, 0, MaxDescriptors),
	}
}}

// Check decides one request: every descriptor is matched (with `replaces`),
// charged hits tokens (a descriptor's HitsAddend overrides hits; hits 0
// means 1) and the request is allowed unless a non-shadow descriptor is over
// its limit. On a deny, tokens already taken for the request's other
// descriptors are given back, and the descriptors after the denying one
// are evaluated without consuming, so that the decision reports the
// longest wait of the limits that deny (see Decision): those whose key
// this agent holds, and none of the Redis backend. A descriptor with
// HitsAddendSet and HitsAddend 0 is checked without consuming: allowed
// unless the budget is exhausted (in debt, or denied by the allocator).
// An unknown domain or no match is allowed (SourceUnlimited).
//
// Check never performs network I/O (except through Config.Redis for rules
// with the redis backend) and does not allocate on its fast paths. The only
// errors wrap ErrInvalid.
func (a *Agent) Check(ctx context.Context, domain string, descs []Descriptor, hits uint32) (d Decision, err error) {
	_, err = a.check(ctx, &d, domain, descs, hits, nil, false)
	return d, err
}

// CheckStatuses is Check plus one Status per descriptor, appended to
// out[:0] (pass the previous result back to avoid allocating). After an
// enforced deny, the remaining descriptors are evaluated in full without
// consuming (keys not seen before are tracked, the Redis backend is asked),
// so every status is meaningful; Remaining counts down exactly by the
// tokens each descriptor took.
func (a *Agent) CheckStatuses(ctx context.Context, domain string, descs []Descriptor, hits uint32, out []Status) (d Decision, st []Status, err error) {
	st, err = a.check(ctx, &d, domain, descs, hits, out[:0], true)
	return d, st, err
}

func validate(domain string, descs []Descriptor) error {
	if domain == "" {
		return fmt.Errorf("%w: empty domain", ErrInvalid)
	}
	if !rules.ValidText(domain) {
		return fmt.Errorf("%w: the domain is not valid UTF-8 text (control characters or invalid bytes)", ErrInvalid)
	}
	if len(descs) == 0 {
		return fmt.Errorf("%w: no descriptors", ErrInvalid)
	}
	if len(descs) > MaxDescriptors {
		return fmt.Errorf("%w: %d descriptors, at most %d", ErrInvalid, len(descs), MaxDescriptors)
	}
	for i := range descs {
		es := descs[i].Entries
		if len(es) == 0 {
			return fmt.Errorf("%w: descriptor %d has no entries", ErrInvalid, i)
		}
		if len(es) > MaxEntries {
			return fmt.Errorf("%w: descriptor %d has %d entries, at most %d", ErrInvalid, i, len(es), MaxEntries)
		}
		size := len(domain)
		for j := range es {
			if es[j].Key == "" {
				return fmt.Errorf("%w: descriptor %d entry %d has an empty key", ErrInvalid, i, j)
			}
			if !rules.ValidText(es[j].Key) || !rules.ValidText(es[j].Value) {
				return fmt.Errorf("%w: descriptor %d entry %d is not valid UTF-8 text (control characters or invalid bytes)", ErrInvalid, i, j)
			}
			size += len(es[j].Key) + len(es[j].Value) + 2
		}
		if size > MaxKeyBytes {
			return fmt.Errorf("%w: descriptor %d is %d bytes, at most %d", ErrInvalid, i, size, MaxKeyBytes)
		}
	}
	return nil
}

// checkStart is the origin of checkNanos.
var checkStart = time.Now()

// checkNanos is the time a sampled check starts or ends, in nanoseconds
// since checkStart plus one (never 0, which marks a check not timed). It
// reads the monotonic clock only, where time.Now reads the wall clock too.
func checkNanos() int64 { return int64(time.Since(checkStart)) + 1 }

func hitsFor(d *Descriptor, hits uint32) int64 {
	if d.HitsAddend != 0 || d.HitsAddendSet {
		return int64(d.HitsAddend)
	}
	if hits == 0 {
		return 1
	}
	return int64(hits)
}

// check decides into *dec, which is the zero Decision on entry (the
// caller's result, written in place: a Decision is large, and copying one
// just written field by field stalls the CPU) and stays so on an error.
func (a *Agent) check(ctx context.Context, dec *Decision, domain string, descs []Descriptor, hits uint32, out []Status, withStatuses bool) ([]Status, error) {
	var t0 int64 // checkNanos of a sampled check, 0 otherwise
	if a.met.sampleCheck(uintptr(unsafe.Pointer(dec))) {
		t0 = checkNanos()
	}
	set := a.rules.Load()

	// The request memo: a request seen before under this rule set skips
	// validation, matching and the key-table lookups (see memo). Entries
	// are recorded only for requests that passed validate, and a hit
	// matches every byte of the domain and of every entry, and the
	// descriptors' boundaries (see identity), so it is a request
	// byte-identical to one validated before.
	var mh uint64
	var iw identWords
	var me *memoEntry
	memoable := false
	if a.memo != nil && set != nil {
		// identHash, with its commonest case called directly.
		if mh, memoable = identHashShort(a.memo.seed, domain, descs, &iw); !memoable {
			mh, memoable = identHashAny(a.memo.seed, domain, descs, &iw)
		}
	}
	if memoable {
		me = a.memo.get(mh, set, domain, descs, &iw)
	}
	if me == nil {
		if err := validate(domain, descs); err != nil {
			return out, err
		}
	} else if len(descs) == 1 && !withStatuses {
		if a.checkLeasedHit(dec, me, set, &descs[0], hits, t0) || a.checkStaticHit(dec, me, set, &descs[0], hits, t0) {
			return out, nil
		}
	}
	memoMiss := memoable && me == nil // record what the slow path finds
	return a.checkAll(ctx, dec, set, domain, descs, hits, out, withStatuses, me, memoMiss, mh, &iw, t0), nil
}

// checkAll is check past the request memo's probe and its fast path
// (apart, so that a hit there does not pay for this frame): it decides
// every descriptor, matched by the rules or found in the memo entry me,
// and records the request in the memo when memoMiss (hash mh, first form
// of its identity iw).
//
//go:noinline
func (a *Agent) checkAll(ctx context.Context, dec *Decision, set *rules.Set, domain string, descs []Descriptor, hits uint32, out []Status, withStatuses bool,
	me *memoEntry, memoMiss bool, mh uint64, iw *identWords, t0 int64) []Status {
	now := a.now()

	var (
		matchedArr [stackDescs]*rules.Rule
		outsArr    [stackDescs]outcome
		sc         *scratch
		outs       []outcome
	)
	matched := matchedArr[:0]
	if len(descs) <= stackDescs {
		outs = outsArr[:len(descs)]
	} else {
		sc = scratchPool.Get().(*scratch)
		matched = sc.matched[:0]
		outs = sc.outs[:len(descs)]
	}
	if me != nil {
		matched = append(matched, me.rules[:len(descs)]...)
	} else {
		matched = a.match(set, domain, descs, sc, matched)
	}

	dec.Allowed, dec.Source = true, SourceUnlimited
	hint := uintptr(unsafe.Pointer(dec))
	ri := a.met.ruleIndexFor(set)
	reported := -1
	var reportedSt Status
	denied := false
	for i, r := range matched {
		outs[i] = outcome{}
		// After an enforced deny nothing more is consumed. With statuses
		// the remaining descriptors are evaluated in full, so that each
		// status is meaningful; without, they are only peeked at, to
		// report the longest wait (see decide): neither counted nor
		// looked up beyond what this agent holds.
		peek := denied && !withStatuses
		if r == nil || r.Unlimited {
			if !peek {
				a.met.unlimitedDecision(hint, ri, domain, r)
			}
			if withStatuses {
				out = append(out, Status{Rule: r, Allowed: true, Source: SourceUnlimited})
			}
			continue
		}
		var known *keyState
		if me != nil {
			known = me.keys[i]
		}
		if peek && r.ShadowMode {
			outs[i].ks = known // it never denies: nothing to learn
			continue
		}
		st, oc := a.decide(ctx, r, domain, descs[i].Entries, known, now, hitsFor(&descs[i], hits), !denied, peek)
		// A memo entry without this key (it left the table, or was not
		// in it when the entry was recorded) is recorded again, with the
		// key decided on.
		memoMiss = memoMiss || (me != nil && oc.ks != known && !a.remote(r))
		outs[i] = oc
		if !st.Allowed && r.ShadowMode {
			st.Allowed, st.Shadow = true, true
			dec.Shadow = true
			a.met.shadow(hint)
		}
		if !peek {
			a.met.ruleDecision(hint, ri, r, &st)
		}
		switch {
		case st.Allowed:
			if !denied && (reported < 0 || reportedBefore(&st, &reportedSt)) {
				reported, reportedSt = i, st
			}
		case !denied:
			denied = true
			dec.Allowed = false
			reported, reportedSt = i, st
			for j := 0; j < i; j++ {
				if t := outs[j].taken; t > 0 {
					a.refund(&outs[j], now, matched[j], domain, descs[j].Entries)
					if withStatuses {
						out[j].Remaining += t
					}
				}
			}
		case st.RetryAfter > reportedSt.RetryAfter:
			// The request cannot succeed before every denying limit
			// allows it: report the longest wait.
			reported, reportedSt = i, st
		}
		if withStatuses {
			out = append(out, st)
		}
	}
	if memoMiss {
		a.memoize(mh, set, domain, descs, iw, matched, outs)
	}
	if sc != nil {
		clear(sc.outs[:len(descs)])
		clear(sc.matched[:cap(sc.matched)])
		scratchPool.Put(sc)
	}

	if reported >= 0 {
		r := reportedSt.Rule
		dec.Source = reportedSt.Source
		dec.Rule = r
		dec.Policy = r.Name
		dec.Quota = int64(r.RequestsPerUnit)
		dec.Window = r.Window
		dec.Remaining = reportedSt.Remaining
		dec.ResetAfter = reportedSt.ResetAfter
		if !dec.Allowed {
			dec.RetryAfter = reportedSt.RetryAfter
		} else {
			dec.NextAfter = reportedSt.NextAfter
		}
	}
	a.met.decision(hint, dec.Source, dec.Allowed)
	if t0 != 0 {
		a.met.checkSeconds.Observe(float64(checkNanos()-t0) / 1e9)
	}
	return out
}

// reportedBefore reports whether st, of an allowed request, is reported
// rather than cur: an enforced limit before one in shadow mode (which no
// transport advertises), then the lower Remaining.
func reportedBefore(st, cur *Status) bool {
	if s, c := st.Rule.ShadowMode, cur.Rule.ShadowMode; s != c {
		return c
	}
	return st.Remaining < cur.Remaining
}

// match runs the rules on a request the memo does not hold (apart from
// check, so that a memo hit does not pay for zeroing the entries array).
func (a *Agent) match(set *rules.Set, domain string, descs []Descriptor, sc *scratch, matched []*rules.Rule) []*rules.Rule {
	var entriesArr [stackDescs][]rules.Entry
	entries := entriesArr[:0]
	if sc != nil {
		entries = sc.entries[:0]
	}
	for i := range descs {
		entries = append(entries, descs[i].Entries)
	}
	matched = set.MatchAll(domain, entries, matched)
	if sc != nil {
		clear(entries)
	}
	return matched
}

// memoize records a decided request in the memo: its matched rules and
// the key each rule was decided on (none for the Redis backend, which
// check sends down the slow path, nor for a key a peek did not find: a hit
// looks it up, and records it once found).
func (a *Agent) memoize(h uint64, set *rules.Set, domain string, descs []Descriptor, iw *identWords, matched []*rules.Rule, outs []outcome) {
	if !a.memo.wants(h, set) {
		return
	}
	e := &memoEntry{hash: h, set: set, ident: newIdentity(domain, descs, iw)}
	copy(e.rules[:], matched)
	for i := range outs {
		if r := matched[i]; r != nil && !r.Unlimited && !a.remote(r) {
			e.keys[i] = outs[i].ks
		}
	}
	a.memo.store(e)
}

// remote reports whether r's checks go to the Redis backend first.
func (a *Agent) remote(r *rules.Rule) bool {
	return r.Backend == rules.BackendRedis && a.redis != nil
}

// refund gives back what one descriptor took for a request that was denied
// by another descriptor.
func (a *Agent) refund(oc *outcome, now int64, r *rules.Rule, domain string, entries []rules.Entry) {
	ks, n := oc.ks, oc.taken
	if oc.kind == takeRemote {
		a.refundRemote(oc, r, domain, entries)
		return
	}
	switch oc.kind {
	case takeStatic, takeStaticCharged:
		a.refundStatic(oc, now)
	case takeLease:
		ks.balance.Add(n)
	case takePromise:
		ks.charged.Add(-n)
	case takeFallback, takeBucket, takeOutage:
		ks.mu.Lock()
		ks.fbLimit.GiveBack(&ks.fbState, now, n)
		ks.mu.Unlock()
		// May go below zero if the charge was already sent; the refill
		// loop then reports 0 and keeps the credit.
		switch oc.kind {
		case takeFallback:
			ks.charged.Add(-n)
		case takeOutage:
			ks.outage.Add(-n)
		}
	}
	ks.spent.Add(-n)
	if ks.dormant.Load() {
		a.wake(ks)
	}
	oc.taken = 0
}

// decide evaluates one descriptor under rule r. With consume false (after
// an enforced deny) or n == 0 it changes nothing. peek (consume false)
// evaluates only what this agent holds, with no I/O and no new key: a key
// not in the table, or a rule of the Redis backend, is reported allowed
// (its wait is not known here). known, when not nil, is the key the
// request memo found for it: decided on unless it has left the table
// since (then the table is searched, as without it).
func (a *Agent) decide(ctx context.Context, r *rules.Rule, domain string, entries []rules.Entry, known *keyState, now, n int64, consume, peek bool) (Status, outcome) {
	if a.remote(r) {
		if peek {
			return Status{Rule: r, Allowed: true, Source: SourceRedis}, outcome{}
		}
		if st, ok := a.decideRemote(ctx, r, domain, entries, n, consume); ok {
			var oc outcome
			if st.Allowed {
				st.NextAfter = r.Limit.NextAfter(now, st.ResetAfter) // the backend's bucket is the rule's
				if consume && n > 0 {
					oc = outcome{taken: n, kind: takeRemote}
				}
			}
			return st, oc
		}
		if r.FailureMode == rules.FailClosed {
			return Status{Rule: r, Source: SourceRedis, RetryAfter: time.Second}, outcome{}
		}
		// Fail open: the local bucket decides, below.
	}

	if known != nil && consume && n > 0 && a.leasing(r) {
		// The commonest case, without the shard lock (see spendLive).
		if left, ok := a.spendLive(known, now, n); ok {
			return leaseStatus(known, r, now, left), outcome{ks: known, taken: n, kind: takeLease}
		}
	}
	var sh *shard
	ks := known
	if ks != nil {
		// keyState.dropped is set under the shard's write lock before
		// the key leaves the table, so under the read lock it is final.
		sh = a.keys.shard(ks.hash)
		sh.mu.RLock()
		if ks.dropped.Load() {
			sh.mu.RUnlock()
			ks = nil
		}
	}
	if ks == nil {
		h := a.keys.keyHash(r, domain, entries)
		sh = a.keys.shard(h)
		sh.mu.RLock()
		ks = sh.lookupRLocked(h, r, domain, entries)
		if ks == nil && peek {
			sh.mu.RUnlock()
			return Status{Rule: r, Allowed: true}, outcome{}
		}
		for ks == nil {
			// First sight: insert under the write lock, then decide
			// under the read lock like any other check (looking the key
			// up again, so a key dropped in between is never decided
			// on).
			sh.mu.RUnlock()
			var ss *staticShares
			if a.staticEligible(r) {
				ss = &a.ss
			}
			if k, created := sh.insert(h, r, domain, entries, now, ss); created && k.unsendable {
				a.keyRefused(k)
			} else if created && a.leasing(r) && k.smode.Load() == staticOff {
				a.enqueue(k)
			}
			sh.mu.RLock()
			ks = sh.lookupRLocked(h, r, domain, entries)
		}
	}
	if ks.lastUse.Load() != now {
		ks.lastUse.Store(now)
	}
	var st Status
	var oc outcome
	if a.leasing(r) {
		static := false
		if ks.staticable && ks.smode.Load() != staticOff {
			st, oc, static = a.decideStatic(ks, r, now, n, consume)
		}
		if !static {
			st, oc = a.decideLease(ks, r, now, n, consume)
		}
	} else {
		if ks.staticable && ks.smode.Load() != staticOff {
			// Its rule left the lease backend: no longer eligible.
			ks.mu.Lock()
			a.ss.leaveLocked(ks)
			ks.mu.Unlock()
		}
		if !ks.local.Load() {
			ks.local.Store(true)
		}
		src, nAgents := SourceLocal, uint32(1)
		if r.Backend == rules.BackendRedis && a.redis != nil {
			// The Redis backend failed; fail open. An agent that talks to
			// an allocator knows how many gateways are live: each takes
			// its share (R/N, as the allocator's fallback does), so the
			// fleet admits no more than B + R·T. A standalone agent does
			// not, and takes the whole limit.
			src = SourceFallback
			if !a.standalone && r.Routing != rules.RoutingConsistentHash {
				nAgents = max(a.liveAgents.Load(), 1)
			}
		}
		st, oc = a.decideBucket(ks, r, now, n, consume, nAgents, src)
	}
	if !st.Allowed && consume {
		ks.denied.Add(1)
	}
	if ks.dormant.Load() {
		a.wake(ks) // after every change above: see due.go
	}
	sh.mu.RUnlock()
	oc.ks = ks
	return st, oc
}

// leasing reports whether keys under r are leased from the allocator.
func (a *Agent) leasing(r *rules.Rule) bool {
	return r.Backend == rules.BackendLease && !a.standalone
}

func (a *Agent) decideLease(ks *keyState, r *rules.Rule, now, n int64, consume bool) (Status, outcome) {
	if ks.local.Load() {
		ks.local.Store(false) // the rule moved back to the lease backend
	}
	exp := ks.expiry.Load()
	if now < exp {
		if consume && n > 0 {
			if left, ok := a.spendBalance(ks, n); ok {
				return leaseStatus(ks, r, now, left), outcome{ks: ks, taken: n, kind: takeLease}
			}
		} else if b := ks.balance.Load(); b >= n {
			return leaseStatus(ks, r, now, b), outcome{}
		}
	}
	open := a.breakerOpen.Load()
	charge := !open && !ks.notLeased.Load()
	if du := ks.deniedUntil.Load(); now < du {
		st := Status{
			Rule:       r,
			ResetAfter: until(ks.resetAt.Load(), now),
			RetryAfter: time.Duration(du - now),
			Source:     SourceLease,
		}
		if charge && consume && n > 0 && ks.keepPromise(a.preciseNow(), n, st.RetryAfter) {
			st.NextAfter = r.Limit.NextAfter(now, st.ResetAfter)
			return a.promised(ks, st, n)
		}
		return st, outcome{}
	}
	if open && r.FailureMode == rules.FailClosed {
		return Status{
			Rule:       r,
			RetryAfter: a.closedRetryAfter(now),
			Source:     SourceFallback,
		}, outcome{}
	}
	nAgents := uint32(1)
	if r.Routing != rules.RoutingConsistentHash {
		nAgents = max(a.liveAgents.Load(), 1)
	}
	if !ks.fbUsed.Load() {
		ks.fbUsed.Store(true)
	}
	st, oc := a.decideBucket(ks, r, now, n, consume, nAgents, SourceFallback)
	if !st.Allowed && charge && consume && n > 0 && ks.keepPromise(a.preciseNow(), n, st.RetryAfter) {
		return a.promised(ks, st, n)
	}
	switch {
	case oc.taken > 0 && charge:
		oc.kind = takeFallback
		ks.charged.Add(oc.taken)
		a.enqueue(ks)
	case oc.taken > 0 && open && !ks.notLeased.Load():
		// Reported once the allocator is back, against the refill the
		// key gained meanwhile (the scan sends it: see needsAcquire).
		oc.kind = takeOutage
		ks.outage.Add(oc.taken)
	case consume && (exp == 0 || now >= exp) && !open:
		a.enqueue(ks) // no lease, or it expired: ask for one
	}
	return st, oc
}

// promised admits a request of a leased key that the lease path denied
// with st (its NextAfter that of the limit that denied), because the key's
// latest denial promised it (promise.go): the n tokens are charged to the
// allocator.
func (a *Agent) promised(ks *keyState, st Status, n int64) (Status, outcome) {
	ks.spent.Add(n)
	ks.charged.Add(n)
	a.enqueue(ks)
	st.Allowed, st.RetryAfter, st.Remaining = true, 0, 0
	return st, outcome{ks: ks, taken: n, kind: takePromise}
}

// leaseStatus is the status of a check allowed from ks's lease, with
// balance tokens left in it.
func leaseStatus(ks *keyState, r *rules.Rule, now, balance int64) Status {
	reset := until(ks.resetAt.Load(), now)
	return Status{
		Rule:       r,
		Allowed:    true,
		Remaining:  ks.remaining.Load() + balance,
		ResetAfter: reset,
		NextAfter:  r.Limit.NextAfter(now, reset),
		Source:     SourceLease,
	}
}

// spendBalance takes n > 0 tokens from ks's live lease (the caller checked
// now < expiry, under the key's shard read lock) if its balance holds
// them, counts them spent, and returns the balance left.
func (a *Agent) spendBalance(ks *keyState, n int64) (left int64, ok bool) {
	for {
		b := ks.balance.Load()
		if b < n {
			return 0, false
		}
		if ks.balance.CompareAndSwap(b, b-n) {
			ks.spent.Add(n)
			if b-n < ks.lowWater.Load() {
				a.enqueue(ks)
			}
			return b - n, true
		}
	}
}

// checkLeasedHit is check's fast path for the commonest request: one
// descriptor, found in the memo, on a leased key whose live lease holds
// the tokens. It decides as decide and check do for that case (an allowed
// status from the lease, counted the same way) without their general
// bookkeeping, filling *dec field by field; ok is false, with nothing
// changed (but a dropped key's lastUse), when the request is not that
// case, and check goes on as usual.
func (a *Agent) checkLeasedHit(dec *Decision, me *memoEntry, set *rules.Set, d *Descriptor, hits uint32, t0 int64) (ok bool) {
	r, ks := me.rules[0], me.keys[0]
	n := hitsFor(d, hits)
	if r == nil || r.Unlimited || ks == nil || n <= 0 || !a.leasing(r) {
		return false
	}
	now, ok := a.nowFast()
	if !ok {
		now = a.now()
	}
	left, ok := a.spendLive(ks, now, n)
	if !ok {
		return false
	}
	// As leaseStatus.
	reset := until(ks.resetAt.Load(), now)
	a.allowedHit(dec, set, r, SourceLease, ks.remaining.Load()+left, reset, r.Limit.NextAfter(now, reset), t0)
	return true
}

// allowedHit counts a fast path's check allowed under r (of set) from src,
// SourceLease or SourceStatic, fills *dec for it (as checkAll does for one
// descriptor), and times a sampled check (t0).
func (a *Agent) allowedHit(dec *Decision, set *rules.Set, r *rules.Rule, src Source, remaining int64, resetAfter, nextAfter time.Duration, t0 int64) {
	hint := uintptr(unsafe.Pointer(dec))
	ri := a.met.ruleIndexFor(set)
	slot := ruleLeaseCheck
	if src == SourceStatic {
		slot = ruleStaticCheck
	}
	if c := a.met.oneCheck(hint, ri, r, slot); c != 0 {
		a.met.arm(hint, c)
	} else {
		a.met.ruleDecision(hint, ri, r, &Status{Rule: r, Allowed: true, Source: src})
		a.met.decision(hint, src, true)
	}
	dec.Allowed = true
	dec.Source = src
	dec.Rule = r
	dec.Policy = r.Name
	dec.Quota = int64(r.RequestsPerUnit)
	dec.Window = r.Window
	dec.Remaining = remaining
	dec.ResetAfter = resetAfter
	dec.NextAfter = nextAfter
	if t0 != 0 {
		a.met.checkSeconds.Observe(float64(checkNanos()-t0) / 1e9)
	}
}

// spendLive takes n > 0 tokens from the live lease of ks, a key the
// request memo found, if its balance holds them, as decideLease would,
// and returns the balance left; ok is false, with nothing changed (but a
// dropped key's lastUse), when the key is decided locally, its lease is
// not live, its balance is short or it has left the table.
//
// It takes no shard lock. The refill loop drops a key (shard.remove) by
// setting dropped and then reading the key's counters again, keeping the
// key when they changed; spendLive changes the counters (balance, spent,
// lastUse) and then reads dropped, giving the tokens back when it is set.
// With sequentially consistent atomics one of the two sees the other, so,
// as under the lock, no spend stays on a key that has left the table.
func (a *Agent) spendLive(ks *keyState, now, n int64) (left int64, ok bool) {
	// A key decided locally until now goes the slow way (decideLease
	// resets it). A dropped key is found below, after the spend.
	if ks.local.Load() || now >= ks.expiry.Load() {
		return 0, false
	}
	for {
		b := ks.balance.Load()
		if b < n {
			return 0, false
		}
		if ks.balance.CompareAndSwap(b, b-n) {
			left = b - n
			break
		}
	}
	ks.spent.Add(n)
	if ks.lastUse.Load() != now {
		ks.lastUse.Store(now)
	}
	if ks.dropped.Load() {
		// Dropped, or being dropped (shard.remove): undo, as refund does.
		ks.balance.Add(n)
		ks.spent.Add(-n)
		return 0, false
	}
	if left < ks.lowWater.Load() {
		a.enqueue(ks)
	}
	if ks.dormant.Load() {
		a.wake(ks) // after every change above: see due.go
	}
	return left, true
}

// decideBucket decides from the key's own bucket: the fallback (R/N, burst
// ⌈burst/N⌉) or, with nAgents 1, the full-rate local bucket.
func (a *Agent) decideBucket(ks *keyState, r *rules.Rule, now, n int64, consume bool, nAgents uint32, src Source) (Status, outcome) {
	ks.mu.Lock()
	if ks.fbRule != r || ks.fbN != nAgents {
		a.rebindBucket(ks, r, nAgents, now)
	}
	if ks.fbRebase {
		ks.fbRebase = false
		rebase(ks.fbLimit, &ks.fbState, ks.fbAvail, ks.fbAt, now)
	}
	var res bucket.Result
	var oc outcome
	if consume && n > 0 {
		res = ks.fbLimit.AllowN(&ks.fbState, now, n)
		if res.Allowed {
			oc = outcome{ks: ks, taken: n, kind: takeBucket}
		}
	} else {
		// Evaluate on a copy: nothing changes. n == 0 is allowed unless
		// the bucket is in debt (bucket.Limit.AllowN's convention).
		cp := ks.fbState
		res = ks.fbLimit.AllowN(&cp, now, n)
		peek := ks.fbLimit.Peek(ks.fbState, now)
		res.Remaining, res.ResetAfter = peek.Remaining, peek.ResetAfter
	}
	next := ks.fbLimit.NextAfter(now, res.ResetAfter) // R/N in fallback, not the rule's R
	if !res.Allowed {
		res.RetryAfter = shareRetryAfter(r, ks.fbLimit, now, n, res.RetryAfter)
	}
	ks.mu.Unlock()
	if oc.taken > 0 {
		ks.spent.Add(n)
	}
	st := Status{
		Rule:       r,
		Allowed:    res.Allowed,
		Remaining:  res.Remaining,
		ResetAfter: res.ResetAfter,
		NextAfter:  next,
		Source:     src,
	}
	if !res.Allowed {
		st.RetryAfter = res.RetryAfter
	}
	return st, oc
}

// rebindBucket derives the key's bucket limit for rule r shared by nAgents;
// ks.mu is held. The state is kept when the algorithm is unchanged (so a
// change of N does not hand out a fresh burst), and reset to full otherwise.
func (a *Agent) rebindBucket(ks *keyState, r *rules.Rule, nAgents uint32, now int64) {
	l, err := fallbackLimit(r.Limit, nAgents)
	if err != nil {
		a.logs.log(a.log, "fallback_limit", "agent: cannot derive the fallback limit; using the full rule limit",
			"rule", r.Name, "agents", nAgents, "err", err)
		l = r.Limit
	}
	if ks.fbRule == nil || ks.fbLimit.Algorithm() != l.Algorithm() {
		ks.fbState = bucket.State{}
	} else {
		// Keep what the old state holds, clamped to the new capacity.
		rebase(l, &ks.fbState, capacity(l, now), now, now)
	}
	ks.fbRule, ks.fbN, ks.fbLimit = r, nAgents, l
}

// closedRetryAfter is the Retry-After of a failure_mode: closed denial while
// the allocator is unreachable: until the breaker's next probe, at least 1s.
func (a *Agent) closedRetryAfter(now int64) time.Duration {
	return max(until(a.nextProbe.Load(), now), time.Second)
}

func until(t, now int64) time.Duration {
	if t <= now {
		return 0
	}
	return time.Duration(t - now)
}

// enqueue hands ks to the refill loop without blocking: when the queue is
// full the loop's next scan finds the key anyway.
func (a *Agent) enqueue(ks *keyState) {
	if ks.queued.Load() || !ks.queued.CompareAndSwap(false, true) {
		return
	}
	select {
	case a.pending <- ks:
	default:
		ks.queued.Store(false)
	}
}

// decideRemote asks Config.Redis. ok is false when the backend failed.
func (a *Agent) decideRemote(ctx context.Context, r *rules.Rule, domain string, entries []rules.Entry, n int64, consume bool) (Status, bool) {
	if !consume {
		n = 0
	}
	// Its own buffer: handing a slice to an interface method makes it
	// escape, which must not cost the lease path an allocation.
	var buf [keyBufLen]byte
	key := rules.AppendKey(buf[:0], r, domain, entries)
	res, err := a.redis.AllowN(ctx, r, key, n)
	if err != nil {
		a.met.redisError()
		a.logs.log(a.log, "redis_error", "agent: redis backend failed; applying the rule's failure mode",
			"rule", r.Name, "failure_mode", r.FailureMode.String(), "err", err)
		return Status{}, false
	}
	st := Status{Rule: r, Allowed: res.Allowed, Remaining: res.Remaining, ResetAfter: res.ResetAfter, Source: SourceRedis}
	if !res.Allowed {
		st.RetryAfter = res.RetryAfter
	}
	return st, true
}

// refundRemote gives tokens the Redis backend took back to it, when the
// backend can (RemoteRefunder), for a request another descriptor denied.
// Best effort: a failure leaves the tokens spent (under-admission, never
// over-admission).
func (a *Agent) refundRemote(oc *outcome, r *rules.Rule, domain string, entries []rules.Entry) {
	rf, ok := a.redis.(RemoteRefunder)
	if !ok || oc.taken <= 0 {
		return
	}
	var buf [keyBufLen]byte
	key := rules.AppendKey(buf[:0], r, domain, entries)
	ctx, cancel := context.WithTimeout(context.Background(), remoteRefundTimeout)
	defer cancel()
	if err := rf.GiveBack(ctx, r, key, oc.taken); err != nil {
		a.met.redisError()
	}
	oc.taken = 0
}

// remoteRefundTimeout bounds a refund to the Redis backend.
const remoteRefundTimeout = 50 * time.Millisecond
