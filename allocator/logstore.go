package allocator

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftwal "github.com/hashicorp/raft-wal"
	walfs "github.com/hashicorp/raft-wal/fs"
	"github.com/hashicorp/raft-wal/metadb"
	"github.com/hashicorp/raft-wal/segment"
	"github.com/hashicorp/raft-wal/types"
	"go.etcd.io/bbolt"
)

// Raft log stores a data dir can hold (Config.LogStore, -log-store).
const (
	// LogStoreBolt is raft-boltdb/v2: one bolt file, raft.db, holding the
	// log and the stable store; each append is a bolt transaction with two
	// fdatasyncs (the pages, then the meta page).
	LogStoreBolt = "bolt"
	// LogStoreWAL is hashicorp/raft-wal: a directory, wal/, of
	// preallocated segment files appended in place (one fsync an append)
	// and a small bolt file for the stable store and the segment list.
	LogStoreWAL = "wal"
)

// walDir is the LogStoreWAL directory inside a data dir.
const walDir = "wal"

// raftStore is a Raft log store that is also the stable store.
type raftStore interface {
	raft.LogStore
	raft.StableStore
	Close() error
}

// storePath is where a log store of kind lives in dir.
func storePath(dir, kind string) string {
	if kind == LogStoreWAL {
		return filepath.Join(dir, walDir)
	}
	return filepath.Join(dir, raftDBFile)
}

// pickLogStore decides which log store dir's node runs on: the one the
// dir holds; when it holds none, the one its watermark records (a log
// that went missing: checkMissingDB then refuses or rebuilds it); for a
// new dir, want, else fallback, else bolt. A want that differs from what the dir
// holds is refused: the two stores do not read each other's files.
func pickLogStore(dir, want, fallback string, mark watermark, hasMark bool) (string, error) {
	switch want {
	case "", LogStoreBolt, LogStoreWAL:
	default:
		return "", fmt.Errorf("allocator: log store %q: want %q or %q", want, LogStoreBolt, LogStoreWAL)
	}
	boltMissing, err := dbMissing(storePath(dir, LogStoreBolt))
	if err != nil {
		return "", err
	}
	walMissing, err := walMissing(storePath(dir, LogStoreWAL))
	if err != nil {
		return "", err
	}
	have := ""
	switch {
	case !boltMissing && !walMissing:
		return "", fmt.Errorf("allocator: %s and %s both hold a raft log; a data dir holds one: move aside the one the node does not run on",
			storePath(dir, LogStoreBolt), storePath(dir, LogStoreWAL))
	case !boltMissing:
		have = LogStoreBolt
	case !walMissing:
		have = LogStoreWAL
	case hasMark && mark.LogStore != "":
		have = mark.LogStore
	case hasMark && mark.Term > 0:
		have = LogStoreBolt // a watermark from before it named its store
	}
	if have != "" && want != "" && want != have {
		return "", fmt.Errorf("allocator: %s is a data dir of the %q log store (%s); -log-store %s needs a new data dir: "+
			"start without -log-store, or move the data dir aside and rejoin the node as a new member (docs/operations.md, \"Raft log store\")",
			dir, have, storePath(dir, have), want)
	}
	switch {
	case have != "":
		return have, nil
	case want != "":
		return want, nil
	case fallback != "":
		return fallback, nil
	}
	return LogStoreBolt, nil
}

// storeMissing reports whether the log store of kind at path is absent or
// empty.
func storeMissing(kind, path string) (bool, error) {
	if kind == LogStoreWAL {
		return walMissing(path)
	}
	return dbMissing(path)
}

// walMissing reports whether the WAL directory at path is absent or has no
// meta file (or an empty one): raft-wal would start it as a new, empty log.
func walMissing(path string) (bool, error) {
	switch fi, err := os.Stat(path); {
	case errors.Is(err, fs.ErrNotExist):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("allocator: %s: %w", path, err)
	case !fi.IsDir():
		return false, fmt.Errorf("allocator: %s is not a directory", path)
	}
	return dbMissing(filepath.Join(path, metadb.FileName))
}

// verifyStore reads the whole log store of kind at path before Raft opens
// it, so that damage is an error naming the path rather than a panic or a
// fault inside Raft. A missing store is not checked.
func verifyStore(kind, path string, logger hclog.Logger, segSize int) error {
	if kind != LogStoreWAL {
		return verifyBolt(path)
	}
	if missing, err := walMissing(path); err != nil || missing {
		return err
	}
	// The meta file is bolt: read every page (and learn whether another
	// process holds it, which raft-wal would wait on for ever).
	if err := verifyBolt(filepath.Join(path, metadb.FileName)); err != nil {
		return err
	}
	if err := checkWALSegments(path); err != nil {
		return err
	}
	w, err := openWAL(path, logger, segSize)
	if err != nil {
		return err
	}
	defer w.Close()
	return readWholeLog(w, path)
}

// checkWALSegments refuses a WAL directory holding a segment file newer
// than its meta file knows of: raft-wal commits the meta file before it
// creates a segment, so only an older meta file put back over newer
// segments leaves one, and opening the WAL would delete it.
func checkWALSegments(path string) error {
	metaPath := filepath.Join(path, metadb.FileName)
	db, err := openBoltReadOnly(metaPath)
	if err != nil {
		return err
	}
	defer db.Close()
	var st types.PersistentState
	err = db.View(func(tx *bbolt.Tx) error {
		b := tx.Bucket([]byte(metadb.MetaBucket))
		if b == nil {
			return nil
		}
		if raw := b.Get([]byte(metadb.MetaKey)); raw != nil {
			return json.Unmarshal(raw, &st)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("allocator: read raft log %s: %w", metaPath, err)
	}
	files, err := segment.NewFiler(path, walfs.New()).List()
	if err != nil {
		return fmt.Errorf("allocator: list raft log segments in %s: %w", path, err)
	}
	for id, base := range files {
		if id >= st.NextSegmentID {
			return fmt.Errorf("allocator: raft log %s: segment %s is newer than %s knows of (next segment %d): an older meta file put back?",
				path, segment.FileName(types.SegmentInfo{BaseIndex: base, ID: id}), metaPath, st.NextSegmentID)
		}
	}
	return nil
}

// readWholeLog reads every entry of s, recovering from a panic on a
// damaged file.
func readWholeLog(s raft.LogStore, path string) (err error) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("allocator: read raft log %s: corrupt log: %v", path, r)
		}
	}()
	first, err := s.FirstIndex()
	if err != nil {
		return fmt.Errorf("allocator: read raft log %s: %w", path, err)
	}
	last, err := s.LastIndex()
	if err != nil {
		return fmt.Errorf("allocator: read raft log %s: %w", path, err)
	}
	if first == 0 {
		return nil
	}
	var l raft.Log
	for i := first; i <= last; i++ {
		if err := s.GetLog(i, &l); err != nil {
			return fmt.Errorf("allocator: read raft log %s: entry %d of %d-%d: %w", path, i, first, last, err)
		}
		if l.Index != i {
			return fmt.Errorf("allocator: read raft log %s: entry %d reads as index %d", path, i, l.Index)
		}
	}
	return nil
}

// openStore opens (creating when absent) the log store of kind at path;
// segSize > 0 sets raft-wal's segment size (tests).
func openStore(kind, path string, logger hclog.Logger, segSize int) (raftStore, error) {
	var s raftStore
	var err error
	if kind == LogStoreWAL {
		s, err = openWAL(path, logger, segSize)
	} else {
		s, err = openBolt(path)
	}
	if err != nil {
		return nil, err // not a typed nil
	}
	return s, nil
}

// openWAL opens the raft-wal directory at path, creating it when absent,
// and turns a panic while reading a damaged file into an error naming it.
// The WAL's Close closes its meta file; when Open fails, the meta file
// (and its lock) is closed here.
func openWAL(path string, logger hclog.Logger, segSize int) (w *raftwal.WAL, err error) {
	if err := os.MkdirAll(path, 0o750); err != nil {
		return nil, fmt.Errorf("allocator: create raft log %s: %w", path, err)
	}
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		if r := recover(); r != nil {
			w, err = nil, fmt.Errorf("allocator: open raft log %s: corrupt log: %v", path, r)
		}
	}()
	meta := &metadb.BoltMetaDB{}
	defer func() {
		if w == nil {
			_ = meta.Close()
		}
	}()
	size := raftwal.DefaultSegmentSize
	if segSize > 0 {
		size = segSize
	}
	w, err = raftwal.Open(path, raftwal.WithLogger(logger.Named("wal")), raftwal.WithMetaStore(meta), raftwal.WithSegmentSize(size))
	if err != nil {
		return nil, fmt.Errorf("allocator: open raft log %s: %w", path, err)
	}
	return w, nil
}
