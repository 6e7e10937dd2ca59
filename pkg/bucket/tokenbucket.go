package bucket

import "math"

// Token bucket: capacity burst, refilled continuously at quota/window.
//
// The State holds F = A + B/quota, the instant at which the bucket is full
// again (see State). At now the bucket misses D/window tokens, where
//
//	D = (F − now)·quota   (0 when F ≤ now)
//
// is an exact integer (the "deficit"). Tokens are whole: the bucket holds
// burst − ⌈D/window⌉ of them, and n can be taken iff D + n·window ≤
// burst·window. Taking, giving back and debiting move D by n·window and store
// F = now + D/quota, which is again exact. No rounding ever accumulates, so a
// bucket called every nanosecond for a century admits exactly what one called
// once would.
//
// The debt floor is D ≤ 2·burst·window (Remaining ≥ −burst).

// loadFull returns the state's full-again instant F. A fraction that does not
// fit this Limit's quota (the rule changed) is rounded up, which can only
// remove a fraction of a token.
func (l *Limit) loadFull(s *State) vt {
	f := vt{s.A, uint64(s.B)}
	if s.B < 0 || uint64(s.B) >= uint64(l.quota) {
		f.frac = 0
		if f.ns < math.MaxInt64 {
			f.ns++
		}
	}
	return f
}

// storeFull sets the state to F = now + d/quota.
func (l *Limit) storeFull(s *State, now int64, d u128) {
	ns, frac := d.divmod(uint64(l.quota))
	s.A, s.B = now+int64(ns), int64(frac)
}

// deficit returns D = (F − now)·quota, or 0 when the bucket is full.
func (l *Limit) deficit(f vt, now int64) u128 {
	if !f.after(now) {
		return u128{}
	}
	return l.units(f, now)
}

// bw returns k·window as a 128-bit deficit (k tokens missing).
func (l *Limit) bw(k int64) u128 { return mul64(uint64(k), uint64(l.window)) }

// tbRemaining is burst − ⌈D/window⌉, floored at −burst.
func (l *Limit) tbRemaining(d u128) int64 {
	if !d.less(l.bw(2 * l.burst)) {
		return -l.burst
	}
	return l.burst - int64(d.ceilDiv(uint64(l.window)))
}

// tbRetry returns how long until n ≤ burst tokens are available, for a
// bucket with deficit d that does not have them: until the deficit is down to
// (burst−n)·window, ⌈(d − (burst−n)·window)/quota⌉ ns.
func (l *Limit) tbRetry(d u128, n int64) int64 {
	return sat(d.sub(l.bw(l.burst - n)).ceilDiv(uint64(l.quota)))
}

// tbReset returns how long from now until the bucket is full.
func tbReset(f vt, now int64) int64 {
	if !f.after(now) {
		return 0
	}
	return f.ceilSince(now)
}

func (l *Limit) tbAllowN(s *State, now, n int64) Result {
	f := l.loadFull(s)
	d := l.deficit(f, now)
	rem := l.tbRemaining(d)
	switch {
	case n > l.burst:
		return Result{Remaining: rem, RetryAfter: Never, ResetAfter: dur(tbReset(f, now))}
	case n < 0:
		n = 0
	}
	if l.bw(l.burst - n).less(d) {
		return Result{Remaining: rem, RetryAfter: dur(l.tbRetry(d, n)), ResetAfter: dur(tbReset(f, now))}
	}
	if n == 0 {
		return Result{Allowed: true, Remaining: rem, ResetAfter: dur(tbReset(f, now))}
	}
	d = d.add(l.bw(n))
	l.storeFull(s, now, d)
	return Result{Allowed: true, Remaining: rem - n, ResetAfter: dur(l.loadFull(s).ceilSince(now))}
}

func (l *Limit) tbTakeUpTo(s *State, now, n int64) int64 {
	d := l.deficit(l.loadFull(s), now)
	avail := l.tbRemaining(d)
	if avail <= 0 {
		return 0
	}
	g := min64(n, avail)
	l.storeFull(s, now, d.add(l.bw(g)))
	return g
}

func (l *Limit) tbGiveBack(s *State, now, n int64) {
	f := l.loadFull(s)
	d := l.deficit(f, now)
	switch {
	case d == (u128{}):
		return // already full
	case !d.less(l.bw(2 * l.burst)):
		// Deeper than the debt floor (an earlier now, or a changed rule):
		// F − now ≥ 2·burst·window/quota ≥ the span given back.
		f = l.vsub(f, l.span(n))
		s.A, s.B = f.ns, int64(f.frac)
	case d.less(l.bw(n)):
		s.A, s.B = now, 0 // capped at full
	default:
		l.storeFull(s, now, d.sub(l.bw(n)))
	}
}

func (l *Limit) tbDebit(s *State, now, n int64) {
	d := l.deficit(l.loadFull(s), now)
	floor := l.bw(2 * l.burst)
	if !d.less(floor) {
		return
	}
	d = d.add(l.bw(n))
	if floor.less(d) {
		d = floor
	}
	l.storeFull(s, now, d)
}

func (l *Limit) tbDrain(s *State, now int64) {
	if d := l.deficit(l.loadFull(s), now); d.less(l.bw(l.burst)) {
		l.storeFull(s, now, l.bw(l.burst))
	}
}

func (l *Limit) tbPeek(s State, now int64) Result {
	f := l.loadFull(&s)
	d := l.deficit(f, now)
	r := Result{Remaining: l.tbRemaining(d), ResetAfter: dur(tbReset(f, now))}
	r.Allowed = r.Remaining >= 1
	if !r.Allowed {
		r.RetryAfter = dur(l.tbRetry(d, 1))
	}
	return r
}
