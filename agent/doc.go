// Package agent is the library a gateway embeds to decide allow/deny for
// every request in-process, at memory speed, against limits that hold across
// the whole fleet.
//
// Most callers want New, then Agent.Check per request (or
// Agent.CheckStatuses when per-descriptor statuses are needed, as for
// Envoy's RLS), and Agent.Close at shutdown. An Agent is safe for
// concurrent use.
//
// # How a check is decided
//
// Check matches each descriptor against the current rules (compiled once per
// rules version and swapped atomically), hashes the budget key without
// allocating and finds the key's state in a sharded table (a request seen
// before under the same rules takes its matched rules and key states from
// the request memo instead; see memo.go). Then, for a rule with the lease backend, in this order:
//
//  1. A live lease with enough tokens: the balance is decremented with a CAS
//     (SourceLease). Leased tokens were taken from the global budget by the
//     allocator before it answered, so spending them never over-admits.
//  2. The allocator said EXHAUSTED for the key, or its last grant fell
//     short of the want on a key paced as below: deny until retry_after_ms
//     or until the paced ask has had time to be answered (SourceLease),
//     without asking again meanwhile. The lease says no; the fallback is
//     not consulted and nothing is charged.
//  3. Otherwise (no lease yet, lease expired, balance too small, a paced
//     ask not answered in time) the key's local fallback bucket decides
//     (SourceFallback). It has rate R/N and burst ⌈burst/N⌉, N being the
//     live agents the allocator last reported (N = 1 when the rule routes
//     by consistent hash). Each grant re-bases the fallback bucket down to
//     this agent's share of the global remaining (⌈remaining/N⌉, never
//     above its burst), so a key whose lease ran dry cannot take a second
//     full burst. A paced key's bucket starts from its share at the end of
//     the grace. Tokens the fallback admits while the
//     allocator is reachable are charged in the next Acquire, or paid out of
//     a grant that arrives while they are owed (that grant already took them
//     from the global budget): the global budget pays for each exactly once.
//
// Rules with the local backend are always decided by a per-agent bucket at
// the full rate (SourceLocal); rules with the redis backend go to
// Config.Redis when set, else to the same local bucket.
//
// No check performs network I/O or waits on the refill loop; the clock is a
// coarse atomic ticked every millisecond by an owned goroutine while checks
// arrive at least 16 times a millisecond, and read by each check itself
// (the monotonic clock) below that rate.
//
// # The refill loop
//
// One goroutine wakes every Config.RefillInterval and sends, in batched
// Acquire calls (at most 1000 keys each, strictly increasing request ids),
// every key that is new, owes a charge, is below its low watermark, is near
// lease expiry or past the allocator's refresh_after, or has tokens to hand
// back because it went idle. Its periodic scan (every Config.ScanInterval)
// visits only the keys that need it: a key at rest sleeps until its next
// deadline (renewal, expiry, idle timeout, paced refresh) or until a check
// touches it, so an agent with no traffic costs next to nothing whatever
// the keys it holds (see due.go; bench/idle measures it). The refill
// policy (demand, wants, pacing, thin shares, excess, the breaker) is a
// pure core, policy.Core in agent/internal/policy, that takes the time and
// what the check path published of each key and returns what to send;
// refill.go and send.go drive it, and the scripts in its testdata specify
// it.
//
// A key whose grant fell short of its want (the global bucket is empty, or
// the allocator's grant pacing has given this agent its share for the
// refresh window) is paced: it is not sent again, charges included, until
// a jittered p/2…p later, p = min(refresh_after, B/(2R), k·10 ms with k
// agents on the key, 500 ms), and its dry lease denies meanwhile. Without
// that, every agent on a contended key would admit from its fallback and
// owe a charge on every tick (bench/sim's hot-key scenario measures the
// calls per admitted request, docs/performance-sim.md). Keys whose pace
// would be under two scans (fewer than 20 agents on the key, or a small
// B/R) are not paced: nobody else would collect the budget's refill between
// their asks.
//
// A key's want is one lease horizon of its demand plus what it spends
// while a refill is collected and answered, rounded up once (at least one
// token; none for a first use that the fallback bucket admitted when the
// agent's share of the key, R/N, is under one token per horizon: the
// fallback gets that token back once its charge is debited). Its demand
// is an EWMA of what it admits (time constant 1 s); a
// key used less than twice per horizon reports at most its rate from the
// gaps between uses (none for a key used once; tokens that arrive together
// are spread over the time since the previous use), so the agents that use
// a low-rate key rarely do not claim a share of it they will not spend. A
// scan that counts a quarter of the EWMA's expectation or less (at least
// 40 tokens expected, nothing denied) sets the demand to the scan's rate,
// and the key is reported at once with what it holds beyond twice its new
// target handed back: a gateway the load balancer moved the traffic away
// from no longer weighs its old demand for a second. A failed call is retried with the same request
// id (the allocator answers a retry from its record, so nothing is granted
// or charged twice) before any new request is made. An overload refusal
// (ResourceExhausted) is not a failure: the same batch is retried after
// the allocator's RetryInfo delay, and the breaker stays closed. A lease expires, on the
// agent, at the time the call was first sent plus lease_ttl_ms minus a
// safety margin: never later than the allocator's own expiry.
//
// Calls go to the leader: a follower forwards them, and names the leader in
// its answer, so the loop moves to that address (one of Config.Allocators,
// or dialed with Config.DialOptions; see route.go) and the follower's hop
// is paid once per leader change. An Unavailable answer that names the
// leader is retried there at once and is not a failure. In a cluster of
// several Raft groups the allocator sends its topology (which group owns
// each slot of the key space, and each group's leader): a refill tick then
// sends each group's keys to that group's leader, and a key answered
// MOVED keeps being decided from its lease and fallback bucket and goes to
// its new owner at its next refill (groups.go).
//
// # Static shares
//
// With Config.StaticShares (the default) every Acquire asks for a static
// slot (docs/static-shares.md). While the allocator's latest answer grants
// one (N slots, valid for valid_ms from the call's first send, less the
// lease safety margin), a key of a static-eligible rule
// ((*rules.Rule).StaticShare) that is not in the allocator's hot-key set
// and holds no lease is decided from its own bucket with rate R/N and
// burst ⌊B/N⌋ (SourceStatic): no call, no charge. A key whose share falls
// below half its burst, or whose demand estimate passes half the share's
// rate, is sent with promote and static_left (what its share holds); until
// the answer it keeps deciding from its share and what it admits is
// charged, and from the answer it is leased like any key. A key the hot-key
// set gains, or any static key once the permission has lapsed, takes the
// path of a key's first use (3 above); a key the set loses is static again,
// with a full share, once it holds no lease and owes nothing. A key that
// stops for another reason than the hot-key set (the permission lapsed,
// its rule no longer eligible, its promotion not applied) owes its share's
// level: its next call promotes it with that level, or, if it turns hot
// first, reports it. A static or owing key is forgotten only once its
// share is full again. A check of one descriptor the request memo knows,
// on a static key whose share admits it, is decided without the shard
// lock, as a leased key's is (checkStaticHit). With nothing else to
// send, a slot holder renews with an empty Acquire every half validity.
// An agent that routes to several data groups asks for no slot. The
// allocator's hash of each eligible key is taken once, when the key is
// first seen after the agent's first slot, and indexed so that a hot-set
// change finds its keys without a scan (static.go).
//
// # When the allocator is unreachable
//
// A circuit breaker opens after Config.FailureThreshold consecutive failed
// calls (each bounded by Config.CallTimeout) and then probes with jittered
// exponential backoff, rotating over Config.Allocators. While it is open the
// agent spends what it holds until the leases expire, then decides from the
// fallback buckets (failure_mode open) or denies (failure_mode closed, with
// RetryAfter = the time until the next probe, at least one second). Tokens
// the fallback admits while the breaker is open are reported after recovery
// as outage_charged, with the key's first Acquire: the allocator takes them
// from what the key's bucket holds, never into debt, so the refill the key
// gained during the outage pays for them instead of being granted again,
// and traffic still flows at the key's rate once the allocator is back.
// The call in flight when the breaker opened is retried first with its
// wants set to 0 (a want sized before the outage would otherwise take that
// refill ahead of the charge). Transitions are logged (rate-limited) and
// exported as metrics.
//
// # Bounds
//
// With the allocator reachable, over-admission for a key comes only from
// fallback decisions made before a charge is applied: the cold start (each
// agent's fallback burst ⌈burst/N⌉ plus R/N × the time to its first grant)
// and, when a lease runs dry, at most R/N × one refill round trip per agent
// (the re-based fallback starts from the agent's share of what is left).
// Charges that push the global bucket past its debt floor are forgiven by
// the allocator; that is the documented cold-start bound.
package agent
