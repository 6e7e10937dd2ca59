package rules

import "github.com/allot/allot/pkg/bucket"

// StaticShare returns one of n static shares of r's limit
// (docs/static-shares.md) and whether r is static-eligible: a leased rule
// that limits (not unlimited, deny-all or shadow), whose budget is its
// cluster's own (not ScopeGlobal), with a token-bucket or GCRA limit of
// which a 1/n share holds at least a token. The allocator and the agent
// decide eligibility with this one function.
func (r *Rule) StaticShare(n uint32) (bucket.Limit, bool) {
	if r == nil || n == 0 || r.Backend != BackendLease || r.Unlimited || r.DenyAll || r.ShadowMode || r.Scope == ScopeGlobal {
		return bucket.Limit{}, false
	}
	return r.Limit.Share(1, n)
}
