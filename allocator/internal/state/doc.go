// Package state is the allocator's replicated state machine: the rule set,
// every tracked key's authoritative limiter state, the leases agents hold on
// those keys, the agents themselves (with their idempotency records) and the
// cluster members.
//
// State is deterministic. Apply reads no clock and no randomness: the time
// of every command is the leader's stamp in Command.NowUnixNanos (made
// monotone with the last applied time), map iteration order never affects a
// result, and snapshots are byte-identical on every replica that applied the
// same commands. The raft adapter in package allocator wraps State in an FSM;
// this package imports no raft.
//
// Memory. Per-key limiter state lives in an ordered open-addressing table of
// 32-byte slots keyed by rules.KeyHash (xxhash64 of the canonical key), with
// copy-on-write chunks so that Snapshot does not copy the table under the
// lock. Key strings and leases are kept only for keys with live leases. Keys
// whose bucket is full and that carry no lease are dropped by the Expire
// sweep, a bounded slice of the hash space per Expire.
//
// The grant policy (sizing, max-min fair share, lease TTL and refresh) is
// described in docs/leases.md.
//
// State is safe for concurrent use: Apply and Restore take the write lock,
// the read APIs take the read lock.
package state
