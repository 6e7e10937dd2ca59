package groupdir

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/allot/allot/pkg/slots"
)

// File and directory names.
const (
	ClusterFile = "cluster.json"
	GroupsDir   = "groups"
	GroupFile   = "group.json"
	tmpSuffix   = ".tmp"
	format      = 1
)

// The files a single-group node keeps at the root of its data dir, which
// MigrateLegacy moves into groups/0/.
// (raft.db is the bolt log store, wal/ the raft-wal one: a data dir holds
// one of the two.)
var legacyFiles = []string{"raft.db", "wal", "snapshots", "raft-watermark.json"}

// Sentinels the errors wrap.
var (
	// ErrNotInitialized: the data dir has no cluster.json (a new node).
	ErrNotInitialized = errors.New("groupdir: data dir not initialized")
	// ErrOtherCluster: the data dir, or a group directory in it, belongs
	// to another cluster or another node.
	ErrOtherCluster = errors.New("groupdir: data dir of another cluster")
	// ErrMissingGroup: a group the node hosts has no directory.
	ErrMissingGroup = errors.New("groupdir: group directory missing")
	// ErrLegacy: the data dir is a single-group node's.
	ErrLegacy = errors.New("groupdir: single-group data dir")
	// ErrCorrupt: a file of the layout does not parse, or the groups
	// directory holds something unexpected.
	ErrCorrupt = errors.New("groupdir: damaged data dir")
)

// Layout is an initialized data dir.
type Layout struct {
	Root      string
	ClusterID string
	NodeID    string
}

type clusterFile struct {
	Format    int    `json:"format"`
	ClusterID string `json:"cluster_id"`
	NodeID    string `json:"node_id"`
}

type groupFile struct {
	Format    int           `json:"format"`
	ClusterID string        `json:"cluster_id"`
	Group     slots.GroupID `json:"group"`
}

// NewClusterID returns a random cluster id, 32 hex digits.
func NewClusterID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand panics instead)
	return hex.EncodeToString(b[:])
}

// Init prepares root for a new node of cluster clusterID named nodeID and
// returns its Layout. A root already initialized for the same cluster and
// node is opened as is; one of another cluster or node, or a single-group
// data dir, is refused.
func Init(root, clusterID, nodeID string) (*Layout, error) {
	if clusterID == "" || nodeID == "" {
		return nil, fmt.Errorf("groupdir: init %s: empty cluster or node id", root)
	}
	l, err := Open(root)
	switch {
	case err == nil:
		return l, l.Check(clusterID, nodeID)
	case !errors.Is(err, ErrNotInitialized):
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(root, GroupsDir), 0o750); err != nil {
		return nil, fmt.Errorf("groupdir: create %s: %w", filepath.Join(root, GroupsDir), err)
	}
	if err := writeJSON(filepath.Join(root, ClusterFile), clusterFile{format, clusterID, nodeID}); err != nil {
		return nil, err
	}
	return &Layout{Root: root, ClusterID: clusterID, NodeID: nodeID}, nil
}

// Open reads root's cluster.json. A root without one is ErrNotInitialized,
// or ErrLegacy when it holds a single-group node's files.
func Open(root string) (*Layout, error) {
	path := filepath.Join(root, ClusterFile)
	var cf clusterFile
	err := readJSON(path, &cf)
	if errors.Is(err, fs.ErrNotExist) {
		if legacy, err := isLegacy(root); err != nil {
			return nil, err
		} else if legacy {
			return nil, fmt.Errorf("%w: %s holds a single-group node's raft log and no %s: migrate it (MigrateLegacy) before starting with groups",
				ErrLegacy, root, ClusterFile)
		}
		// cluster.json is written last, by Init and by MigrateLegacy: an
		// empty groups/ is an interrupted Init, a group 0 an interrupted
		// migration.
		entries, err := os.ReadDir(filepath.Join(root, GroupsDir))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("groupdir: %w", err)
		}
		for _, e := range entries {
			if e.Name() == "0" || e.Name() == "0"+tmpSuffix {
				return nil, fmt.Errorf("%w: %s: the migration of a single-group data dir did not finish (no %s): run it again (MigrateLegacy)",
					ErrLegacy, root, ClusterFile)
			}
		}
		if len(entries) > 0 {
			return nil, fmt.Errorf("%w: %s has group directories but no %s", ErrCorrupt, root, ClusterFile)
		}
		return nil, fmt.Errorf("%w: %s has no %s", ErrNotInitialized, root, ClusterFile)
	}
	if err != nil {
		return nil, err
	}
	if cf.Format != format || cf.ClusterID == "" || cf.NodeID == "" {
		return nil, fmt.Errorf("%w: %s: want format %d with a cluster_id and a node_id", ErrCorrupt, path, format)
	}
	return &Layout{Root: root, ClusterID: cf.ClusterID, NodeID: cf.NodeID}, nil
}

// Check refuses the data dir unless it belongs to cluster clusterID and
// node nodeID ("" skips that comparison).
func (l *Layout) Check(clusterID, nodeID string) error {
	path := filepath.Join(l.Root, ClusterFile)
	if clusterID != "" && clusterID != l.ClusterID {
		return fmt.Errorf("%w: %s belongs to cluster %s, not %s: this data dir is another cluster's; give the node an empty data dir to join this one",
			ErrOtherCluster, path, l.ClusterID, clusterID)
	}
	if nodeID != "" && nodeID != l.NodeID {
		return fmt.Errorf("%w: %s belongs to node %q, not %q", ErrOtherCluster, path, l.NodeID, nodeID)
	}
	return nil
}

// GroupDir is group id's directory.
func (l *Layout) GroupDir(id slots.GroupID) string {
	return filepath.Join(l.Root, GroupsDir, strconv.FormatUint(uint64(id), 10))
}

// CreateGroup makes group id's directory, with its group.json, and
// returns it. It refuses a directory that exists already.
func (l *Layout) CreateGroup(id slots.GroupID) (string, error) {
	dir := l.GroupDir(id)
	if _, err := os.Stat(dir); err == nil {
		return "", fmt.Errorf("groupdir: create group %d: %s exists", id, dir)
	}
	tmp := dir + tmpSuffix
	if err := os.RemoveAll(tmp); err != nil { // a crash's leftover
		return "", fmt.Errorf("groupdir: create group %d: %w", id, err)
	}
	if err := os.Mkdir(tmp, 0o750); err != nil {
		return "", fmt.Errorf("groupdir: create group %d: %w", id, err)
	}
	if err := writeJSON(filepath.Join(tmp, GroupFile), groupFile{format, l.ClusterID, id}); err != nil {
		return "", err
	}
	if err := renameSync(tmp, dir); err != nil {
		return "", fmt.Errorf("groupdir: create group %d: %w", id, err)
	}
	return dir, nil
}

// OpenGroup returns group id's directory after checking its group.json.
func (l *Layout) OpenGroup(id slots.GroupID) (string, error) {
	dir := l.GroupDir(id)
	if fi, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%w: %s: this node hosts group %d but its directory is gone; restore it, or remove the node from the group and add it back",
			ErrMissingGroup, dir, id)
	} else if err != nil {
		return "", fmt.Errorf("groupdir: %w", err)
	} else if !fi.IsDir() {
		return "", fmt.Errorf("%w: %s is not a directory", ErrCorrupt, dir)
	}
	path := filepath.Join(dir, GroupFile)
	var gf groupFile
	if err := readJSON(path, &gf); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", fmt.Errorf("%w: %s is missing", ErrCorrupt, path)
		}
		return "", err
	}
	switch {
	case gf.Format != format:
		return "", fmt.Errorf("%w: %s: format %d, want %d", ErrCorrupt, path, gf.Format, format)
	case gf.ClusterID != l.ClusterID:
		return "", fmt.Errorf("%w: %s belongs to cluster %s, but %s to %s", ErrOtherCluster, path, gf.ClusterID,
			filepath.Join(l.Root, ClusterFile), l.ClusterID)
	case gf.Group != id:
		return "", fmt.Errorf("%w: %s is group %d's, in the directory of group %d", ErrCorrupt, path, gf.Group, id)
	}
	return dir, nil
}

// Groups lists the group directories, in id order. Leftovers of an
// interrupted CreateGroup (<id>.tmp) are skipped; anything else that is
// not a group directory is ErrCorrupt.
func (l *Layout) Groups() ([]slots.GroupID, error) {
	dir := filepath.Join(l.Root, GroupsDir)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("groupdir: %w", err)
	}
	var out []slots.GroupID
	for _, e := range entries {
		name := e.Name()
		if strings.HasSuffix(name, tmpSuffix) {
			continue
		}
		id, err := slots.ParseGroup(name)
		if err != nil || !e.IsDir() {
			return nil, fmt.Errorf("%w: %s is not a group directory", ErrCorrupt, filepath.Join(dir, name))
		}
		out = append(out, id)
	}
	slices.Sort(out)
	return out, nil
}

// CheckGroups opens every group in hosted (OpenGroup) and returns the
// group directories present that hosted does not name (replicas this node
// no longer hosts, for RemoveGroup).
func (l *Layout) CheckGroups(hosted []slots.GroupID) (extra []slots.GroupID, err error) {
	for _, id := range hosted {
		if _, err := l.OpenGroup(id); err != nil {
			return nil, err
		}
	}
	present, err := l.Groups()
	if err != nil {
		return nil, err
	}
	for _, id := range present {
		if !slices.Contains(hosted, id) {
			extra = append(extra, id)
		}
	}
	return extra, nil
}

// RemoveGroup deletes group id's directory (renamed aside first, so a
// crash leaves no half-deleted group behind). A missing one is not an
// error.
func (l *Layout) RemoveGroup(id slots.GroupID) error {
	dir := l.GroupDir(id)
	tmp := dir + tmpSuffix
	if err := os.RemoveAll(tmp); err != nil {
		return fmt.Errorf("groupdir: remove group %d: %w", id, err)
	}
	if err := renameSync(dir, tmp); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("groupdir: remove group %d: %w", id, err)
	}
	if err := os.RemoveAll(tmp); err != nil {
		return fmt.Errorf("groupdir: remove group %d: %w", id, err)
	}
	return nil
}

// isLegacy reports whether root holds a single-group node's files at its
// root.
func isLegacy(root string) (bool, error) {
	for _, name := range legacyFiles {
		if _, err := os.Stat(filepath.Join(root, name)); err == nil {
			return true, nil
		} else if !errors.Is(err, fs.ErrNotExist) {
			return false, fmt.Errorf("groupdir: %w", err)
		}
	}
	return false, nil
}

// MigrateLegacy turns a single-group node's data dir into a Layout whose
// group 0 holds its files. It builds groups/0.tmp/, moves raft.db (or wal/),
// snapshots/ and raft-watermark.json into it, renames it to groups/0/ and
// writes cluster.json last: a node that dies at any step finds the
// migration unfinished (no cluster.json) and MigrateLegacy resumes it.
func MigrateLegacy(root, clusterID, nodeID string) (*Layout, error) {
	if clusterID == "" || nodeID == "" {
		return nil, fmt.Errorf("groupdir: migrate %s: empty cluster or node id", root)
	}
	if _, err := os.Stat(filepath.Join(root, ClusterFile)); err == nil {
		return nil, fmt.Errorf("groupdir: migrate %s: it has a %s already", root, ClusterFile)
	}
	l := &Layout{Root: root, ClusterID: clusterID, NodeID: nodeID}
	dir := l.GroupDir(0)
	tmp := dir + tmpSuffix
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		legacy, err := isLegacy(root)
		if err != nil {
			return nil, err
		}
		if _, err := os.Stat(tmp); !legacy && errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: migrate %s: no raft.db, snapshots or watermark to migrate", ErrNotInitialized, root)
		}
		if err := os.MkdirAll(tmp, 0o750); err != nil {
			return nil, fmt.Errorf("groupdir: migrate %s: %w", root, err)
		}
		for _, name := range legacyFiles {
			err := os.Rename(filepath.Join(root, name), filepath.Join(tmp, name))
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("groupdir: migrate %s: %w", root, err)
			}
		}
		if err := writeJSON(filepath.Join(tmp, GroupFile), groupFile{format, clusterID, 0}); err != nil {
			return nil, err
		}
		if err := renameSync(tmp, dir); err != nil {
			return nil, fmt.Errorf("groupdir: migrate %s: %w", root, err)
		}
	} else if err != nil {
		return nil, fmt.Errorf("groupdir: migrate %s: %w", root, err)
	} else if legacy, err := isLegacy(root); err != nil {
		return nil, err
	} else if legacy {
		return nil, fmt.Errorf("%w: migrate %s: both %s and a raft.db, snapshots or watermark at the root exist; move one aside",
			ErrCorrupt, root, dir)
	}
	if err := writeJSON(filepath.Join(root, ClusterFile), clusterFile{format, clusterID, nodeID}); err != nil {
		return nil, err
	}
	if _, err := l.OpenGroup(0); err != nil {
		return nil, err
	}
	return l, nil
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("groupdir: read %s: %w", path, err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrCorrupt, path, err)
	}
	return nil
}

// writeJSON writes v to path durably.
func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("groupdir: write %s: %w", path, err)
	}
	tmp := path + tmpSuffix
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640)
	if err != nil {
		return fmt.Errorf("groupdir: write %s: %w", path, err)
	}
	_, err = f.Write(append(b, '\n'))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = renameSync(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("groupdir: write %s: %w", path, err)
	}
	return nil
}

// renameSync renames and fsyncs the parent directory, so the rename
// survives a crash.
func renameSync(from, to string) error {
	if err := os.Rename(from, to); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(to))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
