package allocator

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/hashicorp/raft"
	"go.etcd.io/bbolt"
)

// watermarkFile, in Config.DataDir, records the highest term and applied
// index this node has reached. Both only grow while raft.db is intact; a
// raft.db that holds less (a missing, emptied or older file) would roll
// the node back, and the node refuses to start on it.
const watermarkFile = "raft-watermark.json"

// watermarkInterval is how often a running node rewrites watermarkFile
// (and at shutdown).
const watermarkInterval = 5 * time.Second

// keyCurrentTerm and keyLastVoteTerm are the stable-store keys
// hashicorp/raft keeps its term and its last vote's term in.
var (
	keyCurrentTerm  = []byte("CurrentTerm")
	keyLastVoteTerm = []byte("LastVoteTerm")
)

// watermark is watermarkFile's content.
type watermark struct {
	Term    uint64 `json:"term"`
	Applied uint64 `json:"applied_index"`
	// LogStore is the log store the node runs on (absent: LogStoreBolt),
	// so that a log that went missing is still known by its kind.
	LogStore string `json:"log_store,omitempty"`
}

// errLocked: another process holds the log store open.
var errLocked = errors.New("locked by another process")

// recoverHint is how every refusal below ends.
const recoverHint = "to start from the newest snapshot anyway (losing what was committed after it), " +
	"run once with -recover-from-snapshot (Config.RecoverFromSnapshot); or move the data dir aside and rejoin the node " +
	"as a new member (docs/operations.md, \"Recovering a damaged data dir\")"

func readWatermark(dir string) (watermark, bool, error) {
	path := filepath.Join(dir, watermarkFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return watermark{}, false, nil
	}
	if err != nil {
		return watermark{}, false, fmt.Errorf("allocator: read %s: %w", path, err)
	}
	var w watermark
	if err := json.Unmarshal(b, &w); err != nil {
		return watermark{}, false, fmt.Errorf("allocator: %s: %w", path, err)
	}
	return w, true, nil
}

// writeFileSync writes data to path durably: a temporary file, fsync,
// rename.
func writeFileSync(path string, data []byte) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640)
	if err != nil {
		return fmt.Errorf("allocator: write %s: %w", path, err)
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("allocator: write %s: %w", path, err)
	}
	return nil
}

// writeWatermark records the node's term and the FSM's applied index, both
// already durable in raft.db, unless they are below the recorded ones.
func (n *node) writeWatermark(f *fsm) error {
	n.markMu.Lock()
	defer n.markMu.Unlock()
	w := watermark{Term: n.raft.CurrentTerm(), Applied: f.applied.Load(), LogStore: n.kind}
	if w.Term <= n.mark.Term && w.Applied <= n.mark.Applied && n.mark.LogStore == n.kind {
		return nil
	}
	w.Term, w.Applied = max(w.Term, n.mark.Term), max(w.Applied, n.mark.Applied)
	b, err := json.Marshal(w)
	if err != nil {
		return err
	}
	if err := writeFileSync(filepath.Join(n.dataDir, watermarkFile), append(b, '\n')); err != nil {
		return err
	}
	n.mark = w
	return nil
}

// dbMissing reports whether raft.db is absent or empty.
func dbMissing(path string) (bool, error) {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("allocator: %s: %w", path, err)
	}
	return fi.Size() == 0, nil
}

// snapshotDirs lists the snapshot directories in dir/snapshots (none when
// it does not exist).
func snapshotDirs(dir string) ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(dir, snapshotsDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("allocator: read %s: %w", filepath.Join(dir, snapshotsDir), err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() && filepath.Ext(e.Name()) != ".tmp" {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// checkMissingDB refuses a data dir whose raft.db is missing or empty
// while snapshots or a watermark show the node had state: raft would
// start from the newest snapshot with the term and every later entry
// lost. It reports whether raft.db must be rebuilt from a snapshot
// (recover set and the file missing).
func checkMissingDB(dir, dbPath string, missing bool, mark watermark, hasMark, recover bool) (rebuild bool, err error) {
	if !missing {
		return false, nil
	}
	snaps, err := snapshotDirs(dir)
	if err != nil {
		return false, err
	}
	if len(snaps) == 0 && !(hasMark && mark.Term > 0) {
		return false, nil // a new node
	}
	if len(snaps) == 0 {
		return false, fmt.Errorf("allocator: %s is missing or empty, but %s records term %d and applied index %d, "+
			"and there is no snapshot to recover from: move the data dir aside and rejoin the node as a new member",
			dbPath, filepath.Join(dir, watermarkFile), mark.Term, mark.Applied)
	}
	if !recover {
		return false, fmt.Errorf("allocator: %s is missing or empty, but %s holds %d snapshot(s): the node's term, vote "+
			"and every entry after the newest snapshot are gone, and starting would roll it back; %s",
			dbPath, filepath.Join(dir, snapshotsDir), len(snaps), recoverHint)
	}
	return true, nil
}

// checkRollback refuses a raft log whose term or last index is below the
// watermark (an older copy put back, or a file that lost its tail), and a
// log that refuses gaps (raft-wal) but ends before the newest snapshot.
func checkRollback(dir, dbPath string, store raftStore, snaps *raft.FileSnapshotStore, mark watermark) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("allocator: read raft log %s: corrupt database: %v", dbPath, r)
		}
	}()
	term, err := store.GetUint64(keyCurrentTerm)
	if err != nil && err.Error() != "not found" {
		return fmt.Errorf("allocator: read raft term from %s: %w", dbPath, err)
	}
	last, err := store.LastIndex()
	if err != nil {
		return fmt.Errorf("allocator: read raft log %s: %w", dbPath, err)
	}
	if metas, err := snaps.List(); err == nil && len(metas) > 0 {
		last = max(last, metas[0].Index)
	}
	if m, ok := store.(raft.MonotonicLogStore); ok && m.IsMonotonic() {
		// A log that refuses gaps must reach the newest snapshot when it
		// holds any entry, or Raft's next append after the snapshot fails
		// for ever. A shorter one either lost its tail (raft-wal reads a
		// damaged tail as a torn write and ends the log before it) or
		// belongs to a node stopped while installing a snapshot from the
		// leader (the snapshot is written before the old log is cleared).
		logLast, err := store.LastIndex()
		if err != nil {
			return fmt.Errorf("allocator: read raft log %s: %w", dbPath, err)
		}
		if metas, err := snaps.List(); err == nil && len(metas) > 0 && logLast > 0 && logLast < metas[0].Index {
			return fmt.Errorf("allocator: %s ends at entry %d, before the newest snapshot (%d, %s): either the node stopped while "+
				"installing that snapshot from the leader (nothing is lost: -recover-from-snapshot is safe), or the log's tail is lost or damaged; %s",
				dbPath, logLast, metas[0].Index, filepath.Join(dir, snapshotsDir, metas[0].ID), recoverHint)
		}
	}
	if term < mark.Term || last < mark.Applied {
		return fmt.Errorf("allocator: %s holds term %d and entries up to %d, but this node had reached term %d and "+
			"applied index %d (%s): it is an older or truncated copy, and starting would roll the node back; %s",
			dbPath, term, last, mark.Term, mark.Applied, filepath.Join(dir, watermarkFile), recoverHint)
	}
	return nil
}

// rebuildFromSnapshot prepares a data dir for a start from its newest
// snapshot (Config.RecoverFromSnapshot): a damaged or rolled-back raft.db
// is moved aside, and the new one gets a term past any this node may have
// voted in (the snapshot's, the watermark's and, when it could be read,
// the old log's current and last-vote terms, plus one), so it can never
// vote twice in one term.
func rebuildFromSnapshot(dir, dbPath string, snaps *raft.FileSnapshotStore, store raftStore, mark watermark, seenTerm uint64) (string, error) {
	metas, err := snaps.List()
	if err != nil {
		return "", fmt.Errorf("allocator: list snapshots in %s: %w", filepath.Join(dir, snapshotsDir), err)
	}
	if len(metas) == 0 {
		return "", fmt.Errorf("allocator: -recover-from-snapshot: no snapshot in %s", filepath.Join(dir, snapshotsDir))
	}
	term := max(metas[0].Term, mark.Term, seenTerm) + 1
	if err := store.SetUint64(keyCurrentTerm, term); err != nil {
		return "", fmt.Errorf("allocator: -recover-from-snapshot: write term to %s: %w", dbPath, err)
	}
	return fmt.Sprintf("snapshot %s (index %d, term %d); term set to %d", metas[0].ID, metas[0].Index, metas[0].Term, term), nil
}

// storedTerms returns the highest of the current term and the last vote's
// term that store records (0 for what it cannot read).
func storedTerms(store raft.StableStore) (term uint64) {
	defer func() { _ = recover() }() // a damaged store: what was read so far
	for _, k := range [][]byte{keyCurrentTerm, keyLastVoteTerm} {
		if v, err := store.GetUint64(k); err == nil {
			term = max(term, v)
		}
	}
	return term
}

// moveAside renames a damaged raft.db out of the way, keeping it for
// inspection.
func moveAside(path string) (string, error) {
	aside := path + ".damaged-" + strconv.FormatInt(time.Now().Unix(), 10)
	if err := os.Rename(path, aside); err != nil {
		return "", fmt.Errorf("allocator: move %s aside: %w", path, err)
	}
	return aside, nil
}

// verifyBolt reads every page of the bolt file at path (every bucket's
// every key and value) before raft opens it, so that a damaged page is an
// error naming the file, not a panic or a fault inside raft. A missing or
// empty file is not checked.
func verifyBolt(path string) (err error) {
	if missing, err := dbMissing(path); err != nil || missing {
		return err
	}
	// A corrupt page id points anywhere in the mapping: make the fault a
	// panic this function recovers.
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	var db *bbolt.DB
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("allocator: open raft log %s: corrupt database: %v", path, r)
		}
		if db != nil {
			_ = db.Close()
		}
	}()
	if db, err = openBoltReadOnly(path); err != nil {
		return err
	}
	var sink byte
	err = db.View(func(tx *bbolt.Tx) error {
		return tx.ForEach(func(_ []byte, b *bbolt.Bucket) error {
			c := b.Cursor()
			for k, v := c.First(); k != nil; k, v = c.Next() {
				if len(v) > 0 {
					sink ^= v[0] ^ v[len(v)-1]
				}
			}
			return nil
		})
	})
	_ = sink
	if err != nil {
		return fmt.Errorf("allocator: read raft log %s: %w", path, err)
	}
	return nil
}

// openBoltReadOnly opens the bolt file at path read-only, with an error
// naming it (errLocked when another process holds it).
func openBoltReadOnly(path string) (*bbolt.DB, error) {
	opts := *boltOptions()
	opts.ReadOnly = true
	db, err := bbolt.Open(path, 0o600, &opts)
	if err != nil {
		if errors.Is(err, bbolt.ErrTimeout) {
			return nil, fmt.Errorf("allocator: open raft log %s: %w: %w", path, errLocked, err)
		}
		return nil, fmt.Errorf("allocator: open raft log %s: %w", path, err)
	}
	return db, nil
}

// watermarkLoop rewrites watermarkFile every watermarkInterval until the
// Server stops (shutdown writes it a last time).
func (s *Server) watermarkLoop() {
	t := time.NewTicker(watermarkInterval)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
			if err := s.node.writeWatermark(s.fsm); err != nil {
				s.log.Warn("watermark not written", "err", err)
			}
			s.writeGroupWatermarks()
		}
	}
}
