package state

import (
	"math/bits"
	"slices"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// The grant policy. docs/leases.md derives it; in short:
//
//   - capacity C = max(burst, ⌈R·F⌉) tokens, R the limit's rate and F the
//     refresh interval: the most one refresh interval can hand out; the
//     refill Cᵣ = ⌈R·F⌉ is what the bucket gains in one interval;
//   - an agent's need = min(C, held + min(want, C));
//   - when the needs of all agents leasing the key fit in C, each agent may
//     hold its need; otherwise its cap is its max-min fair share of C
//     (water-filling over the needs, integer tokens);
//   - grant pacing: what an agent is granted within one refresh window (a
//     multiple of F in absolute time) is at most its allowance: its max-min
//     fair share of Cᵣ over the live agents' claims min(C, max(ask,
//     ⌈demand·F⌉)) (ask: what it asks for and was not granted) when the
//     claims exceed Cᵣ, else Cᵣ less the others' claims (C for an agent
//     alone on the key). So an agent that reports held 0 on every call
//     still gets at most its fair share per interval. The others' claims
//     and needs are weighed in milli-tokens, a light lease (one token,
//     demand·F < 1) by its demand·F;
//   - grant = TakeUpTo(min(want, cap − held, allowance − granted in the
//     window)): never more than the bucket has;
//   - the lease TTL and refresh grow as demand falls (cold keys get long
//     leases) and shrink under contention;
//   - a key that asks for it (want_share: a region at the global cluster)
//     is answered its rate share: its max-min fair share of R over the
//     demands the live leases report (rateShare), at most what the shares
//     last issued to the other unexpired leases leave of R (issueShare),
//     the rate a region falls to when cut off.

// capacityOf returns C = max(burst, ⌈quota·F/window⌉).
func capacityOf(l bucket.Limit, refresh time.Duration) int64 {
	c, _ := capacityRefill(l, refresh)
	return c
}

// capacityRefill returns capacityOf and refillOf.
func capacityRefill(l bucket.Limit, refresh time.Duration) (capacity, refill int64) {
	burst := l.Burst()
	if burst <= 0 {
		burst = l.Quota()
	}
	refill = refillOf(l, refresh)
	return max(burst, refill), refill
}

// refillOf returns Cᵣ = ⌈quota·F/window⌉ (at least 1), the tokens the limit
// refills in one refresh interval; for a limit without a rate, its burst.
func refillOf(l bucket.Limit, refresh time.Duration) int64 {
	w := l.Window()
	if w <= 0 || l.Quota() <= 0 {
		burst := l.Burst()
		if burst <= 0 {
			burst = l.Quota()
		}
		return max(burst, 1)
	}
	hi, lo := bits.Mul64(uint64(l.Quota()), uint64(refresh))
	if hi >= uint64(w) {
		return maxAmount
	}
	q, r := bits.Div64(hi, lo, uint64(w))
	if r != 0 {
		q++
	}
	if q > maxAmount {
		q = maxAmount
	}
	return max(int64(q), 1)
}

// claimLiveIntervals: a lease not renewed within this many refresh
// intervals no longer counts in the other agents' allowances (an agent
// that stopped asking does not hold back the ones still asking).
const claimLiveIntervals = 2

// claimOf returns an agent's claim on the key's refill per interval:
// min(C, max(ask, ⌈demand·F⌉)), ask what it still asks for: its want on
// its own call, need − held for a recorded lease (what it asked and was
// not granted). An agent that refills often asks for little at a time but
// is granted about demand·F per interval. An agent's holding is not part
// of its claim: the gateway that carried a key's traffic until its load
// balancer moved it holds a second of it, spends it at its new, lower
// rate, and asks for nothing meanwhile; counting its holding took that
// much of the refill from the gateway now carrying the traffic
// (bench/load -workload skew).
func claimOf(ask int64, demand float32, refresh time.Duration, capacity int64) int64 {
	return claimPM(ask, perWindowMilli(demand, refresh), capacity)
}

// claimPM is claimOf with ⌈demand·F⌉ given in milli-tokens
// (perWindowMilli).
func claimPM(ask, pm, capacity int64) int64 {
	per := int64(0)
	if pm > 0 {
		per = min(ceilDiv(pm, milli), capacity)
	}
	return min(capacity, max(ask, per))
}

// milli: the fairness arithmetic (hold caps, allowances, reservations) is
// in milli-tokens, so that an agent using a key less than once per
// interval weighs what it uses rather than a whole token.
const milli = 1000

// perWindowMilli returns ⌈demand·F⌉ in milli-tokens (0 for no demand;
// at most maxAmount·milli).
func perWindowMilli(demand float32, refresh time.Duration) int64 {
	dm := demandMilli(float64(demand))
	if dm <= 0 {
		return 0
	}
	// ⌈dm·F/10⁹⌉: dm in milli-tokens/s, F in ns.
	const div = 1_000_000_000
	hi, lo := bits.Mul64(uint64(dm), uint64(refresh))
	if hi >= div {
		return maxAmount * milli
	}
	var q, r uint64
	if hi == 0 {
		q, r = lo/div, lo%div // by a constant: no division instruction
	} else {
		q, r = bits.Div64(hi, lo, div)
	}
	if r != 0 {
		q++
	}
	return int64(min(q, uint64(maxAmount*milli)))
}

// weightOf returns what another agent's lease weighs, in milli-tokens, in
// an agent's hold cap (whole = the lease's need) or allowance (whole = its
// claim): whole·1000, except for a light lease, which weighs its demand·F
// (at least 1 milli-token). A lease is light when whole ≤ 1 and its
// demand·F < 1: the agent holds or wants one token and spends less than
// one per interval. Counting each of 19 or 199 such agents as a whole
// token filled a 20/s key, and the agent that carried most of the key's
// traffic was held to about one token per interval (docs/leases.md,
// "Light agents"). The agent computing its own cap or allowance always
// counts its own need or claim whole, so a light agent that asks is still
// granted its token, and an agent that wants more than one token (a flooder
// asking for C) is never light.
func weightOf(whole int64, demand float32, refresh time.Duration) int64 {
	if whole > 1 {
		return whole * milli
	}
	return weightPM(whole, perWindowMilli(demand, refresh))
}

// weightPM is weightOf with the lease's ⌈demand·F⌉ given in milli-tokens
// (perWindowMilli).
func weightPM(whole, pm int64) int64 {
	if whole <= 1 && pm < milli {
		return max(pm, 1)
	}
	return whole * milli
}

// ceilDiv returns ⌈a/b⌉ for a ≥ 0, b > 0.
func ceilDiv(a, b int64) int64 {
	return (a + b - 1) / b
}

// satAdd returns a + b for a, b ≥ 0, saturated at 2⁶² (sums of weights over
// many leases cannot wrap).
func satAdd(a, b int64) int64 {
	const top = 1 << 62
	return min(a+b, top) // a, b ≤ 2⁶², so a+b does not overflow
}

// windowOf returns the refresh window a Unix millisecond is in.
func windowOf(ms int64, refresh time.Duration) int64 {
	return floorDiv(ms*1e6, int64(refresh)) // |ms| < 2⁶³/10⁶: ms is a command time / 10⁶
}

// usedInWindow returns the tokens l was granted in the refresh window of
// nowMs (Unix ms): its win count if its latest grant is in that window.
func usedInWindow(l *lease, nowMs int64, refresh time.Duration) int64 {
	if l.grantedAt == 0 || windowOf(l.grantedAt, refresh) != windowOf(nowMs, refresh) {
		return 0
	}
	return l.win
}

// usedIn is usedInWindow for the window [from, to) (Unix ns, from a
// multiple of the refresh interval and to the next one): l's grant time
// is compared with the window's bounds rather than divided.
func usedIn(l *lease, from, to int64) int64 {
	if at := l.grantedAt * 1e6; l.grantedAt == 0 || at < from || at >= to {
		return 0
	}
	return l.win
}

// liveExpiry returns the least expiry of a lease that counts as live at
// now in the others' claims and shares: one renewed within
// claimLiveIntervals·F has an expiry of at least now −
// claimLiveIntervals·F + LeaseTTL (a lease renewed with a longer TTL, a
// cold key's, counts for longer).
func (c *core) liveExpiry(now int64) int64 {
	return now - claimLiveIntervals*int64(c.cfg.RefreshInterval) + int64(c.cfg.LeaseTTL)
}

// allowance returns the most agent may be granted in the current refresh
// window, given its claim: C when no other live lease is on the key; else
// Cᵣ less the others' claims when all claims fit in Cᵣ; else its max-min
// fair share of Cᵣ over the live claims, rounded up to a whole token. The
// others' claims are weighed in milli-tokens (weightOf: a light lease
// weighs its demand·F); the agent's own claim counts whole. A lease is
// live when its expiry is at least liveExpiry(now).
//
// It also returns reserved: what the live agents served first may still
// be granted in this window (their allowances less their window grants,
// rounded up to a whole token), for fromBucket.
func (c *core) allowance(leases []lease, agent uint32, claim, used, capacity, refill, now int64) (allow, reserved int64) {
	f := c.cfg.RefreshInterval
	live := c.liveExpiry(now)
	win := windowOf(now/1e6, f)
	from, to := win*int64(f), (win+1)*int64(f) // the window, in ns
	mine := claim * milli
	// The others' live claims, weighed, and their window grants.
	others := int64(0)
	needs := c.scr.needs[:0]
	for i := range leases {
		l := &leases[i]
		if l.agent == agent || l.expiry < live {
			continue
		}
		pm := perWindowMilli(l.demand, f)
		w := weightPM(claimPM(max(0, l.need-l.held), pm, capacity), pm)
		others = satAdd(others, w)
		needs = append(needs, needEnt{need: w, agent: l.agent, used: usedIn(l, from, to)})
	}
	c.scr.needs = needs
	switch {
	case len(needs) == 0:
		return capacity, 0
	case others+mine <= refill*milli:
		for _, e := range needs {
			if servedFirst(e.need, e.used, mine, used) {
				reserved = satAdd(reserved, max(0, e.need-e.used*milli))
			}
		}
		return (refill*milli - others) / milli, ceilDiv(reserved, milli)
	}
	needs = append(needs, needEnt{need: mine, agent: agent})
	c.scr.needs = needs
	waterFill(needs, refill*milli, milli)
	for _, e := range needs {
		switch {
		case e.agent == agent:
			allow = ceilDiv(e.share, milli)
		case servedFirst(e.need, e.used, mine, used):
			reserved = satAdd(reserved, max(0, e.share-e.used*milli))
		}
	}
	return allow, ceilDiv(reserved, milli)
}

// servedFirst reports whether an agent with claim cj that was granted uj
// in this window is served before one with claim ci granted ui: a smaller
// claim first (max-min fairness serves it first), and between equal claims
// the one granted less so far. Of two agents at most one is served first.
func servedFirst(cj, uj, ci, ui int64) bool {
	return cj < ci || (cj == ci && uj < ui)
}

// fromBucket returns the most an agent whose window allowance has left
// tokens may take from a bucket with avail tokens, of a key whose bucket
// holds at most full and refills refill per interval: what the bucket
// holds beyond reserved, the unused allowances of the agents served before
// it (servedFirst). Without the reservation an agent that calls first in
// every window (a flooder) would drain a bucket that holds less than every
// allowance, and the others would find it empty until it refilled.
//
// A bucket that holds less than one interval's refill (burst B below
// R·F) cannot keep the others' whole allowances: it refills while they
// spend them over the window. So the reservation is scaled to one fill of
// the bucket, reserved·full/refill; if that is still full or more, the
// agent takes its part of what the bucket holds in proportion to its
// unused allowance, avail·left/(reserved+left). Before, an agent carrying
// half of a 5000/s key with burst 500 was granted nothing until the others
// had taken their allowances, late in every window (bench/load -workload
// skew: 37% false rejects).
func fromBucket(avail, left, reserved, full, refill int64) int64 {
	if reserved <= 0 {
		return left
	}
	if full < refill {
		// reserved·full/refill ≤ reserved: the quotient fits.
		hi, lo := bits.Mul64(uint64(reserved), uint64(max(full, 0)))
		q, r := bits.Div64(hi, lo, uint64(refill))
		if r != 0 {
			q++
		}
		reserved = int64(q)
	}
	switch {
	case reserved < full:
		return min(left, max(0, avail-reserved))
	case avail <= 0:
		return 0
	}
	// avail·left/(reserved+left) < avail ≤ maxAmount: the quotient fits.
	hi, lo := bits.Mul64(uint64(avail), uint64(left))
	q, _ := bits.Div64(hi, lo, uint64(reserved+left))
	return min(left, int64(q))
}

// needEnt is one agent's need in a water-filling.
type needEnt struct {
	need  int64
	agent uint32
	share int64 // waterFill's result
	used  int64 // allowance: tokens granted in the window
}

// sortNeeds orders needs ascending, ties by agent number.
func sortNeeds(needs []needEnt) {
	slices.SortFunc(needs, func(a, b needEnt) int {
		if a.need != b.need {
			if a.need < b.need {
				return -1
			}
			return 1
		}
		return int(int64(a.agent) - int64(b.agent))
	})
}

// fairShare returns target's max-min fair share of capacity among needs
// (which include target). Needs are served smallest first; each gets
// min(need, ⌈remaining/agents left⌉), so equal needs differ by at most one
// token, lower agent numbers first, and the shares never sum above
// capacity.
func fairShare(needs []needEnt, capacity int64, target uint32) int64 {
	return shareOf(needs, capacity, 1, target)
}

// shareOf water-fills needs over capacity in units of unit (see waterFill)
// and returns target's share.
func shareOf(needs []needEnt, capacity, unit int64, target uint32) int64 {
	waterFill(needs, capacity, unit)
	for _, e := range needs {
		if e.agent == target {
			return e.share
		}
	}
	return 0
}

// waterFill sorts needs and sets every share as fairShare describes, with
// ⌈remaining/agents left⌉ rounded up to a multiple of unit (1, or milli
// when needs are in milli-tokens: an agent needing whole tokens is then
// served whole tokens, as with unit 1) and never above what remains, so
// the shares never sum above capacity.
func waterFill(needs []needEnt, capacity, unit int64) {
	sortNeeds(needs)
	remaining := capacity
	for i := range needs {
		k := int64(len(needs) - i)
		share := ceilDiv(ceilDiv(remaining, k), unit) * unit
		needs[i].share = min(needs[i].need, share, remaining)
		remaining -= needs[i].share
	}
}

// agentCap returns the most the agent may hold on the key after this call
// and whether the key is contended (Σ needs > C). The others' needs are
// weighed in milli-tokens (weightOf: a light lease weighs its demand·F,
// not the token it holds); the agent's own need counts whole, and its
// share is rounded up to a whole token.
func (c *core) agentCap(leases []lease, agent uint32, need, capacity int64) (int64, bool) {
	f := c.cfg.RefreshInterval
	others := int64(0)
	for i := range leases {
		if l := &leases[i]; l.agent != agent {
			others = satAdd(others, weightOf(l.need, l.demand, f))
		}
	}
	if others+need*milli <= capacity*milli {
		return need, false
	}
	needs := c.scr.needs[:0]
	for i := range leases {
		if l := &leases[i]; l.agent != agent {
			needs = append(needs, needEnt{need: weightOf(l.need, l.demand, f), agent: l.agent})
		}
	}
	needs = append(needs, needEnt{need: need * milli, agent: agent})
	c.scr.needs = needs
	return ceilDiv(shareOf(needs, capacity*milli, milli, agent), milli), true
}

// Lease timing constants: a lease lasts leaseSpendFactor × the time the
// agent needs to spend what it holds, clamped to [LeaseTTL, MaxLeaseTTL].
const leaseSpendFactor = 4

// leaseTiming returns the lease TTL and the server-directed refresh time.
//
//   - contended key: TTL = LeaseTTL, refresh = F/2, so shares rebalance fast;
//   - no demand reported: TTL = MaxLeaseTTL, refresh = TTL/2;
//   - else, with s = holding / demand (the time to spend the holding):
//     TTL = clamp(4·s, LeaseTTL, MaxLeaseTTL), refresh = clamp(s/2, F, TTL/2).
func (c *core) leaseTiming(contended bool, holding int64, demand float64) (ttl, refresh time.Duration) {
	f := c.cfg.RefreshInterval
	if contended {
		return c.cfg.LeaseTTL, max(f/2, time.Millisecond)
	}
	dm := demandMilli(demand)
	if dm == 0 {
		return c.cfg.MaxLeaseTTL, c.cfg.MaxLeaseTTL / 2
	}
	// spend = holding / demand seconds = holding·1e6 / dm milliseconds.
	spendMs := holding * 1_000_000 / dm // holding ≤ 2e12, so no overflow
	spend := time.Duration(min(spendMs, int64(c.cfg.MaxLeaseTTL/time.Millisecond))) * time.Millisecond
	ttl = min(max(leaseSpendFactor*spend, c.cfg.LeaseTTL), c.cfg.MaxLeaseTTL)
	refresh = min(max(spend/2, f), ttl/2)
	return ttl, refresh
}

// demandMilli converts a reported demand (tokens/s, validated finite and in
// [0, 1e12]) to integer milli-tokens per second. One multiplication and one
// conversion: exact IEEE rounding, the same on every platform.
func demandMilli(d float64) int64 {
	if !(d > 0) {
		return 0
	}
	return int64(d * 1000)
}

// rateMilli returns l's rate R = quota/window in milli-tokens/s, rounded
// down (0 for a limit without a rate; at most maxAmount·milli).
func rateMilli(l bucket.Limit) int64 {
	w, q := l.Window(), l.Quota()
	if w <= 0 || q <= 0 {
		return 0
	}
	const perSec = milli * int64(time.Second) // quota·10¹²/window ns
	hi, lo := bits.Mul64(uint64(q), uint64(perSec))
	if hi >= uint64(w) {
		return maxAmount * milli
	}
	r, _ := bits.Div64(hi, lo, uint64(w))
	return int64(min(r, uint64(maxAmount*milli)))
}

// rateShare returns agent's rate share of a key of rate rate (milli-
// tokens/s): its max-min fair share of the rate over the demands the key's
// live leases report, its own being demand (this call's report). The agents that report a demand
// are water-filled (waterFill, in milli-tokens/s) over the rate; what
// remains is split evenly, rounded down, between the agents that report
// none, so that an agent whose demand is yet to show has a rate to fall to
// that takes nothing from the agents using the key. A lease is live as in
// allowance (liveExpiry), and not expired. Every agent's share is
// computed over the same leases, so the shares of the live leases at one
// instant sum to at most rate; issueShare (shares.go) caps the share a
// grant answers so that the shares last issued do too.
func (c *core) rateShare(leases []lease, agent uint32, demand float32, rate, now int64) int64 {
	live := max(c.liveExpiry(now), now+1)
	needs := c.scr.needs[:0]
	idle := int64(0) // agents reporting no demand
	add := func(a uint32, d float32) {
		if m := demandMilli(float64(d)); m > 0 {
			needs = append(needs, needEnt{need: m, agent: a})
		} else {
			idle++
		}
	}
	for i := range leases {
		if l := &leases[i]; l.agent != agent && l.expiry >= live {
			add(l.agent, l.demand)
		}
	}
	add(agent, demand)
	c.scr.needs = needs
	waterFill(needs, rate, 1)
	remaining, mine := rate, int64(0)
	for _, e := range needs {
		remaining -= e.share
		if e.agent == agent {
			mine = e.share
		}
	}
	if demandMilli(float64(demand)) == 0 {
		mine = remaining / idle
	}
	return mine
}
