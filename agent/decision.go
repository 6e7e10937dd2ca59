package agent

import (
	"time"

	"github.com/allot/allot/pkg/rules"
)

// Source says what decided a check.
type Source uint8

const (
	// SourceUnlimited: no rule matched any descriptor, or the rule is
	// unlimited. Always allowed.
	SourceUnlimited Source = iota
	// SourceLease: spent from (or denied by) tokens leased from the allocator,
	// or by the allocator's "exhausted until" answer.
	SourceLease
	// SourceFallback: decided by the local fallback bucket (no lease yet, or
	// the allocator unreachable).
	SourceFallback
	// SourceLocal: the rule's backend is local: a per-agent bucket by design.
	SourceLocal
	// SourceRedis: decided against the Redis backend.
	SourceRedis
	// SourceStatic: decided from the agent's static share of the limit
	// (Config.StaticShares), without the allocator.
	SourceStatic
)

func (s Source) String() string {
	switch s {
	case SourceUnlimited:
		return "unlimited"
	case SourceLease:
		return "lease"
	case SourceFallback:
		return "fallback"
	case SourceLocal:
		return "local"
	case SourceRedis:
		return "redis"
	case SourceStatic:
		return "static"
	}
	return "unknown"
}

// Descriptor is one rate limit descriptor of a request, as in Envoy.
// HitsAddend, when non-zero, overrides the request-level hits for this
// descriptor (Envoy's per-descriptor hits_addend).
//
// HitsAddendSet marks HitsAddend as explicitly given, as Envoy's
// google.protobuf.UInt64Value wrapper does: with it, HitsAddend 0 means
// "check without consuming": allowed unless the budget is exhausted (in
// debt, or denied by the allocator), as envoyproxy/ratelimit treats
// hits_addend 0 and as bucket.Limit.AllowN treats n = 0.
// Without it, 0 means "use the request's hits".
type Descriptor struct {
	Entries       []rules.Entry
	HitsAddend    uint32
	HitsAddendSet bool
}

// Status is the outcome for one descriptor of a check.
type Status struct {
	Rule       *rules.Rule // nil when no rule matched (or it was replaced)
	Allowed    bool        // false only when enforced (not shadow) and over the limit
	Shadow     bool        // over the limit, but the rule is in shadow mode
	Remaining  int64
	ResetAfter time.Duration
	RetryAfter time.Duration
	// NextAfter is how long until the limit that decided has more quota
	// (bucket.Limit.NextAfter): the rule's limit on the lease and Redis
	// paths, this agent's share of it (fallback, static) where its own
	// bucket decided; 0 when the limit is full or it is not known.
	NextAfter time.Duration
	Source    Source
}

// Decision is the outcome of Agent.Check.
//
// Allowed is false when any non-shadow descriptor is over its limit. The
// reported limit (Policy, Quota, Window, Remaining, ResetAfter, RetryAfter)
// is, when the request is denied, the denying limit with the longest
// RetryAfter, so a client that waits RetryAfter is not denied again by
// another limit. Check weighs only the limits it can evaluate without I/O:
// a limit on a key this agent has not seen yet, or of the Redis backend,
// can have a longer wait that RetryAfter does not show (CheckStatuses
// evaluates every descriptor). When the request is allowed, it is the
// enforced limit with the lowest Remaining (what Envoy reports in
// x-ratelimit-*), so headers show the closest limit. A shadow-mode limit
// is reported only when no enforced limit matched (the transports never
// advertise it).
type Decision struct {
	Allowed    bool
	Shadow     bool   // some descriptor would have denied but its rule is in shadow mode
	Source     Source // source of the reported limit
	Policy     string // policy name of the reported limit; "" when unlimited
	Quota      int64  // requests per window of the reported limit
	Window     time.Duration
	Remaining  int64
	ResetAfter time.Duration
	RetryAfter time.Duration // zero when allowed
	// NextAfter, when allowed, is how long until the reported limit has
	// more quota: the next token (token bucket, GCRA) or the next window
	// boundary (windows); 0 when it is full (bucket.Limit.NextAfter). It
	// is computed from the limit that decided (Status.NextAfter): in
	// fallback, this agent's share of the rule.
	NextAfter time.Duration
	Rule      *rules.Rule // the reported rule; nil when unlimited
}
