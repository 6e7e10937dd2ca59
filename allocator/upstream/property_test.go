package upstream

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

// globalModel is a global cluster reduced to what the invariants need: one
// token bucket that grants min(want, what it holds), credits what is
// returned (never beyond full) and debits outage charges from what it
// holds. It answers each call once; the network may then lose, repeat or
// reorder the answers.
type globalModel struct {
	lim     bucket.Limit
	st      bucket.State
	granted []int64 // per region: tokens the bucket granted it
	taken   int64   // tokens granted less tokens credited back, all regions
	// shares: the model answers each region its max-min fair share of the
	// rate by the demands the regions last reported (else no share: a
	// global cluster that predates Grant.Share).
	shares  bool
	rate    float64
	demands []float64
}

func (g *globalModel) serve(now int64, region int, r Request) Grant {
	before := g.lim.Peek(g.st, now).Remaining
	g.lim.GiveBack(&g.st, now, r.Returned)
	g.taken -= g.lim.Peek(g.st, now).Remaining - before
	if r.OutageCharged > 0 {
		g.lim.TakeUpTo(&g.st, now, r.OutageCharged)
	}
	n := g.lim.TakeUpTo(&g.st, now, r.Want)
	g.granted[region] += n
	g.taken += n
	gr := Grant{ID: r.ID, Granted: n}
	if g.shares {
		g.demands[region] = r.Demand
		gr.Share, gr.HasShare = maxMinShare(g.rate, g.demands, region), true
	}
	return gr
}

// maxMinShare is region's max-min fair share of rate over demands.
func maxMinShare(rate float64, demands []float64, region int) float64 {
	ds := slices.Clone(demands)
	slices.Sort(ds)
	left := rate
	for i, d := range ds {
		level := left / float64(len(ds)-i)
		if d >= level {
			return min(demands[region], level)
		}
		left -= d
	}
	return demands[region]
}

type reply struct {
	region int
	g      Grant
}

// TestPropertyInvariants drives 2-4 regions against one global bucket with
// random demand, sub-grants and returns, partitions, and lost, repeated and
// reordered answers, and checks after every step:
//
//   - each region: lease tokens sub-granted and not returned ≤ tokens held
//     (granted less returned), what it holds is never negative, and
//     gateways never hand back into the lease more than it sub-granted;
//   - each region accepts at most what the global bucket granted it (no
//     grant counted twice), so across regions the total held ≤ what the
//     global bucket granted, which is ≤ B + R·t;
//   - over-admission in a partition, or while a call is overdue, is
//     bounded: the fallback tokens a region sub-granted are at most its
//     fallback rate integrated over the time it was cut off or its call
//     overdue, plus one tick of it and one token;
//   - every fallback token sub-granted is reported upstream as
//     outage_charged by a call that did not fail, or still owed: a
//     failed call's charge is owed again, and an overdue call that is
//     answered after all leaves its region's mints to be charged, as a
//     partition does;
//   - a region's share is at most the rule's rate, and, when the global
//     cluster sends shares, the one the last grant it accepted carried.
func TestPropertyInvariants(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		const rate, burst = 1000.0, 500
		lim, err := bucket.NewLimit(bucket.TokenBucket, int64(rate), time.Second, burst)
		if err != nil {
			t.Fatal(err)
		}
		n := rapid.IntRange(2, 4).Draw(t, "regions")
		static := rapid.Bool().Draw(t, "static")
		cfg := Config{RTT: 100 * time.Millisecond, Tick: 100 * time.Millisecond, CallTimeout: 500 * time.Millisecond,
			RetryBackoff: 300 * time.Millisecond}
		g := &globalModel{lim: lim, granted: make([]int64, n), shares: rapid.Bool().Draw(t, "shares"), rate: rate,
			demands: make([]float64, n)}
		lastShare := make([]float64, n) // the share of the last grant accepted (-1: none yet)
		for i := range lastShare {
			lastShare[i] = -1
		}
		keys := make([]*Key, n)
		cut := make([]bool, n)
		allowance := make([]float64, n) // ∫ fallback rate over time cut off or overdue, tokens
		charged := make([]int64, n)     // outage_charged in the calls made and not failed
		lastCharge := make([]int64, n)  // outage_charged in the last call made
		failures := make([]int64, n)    // the calls failed so far
		// failed takes the charge of a call that failed out of charged:
		// only the last call made can be in flight.
		failed := func(i int) {
			if f := keys[i].Status().Failures; f > failures[i] {
				failures[i] = f
				charged[i] -= lastCharge[i]
			}
		}
		maxCapRate := 0.0
		for i := range keys {
			r := Rule{Rate: rate, Burst: burst}
			if static {
				r.Fallback, r.Fraction = rules.FallbackStatic, rapid.Float64Range(0, 1).Draw(t, fmt.Sprintf("fraction%d", i))
			}
			if keys[i], err = NewKey(cfg, r); err != nil {
				t.Fatal(err)
			}
		}
		var pending []reply
		now := epoch
		for step := range rapid.IntRange(1, 300).Draw(t, "steps") {
			// Integrate each region's fallback rate over the time that
			// passes while it is cut off.
			dt := time.Duration(rapid.Int64Range(0, int64(300*time.Millisecond)).Draw(t, "dt"))
			for i, k := range keys {
				if s := k.Status(); s.CutOff || s.Overdue {
					allowance[i] += s.FallbackRt * dt.Seconds()
					maxCapRate = max(maxCapRate, s.FallbackRt)
				}
			}
			now += int64(dt)
			i := rapid.IntRange(0, n-1).Draw(t, "region")
			k := keys[i]
			switch rapid.IntRange(0, 7).Draw(t, "action") {
			case 0, 1: // tick: a call reaches the global cluster unless partitioned
				r, ok := k.Tick(now, rapid.Float64Range(0, 3000).Draw(t, "demand"))
				failed(i) // the call in flight may have timed out
				if ok {
					charged[i] += r.OutageCharged
					lastCharge[i] = r.OutageCharged
				}
				if ok && !cut[i] {
					pending = append(pending, reply{i, g.serve(now, i, r)})
				}
			case 2: // an answer arrives: any pending one, perhaps twice
				if len(pending) > 0 {
					j := rapid.IntRange(0, len(pending)-1).Draw(t, "reply")
					rp := pending[j]
					if !rapid.Bool().Draw(t, "repeat") {
						pending = append(pending[:j], pending[j+1:]...)
					}
					if keys[rp.region].Granted(now, rp.g) == nil && rp.g.HasShare {
						lastShare[rp.region] = rp.g.Share
					}
				}
			case 3: // an answer is lost
				if len(pending) > 0 {
					pending = pending[1:]
				}
			case 4: // the call in flight fails
				_ = k.Failed(now, k.sent.ID)
				failed(i)
			case 5, 6: // a gateway asks: the leader caps its want, then sub-grants
				want := rapid.Int64Range(0, 400).Draw(t, "want")
				c := k.Cap(now, want)
				if c < 0 || c > want {
					t.Fatalf("step %d: Cap(%d) = %d", step, want, c)
				}
				if got := k.SubGrant(now, c); got != c {
					t.Fatalf("step %d: SubGrant(%d) = %d right after Cap", step, c, got)
				}
			case 7:
				switch rapid.IntRange(0, 2).Draw(t, "other") {
				case 0:
					cut[i] = !cut[i]
				case 1:
					k.SubReturn(now, rapid.Int64Range(0, 200).Draw(t, "returned"))
				case 2:
					k.SubSpent(rapid.Int64Range(0, 200).Draw(t, "spent"))
				}
			}

			tSec := float64(now-epoch) / 1e9
			sumHeld := int64(0)
			for r, k := range keys {
				s := k.Status()
				held := s.Received - s.Returned
				if s.Available < 0 || s.Available != held-(s.SubGranted-s.SubReturned) {
					t.Fatalf("step %d region %d: available %d, held %d, sub-granted %d, returned by gateways %d",
						step, r, s.Available, held, s.SubGranted, s.SubReturned)
				}
				if s.SubGranted-s.SubReturned > held || s.SubReturned > s.SubGranted {
					t.Fatalf("step %d region %d: sub-granted %d (net) > held %d", step, r, s.SubGranted-s.SubReturned, held)
				}
				if s.Owed < 0 || s.Owed > s.SubGranted-s.SubReturned {
					t.Fatalf("step %d region %d: owed %d outside [0, %d]", step, r, s.Owed, s.SubGranted-s.SubReturned)
				}
				if s.Received > g.granted[r] {
					t.Fatalf("step %d region %d: accepted %d > granted %d by the global bucket", step, r, s.Received, g.granted[r])
				}
				sumHeld += held
				if s.Share < 0 || s.Share > rate || (lastShare[r] >= 0 && s.Share != min(lastShare[r], rate)) {
					t.Fatalf("step %d region %d: share %v, the last grant's %v, rate %v", step, r, s.Share, lastShare[r], rate)
				}
				if bound := allowance[r] + maxCapRate*cfg.Tick.Seconds() + 1; float64(s.Minted) > bound+1e-6 {
					t.Fatalf("step %d region %d: minted %d > %.3f (fallback rate over the time cut off or overdue, plus one tick and one token)",
						step, r, s.Minted, bound)
				}
				if charged[r]+k.fbOwed != s.Minted {
					t.Fatalf("step %d region %d: minted %d, reported as outage_charged %d, owed %d", step, r, s.Minted, charged[r], k.fbOwed)
				}
			}
			if limit := float64(burst) + rate*tSec; float64(g.taken) > limit+1e-6 || float64(sumHeld) > float64(g.taken)+1e-6 {
				t.Fatalf("step %d: regions hold %d, global granted net %d, B + R·t = %.1f", step, sumHeld, g.taken, limit)
			}
		}
	})
}

// TestRuleOf: a compiled rule's rate, burst and fallback, per region.
func TestRuleOf(t *testing.T) {
	set, err := rules.Compile(1, []rules.File{{Name: "g.yaml", Source: []byte(`domain: g
scope: global
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 600, burst: 50, global_fallback: static, static_fraction: {eu: 0.5}}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 0}
`)}})
	if err != nil {
		t.Fatal(err)
	}
	a := RuleOf(set.Match("g", []rules.Entry{{Key: "a", Value: "1"}}), "eu")
	if a.Rate != 10 || a.Burst != 50 || a.Fallback != rules.FallbackStatic || a.Fraction != 0.5 {
		t.Errorf("a in eu: %+v", a)
	}
	if us := RuleOf(set.Match("g", []rules.Entry{{Key: "a", Value: "1"}}), "us"); us.Fraction != 0 {
		t.Errorf("a in us: %+v", us)
	}
	if b := RuleOf(set.Match("g", []rules.Entry{{Key: "b", Value: "1"}}), "eu"); b.Rate != 0 || b.Burst != 0 {
		t.Errorf("b: %+v", b)
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		rule Rule
	}{
		{Config{RTT: -1}, Rule{Rate: 1}},
		{Config{Tick: 2 * time.Hour}, Rule{Rate: 1}},
		{Config{}, Rule{Rate: -1}},
		{Config{}, Rule{Rate: 1, Burst: -1}},
		{Config{}, Rule{Rate: 1, Fraction: 1.5}},
		{Config{}, Rule{Rate: 1, Fallback: 9}},
	} {
		if _, err := NewKey(c.cfg, c.rule); err == nil {
			t.Errorf("NewKey(%+v, %+v) succeeded", c.cfg, c.rule)
		}
	}
	k, err := NewKey(Config{}, Rule{Rate: 100, Burst: 100})
	if err != nil {
		t.Fatal(err)
	}
	if err := k.SetRule(Rule{Rate: -1}); err == nil {
		t.Error("SetRule accepted a negative rate")
	}
}
