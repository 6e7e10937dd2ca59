package groupdir

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/allot/allot/pkg/slots"
)

// wantErr fails unless err wraps is and names path.
func wantErr(t *testing.T, what string, err, is error, path string) {
	t.Helper()
	if !errors.Is(err, is) || !strings.Contains(err.Error(), path) {
		t.Fatalf("%s: err = %v, want %v naming %s", what, err, is, path)
	}
}

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o640); err != nil {
		t.Fatal(err)
	}
}

func TestInitOpenCheck(t *testing.T) {
	root := filepath.Join(t.TempDir(), "data")
	_, err := Open(root)
	wantErr(t, "Open of a new dir", err, ErrNotInitialized, root)

	id := NewClusterID()
	if len(id) != 32 || id == NewClusterID() {
		t.Fatalf("NewClusterID = %q", id)
	}
	l, err := Init(root, id, "n1")
	if err != nil {
		t.Fatal(err)
	}
	again, err := Open(root)
	if err != nil || *again != *l {
		t.Fatalf("Open = %+v, %v; want %+v", again, err, l)
	}
	if _, err := Init(root, id, "n1"); err != nil {
		t.Fatalf("Init again with the same ids: %v", err)
	}
	cf := filepath.Join(root, ClusterFile)
	_, err = Init(root, "other", "n1")
	wantErr(t, "Init for another cluster", err, ErrOtherCluster, cf)
	if !strings.Contains(err.Error(), "another cluster's") {
		t.Fatalf("message: %v", err)
	}
	wantErr(t, "Check another node", l.Check(id, "n2"), ErrOtherCluster, cf)
	if err := l.Check("", ""); err != nil {
		t.Fatal(err)
	}

	for _, bad := range []string{"{", `{"format":2,"cluster_id":"c","node_id":"n"}`, `{"format":1,"cluster_id":"c","node_id":"n","x":1}`, `{"format":1,"node_id":"n"}`} {
		write(t, cf, bad)
		_, err := Open(root)
		wantErr(t, "Open of "+bad, err, ErrCorrupt, cf)
	}
}

// An Init interrupted before cluster.json leaves an empty groups/: the
// next Init finishes it.
func TestInitInterrupted(t *testing.T) {
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, GroupsDir), 0o750); err != nil {
		t.Fatal(err)
	}
	if _, err := Init(root, "c", "n1"); err != nil {
		t.Fatal(err)
	}
	// Group directories without cluster.json are not a new dir.
	root2 := t.TempDir()
	write(t, filepath.Join(root2, GroupsDir, "3", GroupFile), "{}")
	_, err := Init(root2, "c", "n1")
	wantErr(t, "Init over orphaned groups", err, ErrCorrupt, root2)
}

func TestGroups(t *testing.T) {
	root := t.TempDir()
	l, err := Init(root, "c1", "n1")
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []slots.GroupID{2, 0, 1} {
		dir, err := l.CreateGroup(id)
		if err != nil || dir != filepath.Join(root, "groups", strconv.Itoa(int(id))) {
			t.Fatalf("CreateGroup(%d) = %s, %v", id, dir, err)
		}
	}
	_, err = l.CreateGroup(1)
	if err == nil || !strings.Contains(err.Error(), l.GroupDir(1)) {
		t.Fatalf("CreateGroup twice: %v", err)
	}
	// A leftover of an interrupted CreateGroup is skipped, and cleared by
	// the next.
	write(t, filepath.Join(l.GroupDir(5)+".tmp", GroupFile), "junk")
	got, err := l.Groups()
	if err != nil || !slices.Equal(got, []slots.GroupID{0, 1, 2}) {
		t.Fatalf("Groups = %v, %v", got, err)
	}
	if _, err := l.CreateGroup(5); err != nil {
		t.Fatal(err)
	}
	if _, err := l.OpenGroup(5); err != nil {
		t.Fatal(err)
	}

	extra, err := l.CheckGroups([]slots.GroupID{0, 1, 5})
	if err != nil || !slices.Equal(extra, []slots.GroupID{2}) {
		t.Fatalf("CheckGroups = %v, %v", extra, err)
	}
	if err := l.RemoveGroup(2); err != nil {
		t.Fatal(err)
	}
	if err := l.RemoveGroup(2); err != nil {
		t.Fatalf("RemoveGroup of a missing group: %v", err)
	}

	// A hosted group whose directory is gone.
	if err := os.RemoveAll(l.GroupDir(1)); err != nil {
		t.Fatal(err)
	}
	_, err = l.CheckGroups([]slots.GroupID{0, 1})
	wantErr(t, "missing group", err, ErrMissingGroup, l.GroupDir(1))

	// A group directory copied from another cluster's node.
	other, err := Init(t.TempDir(), "c2", "n1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.CreateGroup(1); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(other.GroupDir(1), l.GroupDir(1)); err != nil {
		t.Fatal(err)
	}
	_, err = l.OpenGroup(1)
	wantErr(t, "group of another cluster", err, ErrOtherCluster, filepath.Join(l.GroupDir(1), GroupFile))

	// A group's directory under another group's name.
	if err := os.RemoveAll(l.GroupDir(1)); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(l.GroupDir(5), l.GroupDir(1)); err != nil {
		t.Fatal(err)
	}
	_, err = l.OpenGroup(1)
	wantErr(t, "renamed group", err, ErrCorrupt, l.GroupDir(1))

	// Something else in groups/.
	for _, name := range []string{"x", "01"} {
		write(t, filepath.Join(root, GroupsDir, name), "")
		_, err = l.Groups()
		wantErr(t, "stray "+name, err, ErrCorrupt, filepath.Join(root, GroupsDir, name))
		os.Remove(filepath.Join(root, GroupsDir, name))
	}
	write(t, l.GroupDir(9), "a file")
	_, err = l.OpenGroup(9)
	wantErr(t, "a file for a group", err, ErrCorrupt, l.GroupDir(9))
}

// legacyDir makes a single-group node's data dir.
func legacyDir(t *testing.T) string {
	root := t.TempDir()
	write(t, filepath.Join(root, "raft.db"), "bolt")
	write(t, filepath.Join(root, "snapshots", "1-2-3", "state.bin"), "snap")
	write(t, filepath.Join(root, "raft-watermark.json"), `{"term":2}`)
	write(t, filepath.Join(root, "advertised.json"), `{}`)
	return root
}

func checkMigrated(t *testing.T, root string) {
	t.Helper()
	l, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := l.OpenGroup(0)
	if err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		filepath.Join(dir, "raft.db"):                         "bolt",
		filepath.Join(dir, "snapshots", "1-2-3", "state.bin"): "snap",
		filepath.Join(dir, "raft-watermark.json"):             `{"term":2}`,
		filepath.Join(root, "advertised.json"):                `{}`,
	} {
		if b, err := os.ReadFile(path); err != nil || string(b) != want {
			t.Fatalf("%s = %q, %v; want %q", path, b, err, want)
		}
	}
	if _, err := os.Stat(filepath.Join(root, "raft.db")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("raft.db still at the root: %v", err)
	}
}

func TestMigrateLegacy(t *testing.T) {
	root := legacyDir(t)
	_, err := Open(root)
	wantErr(t, "Open of a single-group dir", err, ErrLegacy, root)
	_, err = Init(root, "c", "n1")
	wantErr(t, "Init over a single-group dir", err, ErrLegacy, root)
	if _, err := MigrateLegacy(root, "c", "n1"); err != nil {
		t.Fatal(err)
	}
	checkMigrated(t, root)
	if _, err := MigrateLegacy(root, "c", "n1"); err == nil {
		t.Fatal("migrating twice: no error")
	}
	_, err = MigrateLegacy(t.TempDir(), "c", "n1")
	if !errors.Is(err, ErrNotInitialized) {
		t.Fatalf("migrating an empty dir: %v", err)
	}
}

// A migration that died midway resumes: after moving some files, and
// after renaming group 0's directory but before cluster.json.
func TestMigrateLegacyResumes(t *testing.T) {
	root := legacyDir(t)
	tmp := filepath.Join(root, GroupsDir, "0.tmp")
	if err := os.MkdirAll(tmp, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(root, "raft.db"), filepath.Join(tmp, "raft.db")); err != nil {
		t.Fatal(err)
	}
	_, err := Open(root)
	wantErr(t, "Open mid-migration", err, ErrLegacy, root)
	if _, err := MigrateLegacy(root, "c", "n1"); err != nil {
		t.Fatal(err)
	}
	checkMigrated(t, root)

	root = legacyDir(t)
	if _, err := MigrateLegacy(root, "c", "n1"); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, ClusterFile)); err != nil {
		t.Fatal(err)
	}
	_, err = Open(root)
	wantErr(t, "Open before cluster.json", err, ErrLegacy, root)
	if _, err := MigrateLegacy(root, "c", "n1"); err != nil {
		t.Fatal(err)
	}
	checkMigrated(t, root)

	// Files at the root and a migrated group 0: refused, nothing moved.
	write(t, filepath.Join(root, "raft.db"), "another")
	if err := os.Remove(filepath.Join(root, ClusterFile)); err != nil {
		t.Fatal(err)
	}
	_, err = MigrateLegacy(root, "c", "n1")
	wantErr(t, "both layouts", err, ErrCorrupt, root)
}
