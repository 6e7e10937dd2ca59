package allocator

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"go.etcd.io/bbolt"
)

// TestPickLogStore: a data dir runs on the store it holds, or the one its
// watermark names when the log is gone; a new dir on the one asked for
// (bolt by default); asking for the other store than the dir holds, or
// holding both, is an error naming the paths.
func TestPickLogStore(t *testing.T) {
	bolt := func(dir string) {
		if err := os.WriteFile(filepath.Join(dir, raftDBFile), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	wal := func(dir string) {
		if err := os.MkdirAll(filepath.Join(dir, walDir), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, walDir, "wal-meta.db"), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	emptyWAL := func(dir string) { // a directory without its meta file
		if err := os.MkdirAll(filepath.Join(dir, walDir), 0o750); err != nil {
			t.Fatal(err)
		}
	}
	none := func(string) {}
	for _, c := range []struct {
		name     string
		make     func(dir string)
		mark     *watermark
		want     string
		fallback string
		got      string
		errWith  []string
	}{
		{name: "new dir", make: none, got: LogStoreBolt},
		{name: "new dir, wal", make: none, want: LogStoreWAL, got: LogStoreWAL},
		{name: "new dir, bolt", make: none, want: LogStoreBolt, got: LogStoreBolt},
		{name: "new dir, group 0 on wal", make: none, fallback: LogStoreWAL, got: LogStoreWAL},
		{name: "new dir, group 0 on wal, bolt asked", make: none, want: LogStoreBolt, fallback: LogStoreWAL, got: LogStoreBolt},
		{name: "bolt dir, group 0 on wal", make: bolt, fallback: LogStoreWAL, got: LogStoreBolt},
		{name: "bolt dir", make: bolt, got: LogStoreBolt},
		{name: "bolt dir, wal asked", make: bolt, want: LogStoreWAL, errWith: []string{raftDBFile, "-log-store wal"}},
		{name: "wal dir", make: wal, got: LogStoreWAL},
		{name: "wal dir, bolt asked", make: wal, want: LogStoreBolt, errWith: []string{walDir, "-log-store bolt"}},
		{name: "both", make: func(d string) { bolt(d); wal(d) }, errWith: []string{raftDBFile, walDir}},
		{name: "wal dir without meta", make: emptyWAL, want: LogStoreWAL, got: LogStoreWAL},
		{name: "log gone, watermark names wal", make: none, mark: &watermark{Term: 3, LogStore: LogStoreWAL}, got: LogStoreWAL},
		{name: "log gone, watermark names wal, bolt asked", make: none, mark: &watermark{Term: 3, LogStore: LogStoreWAL},
			want: LogStoreBolt, errWith: []string{"-log-store bolt"}},
		{name: "log gone, watermark without a store", make: none, mark: &watermark{Term: 3}, got: LogStoreBolt},
		{name: "log gone, watermark without a store, wal asked", make: none, mark: &watermark{Term: 3},
			want: LogStoreWAL, errWith: []string{"-log-store wal"}},
		{name: "unknown store", make: none, want: "rocks", errWith: []string{`"rocks"`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			c.make(dir)
			var mark watermark
			if c.mark != nil {
				mark = *c.mark
			}
			got, err := pickLogStore(dir, c.want, c.fallback, mark, c.mark != nil)
			if c.errWith != nil {
				if err == nil {
					t.Fatalf("pickLogStore = %q, want an error naming %q", got, c.errWith)
				}
				for _, p := range c.errWith {
					if !strings.Contains(err.Error(), p) {
						t.Fatalf("error %q does not name %q", err, p)
					}
				}
				return
			}
			if err != nil || got != c.got {
				t.Fatalf("pickLogStore = %q, %v; want %q", got, err, c.got)
			}
		})
	}
}

// TestLogStoreRestart: a node on each store keeps its rules, term and
// entries across a restart, and its data dir holds that store only.
func TestLogStoreRestart(t *testing.T) {
	for _, kind := range []string{LogStoreBolt, LogStoreWAL} {
		t.Run(kind, func(t *testing.T) {
			tc := newTestCluster(t, 1, withLogStore(kind))
			putRulesV2(t, tc, 0)
			term := tc.node(0).node.raft.CurrentTerm()
			last := tc.node(0).node.raft.LastIndex()
			tc.stop(0, true)
			other := LogStoreWAL
			if kind == LogStoreWAL {
				other = LogStoreBolt
			}
			if _, err := os.Stat(storePath(tc.cfgs[0].DataDir, other)); !os.IsNotExist(err) {
				t.Fatalf("%s exists beside the %s store: %v", storePath(tc.cfgs[0].DataDir, other), kind, err)
			}
			// Started without naming a store, the node finds its own.
			tc.cfgs[0].LogStore = ""
			tc.restart(0)
			tc.waitReady(0)
			s := tc.node(0)
			if v := s.rulesVersion(); v != 2 {
				t.Fatalf("rules version %d after restart, want 2", v)
			}
			if s.node.kind != kind || s.node.raft.CurrentTerm() <= term || s.node.raft.LastIndex() <= last {
				t.Fatalf("after restart: store %q term %d last index %d; want %q, past term %d and index %d",
					s.node.kind, s.node.raft.CurrentTerm(), s.node.raft.LastIndex(), kind, term, last)
			}
		})
	}
}

// TestLogStoreSnapshotCatchUp: a follower further behind than the
// leader's log (compacted by a snapshot) catches up from the snapshot and
// then appends the entries after it, on each store. raft-wal refuses a
// gap in the log, so Raft must clear the follower's old log when it
// installs the snapshot: it does so only if it sees the store as
// monotonic through the wrappers around it.
func TestLogStoreSnapshotCatchUp(t *testing.T) {
	for _, kind := range []string{LogStoreBolt, LogStoreWAL} {
		t.Run(kind, func(t *testing.T) {
			tc := newTestCluster(t, 3, withLogStore(kind), func(_ int, c *Config) { c.trailingLogs, c.walSegmentSize = 2, 1024 })
			l := tc.leader()
			f := (l + 1) % 3
			behind := tc.node(f).node.raft.LastIndex()
			tc.stop(f, true)
			alloc, _ := tc.clients(l)
			ctx := ctxT(t)
			for i := range 20 {
				acquireGrants(ctx, t, alloc, acquireReq("catch-up", uint64(i+1), key("user", fmt.Sprintf("u%d", i), 5)))
			}
			if err := tc.node(l).node.raft.Snapshot().Error(); err != nil {
				t.Fatal(err)
			}
			first, err := tc.node(l).node.logs.FirstIndex()
			if err != nil || first <= behind+1 {
				t.Fatalf("leader's log starts at %d (%v); the stopped follower has up to %d: no snapshot needed", first, err, behind)
			}
			var gone raft.Log
			if err := tc.node(l).node.logs.GetLog(behind+1, &gone); !errors.Is(err, raft.ErrLogNotFound) {
				t.Fatalf("leader's entry %d after compaction: %v, want ErrLogNotFound", behind+1, err)
			}
			snapIdx := tc.node(l).node.raft.LastIndex()
			tc.restart(f)
			tc.waitReady(f)
			putRulesV2(t, tc, f) // an entry after the snapshot, appended and applied
			s := tc.node(f)
			last, err := s.node.logs.LastIndex()
			if err != nil || last < tc.node(tc.leader()).node.raft.CommitIndex() {
				t.Fatalf("follower's log ends at %d (%v), before the leader's commit index %d", last, err, tc.node(tc.leader()).node.raft.CommitIndex())
			}
			if err := s.node.appendErr.Load(); err != nil {
				t.Fatalf("follower's appends fail: %v", err.err)
			}
			if got, err := strconv.ParseUint(s.node.raft.Stats()["last_snapshot_index"], 10, 64); err != nil || got < snapIdx {
				t.Fatalf("follower's last snapshot index %d (%v), want the leader's snapshot (≥ %d): it caught up without one", got, err, snapIdx)
			}
			// Raft sees through the wrappers whether the store refuses gaps.
			m, ok := s.node.logs.(raft.MonotonicLogStore)
			if !ok || m.IsMonotonic() != (kind == LogStoreWAL) {
				t.Fatalf("log store %s: monotonic %v, %v", kind, ok, ok && m.IsMonotonic())
			}
		})
	}
}

// TestLogStoreTailTruncationRestart: a log whose tail Raft cleared (a
// follower dropping entries a new leader overwrites: "clearing log
// suffix") and then appended to again reopens whole, on each store.
// raft-wal before v0.4.1 marked the truncated segment sealed without
// writing its index, and the next start failed ("sealed segment has no
// index block").
func TestLogStoreTailTruncationRestart(t *testing.T) {
	for _, kind := range []string{LogStoreBolt, LogStoreWAL} {
		t.Run(kind, func(t *testing.T) {
			path := storePath(t.TempDir(), kind)
			logger := hclog.NewNullLogger()
			entries := func(from, to uint64, term uint64) []*raft.Log {
				var out []*raft.Log
				for i := from; i <= to; i++ {
					out = append(out, &raft.Log{Index: i, Term: term, Type: raft.LogCommand, Data: []byte(fmt.Sprintf("entry %d term %d", i, term))})
				}
				return out
			}
			s, err := openStore(kind, path, logger, 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.StoreLogs(entries(1, 10, 1)); err != nil {
				t.Fatal(err)
			}
			if err := s.DeleteRange(8, 10); err != nil {
				t.Fatal(err)
			}
			if err := s.StoreLogs(entries(8, 12, 2)); err != nil {
				t.Fatal(err)
			}
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			if err := verifyStore(kind, path, logger, 0); err != nil {
				t.Fatalf("reopen after a tail truncation: %v", err)
			}
			s, err = openStore(kind, path, logger, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			for i := uint64(1); i <= 12; i++ {
				var l raft.Log
				if err := s.GetLog(i, &l); err != nil {
					t.Fatalf("entry %d: %v", i, err)
				}
				want := uint64(1)
				if i >= 8 {
					want = 2
				}
				if l.Term != want || string(l.Data) != fmt.Sprintf("entry %d term %d", i, want) {
					t.Fatalf("entry %d: term %d %q, want term %d", i, l.Term, l.Data, want)
				}
			}
		})
	}
}

// walSegments lists the segment files of the WAL at path by base index.
func walSegments(t *testing.T, path string) map[uint64]string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(path, "*.wal"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[uint64]string{}
	for _, f := range files {
		var base, id uint64
		if _, err := fmt.Sscanf(filepath.Base(f), "%020d-%016x.wal", &base, &id); err != nil {
			t.Fatalf("segment %s: %v", f, err)
		}
		out[base] = f
	}
	return out
}

// TestWALOlderMetaRefused: an older wal-meta.db put back over newer
// segments is refused before raft-wal opens the directory (which would
// delete the segments it does not know of), and every segment is still
// there after the refusal.
func TestWALOlderMetaRefused(t *testing.T) {
	path := storePath(t.TempDir(), LogStoreWAL)
	logger := hclog.NewNullLogger()
	store := func(from, to uint64) {
		s, err := openStore(LogStoreWAL, path, logger, 1024)
		if err != nil {
			t.Fatal(err)
		}
		for i := from; i <= to; i++ {
			if err := s.StoreLogs([]*raft.Log{{Index: i, Term: 1, Type: raft.LogCommand, Data: []byte(strings.Repeat("x", 200))}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	store(1, 3)
	meta := filepath.Join(path, "wal-meta.db")
	old := filepath.Join(t.TempDir(), "wal-meta.db")
	copyFile(t, meta, old)
	store(4, 60)
	before := walSegments(t, path)
	if len(before) < 3 {
		t.Fatalf("%d segments; want several", len(before))
	}
	copyFile(t, old, meta)
	err := verifyStore(LogStoreWAL, path, logger, 1024)
	if err == nil || !strings.Contains(err.Error(), "newer than") || !strings.Contains(err.Error(), path) {
		t.Fatalf("verify = %v, want a refusal naming a newer segment in %s", err, path)
	}
	if after := walSegments(t, path); len(after) != len(before) {
		t.Fatalf("%d segments after the refusal, %d before", len(after), len(before))
	}
}

// TestWALDamagedSegments: on small segments, garbage over a sealed segment
// is an error naming the WAL (every entry is read before Raft opens it),
// and a tail lost or damaged back past the newest snapshot (raft-wal ends
// the log before a damaged tail, as at a torn write) is refused even when
// the snapshot covers the watermark: Raft's next append after the
// snapshot would fail for ever. -recover-from-snapshot starts it again.
func TestWALDamagedSegments(t *testing.T) {
	for _, which := range []string{"sealed", "tail"} {
		t.Run(which, func(t *testing.T) {
			tc := newTestCluster(t, 1, withLogStore(LogStoreWAL), func(_ int, c *Config) { c.walSegmentSize = 1024 })
			alloc, _ := tc.clients(0)
			ctx := ctxT(t)
			for i := range 40 {
				acquireGrants(ctx, t, alloc, acquireReq("segments", uint64(i+1), key("user", fmt.Sprintf("u%d", i), 5)))
			}
			putRulesV2(t, tc, 0)
			if err := tc.node(0).node.raft.Snapshot().Error(); err != nil {
				t.Fatal(err)
			}
			snap := tc.node(0).node.raft.LastIndex()
			tc.stop(0, false)
			path := storePath(tc.cfgs[0].DataDir, LogStoreWAL)
			segs := walSegments(t, path)
			var bases []uint64
			for b := range segs {
				bases = append(bases, b)
			}
			slices.Sort(bases)
			if len(bases) < 3 {
				t.Fatalf("%d segments; want several", len(bases))
			}
			want := "before the newest snapshot"
			if which == "sealed" {
				garble(t, segs[bases[1]], 64, 1<<20)
				want = "read raft log"
			} else {
				// Every segment from the one holding the snapshot's
				// entry on: the log then ends before the snapshot.
				from := bases[0]
				for _, b := range bases {
					if b <= snap {
						from = b
					}
				}
				if from == bases[0] {
					t.Fatalf("the snapshot's entry %d is in the first segment", snap)
				}
				for _, b := range bases {
					if b >= from {
						garble(t, segs[b], 64, 1<<20)
					}
				}
			}
			wantErr(t, startErr(tc, 0), path, want)
			tc.cfgs[0].RecoverFromSnapshot = true
			tc.restart(0)
			tc.waitReady(0)
			if v := tc.node(0).rulesVersion(); v != 2 {
				t.Fatalf("recovered rules version %d, want 2 (the snapshot's)", v)
			}
		})
	}
}

// TestRebuildTermPastVotes: a log rebuilt from a snapshot gets a term past
// the snapshot's, the watermark's and the terms the old log recorded (its
// current term and its last vote's), whichever is highest.
func TestRebuildTermPastVotes(t *testing.T) {
	for _, kind := range []string{LogStoreBolt, LogStoreWAL} {
		t.Run(kind, func(t *testing.T) {
			dir := t.TempDir()
			logger := hclog.NewNullLogger()
			old, err := openStore(kind, storePath(t.TempDir(), kind), logger, 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := old.SetUint64(keyCurrentTerm, 5); err != nil {
				t.Fatal(err)
			}
			if err := old.SetUint64(keyLastVoteTerm, 9); err != nil {
				t.Fatal(err)
			}
			seen := storedTerms(old)
			old.Close()
			if seen != 9 {
				t.Fatalf("storedTerms = %d, want 9 (the last vote's)", seen)
			}
			snaps := writeSnapshot(t, dir, 5, 2, nil)
			for _, c := range []struct {
				mark, seen, want uint64
			}{{0, 0, 3}, {4, 0, 5}, {4, seen, 10}} {
				s, err := openStore(kind, storePath(t.TempDir(), kind), logger, 0)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := rebuildFromSnapshot(dir, "log", snaps, s, watermark{Term: c.mark}, c.seen); err != nil {
					t.Fatal(err)
				}
				if got, _ := s.GetUint64(keyCurrentTerm); got != c.want {
					t.Fatalf("snapshot term 2, watermark %d, old log %d: term %d, want %d", c.mark, c.seen, got, c.want)
				}
				s.Close()
			}
		})
	}
}

// TestLockedDataDirNotRecovered: a log store another process holds open is
// refused as locked, and -recover-from-snapshot does not move it aside.
func TestLockedDataDirNotRecovered(t *testing.T) {
	for _, kind := range []string{LogStoreBolt, LogStoreWAL} {
		t.Run(kind, func(t *testing.T) {
			tc, dir := singleNodeWithSnapshot(t, kind)
			path := storePath(dir, kind)
			file := path
			if kind == LogStoreWAL {
				file = filepath.Join(path, "wal-meta.db")
			}
			db, err := bbolt.Open(file, 0o600, nil) // holds the lock
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			tc.cfgs[0].RecoverFromSnapshot = true
			wantErr(t, startErr(tc, 0), file, "locked by another process")
			if _, err := os.Stat(file); err != nil {
				t.Fatalf("%s after the refusal: %v", file, err)
			}
		})
	}
}
