package allocator

import (
	"fmt"
	"runtime"
	"sync"
	"time"
)

// lowApplier runs a follower's FSM applies on an OS thread of its own whose
// scheduling priority is lowered (a higher nice value).
//
// A follower's apply is off every client's path: a call is answered when
// the leader has applied its entry, and a commit waits for the followers'
// log appends, not for their applies. Where the nodes share cores with each
// other, with the groups a node leads or with gateways, the kernel then
// runs the work clients wait on first, and a follower applies in what is
// left (on average it must keep up, or its Raft stops taking entries).
// The leader applies on Raft's own goroutine, as it would without this.
//
// A thread's priority cannot be raised again without privilege, so the
// thread is never shared: its goroutine stays locked to it and ends locked
// when the node leads (the runtime then ends the thread instead of reusing
// it), and a later follower term starts a new one. It is never the main
// thread, which the runtime would park rather than end. The runtime starts
// new threads from its own template thread while the current one is
// locked, so no other thread inherits the priority.
//
// A follower that falls behind applies at the process's priority: one that
// applies entries more than maxLag after the leader appended them (a
// restarted node replaying its log, or one starved on saturated cores)
// until it applies them within maxLag/2 again. maxLag is half the lag at
// which a follower reports not ready (-ready-max-lag), so the lower
// priority alone never makes a follower unready, and it bounds what a
// failover to this node has to apply before its first grant.
//
// Only entries of lowMinEntry bytes or more go to the thread: a smaller
// one (a few hundred packed keys or fewer, by their length, or an Expire)
// applies in less time than the two thread wake-ups the hand-off costs,
// and with -groups a node follows several groups' streams of small
// entries.
//
// A thread the kernel holds back for its priority still holds one of the
// Go runtime's Ps, which the process's other goroutines then cannot use.
// So at most GOMAXPROCS−1 applies run at the lowered priority at once in
// the process (lowSlots; a node follows several groups with -groups), and
// none with GOMAXPROCS 1: at least one P is always free for the rest.
//
// Every method runs on Raft's FSM goroutine, or after Raft has shut down.
type lowApplier struct {
	nice int
	warn func(msg string, args ...any)
	w    *lowWorker
	// off: the priority could not be lowered here; every apply runs on
	// Raft's goroutine from then on.
	off bool
	// maxLag bounds the lag of applies at the lowered priority.
	maxLag time.Duration
	// behind: the last entry was applied more than maxLag after its
	// append (and none since within maxLag/2).
	behind bool
}

// caughtUp reports whether an entry the leader appended at appended
// (zero: unknown), applied at now, may be applied at the lowered priority.
func (a *lowApplier) caughtUp(appended, now time.Time) bool {
	if appended.IsZero() {
		return !a.behind
	}
	lag := now.Sub(appended)
	switch {
	case lag > a.maxLag:
		a.behind = true
	case lag <= a.maxLag/2:
		a.behind = false
	}
	return !a.behind
}

type lowWorker struct {
	req  chan func()
	ack  chan struct{}
	done chan struct{} // closed when the worker's goroutine has ended
}

// run runs f on the low-priority thread, starting it if none runs, and
// reports whether it did (false: run f on the caller's goroutine).
func (a *lowApplier) run(f func()) bool {
	slots := lowSlots()
	if a == nil || a.off || cap(slots) == 0 {
		return false
	}
	if a.w == nil {
		w, err := startLowWorker(a.nice)
		if err != nil {
			a.off = true
			if a.warn != nil {
				a.warn("follower applies stay at normal priority: the apply thread's priority could not be lowered", "nice", a.nice, "err", err)
			}
			return false
		}
		a.w = w
	}
	slots <- struct{}{}
	a.w.req <- f
	<-a.w.ack
	<-slots
	return true
}

// lowMinEntry is the least entry size, in bytes, applied at lowered
// priority.
const lowMinEntry = 16 << 10

var (
	lowSlotsOnce sync.Once
	lowSlotsCh   chan struct{}
)

// lowSlots is the process's semaphore of applies at lowered priority:
// GOMAXPROCS−1 slots, read once.
func lowSlots() chan struct{} {
	lowSlotsOnce.Do(func() { lowSlotsCh = make(chan struct{}, max(runtime.GOMAXPROCS(0)-1, 0)) })
	return lowSlotsCh
}

// stop ends the low-priority thread, if one runs. Safe on nil and twice.
func (a *lowApplier) stop() {
	if a == nil || a.w == nil {
		return
	}
	close(a.w.req)
	<-a.w.done
	a.w = nil
}

func startLowWorker(nice int) (*lowWorker, error) {
	w := &lowWorker{req: make(chan func()), ack: make(chan struct{}), done: make(chan struct{})}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if !onMainThread() {
			w.serve(nice, errc)
			return
		}
		// The runtime parks the process's main thread for good when a
		// goroutine ends locked to it, and ps shows the process at the
		// main thread's priority: serve from another thread. The main
		// thread stays locked to this goroutine until the worker has
		// locked its own, so the worker cannot start on it.
		locked := make(chan struct{})
		go func() {
			runtime.LockOSThread()
			close(locked)
			w.serve(nice, errc)
		}()
		<-locked
		runtime.UnlockOSThread()
	}()
	if err := <-errc; err != nil {
		<-w.done
		return nil, err
	}
	return w, nil
}

// serve lowers the calling goroutine's thread, locked to it, to nice and
// runs w's requests until w.req is closed. It never unlocks: the
// goroutine ends locked, and the runtime ends the thread with it. A nice
// value that is not above the thread's own (a process started niced)
// would raise the applies' priority, or fail without privilege: serve
// refuses it.
func (w *lowWorker) serve(nice int, errc chan<- error) {
	defer close(w.done)
	cur, err := threadNice()
	if err == nil && nice <= cur {
		err = fmt.Errorf("nice %d is not below the process's priority (nice %d)", nice, cur)
	}
	if err == nil {
		err = lowerThreadPriority(nice)
	}
	if err != nil {
		errc <- err
		return
	}
	errc <- nil
	for f := range w.req {
		f()
		w.ack <- struct{}{}
	}
}
