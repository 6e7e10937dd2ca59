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
func singleNodeWithSnapshot(t *testing.T, kind string) (*testCluster, string) {
	t.Helper()
	tc := newTestCluster(t, 1, withLogStore(kind))
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
	t.Logf("start refused: %v", err)
	for _, p := range parts {
		if !strings.Contains(err.Error(), p) {
			t.Fatalf("start error %q does not name %q", err, p)
		}
	}
}

// TestMissingRaftDBRefused: a data dir with snapshots but a missing or
// empty raft log (which started silently with rolled-back rules and term)
// refuses to start, naming the file and -recover-from-snapshot; with
// RecoverFromSnapshot it starts from the snapshot at a higher term. For
// each log store.
func TestMissingRaftDBRefused(t *testing.T) {
	for _, c := range []struct{ kind, how string }{
		{LogStoreBolt, "missing"}, {LogStoreBolt, "empty"}, {LogStoreWAL, "missing"}, {LogStoreWAL, "empty"},
	} {
		t.Run(c.kind+"/"+c.how, func(t *testing.T) {
			tc, dir := singleNodeWithSnapshot(t, c.kind)
			db := storePath(dir, c.kind)
			var err error
			switch {
			case c.how == "missing":
				err = os.RemoveAll(db)
			case c.kind == LogStoreWAL: // the meta file (term, vote, segment list)
				err = os.Truncate(filepath.Join(db, "wal-meta.db"), 0)
			default:
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

// TestRolledBackRaftDBRefused: an older copy of the raft log put back
// (lower term and index than the node had reached) refuses to start, for
// each log store.
func TestRolledBackRaftDBRefused(t *testing.T) {
	for _, kind := range []string{LogStoreBolt, LogStoreWAL} {
		t.Run(kind, func(t *testing.T) { testRolledBack(t, kind) })
	}
}

func testRolledBack(t *testing.T, kind string) {
	tc := newTestCluster(t, 1, withLogStore(kind))
	tc.stop(0, true)
	dir := tc.cfgs[0].DataDir
	db := storePath(dir, kind)
	old := filepath.Join(t.TempDir(), "log.old")
	copyTree(t, db, old)
	// Two more starts: each is a new term; rules version 2 adds entries.
	tc.restart(0)
	tc.waitReady(0)
	putRulesV2(t, tc, 0)
	tc.stop(0, true)
	tc.restart(0)
	tc.waitReady(0)
	tc.stop(0, true)
	if err := os.RemoveAll(db); err != nil {
		t.Fatal(err)
	}
	copyTree(t, old, db)
	wantErr(t, startErr(tc, 0), db, "roll the node back", "-recover-from-snapshot")
}

// TestCorruptRaftDBNamesFile: garbage over raft.db's data pages (a bolt
// panic or fault inside raft before), over the WAL's segments or over its
// meta file is an error naming the file.
func TestCorruptRaftDBNamesFile(t *testing.T) {
	for _, c := range []struct{ kind, file string }{
		{LogStoreBolt, ""}, {LogStoreWAL, "*.wal"}, {LogStoreWAL, "wal-meta.db"},
	} {
		t.Run(c.kind+"/"+c.file, func(t *testing.T) {
			tc := newTestCluster(t, 1, withLogStore(c.kind))
			putRulesV2(t, tc, 0)
			tc.stop(0, true)
			db := storePath(tc.cfgs[0].DataDir, c.kind)
			files := []string{db}
			if c.file != "" {
				var err error
				if files, err = filepath.Glob(filepath.Join(db, c.file)); err != nil || len(files) == 0 {
					t.Fatalf("no %s in %s: %v", c.file, db, err)
				}
			}
			for _, f := range files {
				if c.file == "*.wal" {
					// Past the segment header, over the entries (the
					// file is preallocated far beyond them).
					garble(t, f, 64, 1<<20)
				} else {
					garble(t, f, 2*int64(os.Getpagesize()), -1)
				}
			}
			wantErr(t, startErr(tc, 0), db)
		})
	}
}

// garble writes garbage over path from byte from to byte to (-1: its end),
// a page at a time.
func garble(t *testing.T, path string, from, to int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := f.Stat()
	page := int64(os.Getpagesize())
	junk := []byte(strings.Repeat("\xff\x13\x37garbage", int(page)/10))
	if to < 0 || to > fi.Size() {
		to = fi.Size()
	}
	for off := from; off < to; off += page {
		if _, err := f.WriteAt(junk, off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
}

// TestWatermarkFollowsTerm: the watermark records the node's term,
// applied index and log store, and never moves back.
func TestWatermarkFollowsTerm(t *testing.T) {
	tc := newTestCluster(t, 1, withLogStore(LogStoreWAL))
	putRulesV2(t, tc, 0)
	s := tc.node(0)
	term, applied := s.node.raft.CurrentTerm(), s.fsm.applied.Load()
	tc.stop(0, true)
	w, ok, err := readWatermark(tc.cfgs[0].DataDir)
	if err != nil || !ok {
		t.Fatalf("watermark: %v, %v", ok, err)
	}
	if w.Term != term || w.Applied < applied || w.LogStore != LogStoreWAL {
		t.Fatalf("watermark %+v, want term %d, applied ≥ %d and log store %q", w, term, applied, LogStoreWAL)
	}
}

// copyTree copies the file or directory from to to.
func copyTree(t *testing.T, from, to string) {
	t.Helper()
	fi, err := os.Stat(from)
	if err != nil {
		t.Fatal(err)
	}
	if !fi.IsDir() {
		copyFile(t, from, to)
		return
	}
	if err := os.MkdirAll(to, 0o750); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		copyTree(t, filepath.Join(from, e.Name()), filepath.Join(to, e.Name()))
	}
}

// withLogStore runs every node on the log store kind.
func withLogStore(kind string) clusterOpt {
	return func(_ int, c *Config) { c.LogStore = kind }
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
