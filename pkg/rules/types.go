package rules

import (
	"fmt"
	"strings"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// Entry is one key=value pair of a request descriptor, as in Envoy's
// RateLimitDescriptor.Entry.
type Entry struct{ Key, Value string }

// Unit is the time unit of a rate_limit. Month is 30 days and year 365 days,
// as in envoyproxy/ratelimit.
type Unit uint8

// Units, in Envoy's order.
const (
	UnitUnknown Unit = iota
	UnitSecond
	UnitMinute
	UnitHour
	UnitDay
	UnitWeek
	UnitMonth // 30 days
	UnitYear  // 365 days
)

var unitNames = [...]string{"unknown", "second", "minute", "hour", "day", "week", "month", "year"}
var unitSeconds = [...]int64{0, 1, 60, 3600, 86400, 7 * 86400, 30 * 86400, 365 * 86400}

// String returns the lower-case unit name ("second" … "year", "unknown").
func (u Unit) String() string {
	if int(u) < len(unitNames) {
		return unitNames[u]
	}
	return fmt.Sprintf("unit(%d)", uint8(u))
}

// Seconds returns the unit's length in seconds; 0 for UnitUnknown.
func (u Unit) Seconds() int64 {
	if int(u) < len(unitSeconds) {
		return unitSeconds[u]
	}
	return 0
}

// Duration returns the unit's length; 0 for UnitUnknown.
func (u Unit) Duration() time.Duration { return time.Duration(u.Seconds()) * time.Second }

// ParseUnit parses a unit name case-insensitively ("second", "SECOND", …),
// as Envoy does. "unknown" and anything else is an error.
func ParseUnit(s string) (Unit, error) {
	for i := UnitSecond; int(i) < len(unitNames); i++ {
		if strings.EqualFold(s, unitNames[i]) {
			return i, nil
		}
	}
	return UnitUnknown, fmt.Errorf("rules: invalid rate limit unit '%s'", s)
}

// Backend selects where a rule's budget is kept.
type Backend uint8

const (
	// BackendLease keeps the budget on the allocator cluster and leases
	// shares of it to agents. Default.
	BackendLease Backend = iota
	// BackendRedis checks every request against Redis (optionally sharded).
	BackendRedis
	// BackendLocal enforces the limit per agent, with no coordination.
	BackendLocal
)

var backendNames = [...]string{"lease", "redis", "local"}

// String returns "lease", "redis" or "local".
func (b Backend) String() string { return enumString(b, backendNames[:], "backend") }

// ParseBackend parses "lease", "redis" or "local" (case-insensitive).
func ParseBackend(s string) (Backend, error) {
	if v, ok := parseEnum[Backend](s, backendNames[:]); ok {
		return v, nil
	}
	return 0, fmt.Errorf("rules: unknown backend '%s' (want lease, redis or local)", s)
}

// FailureMode says what an agent does for a rule when the budget's backend
// is unreachable and its lease is spent.
type FailureMode uint8

const (
	// FailOpen decides from the agent's local fallback bucket. Default.
	FailOpen FailureMode = iota
	// FailClosed denies.
	FailClosed
)

var failureModeNames = [...]string{"open", "closed"}

// String returns "open" or "closed".
func (f FailureMode) String() string { return enumString(f, failureModeNames[:], "failure_mode") }

// ParseFailureMode parses "open" or "closed" (case-insensitive).
func ParseFailureMode(s string) (FailureMode, error) {
	if v, ok := parseEnum[FailureMode](s, failureModeNames[:]); ok {
		return v, nil
	}
	return 0, fmt.Errorf("rules: unknown failure_mode '%s' (want open or closed)", s)
}

// Routing says how requests for one budget key are spread over agents,
// which sizes the agent's fallback bucket (R/N for spread, R for
// consistent_hash).
type Routing uint8

const (
	// RoutingSpread: any agent may see any key. Default.
	RoutingSpread Routing = iota
	// RoutingConsistentHash: the load balancer sends a key to one agent.
	RoutingConsistentHash
)

var routingNames = [...]string{"spread", "consistent_hash"}

// String returns "spread" or "consistent_hash".
func (r Routing) String() string { return enumString(r, routingNames[:], "routing") }

// ParseRouting parses "spread" or "consistent_hash" (case-insensitive).
func ParseRouting(s string) (Routing, error) {
	if v, ok := parseEnum[Routing](s, routingNames[:]); ok {
		return v, nil
	}
	return 0, fmt.Errorf("rules: unknown routing '%s' (want spread or consistent_hash)", s)
}

// Scope says which allocator cluster owns a rule's budget.
type Scope uint8

const (
	// ScopeRegional: the cluster the rules are applied to owns the budget.
	// Default.
	ScopeRegional Scope = iota
	// ScopeGlobal: one budget across regions, owned by the global cluster.
	// A regional cluster configured with a global upstream leases it from
	// there; any other cluster keeps it as a regional budget.
	ScopeGlobal
)

var scopeNames = [...]string{"regional", "global"}

// String returns "regional" or "global".
func (s Scope) String() string { return enumString(s, scopeNames[:], "scope") }

// ParseScope parses "regional" or "global" (case-insensitive).
func ParseScope(s string) (Scope, error) {
	if v, ok := parseEnum[Scope](s, scopeNames[:]); ok {
		return v, nil
	}
	return 0, fmt.Errorf("rules: unknown scope '%s' (want regional or global)", s)
}

// GlobalFallback says what share of a global rule's rate a region admits
// while it is cut off from the global cluster and its lease is spent.
type GlobalFallback uint8

const (
	// FallbackFairShare: the region's share at its last grant from the
	// global cluster. Default.
	FallbackFairShare GlobalFallback = iota
	// FallbackStatic: a fixed fraction of the rule's rate per region
	// (Rule.StaticFractions).
	FallbackStatic
)

var globalFallbackNames = [...]string{"fair_share", "static"}

// String returns "fair_share" or "static".
func (f GlobalFallback) String() string {
	return enumString(f, globalFallbackNames[:], "global_fallback")
}

// ParseGlobalFallback parses "fair_share" or "static" (case-insensitive).
func ParseGlobalFallback(s string) (GlobalFallback, error) {
	if v, ok := parseEnum[GlobalFallback](s, globalFallbackNames[:]); ok {
		return v, nil
	}
	return 0, fmt.Errorf("rules: unknown global_fallback '%s' (want fair_share or static)", s)
}

// AnyRegion is the region name in StaticFractions that applies to every
// region not named on its own.
const AnyRegion = "*"

// RegionFraction is one region's static share of a global rule's rate.
type RegionFraction struct {
	Region   string  // a region name, or AnyRegion
	Fraction float64 // in (0, 1]
}

// Rule is one compiled descriptor that carries a rate_limit block. Rules are
// immutable once compiled; a *Rule is valid for the lifetime of its Set and
// is shared by every caller, so callers must not modify it.
type Rule struct {
	ID     int    // index in Set.Rules(), stable within one Set
	Domain string // the file's domain
	// Path is the route through the descriptor tree: "key=value" per level
	// ("key" for a key-only level), joined by '/', e.g.
	// "tier=free/route=/v1/search/api_key".
	Path string
	// Name is rate_limit.name, or Path when no name is given. Only explicit
	// names take part in `replaces` (HasName).
	Name    string
	HasName bool
	Depth   int // number of descriptor entries a request needs to match this rule

	Unit            Unit
	UnitMultiplier  uint32 // Envoy's unit_multiplier; 1 when absent
	Window          time.Duration
	RequestsPerUnit uint32 // quota per Window; 0 when Unlimited or DenyAll
	Unlimited       bool
	// DenyAll: requests_per_unit is 0, Envoy's way to block a key. Limit is
	// bucket.DenyAll(Window): every request is over the limit.
	DenyAll bool
	// ShadowMode: the rule is evaluated and counted but never denies. Also
	// set when QuotaMode is set.
	ShadowMode bool
	// QuotaMode is Envoy's quota_mode (soft limit: never denies, reports the
	// violation). allot treats it as ShadowMode.
	QuotaMode      bool
	DetailedMetric bool
	ValueToMetric  bool
	// ShareThreshold: at least one wildcard level of Path has
	// share_threshold, so every value matching that wildcard shares one
	// budget (the budget key carries the pattern, not the value).
	ShareThreshold bool

	Burst       int64 // bucket capacity; default RequestsPerUnit
	Algorithm   bucket.Algorithm
	Backend     Backend
	FailureMode FailureMode
	Shards      int // ≥ 1; Redis sub-keys for hot keys
	Routing     Routing

	// Scope is where the budget lives: the rule's own scope, else its
	// domain's; ScopeRegional for unlimited rules.
	Scope Scope
	// GlobalFallback and StaticFractions (sorted by region, AnyRegion
	// first) apply to ScopeGlobal only; StaticFractions is set exactly
	// when GlobalFallback is FallbackStatic.
	GlobalFallback  GlobalFallback
	StaticFractions []RegionFraction

	Replaces []string // names of limits this rule drops from the same request

	Limit bucket.Limit // compiled; zero when Unlimited, bucket.DenyAll when DenyAll

	File string // source file name
	Line int    // line of the descriptor's `key`

	levels      []level // one per depth, root first
	nameID      int32   // index into Set.names, -1 when !HasName
	replacesIDs []int32 // indexes into Set.names
}

// level describes how one depth of a rule's path matches.
type level struct {
	key, value string
	kind       matchKind
	share      bool // wildcard with share_threshold: the key carries the pattern
}

type matchKind uint8

const (
	matchKeyOnly matchKind = iota
	matchExact
	matchWildcard
)

// File is one YAML rules file. One file holds one domain.
type File struct {
	Name   string // for error messages
	Domain string // may be empty on input to Compile; filled from the YAML
	Source []byte
}

// Error is a validation error in a rules file. Compile returns it as a
// *Error.
type Error struct {
	File string
	Line int // 1-based; 0 when unknown
	Key  string
	Msg  string
}

// Error returns "file:line: key: msg" (the line part is left out when Line
// is 0, the key part when Key is empty).
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	b.WriteString(": ")
	if e.Key != "" {
		b.WriteString(e.Key)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// StaticFraction returns region's fraction of the rule's rate under
// `global_fallback: static`: its own entry, else the AnyRegion entry, else
// 0 (the region admits nothing of its own while cut off).
func (r *Rule) StaticFraction(region string) float64 {
	rest := 0.0
	for _, f := range r.StaticFractions {
		switch f.Region {
		case region:
			return f.Fraction
		case AnyRegion:
			rest = f.Fraction
		}
	}
	return rest
}

// enumString names an enum value, or kind(n) when out of range.
func enumString[T ~uint8](v T, names []string, kind string) string {
	if int(v) < len(names) {
		return names[v]
	}
	return fmt.Sprintf("%s(%d)", kind, uint8(v))
}

// parseEnum finds s among names, case-insensitively.
func parseEnum[T ~uint8](s string, names []string) (T, bool) {
	for i, n := range names {
		if strings.EqualFold(s, n) {
			return T(i), true
		}
	}
	return 0, false
}
