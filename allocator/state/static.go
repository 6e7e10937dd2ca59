package state

import (
	"encoding/binary"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Static shares (docs/static-shares.md). With N static slots (a
// StaticCommand; 0, the default, is off and leaves c.static nil), an agent
// that asks (AcquireRequest.static_shares) holds one of N slots and decides
// the keys of static-eligible rules (rules.Rule.StaticShare) that are not
// in the hot-key set from a share of rate R/N and burst ⌊B/N⌋ of their
// limit, alone, for up to the static TTL after sending a call.
//
// The state keeps the slots' holders, each with the hot-set version it
// joined at and the latest version it acknowledged (the request's
// hot_version); the hot-key set (key hashes), its version and a bounded log
// of its changes, from which each answer brings the agent's copy up to
// date. Any coordination of an eligible key that is not hot makes it hot
// (promote). The key's bucket then starts with the shares nobody may be
// deciding from: the free slots' and the promoting holder's own, and their
// tokens (a full share for each free slot, static_left for the promoter).
// Until the transition ends its limit is Share(k, N), k being N less the
// other holders that may still decide it (those whose acknowledged version
// is older than the one that made it hot), so that every share is used by
// one bucket at a time. The transition ends when every holder has
// acknowledged it, or the TTL after it began (every answer from before has
// lapsed); the key then has its whole limit and keeps its balance. The
// idle sweep removes a key from the set when it drops it, never during a
// transition.
//
// A change of N or the TTL revokes every slot: answers give none for one
// TTL in force (the holders' last answers lapse meanwhile, and count in
// the transitions as before), after which the new settings take force with
// no holder.
type staticState struct {
	n   uint32 // slots in force (≥ 1)
	ttl int64  // the TTL in force, ns
	// paused: a change is under way; until pauseUntil no slot is granted
	// or answered, then nextN (0: off) and nextTTL take force.
	paused     bool
	pauseUntil int64
	nextN      uint32
	nextTTL    int64

	holders map[uint32]*holder // by agent number
	acks    []uint64           // the holders' effective acks (holder.eff), sorted

	hot   map[uint64]struct{}
	trans map[uint64]*transRec // hot keys whose slot is not yet under the whole limit
	// version is the hot set's; the log holds the changes that made the
	// versions (logStart, version], in order.
	version, logStart uint64
	log               []hotChange
	// ends: the transitions' ends in the order they began, which is their
	// order (metrics only: derived, not persisted as such).
	ends []int64

	// The eligibility of rules of elRules under n, by rule ID (0:
	// unknown, 1: eligible, 2: not); derived.
	elRules *rules.Set
	elig    []uint8
	// whole is the hot set sorted, as of version wholeAt (the answers
	// that carry the whole set share it, read-only); derived.
	whole   []uint64
	wholeAt uint64
}

// holder is a slot's holder: join is the hot-set version of the answer
// that gave it the slot, ack the latest version it acknowledged.
type holder struct{ join, ack uint64 }

// eff is the version the holder decides nothing hot at or before.
func (h *holder) eff() uint64 { return max(h.ack, h.join) }

// transRec is a hot key's transition: v is the hot-set version that made
// it hot, end when it ends at the latest, promoter the holder whose share
// the key took over (0: none), whole the rule's limit. k is the number of
// shares the key's slot is under; 0: none, the slot is under one share
// (the placeholder) holding no tokens, only a debt, as of at.
type transRec struct {
	v        uint64
	end      int64
	promoter uint32
	k        uint32
	at       int64
	whole    bucket.Limit
	// merged: the holders (by agent number) whose shares merged into the
	// key's bucket during the transition, by acknowledging its version or
	// by a promotion sent before they knew it hot, with the tokens those
	// shares held (a full share, or what a static_report or the promotion's
	// static_left said), until the key's next touch credits them (then -1).
	// A share merges once.
	merged map[uint32]int64
}

type hotChange struct {
	h       uint64
	removed bool
}

const (
	// hotLogMax is how many hot-set changes answers are brought up to
	// date from; an agent further behind gets the whole set.
	hotLogMax = 1 << 16
	// MaxStaticSlots bounds StaticCommand.slots.
	MaxStaticSlots = 1<<16 - 1
)

// StaticSettings are the static shares' replicated settings.
type StaticSettings struct {
	Slots uint32        // 0: off
	TTL   time.Duration // 0 when off
}

// StaticSettings returns the settings in effect or, while a change is
// under way, the ones it brings: the leader compares them with its flags.
func (s *State) StaticSettings() StaticSettings {
	s.mu.RLock()
	defer s.mu.RUnlock()
	st := s.st.static
	switch {
	case st == nil:
		return StaticSettings{}
	case st.paused:
		return StaticSettings{Slots: st.nextN, TTL: time.Duration(st.nextTTL)}
	}
	return StaticSettings{Slots: st.n, TTL: time.Duration(st.ttl)}
}

// StaticStatus returns the static shares' state at now for ClusterStatus
// (nil when static shares are off).
func (s *State) StaticStatus(now int64) *allotv1.StaticStatus {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	ss := c.static
	if ss == nil {
		return nil
	}
	st := &allotv1.StaticStatus{
		Slots: ss.n, TtlMs: ss.ttl / int64(time.Millisecond), SlotsHeld: uint32(len(ss.holders)),
		HotKeys: uint64(len(ss.hot)), HotVersion: ss.version, Transitions: uint64(ss.underWay(now)),
		Paused: ss.paused, MaxRefillMs: ss.maxRefill(c.cfg.AgentTTL).Milliseconds(),
	}
	if ss.paused {
		st.NextSlots, st.NextTtlMs = ss.nextN, ss.nextTTL/int64(time.Millisecond)
	}
	return st
}

// inspectStatic sets resp's static shares fields for key h of rule at now
// (read-only: the caller holds the read lock).
func (c *core) inspectStatic(resp *allotv1.InspectKeyResponse, rule *rules.Rule, h uint64, now int64) {
	ss := c.static
	if ss == nil {
		return
	}
	resp.StaticSlots = ss.n
	if _, ok := rule.StaticShare(ss.n, ss.maxRefill(c.cfg.AgentTTL)); !ok {
		resp.Static = "not_eligible"
		return
	}
	if _, hot := ss.hot[h]; !hot {
		resp.Static = "static"
		return
	}
	resp.Static = "hot"
	if tr := ss.trans[h]; tr != nil && !ss.over(tr, now) {
		resp.Static, resp.StaticShares = "transition", ss.kNow(tr)
	}
}

// StaticCommand returns the command that sets ss.
func StaticCommand(ss StaticSettings) *allotv1.Command {
	return &allotv1.Command{Cmd: &allotv1.Command_Static{Static: &allotv1.StaticCommand{
		Slots: ss.Slots, TtlMs: ss.TTL.Milliseconds()}}}
}

// applyStatic applies a StaticCommand.
func (c *core) applyStatic(cmd *allotv1.StaticCommand, now int64) error {
	n, ttlMs := cmd.GetSlots(), cmd.GetTtlMs()
	switch {
	case n > MaxStaticSlots:
		return fmt.Errorf("%w: static slots %d, at most %d", ErrInvalid, n, MaxStaticSlots)
	case n > 0 && ttlMs <= 0:
		return fmt.Errorf("%w: static ttl_ms %d must be > 0", ErrInvalid, ttlMs)
	case n > 0 && time.Duration(ttlMs)*time.Millisecond >= c.cfg.AgentTTL:
		return fmt.Errorf("%w: static ttl %v must be less than the agent TTL %v", ErrInvalid,
			time.Duration(ttlMs)*time.Millisecond, c.cfg.AgentTTL)
	}
	ttl := ttlMs * int64(time.Millisecond)
	if n == 0 {
		ttl = 0
	}
	c.now = now
	c.staticTick(now)
	s := c.static
	if s == nil {
		if n > 0 {
			c.static = newStatic(n, ttl, uint64(now))
			c.hotAllTracked(now)
		}
		return nil
	}
	if s.paused {
		s.nextN, s.nextTTL = n, ttl
		return nil
	}
	if n == s.n && ttl == s.ttl {
		return nil
	}
	// No slot for one old TTL, while the holders' last answers lapse, and
	// then for the longest refill an eligible share may take: every old
	// share the new holders' start full in place of is full again.
	s.paused, s.pauseUntil, s.nextN, s.nextTTL = true, now+s.ttl+int64(s.maxRefill(c.cfg.AgentTTL)), n, ttl
	return nil
}

// newStatic returns the static state of n slots and TTL ttl, its hot set
// empty at version base (the apply time in ns, so that a version is never
// reused after static shares were off, nor after a restore).
func newStatic(n uint32, ttl int64, base uint64) *staticState {
	return &staticState{n: n, ttl: ttl, holders: make(map[uint32]*holder), hot: make(map[uint64]struct{}),
		trans: make(map[uint64]*transRec), version: base, logStart: base}
}

// hotAllTracked makes every tracked key hot that is not idle, in hash
// order: when static shares turn on, when new settings take force and
// when the rules change, a key whose rule was not eligible until then may
// be leased or its bucket drained, and no agent may decide it from a full
// share. An idle key (no lease, its bucket full) is as if untracked: full
// shares admit no more than it would.
//
// Every hot key is tracked (a key joins the set as it is tracked, and
// leaves it as the sweep drops it: hotTracked), so with as many hot keys
// as tracked ones every tracked key is hot and there is nothing to look
// up: a rules update then costs no walk of the table.
func (c *core) hotAllTracked(now int64) {
	s := c.static
	if len(s.hot) == c.tab.n {
		return
	}
	for i := 0; i < c.tab.size; i++ {
		if sl := c.tab.at(i); sl.lim != 0 && (sl.link != 0 || !idle(c.lims.get(sl.lim), sl.st, now)) {
			if _, ok := s.hot[sl.hash]; !ok {
				s.hot[sl.hash] = struct{}{}
				s.change(sl.hash, false)
			}
		}
	}
}

// staticTick ends a pause that is over: the new settings take force with
// no holder (nextN 0: static shares are off and their state goes).
func (c *core) staticTick(now int64) {
	s := c.static
	if s == nil || !s.paused || now < s.pauseUntil {
		return
	}
	if s.nextN == 0 {
		c.static = nil
		return
	}
	s.n, s.ttl = s.nextN, s.nextTTL
	s.paused, s.pauseUntil, s.nextN, s.nextTTL = false, 0, 0, 0
	clear(s.holders)
	s.acks = s.acks[:0]
	s.elRules, s.elig = nil, s.elig[:0]
	c.hotAllTracked(now) // rules may be eligible under them that were not
}

// change logs a change of the hot set.
func (s *staticState) change(h uint64, removed bool) {
	s.version++
	s.log = append(s.log, hotChange{h, removed})
	if len(s.log) > 2*hotLogMax {
		drop := len(s.log) - hotLogMax
		s.log = s.log[:copy(s.log, s.log[drop:])]
		s.logStart += uint64(drop)
	}
}

func (s *staticState) ackInsert(v uint64) {
	i, _ := slices.BinarySearch(s.acks, v)
	s.acks = slices.Insert(s.acks, i, v)
}

func (s *staticState) ackRemove(v uint64) {
	if i, ok := slices.BinarySearch(s.acks, v); ok {
		s.acks = slices.Delete(s.acks, i, i+1)
	}
}

// kNow is the number of shares a key in transition tr has now: N less the
// holders other than its promoter that have not acknowledged its version.
func (s *staticState) kNow(tr *transRec) uint32 {
	lag, _ := slices.BinarySearch(s.acks, tr.v) // holders with eff < v
	if tr.promoter != 0 {
		if h := s.holders[tr.promoter]; h != nil && h.eff() < tr.v {
			lag--
		}
	}
	return s.n - uint32(lag)
}

// over reports whether tr's transition is over at now.
func (s *staticState) over(tr *transRec, now int64) bool {
	return now >= tr.end || s.kNow(tr) >= s.n
}

// maxRefill is the longest a static-eligible share may take to refill
// its burst: the agent TTL less the static TTL. A slot's holder is
// forgotten an agent TTL after its last call, and its last answer lapsed a
// static TTL after that call, so its shares have refilled in full by the
// time its slot goes to another agent, which starts them full.
func (s *staticState) maxRefill(agentTTL time.Duration) time.Duration {
	return agentTTL - time.Duration(s.ttl)
}

// eligible reports whether keys of r are decided from static shares.
func (s *staticState) eligible(set *rules.Set, r *rules.Rule, agentTTL time.Duration) bool {
	if s.elRules != set {
		s.elRules, s.elig = set, s.elig[:0]
	}
	if r.ID >= len(s.elig) {
		s.elig = append(s.elig, make([]uint8, r.ID+1-len(s.elig))...)
	}
	switch s.elig[r.ID] {
	case 1:
		return true
	case 2:
		return false
	}
	_, ok := r.StaticShare(s.n, s.maxRefill(agentTTL))
	s.elig[r.ID] = 2
	if ok {
		s.elig[r.ID] = 1
	}
	return ok
}

// share is k of the n shares of whole; k = 0 gives the placeholder, one
// share (a key with none holds no tokens under it: transRec).
func (s *staticState) share(whole bucket.Limit, k uint32) bucket.Limit {
	if k >= s.n {
		return whole
	}
	l, ok := whole.Share(max(k, 1), s.n)
	if !ok { // not for an eligible rule's limit
		panic(fmt.Sprintf("state: share %d of %d of %v", k, s.n, whole))
	}
	return l
}

// setLevel sets the key at idx under lim to hold level tokens at now (a
// negative level: a debt).
func (c *core) setLevel(idx int, lim bucket.Limit, level, now int64) {
	var ns bucket.State
	if capacity := lim.Peek(ns, now).Remaining; level < capacity {
		lim.Debit(&ns, now, capacity-level)
	}
	c.tab.mut(c, idx).st = ns
}

// debtOf is what a key under no share (k = 0) holds: its debt, as of tr.at.
func (c *core) debtOf(idx int, tr *transRec) int64 {
	sl := c.tab.at(idx)
	return min(c.lims.get(sl.lim).Peek(sl.st, tr.at).Remaining, 0)
}

// staticSlot returns the table index of key h of rule (whole: its limit)
// and the limit it is under now, making the key hot if it is not, when
// static shares are on; -1 when the rule is not static-eligible or the key
// is under its whole limit (the caller goes on as without static shares).
// agent is the caller's number (0: none), promote and left its
// KeyAcquire.promote and static_left.
func (c *core) staticSlot(rule *rules.Rule, h uint64, whole bucket.Limit, agent uint32, promote bool, left, now int64) (int, bucket.Limit) {
	s := c.static
	if !s.eligible(c.rules, rule, c.cfg.AgentTTL) {
		return -1, whole
	}
	if _, hot := s.hot[h]; !hot {
		return c.makeHot(h, whole, agent, promote, left, now)
	}
	tr := s.trans[h]
	if tr == nil {
		return -1, whole
	}
	// The call's static reports were applied before any of its keys
	// (staticReports).
	if promote && agent != tr.promoter {
		// A holder that promotes a key it did not know hot stopped
		// deciding it from its share when it sent the call: the share
		// merges now with what it held then.
		if hd := s.holders[agent]; hd != nil && hd.eff() < tr.v && now < tr.end {
			s.merge(tr, agent, left)
		}
	}
	credit := tr.credit()
	k := s.kNow(tr)
	if now >= tr.end || k >= s.n {
		k = s.n
	}
	lim := s.share(whole, k)
	if k >= s.n {
		// Over: the whole limit from the end (the acknowledgements' times
		// are not known: from now if they ended it sooner).
		var st bucket.State
		ok := false
		if i := c.tab.find(h); i >= 0 {
			st, ok = c.carried(c.tab.at(i), tr, min(now, tr.end)), true
		}
		idx := c.slotFor(h, whole, now)
		if ok {
			whole.GiveBack(&st, now, credit)
			c.tab.mut(c, idx).st = st
		}
		delete(s.trans, h)
		return idx, whole
	}
	var idx int
	if tr.k == 0 {
		// No share so far: the key carries its debt, no refill.
		i := c.tab.find(h)
		debt := int64(0)
		if i >= 0 {
			debt = c.debtOf(i, tr)
		}
		idx = c.slotFor(h, lim, now)
		c.setLevel(idx, lim, debt, now)
		tr.at = now
	} else {
		idx = c.slotFor(h, lim, now) // carries the balance over
	}
	if credit > 0 {
		lim.GiveBack(&c.tab.mut(c, idx).st, now, credit)
	}
	tr.k = k
	return idx, lim
}

// carried returns the state of the key of slot sl, in transition tr,
// under its whole limit from time at on: its balance carried over (its
// debt only if it held no share).
func (c *core) carried(sl *slot, tr *transRec, at int64) bucket.State {
	lim := c.lims.get(sl.lim)
	if tr.k > 0 {
		return carryOver(lim, sl.st, tr.whole, at)
	}
	var ns bucket.State
	debt := min(lim.Peek(sl.st, tr.at).Remaining, 0)
	tr.whole.Debit(&ns, at, tr.whole.Peek(ns, at).Remaining-debt)
	return ns
}

// transBucket returns the limit and state of the key of slot sl (hash h)
// as its next touch at now would find them when it is in a transition
// (ok false otherwise): under the shares it has then, or its whole limit
// once the transition is over, with the merged shares not yet credited
// given back, as staticSlot does. It changes nothing (InspectKey).
func (c *core) transBucket(sl *slot, h uint64, now int64) (lim bucket.Limit, st bucket.State, ok bool) {
	s := c.static
	if s == nil || s.trans[h] == nil {
		return lim, st, false
	}
	tr := s.trans[h]
	credit := int64(0)
	for _, m := range tr.merged {
		credit += max(m, 0)
	}
	k := s.kNow(tr)
	switch {
	case now >= tr.end || k >= s.n:
		lim, st = tr.whole, c.carried(sl, tr, min(now, tr.end))
	case tr.k == 0:
		// No share so far: the key carries its debt, no refill.
		lim = s.share(tr.whole, k)
		debt := min(c.lims.get(sl.lim).Peek(sl.st, tr.at).Remaining, 0)
		if capacity := lim.Peek(st, now).Remaining; debt < capacity {
			lim.Debit(&st, now, capacity-debt)
		}
	default:
		lim = s.share(tr.whole, k)
		st = carryOver(c.lims.get(sl.lim), sl.st, lim, now)
	}
	if credit > 0 {
		lim.GiveBack(&st, now, credit)
	}
	return lim, st, true
}

// makeHot makes key h hot at now and sets its bucket to the shares nobody
// else may decide it from, with their tokens (see staticState).
func (c *core) makeHot(h uint64, whole bucket.Limit, agent uint32, promote bool, left, now int64) (int, bucket.Limit) {
	s := c.static
	s.hot[h] = struct{}{}
	s.change(h, false)
	var pr uint32
	if promote && agent != 0 && s.holders[agent] != nil {
		pr = agent
	}
	others := uint32(len(s.holders))
	if pr != 0 {
		others--
	}
	k := s.n - others
	per := whole.Burst() / int64(s.n)
	level := int64(s.n-uint32(len(s.holders))) * per
	if pr != 0 {
		level += min(max(left, 0), per)
	}
	if k == 0 {
		level = 0
	}
	lim := s.share(whole, k)
	idx := c.slotFor(h, lim, now)
	c.setLevel(idx, lim, level, now)
	if k < s.n {
		s.trans[h] = &transRec{v: s.version, end: now + s.ttl, promoter: pr, k: k, at: now, whole: whole}
		s.ends = append(s.ends, now+s.ttl)
	}
	return idx, lim
}

// staticIdle reports whether the tracked key sl, under limit lim, may be
// dropped at now with static shares on: not during a transition, and
// idle under its whole limit.
func (c *core) staticIdle(sl *slot, lim bucket.Limit, now int64) bool {
	s := c.static
	tr := s.trans[sl.hash]
	if tr == nil {
		return idle(lim, sl.st, now)
	}
	if !s.over(tr, now) {
		return false
	}
	return idle(tr.whole, c.carried(sl, tr, min(now, tr.end)), now)
}

// hotTracked returns a hot key that is not tracked (ok false: none), which
// would break hotAllTracked's count; for tests.
func (c *core) hotTracked() (h uint64, ok bool) {
	if c.static == nil {
		return 0, true
	}
	for h := range c.static.hot {
		if c.tab.find(h) < 0 {
			return h, false
		}
	}
	return 0, true
}

// unhot removes a key the sweep drops from the hot set.
func (c *core) unhot(h uint64) {
	s := c.static
	if _, ok := s.hot[h]; ok {
		delete(s.hot, h)
		delete(s.trans, h)
		s.change(h, true)
	}
}

// staticForget frees a forgotten agent's slot.
func (c *core) staticForget(num uint32) {
	if s := c.static; s != nil {
		if hd := s.holders[num]; hd != nil {
			s.ackRemove(hd.eff())
			delete(s.holders, num)
		}
	}
}

// staticAck records a call's hot_version as its agent's acknowledgement
// (a version the state has not reached acknowledges nothing). The holder's
// shares of the keys in transition that the versions it acknowledges now
// made hot merge into their buckets: a full share each (pending), less
// what a static_report of the same call says its share had spent
// (staticReport).
func (s *staticState) staticAck(num uint32, hv uint64, now int64) {
	hd := s.holders[num]
	if hd == nil || hv > s.version || hv <= hd.ack {
		return
	}
	old := hd.eff()
	hd.ack = hv
	nv := hd.eff()
	if nv == old {
		return
	}
	s.ackRemove(old)
	s.ackInsert(nv)
	// The log holds the changes that made versions (logStart, version].
	from := max(old, s.logStart)
	for v := from + 1; v <= nv; v++ {
		ch := s.log[v-s.logStart-1]
		if ch.removed {
			continue
		}
		tr := s.trans[ch.h]
		if tr == nil || tr.v != v || tr.promoter == num || now >= tr.end {
			continue
		}
		s.merge(tr, num, tr.whole.Burst()/int64(s.n))
	}
}

// merge records that agent num's share of tr's key merged holding left
// tokens, unless it merged before.
func (s *staticState) merge(tr *transRec, num uint32, left int64) {
	if _, ok := tr.merged[num]; ok {
		return
	}
	if tr.merged == nil {
		tr.merged = make(map[uint32]int64)
	}
	tr.merged[num] = min(max(left, 0), tr.whole.Burst()/int64(s.n))
}

// staticReport applies a static_report of agent num for the key in
// transition tr: the share it merged by acknowledging tr's version in this
// call held left tokens, not a full share. A report for a share whose
// tokens were credited already, or that has not merged, changes nothing.
func (s *staticState) staticReport(tr *transRec, num uint32, left int64) {
	if c, ok := tr.merged[num]; ok && c >= 0 {
		tr.merged[num] = min(max(left, 0), c)
	}
}

// staticReports applies the static reports of a call of agent num,
// before any of its keys is touched: a share its acknowledgement merged
// (staticAck) counts what the report says it held, whichever entry of the
// call reports it and whatever else that entry asks (a touch credits the
// merged shares; a report applied later could not lower one).
func (c *core) staticReports(keys []keyArgs, num uint32) {
	s := c.static
	if len(s.trans) == 0 {
		return
	}
	for i := range keys {
		k := &keys[i]
		if !k.staticReport {
			continue
		}
		r := c.rules.Match(k.domain, k.ents)
		if r == nil {
			continue
		}
		if tr := s.trans[rules.KeyHash(r, k.domain, k.ents)]; tr != nil {
			s.staticReport(tr, num, k.staticLeft)
		}
	}
}

// credit takes the tokens of tr's merged shares not yet credited.
func (tr *transRec) credit() int64 {
	sum := int64(0)
	for num, c := range tr.merged {
		if c > 0 {
			sum += c
		}
		tr.merged[num] = -1
	}
	return sum
}

// staticAnswer gives the caller a slot if it has none and one is free,
// and returns its answer's StaticShares: its slot and the hot set's
// changes since hv (the whole set when hv is 0, older than the log or
// newer than the set).
func (c *core) staticAnswer(num uint32, hv uint64) *allotv1.StaticShares {
	s := c.static
	hd := s.holders[num]
	if hd == nil && !s.paused && uint32(len(s.holders)) < s.n {
		hd = &holder{join: s.version}
		s.holders[num] = hd
		s.ackInsert(hd.eff())
	}
	out := &allotv1.StaticShares{HotVersion: s.version}
	if hd != nil && !s.paused {
		out.Slots, out.ValidMs = s.n, s.ttl/int64(time.Millisecond)
		out.MaxRefillMs = s.maxRefill(c.cfg.AgentTTL).Milliseconds()
	}
	switch {
	case hv == s.version:
	case hv == 0 || hv > s.version || hv < s.logStart:
		out.HotReset = true
		if s.whole == nil || s.wholeAt != s.version {
			s.whole, s.wholeAt = slices.Sorted(maps.Keys(s.hot)), s.version
		}
		out.HotAdded = s.whole
	default:
		seen := make(map[uint64]bool, min(int(s.version-hv), 1024))
		for i := len(s.log) - 1; i >= int(hv-s.logStart); i-- {
			ch := s.log[i]
			if seen[ch.h] {
				continue
			}
			seen[ch.h] = true
			if ch.removed {
				out.HotRemoved = append(out.HotRemoved, ch.h)
			} else {
				out.HotAdded = append(out.HotAdded, ch.h)
			}
		}
	}
	return out
}

// transitions returns how many transitions began less than a TTL before
// now (some may be over sooner: every holder acknowledged them).
func (s *staticState) transitions(now int64) int {
	i, _ := slices.BinarySearch(s.ends, now+1)
	return len(s.ends) - i
}

// underWay returns how many transitions are not over at now (the
// metric's transitions counts those begun less than a TTL before).
func (s *staticState) underWay(now int64) int {
	n := 0
	for _, tr := range s.trans {
		if !s.over(tr, now) {
			n++
		}
	}
	return n
}

// trimEnds forgets the ends before now.
func (s *staticState) trimEnds(now int64) {
	if i, _ := slices.BinarySearch(s.ends, now+1); i > 0 {
		s.ends = s.ends[:copy(s.ends, s.ends[i:])]
	}
}

// staticView is the static state as a snapshot captures it: copies, so
// that Persist encodes it outside the lock (the hot set is sorted then).
type staticView struct {
	st      staticState // scalars; its maps and slices are not the live ones
	holders []uint32    // agent numbers, with st.holders copied
	hot     []uint64
	trans   []uint64 // hashes, with st.trans copied
}

// captureStatic copies the static state for a snapshot (nil when off).
// It runs under the lock: O(hot keys) of copying, no sorting.
func (c *core) captureStatic() *staticView {
	s := c.static
	if s == nil {
		return nil
	}
	v := &staticView{st: staticState{n: s.n, ttl: s.ttl, paused: s.paused, pauseUntil: s.pauseUntil,
		nextN: s.nextN, nextTTL: s.nextTTL, version: s.version, logStart: s.logStart, log: slices.Clone(s.log),
		holders: make(map[uint32]*holder, len(s.holders)), trans: make(map[uint64]*transRec, len(s.trans))}}
	for num, hd := range s.holders {
		cp := *hd
		v.st.holders[num] = &cp
		v.holders = append(v.holders, num)
	}
	for h, tr := range s.trans {
		cp := *tr
		cp.merged = maps.Clone(tr.merged)
		v.st.trans[h] = &cp
		v.trans = append(v.trans, h)
	}
	v.hot = slices.Collect(maps.Keys(s.hot))
	return v
}

// encode encodes a captured static state:
//
//	uvarint n, varint ttl ns, byte paused, varint pause until,
//	uvarint next n, varint next ttl, uvarint version, uvarint log start,
//	uvarint log length, log × (fixed64 key hash, byte removed),
//	uvarint holders, holders × (uvarint agent number, uvarint join,
//	uvarint ack) in agent order, uvarint hot keys, hot × fixed64 hash in
//	order, uvarint transitions, transitions × (fixed64 hash, uvarint v,
//	varint end, uvarint promoter, uvarint k, varint at, byte algorithm,
//	varint quota, varint window ns, varint burst) in hash order
func (v *staticView) encode() []byte {
	s := &v.st
	b := binary.AppendUvarint(nil, uint64(s.n))
	b = binary.AppendVarint(b, s.ttl)
	paused := byte(0)
	if s.paused {
		paused = 1
	}
	b = append(b, paused)
	b = binary.AppendVarint(b, s.pauseUntil)
	b = binary.AppendUvarint(b, uint64(s.nextN))
	b = binary.AppendVarint(b, s.nextTTL)
	b = binary.AppendUvarint(b, s.version)
	b = binary.AppendUvarint(b, s.logStart)
	b = binary.AppendUvarint(b, uint64(len(s.log)))
	for _, ch := range s.log {
		b = binary.LittleEndian.AppendUint64(b, ch.h)
		rm := byte(0)
		if ch.removed {
			rm = 1
		}
		b = append(b, rm)
	}
	slices.Sort(v.holders)
	b = binary.AppendUvarint(b, uint64(len(v.holders)))
	for _, num := range v.holders {
		hd := s.holders[num]
		b = binary.AppendUvarint(b, uint64(num))
		b = binary.AppendUvarint(b, hd.join)
		b = binary.AppendUvarint(b, hd.ack)
	}
	slices.Sort(v.hot)
	b = binary.AppendUvarint(b, uint64(len(v.hot)))
	for _, h := range v.hot {
		b = binary.LittleEndian.AppendUint64(b, h)
	}
	slices.Sort(v.trans)
	b = binary.AppendUvarint(b, uint64(len(v.trans)))
	for _, h := range v.trans {
		tr := s.trans[h]
		b = binary.LittleEndian.AppendUint64(b, h)
		b = binary.AppendUvarint(b, tr.v)
		b = binary.AppendVarint(b, tr.end)
		b = binary.AppendUvarint(b, uint64(tr.promoter))
		b = binary.AppendUvarint(b, uint64(tr.k))
		b = binary.AppendVarint(b, tr.at)
		b = append(b, byte(tr.whole.Algorithm()))
		b = binary.AppendVarint(b, tr.whole.Quota())
		b = binary.AppendVarint(b, int64(tr.whole.Window()))
		b = binary.AppendVarint(b, tr.whole.Burst())
		nums := slices.Sorted(maps.Keys(tr.merged))
		b = binary.AppendUvarint(b, uint64(len(nums)))
		for _, num := range nums {
			b = binary.AppendUvarint(b, uint64(num))
			b = binary.AppendVarint(b, tr.merged[num])
		}
	}
	return b
}

// decodeStatic restores the static state encoded by staticView.encode, after
// the agents and keys, checking it.
func (c *core) decodeStatic(b []byte) error {
	d := &dec{b: b}
	n := uint32(d.uvarintMax(MaxStaticSlots, "static slots"))
	s := newStatic(n, d.varint(), 0)
	s.paused = d.uvarintMax(1, "static pause") == 1
	s.pauseUntil = d.varint()
	s.nextN = uint32(d.uvarintMax(MaxStaticSlots, "static slots"))
	s.nextTTL = d.varint()
	s.version, s.logStart = d.uvarint(), d.uvarint()
	nl := d.count("hot-set log")
	if d.err == nil && (n == 0 || s.ttl <= 0 || s.logStart > s.version || s.version-s.logStart != uint64(nl) ||
		nl > 2*hotLogMax || (!s.paused && (s.pauseUntil != 0 || s.nextN != 0 || s.nextTTL != 0)) ||
		(s.paused && (s.nextN == 0) != (s.nextTTL == 0)) || s.nextTTL < 0) {
		return corrupt("static settings or hot-set log")
	}
	s.log = make([]hotChange, 0, nl)
	for i := 0; i < nl && d.err == nil; i++ {
		s.log = append(s.log, hotChange{h: d.fixed64(), removed: d.uvarintMax(1, "hot-set change") == 1})
	}
	nh := d.count("static holders")
	prev := uint32(0)
	for i := 0; i < nh && d.err == nil; i++ {
		num := uint32(d.uvarintMax(math.MaxUint32, "static holder"))
		hd := &holder{join: d.uvarint(), ack: d.uvarint()}
		if d.err != nil {
			break
		}
		if num <= prev || c.byNum[num] == nil || hd.join > s.version || hd.ack > s.version || uint32(nh) > n {
			return corrupt("static holder %d", num)
		}
		prev = num
		s.holders[num] = hd
		s.acks = append(s.acks, hd.eff())
	}
	slices.Sort(s.acks)
	nk := d.count("hot keys")
	var ph uint64
	for i := 0; i < nk && d.err == nil; i++ {
		h := d.fixed64()
		if d.err == nil && i > 0 && h <= ph {
			return corrupt("hot keys out of order")
		}
		ph = h
		s.hot[h] = struct{}{}
	}
	nt := d.count("transitions")
	ph = 0
	for i := 0; i < nt && d.err == nil; i++ {
		h := d.fixed64()
		tr := &transRec{v: d.uvarint(), end: d.varint(), promoter: uint32(d.uvarintMax(math.MaxUint32, "promoter")),
			k: uint32(d.uvarintMax(MaxStaticSlots, "transition shares")), at: d.varint()}
		alg, quota, window, burst := bucket.Algorithm(d.byte()), d.varint(), d.varint(), d.varint()
		if d.err != nil {
			break
		}
		l, err := bucket.NewLimit(alg, quota, time.Duration(window), burst)
		if _, hot := s.hot[h]; err != nil || !hot || (i > 0 && h <= ph) || tr.v > s.version || tr.k >= n ||
			c.tab.find(h) < 0 {
			return corrupt("transition of key %016x", h)
		}
		if _, ok := l.Share(1, n); !ok {
			return corrupt("transition of key %016x: limit %v has no share", h, l)
		}
		nm := d.count("merged shares")
		prevNum := uint32(0)
		for j := 0; j < nm && d.err == nil; j++ {
			num, credit := uint32(d.uvarintMax(math.MaxUint32, "merged agent")), d.varint()
			// Written in agent order (numbers from 1), once each.
			if d.err == nil && (num <= prevNum || credit < -1 || credit > l.Burst()) {
				return corrupt("transition of key %016x: merged share of agent %d, credit %d", h, num, credit)
			}
			prevNum = num
			if tr.merged == nil {
				tr.merged = make(map[uint32]int64, nm)
			}
			tr.merged[num] = credit
		}
		ph = h
		tr.whole = l
		s.trans[h] = tr
		s.ends = append(s.ends, tr.end)
	}
	if d.err != nil {
		return d.err
	}
	if len(d.b) != 0 {
		return corrupt("%d trailing bytes after the static state", len(d.b))
	}
	slices.Sort(s.ends)
	c.static = s
	return nil
}
