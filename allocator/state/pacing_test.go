package state

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// pacingRules: big has C = Cᵣ = 100 per interval; wide has a burst of 300
// above its refill of 100 per interval (C = 300, Cᵣ = 100); small has
// C = Cᵣ = 10.
const pacingRules = `domain: test
descriptors:
  - key: big
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
  - key: wide
    rate_limit: {unit: second, requests_per_unit: 100, burst: 300}
  - key: small
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}
`

// TestGrantPacing is the step table of grant pacing on big (C = Cᵣ = 100,
// F = 1 s, windows aligned to whole seconds), with the issue-#8 liar:
// held 0, want 1000, calling every 10 ms.
func TestGrantPacing(t *testing.T) {
	s := New(testConfig())
	putRules(t, s, t0, pacingRules)
	liar := func(id uint64) *allotv1.KeyAcquire {
		return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: "x"}}, Want: 1000, Demand: 1e6}
	}
	honest := &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "big", Value: "x"}}, Want: 2, Demand: 20}
	grant := func(step int, now int64, agent string, id uint64, k *allotv1.KeyAcquire, want int64) {
		t.Helper()
		if g := mustAcquire(t, s, now, agent, id, k).Grants[0].Granted; g != want {
			t.Fatalf("step %d: %s call %d at %v granted %d, want %d", step, agent, id, time.Duration(now-t0), g, want)
		}
	}
	ms := func(d int) int64 { return at(time.Duration(d) * time.Millisecond) }
	// t0: the liar alone on the key may take all of C.
	grant(0, ms(0), "liar", 1, liar(1), 100)
	// t0+10ms: its held 0 report makes its hold cap room again, but the
	// window's allowance is spent.
	grant(1, ms(10), "liar", 2, liar(2), 0)
	// The honest agent's claim is ⌈20·1 s⌉ = 20; the bucket refilled 2.
	grant(2, ms(20), "h", 1, honest, 2)
	// Next window: the key is contended (claims 100 + 20 > Cᵣ = 100): the
	// liar's allowance is its max-min share, 80, and it may not take the
	// honest agent's unused allowance (20) from the bucket (98): 78.
	grant(3, ms(1000), "liar", 3, liar(3), 78)
	// 10 ms later the bucket refilled 1 above the reservation.
	grant(4, ms(1010), "liar", 4, liar(4), 1)
	// The honest agent gets 2 a call, 10 calls a window.
	id := uint64(2)
	for i := range 10 {
		grant(5+i, ms(1020+100*i), "h", id, honest, 2)
		id++
	}
	// Its allowance is spent: nothing is reserved, the liar takes its last 1.
	grant(15, ms(1990), "liar", 5, liar(5), 1)
	grant(16, ms(1995), "liar", 6, liar(6), 0)
	// Window 2: the bucket (refilled 100 − 22 granted) is 78 + 1 … the liar
	// takes 80 less the honest reservation of 20.
	// A lease not renewed for 2F stops counting: after the honest agent's
	// last call at 1.92 s, at 4 s the liar is alone again and may take C
	// (what the bucket has).
	if g := mustAcquire(t, s, ms(4000), "liar", 8, liar(8)).Grants[0].Granted; g < 90 {
		t.Fatalf("step 18: liar alone after the honest lease went stale granted %d, want ≥ 90 (bucket after refill)", g)
	}
}

// TestPropertyLiarCannotStarve: one agent lies (held 0 on every call, want
// 1000, demand 10⁶, calling every 10 ms) on a key shared with k honest
// agents, each calling every step ms for what it spent since (held 0,
// want ⌈d·step⌉, demand d). From the second whole refresh window after the
// liar arrives, every honest agent is granted, in every window, at least
// min(what it asked in the window, its max-min fair share of Cᵣ over the
// claims: max(want, ⌈d·F⌉) for the honest agents, C for the liar), less
// at most 2 tokens and at most 10% (see the slack below). The fair share
// is computed here in real numbers and floored. Over the run the liar gets at most its shares, what
// the honest agents left unused, and one burst.
func TestPropertyLiarCannotStarve(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := New(testConfig())
		putRules(t, s, t0, pacingRules)
		key := rapid.SampledFrom([]string{"big", "wide", "small"}).Draw(t, "key")
		c, cr := map[string]float64{"big": 100, "wide": 300, "small": 10}[key], map[string]float64{"big": 100, "wide": 100, "small": 10}[key]
		type actor struct {
			id          string
			liar        bool
			step, want  int64 // ms, tokens
			demand      float64
			next        int64 // ms after t0
			req         uint64
			got, wanted map[int64]int64 // per window
		}
		k := rapid.IntRange(1, 3).Draw(t, "honest")
		var actors []*actor
		for i := range k {
			d := rapid.IntRange(1, int(cr)).Draw(t, "demand")
			step := int64(rapid.IntRange(20, 400).Draw(t, "stepMs"))
			actors = append(actors, &actor{id: fmt.Sprint("h", i), step: step, demand: float64(d),
				want: (int64(d)*step + 999) / 1000, next: int64(rapid.IntRange(0, int(step)).Draw(t, "startMs")),
				got: map[int64]int64{}, wanted: map[int64]int64{}})
		}
		liarStart := int64(rapid.IntRange(0, 1500).Draw(t, "liarStartMs"))
		actors = append(actors, &actor{id: "liar", liar: true, step: 10, want: 1000, demand: 1e6, next: liarStart,
			got: map[int64]int64{}, wanted: map[int64]int64{}})
		const endMs = 5000
		nextExpire := int64(1000)
		for {
			a := slices.MinFunc(actors, func(x, y *actor) int { return int(x.next - y.next) })
			if a.next >= endMs {
				break
			}
			now := a.next
			for nextExpire <= now {
				expire(s, at(time.Duration(nextExpire)*time.Millisecond))
				nextExpire += 1000
			}
			a.req++
			g := mustAcquire(t, s, at(time.Duration(now)*time.Millisecond), a.id, a.req, &allotv1.KeyAcquire{Domain: "test",
				Entries: []*allotv1.Entry{{Key: key, Value: "x"}}, Want: a.want, Demand: a.demand}).Grants[0]
			w := now / 1000
			a.got[w] += g.Granted
			a.wanted[w] += a.want
			a.next += a.step
		}
		// The fair shares, water-filling in real numbers.
		claims := make([]float64, 0, len(actors))
		for _, a := range actors {
			cl := c
			if !a.liar {
				cl = min(c, max(float64(a.want), a.demand)) // F = 1 s
			}
			claims = append(claims, cl)
		}
		share := realWaterFill(claims, cr)
		first := liarStart/1000 + 2
		for i, a := range actors[:k] {
			// Slack: the state water-fills integer tokens per aligned window
			// against a bucket that refills continuously, so when the
			// shares sum to exactly Cᵣ a window's last call can find its
			// last tokens not yet refilled (seed 12150017394313031272: 23
			// of a 25.00 share in one window). Starvation, what this test
			// is for, shows as far less (12–17 of ~120 before pacing).
			f := int64(share[i])
			for w := first; w < endMs/1000; w++ {
				if need := max(min(a.wanted[w], f)*9/10, min(a.wanted[w], f)-2); a.got[w] < need {
					t.Fatalf("window %d: honest %s (step %d ms, want %d, demand %v) granted %d, want ≥ %d (asked %d, fair share %.2f of Cᵣ %v; claims %v)",
						w, a.id, a.step, a.want, a.demand, a.got[w], need, a.wanted[w], share[i], cr, claims)
				}
			}
		}
		// The liar: over the run, at most its share + 1 a window, plus the
		// tokens the honest agents left unused (the bucket keeps them, and
		// a burst beyond one window's refill goes by need), plus one burst
		// C (the bucket it found).
		liar := actors[k]
		var total float64
		bound := c
		for w := liarStart / 1000; w < endMs/1000; w++ {
			total += float64(liar.got[w])
			bound += share[k] + 1
			for i, a := range actors[:k] {
				bound += max(0, math.Floor(share[i])-float64(a.got[w]))
			}
		}
		if total > bound {
			t.Fatalf("liar granted %.0f in all, above its shares + 1 a window + what the honest left unused + C (%.0f)", total, bound)
		}
	})
}

// realWaterFill returns the max-min fair shares of capacity over claims, in
// real numbers.
func realWaterFill(claims []float64, capacity float64) []float64 {
	out := make([]float64, len(claims))
	left := capacity
	idx := make([]int, len(claims))
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx, func(a, b int) int {
		switch {
		case claims[a] < claims[b]:
			return -1
		case claims[a] > claims[b]:
			return 1
		}
		return 0
	})
	for n, i := range idx {
		out[i] = min(claims[i], left/float64(len(idx)-n))
		left -= out[i]
	}
	return out
}

// TestLightLeasesDoNotStarveBusyAgent pins the issue-#7 skew bug: on small
// (C = Cᵣ = 10), nine agents that each hold one token and spend 0.1/s
// counted one whole token each in the busy agent's hold cap and allowance,
// so an agent spending 8/s was granted 1 token per interval although the
// key was in quota. A light lease (need ≤ 1, demand·F < 1) now weighs its
// demand·F, and a light agent that asks still gets its one token.
func TestLightLeasesDoNotStarveBusyAgent(t *testing.T) {
	s := New(testConfig())
	putRules(t, s, t0, pacingRules)
	ka := func(want int64, demand float64) *allotv1.KeyAcquire {
		return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "small", Value: "x"}}, Want: want, Demand: demand}
	}
	for i := range 9 {
		if g := mustAcquire(t, s, at(time.Duration(i)*time.Millisecond), fmt.Sprint("light", i), 1, ka(1, 0.1)).Grants[0].Granted; g != 1 {
			t.Fatalf("step %d: light%d granted %d, want 1", i, i, g)
		}
	}
	// One interval later the bucket is full again (10).
	if g := mustAcquire(t, s, at(time.Second), "busy", 1, ka(8, 8)).Grants[0].Granted; g != 8 {
		t.Fatalf("step 9: busy agent (want 8, demand 8) beside nine light leases granted %d, want 8", g)
	}
	// A light agent that spent its token and asks again gets one.
	k := ka(1, 0.1)
	if g := mustAcquire(t, s, at(time.Second+10*time.Millisecond), "light0", 2, k).Grants[0].Granted; g != 1 {
		t.Fatalf("step 10: light0 granted %d, want 1", g)
	}
}

// TestReservationScaledToBucket pins the bench/load skew regression of grant
// pacing: on a 5000/s key with burst 500, the smaller agents' unused
// allowances (8 × 172) exceeded what the bucket can ever hold, so the agent
// carrying half the traffic was granted nothing until the others had taken
// their allowances, late in every window (37% false rejects). The
// reservation is now what the others are owed over one fill of the bucket
// (full/Cᵣ of it).
func TestReservationScaledToBucket(t *testing.T) {
	s := New(testConfig())
	putRules(t, s, t0, `domain: test
descriptors:
  - key: narrow
    rate_limit: {unit: second, requests_per_unit: 5000, burst: 500}
`)
	ka := func(want int64, demand float64) *allotv1.KeyAcquire {
		return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "narrow", Value: "x"}}, Want: want, Demand: demand}
	}
	for i := range 8 {
		if g := mustAcquire(t, s, at(time.Duration(i)*time.Millisecond), fmt.Sprint("small", i), 1, ka(50, 222)).Grants[0].Granted; g != 50 {
			t.Fatalf("step %d: small%d granted %d, want 50", i, i, g)
		}
	}
	// 100 ms later the bucket is full (500); reserved 8 × (222 − 50) = 1376
	// scales to ⌈1376·500/5000⌉ = 138.
	if g := mustAcquire(t, s, at(100*time.Millisecond), "busy", 1, ka(300, 2000)).Grants[0].Granted; g != 300 {
		t.Fatalf("step 8: busy agent granted %d, want 300 (the bucket holds 500, 138 reserved)", g)
	}
	// The next 100 tokens: only 362 − 300 = 62 were beyond the reservation.
	if g := mustAcquire(t, s, at(100*time.Millisecond), "busy", 2, ka(100, 2000)).Grants[0].Granted; g != 62 {
		t.Fatalf("step 9: busy agent granted %d, want 62", g)
	}
}

// TestFromBucket is fromBucket's step table.
func TestFromBucket(t *testing.T) {
	for i, c := range []struct{ avail, left, reserved, full, refill, want int64 }{
		{100, 50, 0, 100, 100, 50},
		{100, 50, 70, 100, 100, 30},
		{100, 50, 100, 100, 100, 33},         // cannot be met: in proportion, 100·50/150
		{500, 3000, 1376, 500, 5000, 362},    // scaled to 138
		{500, 3000, 6000, 500, 5000, 416},    // scaled to 600 ≥ full: 500·3000/3600
		{-5, 3000, 6000, 500, 5000, 0},       // debt
		{300, 20, 1000, 500, 5000, 20},       // scaled to 100
		{1e12, 1e12, 1e12, 1e12, 1e12, 5e11}, // no overflow
	} {
		if got := fromBucket(c.avail, c.left, c.reserved, c.full, c.refill); got != c.want {
			t.Errorf("step %d: fromBucket(%d, %d, %d, %d, %d) = %d, want %d", i, c.avail, c.left, c.reserved, c.full, c.refill, got, c.want)
		}
	}
}

// TestHoldingIsNotAClaim pins the other half of the bench/load skew
// regression: the gateway that carried a key's traffic until the load
// balancer moved it holds what it was granted and asks for nothing more;
// its holding counted in its claim on the refill, and the gateway now
// carrying the traffic was held to a share of what was left.
func TestHoldingIsNotAClaim(t *testing.T) {
	s := New(testConfig())
	putRules(t, s, t0, pacingRules)
	ka := func(want, held int64, demand float64) *allotv1.KeyAcquire {
		return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: "wide", Value: "x"}}, Want: want, Held: held, Demand: demand}
	}
	if g := mustAcquire(t, s, t0, "old", 1, ka(60, 0, 60)).Grants[0].Granted; g != 60 {
		t.Fatalf("step 0: old granted %d, want 60", g)
	}
	// Next window: old holds its 60, spends 5/s and asks for nothing.
	if g := mustAcquire(t, s, at(time.Second), "old", 2, ka(0, 60, 5)).Grants[0].Granted; g != 0 {
		t.Fatalf("step 1: old granted %d, want 0", g)
	}
	// Claims 5 (old) + 80 fit in Cᵣ = 100: the new agent gets its 80, where
	// counting old's holding (claims 60 + 80) held it to 50.
	if g := mustAcquire(t, s, at(time.Second+10*time.Millisecond), "new", 1, ka(80, 0, 80)).Grants[0].Granted; g != 80 {
		t.Fatalf("step 2: new granted %d, want 80", g)
	}
}

// usedIn, which compares a lease's grant time with the window's bounds,
// agrees with usedInWindow, which divides both times by the interval.
func TestUsedInWindowBounds(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		f := time.Duration(rapid.OneOf(rapid.Int64Range(1, 10), rapid.Int64Range(1e6, 1e11),
			rapid.SampledFrom([]int64{1e6, 2e6, 1e9})).Draw(t, "refresh"))
		nowMs := rapid.Int64Range(-1e12, 3e12).Draw(t, "nowMs")
		// Grants before and after now, at and next to window bounds.
		l := lease{win: 7, grantedAt: nowMs - rapid.OneOf(rapid.Int64Range(-2, 2), rapid.Int64Range(-1e6, 1e9)).Draw(t, "ago")}
		if rapid.Bool().Draw(t, "at a bound") {
			w := windowOf(nowMs, f) + rapid.Int64Range(-1, 1).Draw(t, "window")
			l.grantedAt = floorDiv(w*int64(f), 1e6) + rapid.Int64Range(-1, 1).Draw(t, "off")
		}
		if rapid.Bool().Draw(t, "none") {
			l.grantedAt = 0
		}
		w := windowOf(nowMs, f)
		if got, want := usedIn(&l, w*int64(f), (w+1)*int64(f)), usedInWindow(&l, nowMs, f); got != want {
			t.Fatalf("usedIn = %d, usedInWindow = %d (grant %d, now %d ms, F %v)", got, want, l.grantedAt, nowMs, f)
		}
	})
}
