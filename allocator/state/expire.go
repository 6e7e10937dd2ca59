package state

import (
	"math"
	"math/bits"
	"sort"

	"github.com/allot/allot/pkg/bucket"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// applyExpire ends the leases whose expiry is at or before now (their
// tokens are not credited back), forgets agents not heard from for
// AgentTTL, and sweeps one segment of the key table for keys that carry no
// information (full bucket, no lease).
//
// Cost: the keys with a lease due are taken from the expiry wheel (one
// entry per leased key; a renewed key is re-queued when its entry is
// taken), when cmd.MaxEntries is set until the keys whose leases ended
// reach it and, if cmd.LastUnit is set, up to that unit, in whole units of
// the wheel (a second's keys of one hash prefix), so up to a unit's keys
// more. The rest are taken by the next Expire, and a budgeted one takes
// only whole past seconds: a lease ended late only counts in its key's
// hold caps a little longer, and its tokens are not credited back either
// way. The keys a budget reaches are the same on every replica (see
// expireBudgeted). Agents are scanned (thousands at most), and unless
// cmd.SkipSweep the sweep visits 1/SweepSegments of the table, so an
// Expire does not touch every key. Each Expire advances a running arena
// compaction by one step (compactQuota).
func (c *core) applyExpire(cmd *allotv1.ExpireCommand, now int64) {
	c.now = now
	budget := int(cmd.GetMaxEntries())
	sec := dueSec(now, budget > 0)
	if budget <= 0 {
		// Unbudgeted: every unit up to now's second. An unbudgeted Expire
		// ends the due leases of whatever entry it takes, early ones
		// included, so a bound on its units would end different leases on
		// replicas whose wheels differ; last_unit applies to budgeted
		// Expires only.
		c.wheel.takeDue(sec, func(u int64, links []uint32) {
			c.touchEntries(links)
			for _, l := range links {
				c.expireEntry(u, l, now, false)
			}
		})
	} else {
		c.expireBudgeted(sec, cmd.GetLastUnit(), budget, now)
	}
	c.expireLeft = 0
	if budget > 0 {
		c.expireLeft = c.wheel.dueCount(sec)
	}

	var dead []*agentRec
	for _, a := range c.agents {
		if now-a.lastContact >= int64(c.cfg.AgentTTL) {
			dead = append(dead, a)
		}
	}
	sort.Slice(dead, func(i, j int) bool { return dead[i].num < dead[j].num })
	for _, a := range dead {
		if c.endAgentLeases(a.num); c.byNum[a.num].keysHeld > 0 {
			continue // leases in frozen slots: forgotten once they are dropped or thawed
		}
		delete(c.agents, a.id)
		delete(c.byNum, a.num)
		c.staticForget(a.num)
	}
	if c.static != nil {
		c.staticTick(now)
		if c.static != nil {
			c.static.trimEnds(now)
		}
	}

	if cmd.GetSkipSweep() {
		// A compaction under way advances at every Expire: while it runs
		// ExpireIdle is false, so the leader commits one every
		// ExpireInterval. Only a sweep starts one.
		if c.old != nil {
			c.compactStep(c.compactQuota(now))
		}
		return
	}
	c.sweep(now, cmd.GetSweepSkip())
	c.maybeCompact()
}

// dueSec returns the last second of the expiry wheel an Expire at now
// takes: now's, or with a budget the one before. A budgeted Expire takes
// whole past seconds only: now's second's entries are mostly not due yet
// and would be re-queued into it, and at the short interval budgeted
// Expires run at, taken (and re-queued) several times over. A lease ends
// at most 1 s + ExpireInterval late.
func dueSec(now int64, budgeted bool) int64 {
	sec := floorDiv(now, 1e9)
	if budgeted {
		sec--
	}
	return sec
}

// sweepStripes is the number of hash ranges one sweep segment is made of.
const sweepStripes = 256

// sweep passes over skip segments of the hash space (segments the leader
// found nothing to drop in), drops the full, lease-less keys of the next
// one and advances the segment cursor past it. Such a key is
// indistinguishable from an untracked one (a zero State is a full
// bucket), so dropping it changes no future decision; the segment order
// is fixed and skip is in the command, so every replica drops the same
// keys.
func (c *core) sweep(now int64, skip uint32) {
	segs := uint64(c.cfg.SweepSegments)
	seg := (uint64(c.sweepSeg) + uint64(skip)) % segs
	c.sweepSeg = uint32((seg + 1) % segs)
	c.segmentRanges(seg, func(lo, hiLast uint64) bool {
		c.sweepRange(lo, hiLast, now, true)
		return true
	})
	c.tab.maybeShrink(c)
}

// segmentRanges calls f with each hash range [lo, hiLast] that segment seg
// is made of, in hash order, until f returns false.
//
// A segment is not one contiguous range: the hash space is cut into
// SweepSegments·256 stripes, and stripe m belongs to the segment whose
// cursor is the bit-reversal of m mod SweepSegments. Idle keys wait for
// the sweep in proportion to the time since their stripe was swept, so with
// contiguous segments they would pile up in the ranges swept longest ago,
// and the table, run near full, would meet loads above 1 there (clusters
// of many thousand slots, every insert shifting them). Neighbouring stripes
// are swept half a pass apart, which keeps the density even at the scale
// of a cluster.
func (c *core) segmentRanges(seg uint64, f func(lo, hiLast uint64) bool) {
	segs := uint64(c.cfg.SweepSegments)
	if segs == 1 {
		f(0, ^uint64(0))
		return
	}
	b := log2(int(segs))
	r := bits.Reverse64(seg) >> (64 - b)
	shift := uint(64 - b - log2(sweepStripes))
	for j := range uint64(sweepStripes) {
		lo := (j<<b | r) << shift
		if !f(lo, lo+(1<<shift-1)) {
			return
		}
	}
}

// sweepRange visits the keys with hashes in [lo, hiLast] and, with drop,
// drops the idle, lease-less ones. It reports whether it met such a key
// (without drop it stops at the first).
func (c *core) sweepRange(lo, hiLast uint64, now int64, drop bool) (met bool) {
	t := &c.tab
	endHome := t.home(hiLast)
	for i := t.lowerBound(lo); i < t.size; {
		s := t.at(i)
		if s.lim == 0 {
			if i >= endHome {
				break
			}
			i++
			continue
		}
		if s.hash > hiLast {
			break
		}
		if s.link == 0 && c.idleKey(s, now) && !c.frozen(s.hash) {
			if !drop {
				return true
			}
			met = true
			if c.static != nil {
				c.unhot(s.hash)
			}
			lim := s.lim
			t.remove(c, i)
			c.lims.unref(lim)
			continue // the next key moved into i
		}
		i++
	}
	return met
}

// idleKey reports whether the tracked key sl is idle at now (staticIdle
// with static shares on).
func (c *core) idleKey(sl *slot, now int64) bool {
	if c.static != nil {
		return c.staticIdle(sl, c.lims.get(sl.lim), now)
	}
	return idle(c.lims.get(sl.lim), sl.st, now)
}

// idle reports whether st behaves like the zero State from now on: as many
// tokens (or as much window capacity) and no later reset.
func idle(l bucket.Limit, st bucket.State, now int64) bool {
	p := l.Peek(st, now)
	z := l.Peek(bucket.State{}, now)
	return p.Remaining >= z.Remaining && p.ResetAfter <= z.ResetAfter
}

// ExpireIdle reports whether an Expire at now with the given MaxEntries
// would end no lease and forget no agent, with no arena compaction under
// way: the leader need not commit one then, except to sweep. It reads
// the state only, under the read lock; the agents are scanned (thousands
// at most).
func (s *State) ExpireIdle(now int64, maxEntries uint32) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	sec := dueSec(now, maxEntries > 0)
	if m, ok := c.wheel.minSec(); ok && m <= sec || c.old != nil {
		return false
	}
	for _, a := range c.agents {
		if now-a.lastContact >= int64(c.cfg.AgentTTL) {
			return false
		}
	}
	return true
}

// ExpireLastUnit returns the LastUnit of a budgeted Expire at now that
// takes about entries expiry-wheel entries: the earliest due unit at which
// the entries of the due units up to it reach entries (every entry this
// replica's wheel holds, early and stale ones included: the work of taking
// them), or when the due units hold fewer, the last unit of the last
// second due at now, so that an Expire stamped in a later second than now
// (the leader's stamp follows its look) still stops there. 0 (no bound)
// when entries is 0. It reads the wheel's units under the read lock.
func (s *State) ExpireLastUnit(now int64, entries uint32) int64 {
	if entries == 0 {
		return 0
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	sec := dueSec(now, true)
	if u := s.st.wheel.lastUnit(sec, int(entries)); u != 0 {
		return u
	}
	return unitOf(sec, math.MaxUint64)
}

// NextDue returns the earliest time (Unix nanoseconds) at which ExpireIdle
// with the given MaxEntries can turn false without a command applied in
// between: the start of the earliest second the expiry wheel holds leases
// for (its end with a budget, which takes whole past seconds only), an
// agent's TTL, or the last applied time while a compaction is under way;
// math.MaxInt64 when nothing is due. A command applied later (a grant, a
// call from an agent) makes nothing due sooner than the lease TTL or the
// agent TTL after its own time.
func (s *State) NextDue(maxEntries uint32) int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	if c.old != nil {
		return c.now
	}
	next := int64(math.MaxInt64)
	if sec, ok := c.wheel.minSec(); ok {
		if maxEntries > 0 {
			sec++
		}
		next = sec * 1e9
		if sec > math.MaxInt64/int64(1e9) {
			next = math.MaxInt64
		}
	}
	for _, a := range c.agents {
		next = min(next, a.lastContact+int64(c.cfg.AgentTTL))
	}
	return next
}

// SweepIdle reports whether a sweep at now that passes over skip segments
// (ExpireCommand.sweep_skip) would drop no key, and no arena compaction or
// table shrink is due: the leader need not commit it, and checks the next
// segment at its next sweep instead. It reads one segment (1/SweepSegments
// of the keys) under the read lock, and stops at the first key to drop.
func (s *State) SweepIdle(now int64, skip uint32) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	a, t := &c.ar, &c.tab
	if c.old != nil || c.compactAlways || a.idle*2 > a.live && len(a.pages) > 8 ||
		t.capa > minTableCap && t.n*fitLoadDen*2 <= t.capa*fitLoadNum {
		return false
	}
	seg := (uint64(c.sweepSeg) + uint64(skip)) % uint64(c.cfg.SweepSegments)
	found := false
	c.segmentRanges(seg, func(lo, hiLast uint64) bool {
		found = c.sweepRange(lo, hiLast, now, false)
		return !found
	})
	return !found
}
