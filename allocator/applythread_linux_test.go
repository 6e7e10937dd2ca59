package allocator

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// lockedNice returns the nice value of a thread the calling goroutine is
// locked to for the read.
func lockedNice(t testing.TB) int {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	n, err := threadNice()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestLowApplierThread: run runs its function on a thread of the asked
// nice value, one call at a time, and returns once it has run; after stop
// no thread of the process keeps that nice value (the worker's thread
// ended with it), and a later run starts a new one.
func TestLowApplierThread(t *testing.T) {
	skipWithoutLowSlots(t)
	base := lockedNice(t)
	a := &lowApplier{nice: base + 7}
	for round := range 2 {
		var got []int
		for i := range 5 {
			if !a.run(func() { got = append(got, lockedNice(t)*10+i) }) {
				t.Fatal("run refused: the priority could not be lowered")
			}
		}
		for i, g := range got {
			if g != (base+7)*10+i {
				t.Fatalf("round %d: calls saw nice*10+i = %v; want nice %d, in order", round, got, base+7)
			}
		}
		if n := lockedNice(t); n != base {
			t.Fatalf("the caller's thread has nice %d after run, want %d", n, base)
		}
		a.stop()
		a.stop()
		// The thread ends just after its goroutine does.
		waitFor(t, 5*time.Second, "the worker's thread to end", func() bool { return countThreadsWithNice(t, base+7) == 0 })
		// Threads the runtime starts or reuses now run at the base priority.
		var wg sync.WaitGroup
		var bad atomic.Int32
		for range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if lockedNice(t) != base {
					bad.Add(1)
				}
				time.Sleep(time.Millisecond) // hold the thread so that several are used
			}()
		}
		wg.Wait()
		if bad.Load() != 0 {
			t.Fatalf("round %d: %d goroutines ran on a thread of lowered priority", round, bad.Load())
		}
	}
}

// countThreadsWithNice counts the process's threads at nice value n
// (/proc/self/task/*/stat, field 19).
func countThreadsWithNice(t testing.TB, n int) int {
	t.Helper()
	c, err := threadNices()
	if err != nil {
		t.Fatal(err)
	}
	return c[n]
}

// TestFollowerAppliesLowPriority: in a 3-node cluster the followers apply
// entries of lowMinEntry bytes or more on a thread of nice
// FollowerApplyNice, and smaller ones at the process's priority; the leader
// applies every entry at the process's priority; a follower that becomes
// leader applies the entries of its own term at the process's priority.
func TestFollowerAppliesLowPriority(t *testing.T) {
	skipWithoutLowSlots(t)
	base := lockedNice(t)
	var mu sync.Mutex
	type applied struct {
		index uint64
		nice  int
		big   bool
	}
	seen := make([][]applied, 3) // by node, in apply order
	tc := newTestCluster(t, 3, func(i int, c *Config) {
		c.FollowerApplyNice = base + 5
		c.beforeApply = func(l *raft.Log) {
			n, err := threadNice()
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			seen[i] = append(seen[i], applied{l.Index, n, len(l.Data) >= lowMinEntry})
			mu.Unlock()
		}
	})
	// acquire makes a call on the leader and returns the index it was
	// applied at on every live node (the leader's last index after it: the
	// call's entry or a later command).
	acquire := func(leader, down int, agent string) uint64 {
		alloc, _ := tc.clients(leader)
		keys := make([]*allotv1.KeyAcquire, 1000) // a call of lowMinEntry bytes or more
		for k := range keys {
			keys[k] = key("quota", fmt.Sprintf("%s-%04d-padding-to-a-longer-key", agent, k), 1)
		}
		req := &allotv1.AcquireRequest{AgentId: agent, RequestId: 1, PackedGrants: true,
			PackedKeys: allotv1.AppendPackedKeys(nil, keys)}
		if _, got := acquireGrants(ctxT(t), t, alloc, req); len(got) != len(keys) || got[0].GetGranted() != 1 {
			t.Fatalf("%d grants, the first of %d; want %d of 1", len(got), got[0].GetGranted(), len(keys))
		}
		idx := tc.node(leader).node.raft.LastIndex()
		waitApplied(t, tc, idx, down)
		return idx
	}
	// check: every command entry after from, up to to, was applied at the
	// leader's priority on the leader and, when big, at the lowered one
	// elsewhere; at least one was big.
	check := func(leader, down int, from, to uint64) {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		for i := range seen {
			if i == down {
				continue
			}
			n := 0
			for _, a := range seen[i] {
				if a.index <= from || a.index > to {
					continue
				}
				want := base
				if a.big && i != leader {
					want, n = base+5, n+1
				} else if a.big {
					n++
				}
				if a.nice != want {
					t.Errorf("node %d (leader %d) applied entry %d (big %v) at nice %d, want %d", i, leader, a.index, a.big, a.nice, want)
				}
			}
			if n == 0 {
				t.Errorf("node %d applied no entry of %d bytes or more in (%d, %d]", i, lowMinEntry, from, to)
			}
		}
	}
	old := tc.leader()
	from := tc.node(old).node.raft.LastIndex()
	check(old, -1, from, acquire(old, -1, "a"))

	tc.stop(old, false)
	newLeader := tc.leader()
	from = tc.node(newLeader).node.raft.LastIndex()
	check(newLeader, old, from, acquire(newLeader, old, "b"))
}

// threadNices counts the process's threads by nice value
// (/proc/self/task/*/stat).
func threadNices() (map[int]int, error) {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return nil, err
	}
	c := map[int]int{}
	for _, d := range tasks {
		b, err := os.ReadFile("/proc/self/task/" + d.Name() + "/stat")
		if err != nil {
			continue // the thread ended
		}
		// The command name, in parentheses, may hold spaces: the fields
		// after it start at the last ')'.
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) < 17 {
			return nil, fmt.Errorf("/proc/self/task/%s/stat: %d fields after the name", d.Name(), len(f))
		}
		n, err := strconv.Atoi(f[16]) // field 19: the nice value
		if err != nil {
			return nil, err
		}
		c[n]++
	}
	return c, nil
}

// TestLowApplierCaughtUp: an entry applied more than maxLag after its
// append moves the applies to the process's priority until one is applied
// within maxLag/2; an entry of unknown append time changes nothing. The
// bound is half the readiness lag.
func TestLowApplierCaughtUp(t *testing.T) {
	cfg := DefaultConfig()
	if got, want := cfg.followerApplyLag(), cfg.ReadyMaxLag/2; got != want {
		t.Fatalf("followerApplyLag = %v, want half of -ready-max-lag %v", got, want)
	}
	cfg.ReadyMaxLag = -1
	if got, want := cfg.followerApplyLag(), DefaultConfig().ReadyMaxLag/2; got != want {
		t.Fatalf("followerApplyLag with the lag ignored = %v, want %v", got, want)
	}
	const lowMaxLag = 2 * time.Second
	a := &lowApplier{nice: 5, maxLag: lowMaxLag}
	t0 := time.Unix(1000, 0)
	steps := []struct {
		lag  time.Duration // -1: unknown append time
		want bool
	}{
		{0, true}, {lowMaxLag, true}, {-1, true}, {lowMaxLag + 1, false}, {-1, false},
		{lowMaxLag, false}, {lowMaxLag/2 + 1, false}, {lowMaxLag / 2, true}, {lowMaxLag, true},
		{10 * lowMaxLag, false}, {0, true},
	}
	for i, s := range steps {
		appended := time.Time{}
		if s.lag >= 0 {
			appended = t0.Add(-s.lag)
		}
		if got := a.caughtUp(appended, t0); got != s.want {
			t.Fatalf("step %d (lag %v): caughtUp = %v, want %v", i, s.lag, got, s.want)
		}
	}
}

func skipWithoutLowSlots(t *testing.T) {
	if cap(lowSlots()) == 0 {
		t.Skip("GOMAXPROCS 1: no apply runs at lowered priority")
	}
}

// TestLowApplierSlots: applies of several appliers (groups) run at the
// lowered priority at most GOMAXPROCS−1 at a time.
func TestLowApplierSlots(t *testing.T) {
	skipWithoutLowSlots(t)
	var in, most atomic.Int32
	var wg sync.WaitGroup
	appliers := make([]*lowApplier, 4)
	for i := range appliers {
		a := &lowApplier{nice: lockedNice(t) + 3}
		appliers[i] = a
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				a.run(func() {
					n := in.Add(1)
					for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
					}
					time.Sleep(200 * time.Microsecond)
					in.Add(-1)
				})
			}
		}()
	}
	wg.Wait()
	for _, a := range appliers {
		a.stop()
	}
	if got, limit := most.Load(), int32(cap(lowSlots())); got > limit || got == 0 {
		t.Fatalf("at most %d applies ran at once; want 1..%d (GOMAXPROCS−1)", got, limit)
	}
}

// TestLowApplierNotRaised: a nice value not above the thread's own would
// raise the applies' priority (or fail without privilege): run refuses
// it with one warning, and every apply then runs on the caller's thread.
func TestLowApplierNotRaised(t *testing.T) {
	skipWithoutLowSlots(t)
	base := lockedNice(t)
	var warned int
	a := &lowApplier{nice: base, warn: func(string, ...any) { warned++ }}
	for range 3 {
		if a.run(func() { t.Error("ran at a nice value not below the process's") }) {
			t.Fatal("run took an apply at the process's own nice value")
		}
	}
	if warned != 1 || !a.off {
		t.Fatalf("warned %d times, off %v; want one warning and off", warned, a.off)
	}
}
