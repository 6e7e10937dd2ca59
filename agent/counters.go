package agent

import (
	"sync/atomic"

	"github.com/allot/allot/agent/internal/policy"
)

// The refill loop moves tokens between a key's counters and its batches
// while checks spend and charge them concurrently: each move is one Swap or
// a CAS loop, so no token is lost or counted twice.

// sendable takes a count of fallback-admitted tokens (charged or outage)
// out of *c for a report. Negative (a refund arrived after its charge was
// sent): it reports 0 and keeps the credit for the next report. Beyond the
// protocol's bound: it reports the bound and keeps the rest.
func sendable(c *atomic.Int64) int64 {
	n := c.Swap(0)
	if n < 0 || n > maxWant {
		keep := n - min(max(n, 0), maxWant)
		c.Add(keep)
		n -= keep
	}
	return n
}

// returnExcess takes policy.Excess(balance, target) tokens out of *balance
// (the hot path spends from it concurrently, hence the CAS loop) and
// returns how many.
func returnExcess(balance *atomic.Int64, target int64) int64 {
	for {
		b := balance.Load()
		x := policy.Excess(b, target)
		if x <= 0 {
			return 0
		}
		if balance.CompareAndSwap(b, b-x) {
			return x
		}
	}
}

// payOwed settles up to grant tokens of the charge owed in *charged (tokens
// admitted from the fallback bucket and not yet reported) and returns how
// many it settled. The hot path adds to *charged concurrently, hence the
// CAS loop.
func payOwed(charged *atomic.Int64, grant int64) int64 {
	for {
		c := charged.Load()
		if c <= 0 || grant <= 0 {
			return 0
		}
		pay := min(c, grant)
		if charged.CompareAndSwap(c, c-pay) {
			return pay
		}
	}
}
