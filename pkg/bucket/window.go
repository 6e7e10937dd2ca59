package bucket

// Window algorithms. Windows are aligned to Unix-epoch multiples of the
// window length, as envoyproxy/ratelimit aligns them, so every replica and
// every agent agrees on where a window starts. An instant before the state's
// window (the clock went backwards) is treated as that window's start: the
// count is kept, never reset, so going back in time mints nothing.
//
// Both keep counts of tokens taken; a window's capacity is its quota. Debit
// may push the count (the estimate, for SlidingWindow) up to twice the quota
// (Remaining ≥ −quota); AllowN and TakeUpTo never take past the quota.

// windowStart returns the start of the window containing now (now ≥ 0).
func (l *Limit) windowStart(now int64) int64 { return now - now%l.window }

// fwLoad returns the effective instant, its window's start and the count in
// that window.
func (l *Limit) fwLoad(s *State, now int64) (eff, start, count int64) {
	start = l.windowStart(now)
	switch {
	case start == s.A:
		count = s.B
	case start < s.A && s.A <= MaxTime:
		// The clock went backwards: stay in the state's window.
		now, start, count = s.A, s.A, s.B
	}
	return now, start, max64(count, 0)
}

// fwRemaining is quota − count, floored at −quota.
func (l *Limit) fwRemaining(count int64) int64 { return max64(l.quota-count, -l.quota) }

func (l *Limit) fwReset(eff, start, count int64) int64 {
	if count == 0 {
		return 0
	}
	return start + l.window - eff
}

func (l *Limit) fwAllowN(s *State, now, n int64) Result {
	now, start, count := l.fwLoad(s, now)
	rem := l.fwRemaining(count)
	switch {
	case n > l.quota:
		return Result{Remaining: rem, RetryAfter: Never, ResetAfter: dur(l.fwReset(now, start, count))}
	case n < 0:
		n = 0
	}
	if rem < n {
		// The next window starts empty and n ≤ quota.
		return Result{Remaining: rem, RetryAfter: dur(start + l.window - now), ResetAfter: dur(l.fwReset(now, start, count))}
	}
	if n > 0 {
		count += n
		s.A, s.B = start, count
	}
	return Result{Allowed: true, Remaining: rem - n, ResetAfter: dur(l.fwReset(now, start, count))}
}

func (l *Limit) fwTakeUpTo(s *State, now, n int64) int64 {
	_, start, count := l.fwLoad(s, now)
	g := min64(n, l.quota-count)
	if g <= 0 {
		return 0
	}
	s.A, s.B = start, count+g
	return g
}

func (l *Limit) fwGiveBack(s *State, now, n int64) {
	_, start, count := l.fwLoad(s, now)
	s.A, s.B = start, max64(count-n, 0)
}

func (l *Limit) fwDebit(s *State, now, n int64) {
	_, start, count := l.fwLoad(s, now)
	if count >= 2*l.quota {
		return
	}
	s.A, s.B = start, min64(count+n, 2*l.quota)
}

func (l *Limit) fwDrain(s *State, now int64) {
	if _, start, count := l.fwLoad(s, now); count < l.quota {
		s.A, s.B = start, l.quota
	}
}

func (l *Limit) fwPeek(s State, now int64) Result {
	now, start, count := l.fwLoad(&s, now)
	r := Result{Remaining: l.fwRemaining(count), ResetAfter: dur(l.fwReset(now, start, count))}
	r.Allowed = r.Remaining >= 1
	if !r.Allowed {
		r.RetryAfter = dur(start + l.window - now)
	}
	return r
}

// Sliding-window counter. The estimate of tokens taken in the window of
// length W ending at now, elapsed e into the current window, is
//
//	prev·(W − e)/W + curr
//
// (Cloudflare's approximation: the previous window's count, weighted by how
// much of it the sliding window still covers). It is compared exactly, in
// units of 1/W token: E = prev·(W − e) + curr·W against quota·W. The counts
// are 32-bit (see State), which MaxSlidingQuota and the 2·quota debt bound
// keep them within.

// swLoad returns the effective instant, the current window's start and the
// previous and current counts.
func (l *Limit) swLoad(s *State, now int64) (eff, start, prev, curr int64) {
	start = l.windowStart(now)
	p, c := int64(uint64(s.B)>>32), int64(uint32(s.B))
	switch {
	case start == s.A:
		prev, curr = p, c
	case start < s.A && s.A <= MaxTime:
		now, start, prev, curr = s.A, s.A, p, c
	case s.A >= 0 && start-s.A == l.window:
		prev = c
	}
	return now, start, prev, curr
}

func swStore(s *State, start, prev, curr int64) {
	s.A, s.B = start, int64(uint64(prev)<<32|uint64(curr))
}

// swEstimate returns E = prev·(W − e) + curr·W.
func (l *Limit) swEstimate(eff, start, prev, curr int64) u128 {
	return mul64(uint64(prev), uint64(l.window-(eff-start))).add(mul64(uint64(curr), uint64(l.window)))
}

// swRemaining is ⌊(quota·W − E)/W⌋, floored at −quota.
func (l *Limit) swRemaining(e u128) int64 {
	c := l.bw(l.quota)
	if !c.less(e) {
		q, _ := c.sub(e).divmod(uint64(l.window))
		return int64(q)
	}
	if !e.less(l.bw(2 * l.quota)) {
		return -l.quota
	}
	return -int64(e.sub(c).ceilDiv(uint64(l.window)))
}

// swRetry returns how long from eff until the estimate leaves room for
// n ≤ quota tokens, for a state that has no room now.
func (l *Limit) swRetry(eff, start, prev, curr, n int64) int64 {
	if curr+n <= l.quota && prev > 0 {
		// Within this window, once prev·(W − e) ≤ (quota − n − curr)·W:
		// e ≥ W − ⌊(quota − n − curr)·W/prev⌋.
		k := l.bw(l.quota - n - curr)
		if k.less(mul64(uint64(prev), uint64(l.window))) {
			m, _ := k.divmod(uint64(prev))
			return start + l.window - int64(m) - eff
		}
		return 1 // unreachable for a denied state; never report 0
	}
	if curr == 0 {
		return start + l.window - eff
	}
	// In the next window curr becomes prev and must weigh at most quota − n.
	k := l.bw(l.quota - n)
	if !k.less(mul64(uint64(curr), uint64(l.window))) {
		return start + l.window - eff
	}
	m, _ := k.divmod(uint64(curr))
	return start + 2*l.window - int64(m) - eff
}

// swReset returns how long until the estimate is 0.
func (l *Limit) swReset(eff, start, prev, curr int64) int64 {
	switch {
	case curr > 0:
		return start + 2*l.window - eff
	case prev > 0:
		return start + l.window - eff
	}
	return 0
}

func (l *Limit) swAllowN(s *State, now, n int64) Result {
	now, start, prev, curr := l.swLoad(s, now)
	e := l.swEstimate(now, start, prev, curr)
	rem := l.swRemaining(e)
	switch {
	case n > l.quota:
		return Result{Remaining: rem, RetryAfter: Never, ResetAfter: dur(l.swReset(now, start, prev, curr))}
	case n < 0:
		n = 0
	}
	if l.bw(l.quota).less(e.add(l.bw(n))) {
		return Result{
			Remaining:  rem,
			RetryAfter: dur(l.swRetry(now, start, prev, curr, n)),
			ResetAfter: dur(l.swReset(now, start, prev, curr)),
		}
	}
	if n > 0 {
		curr += n
		swStore(s, start, prev, curr)
	}
	return Result{Allowed: true, Remaining: rem - n, ResetAfter: dur(l.swReset(now, start, prev, curr))}
}

func (l *Limit) swTakeUpTo(s *State, now, n int64) int64 {
	now, start, prev, curr := l.swLoad(s, now)
	g := min64(n, l.swRemaining(l.swEstimate(now, start, prev, curr)))
	if g <= 0 {
		return 0
	}
	swStore(s, start, prev, curr+g)
	return g
}

func (l *Limit) swGiveBack(s *State, now, n int64) {
	_, start, prev, curr := l.swLoad(s, now)
	c := min64(n, curr)
	curr -= c
	prev -= min64(n-c, prev)
	swStore(s, start, prev, curr)
}

func (l *Limit) swDebit(s *State, now, n int64) {
	now, start, prev, curr := l.swLoad(s, now)
	e := l.swEstimate(now, start, prev, curr)
	floor := l.bw(2 * l.quota)
	if !e.less(floor) {
		return
	}
	room, _ := floor.sub(e).divmod(uint64(l.window)) // ≤ 2·quota
	swStore(s, start, prev, curr+min64(n, int64(room)))
}

func (l *Limit) swDrain(s *State, now int64) {
	if _, start, prev, curr := l.swLoad(s, now); curr < l.quota {
		swStore(s, start, prev, l.quota)
	}
}

func (l *Limit) swPeek(s State, now int64) Result {
	now, start, prev, curr := l.swLoad(&s, now)
	r := Result{
		Remaining:  l.swRemaining(l.swEstimate(now, start, prev, curr)),
		ResetAfter: dur(l.swReset(now, start, prev, curr)),
	}
	r.Allowed = r.Remaining >= 1
	if !r.Allowed {
		r.RetryAfter = dur(l.swRetry(now, start, prev, curr, 1))
	}
	return r
}
