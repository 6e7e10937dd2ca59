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
//     fair share of Cᵣ over the live agents' claims min(C, max(need,
//     ⌈demand·F⌉)) when the claims exceed Cᵣ, else Cᵣ less the others'
//     claims (C for an agent alone on the key). So an agent that reports
//     held 0 on every call still gets at most its fair share per interval;
//   - grant = TakeUpTo(min(want, cap − held, allowance − granted in the
//     window)): never more than the bucket has;
//   - the lease TTL and refresh grow as demand falls (cold keys get long
//     leases) and shrink under contention.

// capacityOf returns C = max(burst, ⌈quota·F/window⌉).
func capacityOf(l bucket.Limit, refresh time.Duration) int64 {
	burst := l.Burst()
	if burst <= 0 {
		burst = l.Quota()
	}
	return max(burst, refillOf(l, refresh))
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
// min(C, max(need, ⌈demand·F⌉)). An agent that refills often asks for
// little at a time (its need) but is granted about demand·F per interval.
func claimOf(need int64, demand float32, refresh time.Duration, capacity int64) int64 {
	per := int64(0)
	if dm := demandMilli(float64(demand)); dm > 0 {
		// ⌈dm·F/10¹²⌉: dm in milli-tokens/s, F in ns.
		const div = 1_000_000_000_000
		hi, lo := bits.Mul64(uint64(dm), uint64(refresh))
		if hi >= div {
			per = capacity
		} else {
			q, r := bits.Div64(hi, lo, div)
			if r != 0 {
				q++
			}
			per = int64(min(q, uint64(capacity)))
		}
	}
	return min(capacity, max(need, per))
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

// allowance returns the most agent may be granted in the current refresh
// window, given its claim: C when no other live lease is on the key; else
// Cᵣ less the others' claims when all claims fit in Cᵣ; else its max-min
// fair share of Cᵣ over the live claims. A lease is live when it was
// renewed within claimLiveIntervals·F: its expiry is at least
// now − claimLiveIntervals·F + LeaseTTL (a lease renewed with a longer TTL,
// a cold key's, counts for longer).
//
// It also returns reserved: what the live agents served first may still
// be granted in this window (their allowances less their window grants),
// for fromBucket.
func (c *core) allowance(leases []lease, agent uint32, claim, used, capacity, refill, now int64) (allow, reserved int64) {
	f := c.cfg.RefreshInterval
	live := now - claimLiveIntervals*int64(f) + int64(c.cfg.LeaseTTL)
	nowMs := now / 1e6
	others, n := int64(0), 0
	for i := range leases {
		l := &leases[i]
		if l.agent == agent || l.expiry < live {
			continue
		}
		others += claimOf(l.need, l.demand, f, capacity)
		n++
	}
	switch {
	case n == 0:
		return capacity, 0
	case others+claim <= refill:
		for i := range leases {
			l := &leases[i]
			if l.agent == agent || l.expiry < live {
				continue
			}
			cl, u := claimOf(l.need, l.demand, f, capacity), usedInWindow(l, nowMs, f)
			if servedFirst(cl, u, claim, used) {
				reserved += max(0, cl-u)
			}
		}
		return refill - others, reserved
	}
	needs := c.scr.needs[:0]
	for i := range leases {
		l := &leases[i]
		if l.agent != agent && l.expiry >= live {
			needs = append(needs, needEnt{need: claimOf(l.need, l.demand, f, capacity), agent: l.agent, used: usedInWindow(l, nowMs, f)})
		}
	}
	needs = append(needs, needEnt{need: claim, agent: agent})
	c.scr.needs = needs
	waterFill(needs, refill)
	for _, e := range needs {
		switch {
		case e.agent == agent:
			allow = e.share
		case servedFirst(e.need, e.used, claim, used):
			reserved += max(0, e.share-e.used)
		}
	}
	return allow, reserved
}

// servedFirst reports whether an agent with claim cj that was granted uj
// in this window is served before one with claim ci granted ui: a smaller
// claim first (max-min fairness serves it first), and between equal claims
// the one granted less so far. Of two agents at most one is served first.
func servedFirst(cj, uj, ci, ui int64) bool {
	return cj < ci || (cj == ci && uj < ui)
}

// fromBucket returns the most an agent whose window allowance has left
// tokens may take from a bucket with avail tokens: what the bucket holds
// beyond reserved, the unused allowances of the agents served before it
// (servedFirst). Without the reservation an agent that calls first in
// every window (a flooder) would drain a bucket that holds less than every
// allowance, and the others would find it empty until it refilled.
func fromBucket(avail, left, reserved int64) int64 {
	if reserved <= 0 {
		return left
	}
	return min(left, max(0, avail-reserved))
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
	waterFill(needs, capacity)
	for _, e := range needs {
		if e.agent == target {
			return e.share
		}
	}
	return 0
}

// waterFill sorts needs and sets every share as fairShare describes.
func waterFill(needs []needEnt, capacity int64) {
	sortNeeds(needs)
	remaining := capacity
	for i := range needs {
		k := int64(len(needs) - i)
		share := (remaining + k - 1) / k
		needs[i].share = min(needs[i].need, share)
		remaining -= needs[i].share
	}
}

// agentCap returns the most the agent may hold on the key after this call
// and whether the key is contended (Σ needs > C).
func (c *core) agentCap(leases []lease, agent uint32, need, capacity int64) (int64, bool) {
	others := int64(0)
	for i := range leases {
		if leases[i].agent != agent {
			others += leases[i].need
		}
	}
	if others+need <= capacity {
		return need, false
	}
	needs := c.scr.needs[:0]
	for _, l := range leases {
		if l.agent != agent {
			needs = append(needs, needEnt{need: l.need, agent: l.agent})
		}
	}
	needs = append(needs, needEnt{need: need, agent: agent})
	c.scr.needs = needs
	return fairShare(needs, capacity, agent), true
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
