// Package redislimit is allot's Redis backend: a budget shared by every agent
// and checked against Redis on each request, for rules with `backend: redis`.
//
// A check is one atomic Lua script on the key's primary, called with
// EVALSHA: it reads the key, refills, decides, writes and sets the TTL with
// no interleaving. The script implements pkg/bucket's algorithms (token
// bucket and GCRA, plus the fixed and sliding windows) with the same
// semantics: Lua numbers are doubles, so time is whole milliseconds and every
// quantity the script handles is an integer below 2⁵³ (limits that cannot be
// kept so are rejected with ErrUnsupportedLimit), and the script returns the
// key's state, from which the Result is computed in Go by pkg/bucket itself.
// At whole-millisecond instants the two agree exactly; at other instants the
// script sees the time floored to the millisecond (TestRedisScriptMatchesBucket).
//
// Backend is the per-request client (most callers want Backend.AllowN, or
// RuleLimiter to plug it into the agent). A hot key can be split into N
// sub-keys, each holding 1/N of the rate and burst, whose hash tags put them
// on different Redis Cluster slots (and, for the usual contiguous slot
// layout, different masters); rules set `shards: N`, and a Promoter lets an
// agent promote a key that turns hot. Batcher is the lease model on top of
// Redis: it takes small batches of tokens and spends them locally.
//
// Redis errors and timeouts (5 ms by default) return errors wrapping
// ErrUnavailable; a circuit breaker then fails calls fast, without I/O, until
// a probe after the cooldown succeeds. The caller applies the rule's
// failure_mode. docs/redis.md has the operator's view; the
// measured figures are in docs/performance.md.
//
// Every type here is safe for concurrent use.
package redislimit
