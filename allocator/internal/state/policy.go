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
//     refresh interval: the most one refresh interval can hand out;
//   - an agent's need = min(C, held + min(want, C));
//   - when the needs of all agents leasing the key fit in C, each agent may
//     hold its need; otherwise its cap is its max-min fair share of C
//     (water-filling over the needs, integer tokens);
//   - grant = TakeUpTo(min(want, cap − held)): never more than the bucket has;
//   - the lease TTL and refresh grow as demand falls (cold keys get long
//     leases) and shrink under contention.

// capacityOf returns C = max(burst, ⌈quota·F/window⌉).
func capacityOf(l bucket.Limit, refresh time.Duration) int64 {
	burst := l.Burst()
	if burst <= 0 {
		burst = l.Quota()
	}
	w := l.Window()
	if w <= 0 || l.Quota() <= 0 {
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
	return max(burst, int64(q), 1)
}

// needEnt is one agent's need in a water-filling.
type needEnt struct {
	need  int64
	agent uint32
}

// fairShare returns target's max-min fair share of capacity among needs
// (which include target). Needs are served smallest first; each gets
// min(need, ⌈remaining/agents left⌉), so equal needs differ by at most one
// token, lower agent numbers first, and the shares never sum above
// capacity.
func fairShare(needs []needEnt, capacity int64, target uint32) int64 {
	slices.SortFunc(needs, func(a, b needEnt) int {
		if a.need != b.need {
			if a.need < b.need {
				return -1
			}
			return 1
		}
		return int(int64(a.agent) - int64(b.agent))
	})
	remaining := capacity
	for i, e := range needs {
		k := int64(len(needs) - i)
		share := (remaining + k - 1) / k
		a := min(e.need, share)
		if e.agent == target {
			return a
		}
		remaining -= a
	}
	return 0
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
