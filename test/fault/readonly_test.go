package fault

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// TestDataDirReadOnly: the leader's data directory goes read-only under
// load, the way a disk does when the kernel meets an I/O error: the data
// dir is an ext4 filesystem on a loop device mounted errors=remount-ro,
// and the test makes ext4 raise an error through sysfs
// (/sys/fs/ext4/<dev>/trigger_fs_error). The filesystem aborts its journal
// and every later write fails with EROFS, while raft.db stays open.
//
// The node must fail loudly (exit, or log the read-only error) or step
// down; the other two keep granting: zero 5xx, admission within the bound.
// Then the operator's repair: stop the node, fsck, remount read-write,
// restart; the node comes back with its state and catches up.
//
// Needs root, loop devices and mkfs.ext4; skipped otherwise (and under
// -short).
func TestDataDirReadOnly(t *testing.T) {
	checkLeaks(t)
	testproc.Build(t) // skips under -short before anything is mounted
	fs := newLoopExt4(t, 96<<20)
	e, n0 := leaderOnDataDir(t, filepath.Join(fs.mnt, "data"))

	n := e.liveAgents()
	fs.triggerError(t)
	broke := time.Now()
	t.Logf("%s's data dir is read-only (leader, %d live agents)", n0.ID, n)

	// Every Raft entry is a bolt commit, so the leader meets EROFS at its
	// next batch.
	rec := e.failOver(t, n0, broke, "the disk went read-only", "read-only file system")

	// The repair: stop the node, check the filesystem, mount it
	// read-write, restart the node on the same data dir.
	if n0.Proc.Running() {
		if err := n0.Proc.Signal(os.Interrupt, 10*time.Second); err != nil {
			t.Logf("%s did not stop on SIGINT (%v); killing it", n0.ID, err)
			n0.Proc.Kill()
		}
	}
	fs.repair(t)
	repaired := time.Now()
	n0.Proc.Start(t)
	e.catchUpAndReport(t, n0, repaired, "the remount", "leader's data dir read-only (ext4 error, remount-ro)", rec, n)
}

// loopExt4 is an ext4 filesystem in an image file, mounted through a loop
// device with errors=remount-ro.
type loopExt4 struct {
	img, mnt, dev string
}

// newLoopExt4 makes and mounts a size-byte ext4 image; cleanup unmounts it
// (registered before any process using it starts, so it runs after they
// are killed). It skips the test where this cannot be done.
func newLoopExt4(t *testing.T, size int64) *loopExt4 {
	t.Helper()
	for _, tool := range []string{"mkfs.ext4", "mount", "umount", "e2fsck"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s: %v", tool, err)
		}
	}
	dir := t.TempDir()
	fs := &loopExt4{img: filepath.Join(dir, "disk.img"), mnt: filepath.Join(dir, "mnt")}
	if err := os.Mkdir(fs.mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(fs.img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", fs.img).CombinedOutput(); err != nil {
		t.Skipf("mkfs.ext4: %v: %s", err, out)
	}
	if err := fs.mount(); err != nil {
		t.Skipf("cannot mount an ext4 image on a loop device (needs root and loop devices): %v", err)
	}
	t.Cleanup(func() {
		if fs.dev == "" {
			return
		}
		if out, err := exec.Command("umount", fs.mnt).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", fs.mnt, err, out)
		}
	})
	if _, err := os.Stat(fs.sysfs()); err != nil {
		t.Skipf("this kernel has no %s: %v", fs.sysfs(), err)
	}
	return fs
}

func (fs *loopExt4) mount() error {
	if out, err := exec.Command("mount", "-o", "loop,errors=remount-ro", fs.img, fs.mnt).CombinedOutput(); err != nil {
		return fmt.Errorf("mount: %v: %s", err, out)
	}
	out, err := exec.Command("findmnt", "-n", "-o", "SOURCE", fs.mnt).Output()
	if err != nil {
		return fmt.Errorf("findmnt %s: %v", fs.mnt, err)
	}
	fs.dev = strings.TrimSpace(string(out))
	return nil
}

func (fs *loopExt4) sysfs() string {
	return filepath.Join("/sys/fs/ext4", filepath.Base(fs.dev), "trigger_fs_error")
}

// triggerError makes ext4 record an error; with errors=remount-ro it turns
// the filesystem read-only at once.
func (fs *loopExt4) triggerError(t *testing.T) {
	t.Helper()
	if err := os.WriteFile(fs.sysfs(), []byte("allot fault test\n"), 0); err != nil {
		t.Fatalf("trigger an ext4 error: %v", err)
	}
	testproc.Eventually(t, 5*time.Second, "the data dir to turn read-only", func() bool {
		f, err := os.CreateTemp(fs.mnt, "probe")
		if err == nil {
			f.Close()
			os.Remove(f.Name())
			return false
		}
		return strings.Contains(err.Error(), "read-only")
	})
}

// repair unmounts, fscks and remounts the filesystem read-write.
func (fs *loopExt4) repair(t *testing.T) {
	t.Helper()
	if out, err := exec.Command("umount", fs.mnt).CombinedOutput(); err != nil {
		t.Fatalf("umount %s: %v: %s", fs.mnt, err, out)
	}
	fs.dev = ""
	// e2fsck exits 1 when it fixed something, which is expected here.
	if out, err := exec.Command("e2fsck", "-f", "-y", fs.img).CombinedOutput(); err != nil {
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() > 1 {
			t.Fatalf("e2fsck: %v: %s", err, out)
		}
	}
	if err := fs.mount(); err != nil {
		t.Fatal(err)
	}
}
