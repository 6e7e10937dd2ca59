package bucket

// GCRA, the generic cell rate algorithm, in its virtual-scheduling form. The
// State holds one theoretical arrival time TAT = A + B/quota (exact; see
// State). With emission interval T = window/quota and tolerance τ:
//
//	tat     = max(TAT, now)
//	new_tat = tat + T·n
//	allow  ⇔ new_tat − τ ≤ now           (then TAT = new_tat)
//	retry   = new_tat − τ − now          (when denied)
//	remaining = ⌊(now + τ − new_tat)/T⌋
//
// We choose τ = T·burst, so burst requests are admitted at once (libraries
// differ: some use T·(burst−1), admitting burst at once only by counting the
// request itself). With that choice GCRA is the token bucket of capacity burst
// and rate quota/window, computed from the other side; TestGCRAMatchesTokenBucket
// holds the two implementations to identical results and states, which is why
// they share a State encoding.
//
// The debt floor is TAT ≤ now + 2τ (Remaining ≥ −burst).

// gcraRemaining returns ⌊(now + τ − tat)/T⌋, floored at −burst, for
// tat ≥ now.
func (l *Limit) gcraRemaining(tat vt, now int64) int64 {
	limit := l.vadd(vt{now, 0}, l.tau) // now + τ
	if !limit.less(tat) {
		x := l.vsub(limit, tat) // 0 ≤ x ≤ τ
		q, _ := mul64(uint64(x.ns), uint64(l.quota)).add64(x.frac).divmod(uint64(l.window))
		return int64(q)
	}
	y := l.vsub(tat, limit) // in debt by y·quota/window tokens
	if !y.less(l.tau) {
		return -l.burst
	}
	return -int64(mul64(uint64(y.ns), uint64(l.quota)).add64(y.frac).ceilDiv(uint64(l.window)))
}

// gcraTat returns max(TAT, now).
func (l *Limit) gcraTat(s *State, now int64) vt {
	tat := l.loadFull(s)
	if !tat.after(now) {
		return vt{now, 0}
	}
	return tat
}

func gcraReset(tat vt, now int64) int64 {
	if !tat.after(now) {
		return 0
	}
	return tat.ceilSince(now)
}

// gcraRetry returns ⌈new_tat − τ − now⌉ for new_tat = tat + T·n, n ≤ burst,
// when that is positive. It is computed in units of 1/quota ns,
// (tat − now)·quota + n·window − burst·window, so that a TAT far ahead of now
// (an earlier now, or a changed rule) cannot overflow.
func (l *Limit) gcraRetry(tat vt, now, n int64) int64 {
	return sat(l.units(tat, now).sub(l.bw(l.burst - n)).ceilDiv(uint64(l.quota)))
}

func (l *Limit) gcraAllowN(s *State, now, n int64) Result {
	tat := l.gcraTat(s, now)
	if n > l.burst {
		return Result{Remaining: l.gcraRemaining(tat, now), RetryAfter: Never, ResetAfter: dur(gcraReset(tat, now))}
	}
	n = max64(n, 0)
	// Deny iff new_tat − τ > now, i.e. tat − τ > now − T·n (no overflow).
	if l.vsub(vt{now, 0}, l.span(n)).less(l.vsub(tat, l.tau)) {
		return Result{
			Remaining:  l.gcraRemaining(tat, now),
			RetryAfter: dur(l.gcraRetry(tat, now, n)),
			ResetAfter: dur(gcraReset(tat, now)),
		}
	}
	newTat := l.vadd(tat, l.span(n))
	if n > 0 {
		s.A, s.B = newTat.ns, int64(newTat.frac)
	}
	return Result{Allowed: true, Remaining: l.gcraRemaining(newTat, now), ResetAfter: dur(gcraReset(newTat, now))}
}

func (l *Limit) gcraTakeUpTo(s *State, now, n int64) int64 {
	tat := l.gcraTat(s, now)
	g := min64(n, l.gcraRemaining(tat, now))
	if g <= 0 {
		return 0
	}
	tat = l.vadd(tat, l.span(g))
	s.A, s.B = tat.ns, int64(tat.frac)
	return g
}

func (l *Limit) gcraGiveBack(s *State, now, n int64) {
	tat := l.loadFull(s)
	if !tat.after(now) {
		return
	}
	// TAT − T·n, but never before now (a bucket holds at most burst).
	if sp := l.span(n); l.vadd(vt{now, 0}, sp).less(tat) {
		tat = l.vsub(tat, sp)
	} else {
		tat = vt{now, 0}
	}
	s.A, s.B = tat.ns, int64(tat.frac)
}

func (l *Limit) gcraDebit(s *State, now, n int64) {
	tat := l.gcraTat(s, now)
	floor := l.vadd(vt{now, 0}, l.tau2)
	if !tat.less(floor) {
		return
	}
	tat = l.vadd(tat, l.span(n))
	if floor.less(tat) {
		tat = floor
	}
	s.A, s.B = tat.ns, int64(tat.frac)
}

func (l *Limit) gcraDrain(s *State, now int64) {
	if empty := l.vadd(vt{now, 0}, l.tau); l.gcraTat(s, now).less(empty) {
		s.A, s.B = empty.ns, int64(empty.frac)
	}
}

func (l *Limit) gcraPeek(s State, now int64) Result {
	tat := l.gcraTat(&s, now)
	r := Result{Remaining: l.gcraRemaining(tat, now), ResetAfter: dur(gcraReset(tat, now))}
	r.Allowed = r.Remaining >= 1
	if !r.Allowed {
		r.RetryAfter = dur(l.gcraRetry(tat, now, 1))
	}
	return r
}
