package fault

import (
	"os"
	"path/filepath"
	"testing"
)

// The allocators on the raft-wal log store (-log-store wal): the same
// faults as on bolt, the store that the other tests run on (all of them
// run on raft-wal with ALLOT_FAULT_LOG_STORE=wal).

// TestLeaderKillWAL: TestLeaderKill with every allocator on -log-store
// wal: the killed leader restarts on its WAL (a kill -9 in the middle of
// appends), catches up, and the history is linearizable.
func TestLeaderKillWAL(t *testing.T) {
	runKill(t, true, 1, "-log-store", "wal")
}

// TestFullClusterRestartWAL: TestFullClusterRestart with every allocator
// on -log-store wal: the rules, a lease, a drained bucket and an
// idempotency record come back from a snapshot plus the WAL.
func TestFullClusterRestartWAL(t *testing.T) {
	runFullRestart(t, 1, "-log-store", "wal")
}

// wantWAL fails the test unless every node's data dir (every group's,
// with groups) holds a WAL and no bolt log: the flag reached the nodes.
func (e *env) wantWAL() {
	e.t.Helper()
	for _, n := range e.c.Nodes {
		dirs := []string{n.DataDir}
		if e.groups > 1 {
			var err error
			if dirs, err = filepath.Glob(filepath.Join(n.DataDir, "groups", "[0-9]*")); err != nil || len(dirs) == 0 {
				e.t.Fatalf("%s: no group directories in %s: %v", n.ID, n.DataDir, err)
			}
		}
		for _, d := range dirs {
			if fi, err := os.Stat(filepath.Join(d, "wal", "wal-meta.db")); err != nil || fi.Size() == 0 {
				e.t.Fatalf("%s: no WAL in %s: %v", n.ID, d, err)
			}
			if _, err := os.Stat(filepath.Join(d, "raft.db")); err == nil {
				e.t.Fatalf("%s: raft.db beside the WAL in %s", n.ID, d)
			}
		}
	}
}
