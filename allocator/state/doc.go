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
// 32-byte slots keyed by rules.KeyHash (xxhash64 of the canonical key), run
// at 4/5 to 92% load in shards by hash prefix that grow one at a time,
// with copy-on-write chunks so that Snapshot does not copy the table under
// the lock. A key with live leases also has an entry
// in a byte arena (arena.go, entry.go): its rates, its leases (22 bytes
// each) and its key (an interned template and the values), named by a
// uint32 link in its slot, with no Go pointer; an expiry wheel of 4-byte
// links (wheel.go) finds the leases due. Keys whose bucket is full and that
// carry no lease are dropped by the Expire sweep, a bounded slice of the
// hash space per Expire. docs/leases.md gives the layout's cost per key.
//
// The grant policy (sizing, max-min fair share of holdings, grant pacing
// per refresh window, lease TTL and refresh) is described in
// docs/leases.md and summarised in policy.go.
//
// Slots (slots.go). In a cluster of several Raft groups a State serves
// only the slots (pkg/slots) its group owns. A slot move freezes the slots
// at the source (their keys are answered KEY_STATUS_MOVED and their state
// stays exactly as it was), exports their keys' bucket state and leases,
// imports them at the target and drops them at the source, each as a slot
// entry applied in log order (slotentry.go). No token is granted twice
// across a move: the source's state for the slots is final from its freeze
// entry on, the target installs exactly that state and serves none of the
// slots before, so the two grant, key by key, what one group that paused
// the slots would have. During a move of duration D no group grants for
// the moving keys; an agent admits for such a key at most the lease
// balance it held at the freeze (already debited, and carried over) plus
// its fallback bucket's ⌈B/N⌉ + R·D/N, which it reports as charged to the
// new owner afterwards: over all N agents at most B + R·D beyond the
// leases, paid back from the key's budget once the move is done. A State
// that serves every slot, as in a cluster of one group, behaves and
// snapshots as if slots did not exist.
//
// State is safe for concurrent use: Apply and Restore take the write lock,
// the read APIs take the read lock.
package state
