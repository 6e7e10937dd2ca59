package rules

import (
	"math/bits"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// StaticShare returns one of n static shares of r's limit
// (docs/static-shares.md) and whether r is static-eligible: a leased rule
// that limits (not unlimited, deny-all or shadow), whose budget is its
// cluster's own (not ScopeGlobal), with a token-bucket or GCRA limit of
// which a 1/n share holds at least a token and refills its burst within
// maxRefill. The allocator and the agent decide eligibility with this one
// function.
func (r *Rule) StaticShare(n uint32, maxRefill time.Duration) (bucket.Limit, bool) {
	if r == nil || n == 0 || r.Backend != BackendLease || r.Unlimited || r.DenyAll || r.ShadowMode || r.Scope == ScopeGlobal {
		return bucket.Limit{}, false
	}
	s, ok := r.Limit.Share(1, n)
	if !ok || RefillTime(s) > maxRefill {
		return bucket.Limit{}, false
	}
	return s, true
}

// RefillTime is how long an empty token bucket or GCRA limit l takes to
// refill its burst: burst·window/quota, rounded up (at most
// bucket.MaxWindow for a valid limit).
func RefillTime(l bucket.Limit) time.Duration {
	q := uint64(l.Quota())
	if q == 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(l.Burst()), uint64(l.Window()))
	if hi >= q {
		return time.Duration(1<<63 - 1)
	}
	d, r := bits.Div64(hi, lo, q)
	if r != 0 {
		d++
	}
	return time.Duration(min(d, 1<<63-1))
}
