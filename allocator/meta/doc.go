// Package meta is the pure state machine of the meta group (group 0): the
// Raft groups of the cluster and their members, the slot map
// (allocator/slots) and its version, and the slot moves in flight.
//
// A State is changed only by its command methods (Bootstrap, AddGroup,
// SetMembers, RemoveGroup, BeginMove, Froze, Transferred, Commit,
// Abort), which a Raft FSM applies in log order on every replica. They
// read no clock and no randomness: the leader stamps times into the
// command, and ids are assigned from counters in the State. A refused
// command returns an error wrapping one of the sentinels below and changes
// nothing.
//
// # Moving slots
//
// A move hands a range of slots from the group that owns them (the
// source) to another (the target), through these phases, each recorded
// here when the group concerned reports it:
//
//	PhaseFreezing     BeginMove: the move is recorded; the source still serves the slots.
//	PhaseFrozen       Froze: the source committed, in its own log, that it no longer
//	                  serves the slots, at its index SourceIndex; its state for them
//	                  is final from that entry on.
//	PhaseTransferred  Transferred: the target committed the slots' bucket state and
//	                  leases, as of that entry, at its index TargetIndex.
//	(done)            Commit: the slot map names the target as owner, its version
//	                  grows, and the move ends.
//
// Between Froze and Commit no group serves the slots: agents decide their
// keys from their leases and fallback buckets, and calls for them are
// answered "moved" and retried. A token is never granted twice: the
// source grants nothing after its freeze entry, the target starts from
// the state as of that entry, and it serves only after Commit. Abort
// ends a move before Transferred (the source serves the slots again);
// after Transferred a move can only finish, so no state exists twice.
// Every report is idempotent: a report of the phase already reached is a
// no-op, so a driver that lost its leader mid-move retries from the phase
// it reads here.
//
// Invariants, checked by Validate and the property tests: every slot has
// exactly one owner, which is a group of the cluster; no two moves in
// flight share a slot; a move's source owns its whole range and its target
// exists and differs from it; a group with slots or in a move is not
// removed; the slot map's version grows with every change of owner.
//
// Snapshot and Restore encode the whole State as versioned JSON; Restore
// validates it and refuses a snapshot that breaks an invariant.
//
// PlanLeaders spreads the groups' leaders over the live nodes (each of N
// nodes leads ⌊G/N⌋ or ⌈G/N⌉ of G groups) by leadership transfers, the
// fewest that reach it; it is a pure function of the groups, their
// current leaders and the live nodes.
//
// A State is not safe for concurrent use: the FSM adapter serializes
// Apply, Snapshot and the readers.
package meta
