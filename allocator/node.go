package allocator

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"

	"github.com/allot/allot/allocator/raftmux"
	"github.com/allot/allot/pkg/tlsconfig"
)

// Raft storage layout inside Config.DataDir.
const (
	raftDBFile      = "raft.db"   // LogStoreBolt: log store and stable store
	snapshotsDir    = "snapshots" // raft.FileSnapshotStore's own subdirectory
	snapshotsRetain = 2
	// logCacheEntries is how many of the newest log entries are kept in
	// memory for replication: a few times the entries in flight
	// (MaxInflightBatches plus Expire and admin commands). An entry is at
	// most MaxBatchBytes (2 MiB by default), so the cache holds at most
	// 64 MiB, and a few MB at the measured 100-1000 keys per entry.
	logCacheEntries = 32
	// commitTimeout is how often, with no new entries, the leader still
	// sends each follower an AppendEntries carrying its commit index
	// (randomised up to twice that). Entries reach followers as they are
	// appended, with the commit index of the moment; a follower applies
	// the last entries of a burst when it next learns the commit index,
	// within 1 s at this value (well inside ReadyMaxLag), so a rules
	// change shows on a follower's watch that much later at worst.
	// Raft's default, 50 ms, makes these RPCs, on top of the heartbeats
	// (which carry no commit index), most of an idle leader's CPU.
	commitTimeout = 500 * time.Millisecond
)

// node is the Raft half of a Server: the raft.Raft instance and the stores
// and transport it owns. close releases them all.
type node struct {
	raft  *raft.Raft
	trans raft.Transport
	store raftStore // log store and stable store
	kind  string    // store's kind: LogStoreBolt or LogStoreWAL
	// logs is the log store Raft uses (store behind a cache): readiness
	// reads the types of the newest committed entries from it.
	logs    raft.LogStore
	snaps   *raft.FileSnapshotStore
	dataDir string
	// addr is the advertised Raft address (the transport's LocalAddr);
	// bound is the listener's address (addr with a test transport).
	addr  raft.ServerAddress
	bound string
	// existing: the data directory held Raft state at open.
	existing bool
	closed   bool
	markMu   sync.Mutex // guards mark
	// mark is the watermark last read or written (datadir.go).
	mark watermark
	// appendErr is set while appends to the log fail, and appendStart
	// (Unix nanos) while one runs (see watchedLog).
	appendErr   atomic.Pointer[appendFailure]
	appendStart atomic.Int64
	// fsm is the FSM Raft drives (its follower apply thread ends at close).
	fsm *fsm
}

// openNode opens the stores in cfg.DataDir, checks them, and starts Raft
// with f as its FSM, over a transport on stream (the node's group on its
// Raft listener, bound to bound) or, when set, cfg.transport. A node with
// existing Raft state ignores Bootstrap. Any corruption found stops it
// with an error naming the path.
func openNode(cfg Config, f *fsm, logger hclog.Logger, stream raft.StreamLayer, bound net.Addr) (n *node, err error) {
	dir := cfg.DataDir
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("allocator: create data dir %s: %w", dir, err)
	}
	n = &node{dataDir: dir}
	opened := n // n itself is nil once an error is returned
	defer func() {
		if err != nil {
			opened.close()
		}
	}()

	mark, hasMark, err := readWatermark(dir)
	if err != nil {
		return nil, err
	}
	kind, err := pickLogStore(dir, cfg.LogStore, cfg.newLogStore, mark, hasMark)
	if err != nil {
		return nil, err
	}
	n.kind = kind
	dbPath := storePath(dir, kind)
	recoverDB := func(why error) error {
		aside, err := moveAside(dbPath)
		if err != nil {
			return err
		}
		logger.Warn("-recover-from-snapshot: raft log moved aside", "path", aside, "reason", why.Error())
		return nil
	}
	if err := verifyStore(kind, dbPath, logger, cfg.walSegmentSize); err != nil {
		if errors.Is(err, errLocked) {
			return nil, err // another process runs on it: nothing to recover
		}
		if !cfg.RecoverFromSnapshot {
			return nil, fmt.Errorf("%w; %s", err, recoverHint)
		}
		if err := recoverDB(err); err != nil {
			return nil, err
		}
	}
	missing, err := storeMissing(kind, dbPath)
	if err != nil {
		return nil, err
	}
	n.snaps, err = raft.NewFileSnapshotStoreWithLogger(dir, snapshotsRetain, logger.Named("snapshot"))
	if err != nil {
		return nil, fmt.Errorf("allocator: open snapshot store in %s: %w", dir, err)
	}
	if err := checkSnapshots(n.snaps, filepath.Join(dir, snapshotsDir)); err != nil {
		return nil, err
	}
	f.snaps, f.snapsDir = n.snaps, filepath.Join(dir, snapshotsDir)
	// seenTerm: the highest term a log moved aside below had recorded (its
	// current term and the term of its last vote), which a rebuilt log
	// must pass so that the node never votes twice in a term.
	var seenTerm uint64
	if !missing {
		if n.store, err = openStore(kind, dbPath, logger, cfg.walSegmentSize); err != nil {
			return nil, err
		}
		if err = checkRollback(dir, dbPath, n.store, n.snaps, mark); err != nil {
			if !cfg.RecoverFromSnapshot {
				return nil, err
			}
			seenTerm = storedTerms(n.store)
			_ = n.store.Close()
			n.store = nil
			if err = recoverDB(err); err != nil {
				return nil, err
			}
			missing = true
		}
	}
	rebuild, err := checkMissingDB(dir, dbPath, missing, mark, hasMark, cfg.RecoverFromSnapshot)
	if err != nil {
		return nil, err
	}
	if missing && kind == LogStoreWAL {
		// A WAL directory whose meta file is empty does not open (raft-wal
		// fails on it), and one whose meta file is gone would open as a
		// new log with its segments deleted: keep it aside, for
		// inspection, and start an empty one.
		if _, err := os.Stat(dbPath); err == nil {
			aside, err := moveAside(dbPath)
			if err != nil {
				return nil, err
			}
			logger.Warn("raft log without its meta file moved aside", "path", aside)
		}
	}
	if n.store == nil {
		if n.store, err = openStore(kind, dbPath, logger, cfg.walSegmentSize); err != nil {
			return nil, err
		}
	}
	n.mark = mark
	if rebuild {
		desc, err := rebuildFromSnapshot(dir, dbPath, n.snaps, n.store, mark, seenTerm)
		if err != nil {
			return nil, err
		}
		logger.Warn("-recover-from-snapshot: starting from the newest snapshot; entries committed after it are lost on this node", "from", desc)
		n.mark = watermark{}
		if err := os.Remove(filepath.Join(dir, watermarkFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("allocator: %w", err)
		}
	}

	existing, err := hasExistingState(n.store, n.snaps, dbPath)
	if err != nil {
		return nil, err
	}
	n.existing = existing
	if existing {
		if err := checkLogCoverage(n.store, n.snaps, dir); err != nil {
			return nil, err
		}
	}

	if cfg.transport != nil {
		n.trans = cfg.transport
		n.bound = string(n.trans.LocalAddr())
	} else {
		n.trans = newTCPTransport(stream, logger.Named("transport"))
		n.bound = bound.String()
	}
	n.addr = n.trans.LocalAddr()

	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.NodeID)
	rc.CommitTimeout = commitTimeout
	rc.HeartbeatTimeout = cfg.HeartbeatTimeout
	rc.ElectionTimeout = cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = cfg.LeaderLeaseTimeout
	rc.SnapshotInterval = cfg.SnapshotInterval
	rc.SnapshotThreshold = cfg.SnapshotThreshold
	if cfg.trailingLogs > 0 {
		rc.TrailingLogs = cfg.trailingLogs
	}
	rc.Logger = logger
	if err := raft.ValidateConfig(rc); err != nil {
		return nil, fmt.Errorf("allocator: raft config: %w", err)
	}

	if !existing && cfg.Bootstrap {
		boot := raft.Configuration{Servers: []raft.Server{{
			Suffrage: raft.Voter, ID: rc.LocalID, Address: n.addr,
		}}}
		if len(cfg.bootPeers) > 0 {
			boot.Servers = cfg.bootPeers
		}
		if err := raft.BootstrapCluster(rc, n.store, n.store, n.snaps, n.trans, boot); err != nil {
			return nil, fmt.Errorf("allocator: bootstrap %s: %w", dir, err)
		}
	}

	// The leader's replication reads each new entry back for every
	// follower; the cache answers from memory instead of a bolt read and
	// a msgpack decode on the commit path. Writes still go to bolt (and
	// are fsynced) before they are cached.
	logs, err := raft.NewLogCache(logCacheEntries, &watchedLog{LogStore: n.store, failed: &n.appendErr, running: &n.appendStart})
	if err != nil {
		return nil, fmt.Errorf("allocator: raft log cache: %w", err)
	}
	n.logs = logs
	if cfg.FollowerApplyNice > 0 {
		f.low = &lowApplier{nice: cfg.FollowerApplyNice, maxLag: cfg.followerApplyLag(), warn: logger.Warn}
	}
	n.fsm = f
	n.raft, err = raft.NewRaft(rc, f.raftFSM(), logs, n.store, n.snaps, n.trans)
	if err != nil {
		if rerr := f.restoreError(); rerr != nil {
			return nil, fmt.Errorf("allocator: restore snapshot from %s: %w", filepath.Join(dir, snapshotsDir), rerr)
		}
		return nil, fmt.Errorf("allocator: start raft from %s: %w", dir, err)
	}
	f.raft.Store(n.raft)
	// Raft falls back to an older snapshot when the newest fails to restore;
	// the entries between the two may be compacted away, so any restore
	// failure is fatal here.
	if rerr := f.restoreError(); rerr != nil {
		return nil, fmt.Errorf("allocator: restore snapshot from %s: %w", filepath.Join(dir, snapshotsDir), rerr)
	}
	// The snapshot restored at start counts as applied.
	for idx := n.raft.AppliedIndex(); ; {
		cur := f.applied.Load()
		if cur >= idx || f.applied.CompareAndSwap(cur, idx) {
			break
		}
	}
	return n, nil
}

// heartbeatInterval is how often a leader sends each follower a heartbeat
// when it has nothing else to send (randomised up to twice that): a fifth
// of the leader lease, so that the longest gap between two heartbeats is
// at most 40% of the lease, and never less often than hashicorp/raft's
// own tenth of HeartbeatTimeout. With the defaults (500 ms timeout and
// lease) that is 100 ms, half raft's rate: an idle leader's heartbeats
// are most of its CPU (each costs two wake-ups on the leader and one on
// the follower), while a follower still hears from the leader at least
// every 200 ms of its 500 ms timeout.
func heartbeatInterval(cfg Config) time.Duration {
	return max(cfg.LeaderLeaseTimeout/5, cfg.HeartbeatTimeout/10)
}

// raftTimeouts are the reloadable timeouts r runs with: the configured
// ones, or while it leads, the HeartbeatTimeout whose tenth is
// heartbeatInterval (hashicorp/raft sends heartbeats every tenth of it)
// and an ElectionTimeout at least that long (raft requires it; a leader
// uses it only to bound a leadership transfer, which sets the configured
// timeouts back first: see followerTimeouts). A follower's election
// timer, the failover, is always the configured HeartbeatTimeout: the
// leader's values go back before it follows (runLeaderLoop). Lowering
// them makes raft's follower loop look at its last contact at once, so a
// leader that stepped down for want of a quorum asks for a pre-vote then
// rather than one heartbeat timeout later.
func raftTimeouts(r *raft.Raft, cfg Config, leading bool) error {
	rc := r.ReloadableConfig()
	hb, el := cfg.HeartbeatTimeout, cfg.ElectionTimeout
	if leading {
		hb = max(hb, 10*heartbeatInterval(cfg))
		el = max(el, hb)
	}
	if rc.HeartbeatTimeout == hb && rc.ElectionTimeout == el {
		return nil
	}
	rc.HeartbeatTimeout, rc.ElectionTimeout = hb, el
	return r.ReloadConfig(rc)
}

// followerTimeouts sets the configured timeouts on r before a leadership
// transfer, so that raft waits for the transfer no longer than the
// configured ElectionTimeout. A leader whose transfer fails keeps them
// (heartbeats at raft's own rate) until it next gains leadership.
func (s *Server) followerTimeouts(r *raft.Raft) {
	if err := raftTimeouts(r, s.cfg, false); err != nil {
		s.log.Warn("raft timeouts not reloaded", "err", err)
	}
}

// openBolt opens the bolt store, turning bolt's errors (and any panic while
// reading a damaged file) into an error naming the file.
func openBolt(path string) (s *raftboltdb.BoltStore, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("allocator: open raft log %s: corrupt database: %v", path, r)
		}
	}()
	s, err = raftboltdb.New(raftboltdb.Options{
		Path:        path,
		BoltOptions: boltOptions(),
		NoSync:      false,
	})
	if err != nil {
		if errors.Is(err, bbolt.ErrTimeout) {
			return nil, fmt.Errorf("allocator: open raft log %s: locked by another process: %w", path, err)
		}
		return nil, fmt.Errorf("allocator: open raft log %s: %w", path, err)
	}
	return s, nil
}

// boltOptions are the raft log's bolt options. Every commit still
// fdatasyncs (twice: the data pages, then the meta page). The freelist is
// not written on commit (NoFreelistSync): bolt rebuilds it by scanning
// the file at open, which for a log compacted by snapshots (a few
// thousand entries) is quick, and each commit writes fewer pages. The map
// freelist finds free pages in O(1) instead of scanning an array, which
// matters after a compaction frees many pages. Both are crash-safe: the
// freelist is derived data.
func boltOptions() *bbolt.Options {
	return &bbolt.Options{
		Timeout:        2 * time.Second,
		NoFreelistSync: true,
		FreelistType:   bbolt.FreelistMapType,
	}
}

// hasExistingState wraps raft.HasExistingState, recovering from a panic in
// the store on a damaged file.
func hasExistingState(store raftStore, snaps raft.SnapshotStore, path string) (ok bool, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("allocator: read raft log %s: corrupt database: %v", path, r)
		}
	}()
	ok, err = raft.HasExistingState(store, store, snaps)
	if err != nil {
		return false, fmt.Errorf("allocator: read raft state %s: %w", path, err)
	}
	return ok, nil
}

// checkSnapshots verifies every snapshot in dir: a readable meta.json and
// a state.bin whose CRC matches. raft.FileSnapshotStore would silently skip
// a bad one and fall back to an older snapshot, losing the entries between.
func checkSnapshots(store *raft.FileSnapshotStore, dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("allocator: read snapshot dir %s: %w", dir, err)
	}
	metas, err := store.List()
	if err != nil {
		return fmt.Errorf("allocator: list snapshots in %s: %w", dir, err)
	}
	listed := make(map[string]bool, len(metas))
	for _, m := range metas {
		listed[m.ID] = true
	}
	for _, e := range entries {
		if !e.IsDir() || strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		if !listed[e.Name()] {
			return fmt.Errorf("allocator: snapshot %s: unreadable or unsupported meta.json", filepath.Join(dir, e.Name()))
		}
	}
	for _, m := range metas {
		// Open reads the whole state file and verifies its CRC.
		_, rc, err := store.Open(m.ID)
		if err != nil {
			return fmt.Errorf("allocator: snapshot %s: %w", filepath.Join(dir, m.ID), err)
		}
		rc.Close()
	}
	return nil
}

// checkLogCoverage fails when the log was compacted (it does not start at
// index 1) but no snapshot covers the entries before it: the state would be
// silently incomplete.
func checkLogCoverage(store raft.LogStore, snaps *raft.FileSnapshotStore, dir string) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("allocator: read raft log in %s: corrupt database: %v", dir, r)
		}
	}()
	first, err := store.FirstIndex()
	if err != nil {
		return fmt.Errorf("allocator: read raft log in %s: %w", dir, err)
	}
	if first <= 1 {
		return nil
	}
	metas, err := snaps.List()
	if err != nil {
		return fmt.Errorf("allocator: list snapshots in %s: %w", dir, err)
	}
	if len(metas) == 0 || metas[0].Index+1 < first {
		return fmt.Errorf("allocator: %s: the raft log starts at index %d but no snapshot covers the entries before it (missing %s?)",
			dir, first, filepath.Join(dir, snapshotsDir))
	}
	return nil
}

// close shuts Raft down and closes the transport and the stores. It is
// called once, by the Server's shutdown (or a failed start).
func (n *node) close() {
	if n == nil {
		return
	}
	if n.closed {
		return
	}
	n.closed = true
	if n.raft != nil {
		_ = n.raft.Shutdown().Error() // idempotent
	}
	if n.fsm != nil {
		n.fsm.low.stop() // Raft's FSM goroutine has ended
	}
	// CloseStreams first: it closes the pooled outgoing connections, so
	// the peers' handlers for them end too (Close alone leaves them
	// blocked in a read).
	if nt, ok := n.trans.(*raft.NetworkTransport); ok {
		nt.CloseStreams()
	}
	if c, ok := n.trans.(io.Closer); ok {
		_ = c.Close()
	}
	if n.store != nil {
		_ = n.store.Close()
	}
}

// listenRaft binds cfg.RaftAddr for Raft: a raftmux.Mux, advertised as
// cfg.AdvertiseRaftAddr when set, speaking mutual TLS between
// allocator-role certificates (named in cfg.PeerNames when set) with a
// non-nil l. The node's Raft group is the Mux's group 0, which speaks the
// bare Raft protocol (no connection header). Closing the Mux closes the
// group's stream and every connection.
func listenRaft(cfg Config, l *tlsconfig.Loader, log *slog.Logger) (*raftmux.Mux, *raftmux.Stream, error) {
	mc := raftmux.Config{Advertise: cfg.AdvertiseRaftAddr, TLS: l, Logger: log}
	if l != nil {
		mc.PeerNames = cfg.PeerNames
	}
	m, err := raftmux.Listen(cfg.RaftAddr, mc)
	if err != nil {
		return nil, nil, fmt.Errorf("allocator: raft: %w", err)
	}
	stream, err := m.Group(0)
	if err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("allocator: raft: %w", err)
	}
	return m, stream, nil
}

// newTCPTransport returns a Raft network transport over stream (its Addr,
// the advertised address, is the transport's LocalAddr).
func newTCPTransport(stream raft.StreamLayer, logger hclog.Logger) *raft.NetworkTransport {
	return raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream:  stream,
		MaxPool: 3,
		Timeout: 10 * time.Second,
		Logger:  logger,
	})
}

// closeRaftListener closes the Raft listener, after the node: the Mux's
// Close ends its goroutines and any connection not yet handed to the node.
// Safe to call twice.
func (s *Server) closeRaftListener() {
	if s.mux != nil {
		_ = s.mux.Close()
	}
}
