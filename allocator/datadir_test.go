package allocator

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// startErr starts node i of tc again and returns New's error (the node is
// stopped again if it started).
func startErr(tc *testCluster, i int) error {
	tc.newTransport(i)
	cfg := tc.cfgs[i]
	cfg.transport = tc.trans[i]
	s, err := New(cfg)
	if err == nil {
		s.kill()
	}
	return err
}

// singleNodeWithSnapshot runs a one-node cluster to rules version 2 and a
// snapshot, stops it, and returns it with its data dir.
func singleNodeWithSnapshot(t *testing.T) (*testCluster, string) {
	t.Helper()
	tc := newTestCluster(t, 1)
	putRulesV2(t, tc, 0)
	if err := tc.node(0).node.raft.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	tc.stop(0, true)
	return tc, tc.cfgs[0].DataDir
}

func wantErr(t *testing.T, err error, parts ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("start succeeded; want an error naming %q", parts)
	}
	for _, p := range parts {
		if !strings.Contains(err.Error(), p) {
			t.Fatalf("start error %q does not name %q", err, p)
		}
	}
}

// TestMissingRaftDBRefused: a data dir with snapshots but a missing or
// empty raft.db (which started silently with rolled-back rules and term)
// refuses to start, naming the file and -recover-from-snapshot; with
// RecoverFromSnapshot it starts from the snapshot at a higher term.
func TestMissingRaftDBRefused(t *testing.T) {
	for _, how := range []string{"missing", "empty"} {
		t.Run(how, func(t *testing.T) {
			tc, dir := singleNodeWithSnapshot(t)
			db := filepath.Join(dir, raftDBFile)
			var err error
			if how == "missing" {
				err = os.Remove(db)
			} else {
				err = os.Truncate(db, 0)
			}
			if err != nil {
				t.Fatal(err)
			}
			wantErr(t, startErr(tc, 0), db, "-recover-from-snapshot")

			tc.cfgs[0].RecoverFromSnapshot = true
			tc.restart(0)
			tc.waitReady(0)
			if v := tc.node(0).rulesVersion(); v != 2 {
				t.Fatalf("recovered rules version %d, want 2 (the snapshot's)", v)
			}
			tc.stop(0, true)
			// The recovered data dir starts normally.
			tc.cfgs[0].RecoverFromSnapshot = false
			tc.restart(0)
			tc.waitReady(0)
		})
	}
}

// TestRolledBackRaftDBRefused: an older copy of raft.db put back (lower
// term and index than the node had reached) refuses to start.
func TestRolledBackRaftDBRefused(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.stop(0, true)
	dir := tc.cfgs[0].DataDir
	db := filepath.Join(dir, raftDBFile)
	old := filepath.Join(t.TempDir(), "raft.db.old")
	copyFile(t, db, old)
	// Two more starts: each is a new term; rules version 2 adds entries.
	tc.restart(0)
	tc.waitReady(0)
	putRulesV2(t, tc, 0)
	tc.stop(0, true)
	tc.restart(0)
	tc.waitReady(0)
	tc.stop(0, true)
	copyFile(t, old, db)
	wantErr(t, startErr(tc, 0), db, "roll the node back", "-recover-from-snapshot")
}

// TestCorruptRaftDBNamesFile: garbage over raft.db's data pages (a bolt
// panic or fault inside raft before) is an error naming the file.
func TestCorruptRaftDBNamesFile(t *testing.T) {
	tc := newTestCluster(t, 1)
	putRulesV2(t, tc, 0)
	tc.stop(0, true)
	db := filepath.Join(tc.cfgs[0].DataDir, raftDBFile)
	f, err := os.OpenFile(db, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := f.Stat()
	page := int64(os.Getpagesize())
	junk := []byte(strings.Repeat("\xff\x13\x37garbage", int(page)/10))
	for off := 2 * page; off < fi.Size(); off += page {
		if _, err := f.WriteAt(junk, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	wantErr(t, startErr(tc, 0), db)
}

// TestWatermarkFollowsTerm: the watermark records the node's term and
// applied index, and never moves back.
func TestWatermarkFollowsTerm(t *testing.T) {
	tc := newTestCluster(t, 1)
	putRulesV2(t, tc, 0)
	s := tc.node(0)
	term, applied := s.node.raft.CurrentTerm(), s.fsm.applied.Load()
	tc.stop(0, true)
	w, ok, err := readWatermark(tc.cfgs[0].DataDir)
	if err != nil || !ok {
		t.Fatalf("watermark: %v, %v", ok, err)
	}
	if w.Term != term || w.Applied < applied {
		t.Fatalf("watermark %+v, want term %d and applied ≥ %d", w, term, applied)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(to)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
