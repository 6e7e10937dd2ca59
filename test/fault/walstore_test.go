package fault

import "testing"

// The allocators on the raft-wal log store (-log-store wal): the same
// faults as on bolt, the store that the other tests run on.

// TestLeaderKillWAL: TestLeaderKill with every allocator on -log-store
// wal: the killed leader restarts on its WAL (a kill -9 in the middle of
// appends), catches up, and the history is linearizable.
func TestLeaderKillWAL(t *testing.T) { runKill(t, true, 1, "-log-store", "wal") }

// TestFullClusterRestartWAL: TestFullClusterRestart with every allocator
// on -log-store wal: the rules, a lease, a drained bucket and an
// idempotency record come back from a snapshot plus the WAL.
func TestFullClusterRestartWAL(t *testing.T) { runFullRestart(t, 1, "-log-store", "wal") }
