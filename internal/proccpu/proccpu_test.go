package proccpu

import (
	"os"
	"runtime"
	"testing"
	"time"
)

// TestSelfAndOfAgree: CPU spent spinning shows in both readings of this
// process, and Of(0) and Of(own pid) are the same process.
func TestSelfAndOfAgree(t *testing.T) {
	s0, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	o0, err := Of(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		s1, err1 := Self()
		o1, err2 := Of(0)
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		if s1-s0 >= 50*time.Millisecond && o1-o0 >= 20*time.Millisecond {
			return
		}
	}
	t.Fatal("5 s of spinning did not show as CPU time")
}

// TestSchedAndMachine: CPU spent spinning shows as run time in this
// process's schedstat, and /proc/stat's ticks move.
func TestSchedAndMachine(t *testing.T) {
	r0, w0, err := Sched(0)
	if err != nil {
		t.Fatal(err)
	}
	m0, err := ReadMachine()
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		r1, w1, err := Sched(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		if w0 < 0 || w1 < 0 {
			t.Fatalf("run-queue wait %v then %v", w0, w1)
		}
		m1, err := ReadMachine()
		if err != nil {
			t.Fatal(err)
		}
		if r1-r0 >= 50*time.Millisecond && m1.Total > m0.Total {
			idle, iowait, steal := Share(m0, m1)
			if idle < 0 || iowait < 0 || steal < 0 || idle+iowait+steal > 1 {
				t.Fatalf("shares %v %v %v", idle, iowait, steal)
			}
			return
		}
	}
	t.Fatal("5 s of spinning did not show as run time")
}

// TestThread: a locked thread's spinning shows in its own Thread time and
// not in another thread's.
func TestThread(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	t0, err := Thread()
	if err != nil {
		t.Fatal(err)
	}
	other := make(chan time.Duration)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		o0, _ := Thread()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
			if o1, _ := Thread(); o1-o0 >= 50*time.Millisecond {
				break
			}
		}
		o1, _ := Thread()
		other <- o1 - o0
	}()
	spun := <-other // this thread blocked meanwhile
	t1, err := Thread()
	if err != nil {
		t.Fatal(err)
	}
	if spun < 50*time.Millisecond {
		t.Fatalf("5 s of spinning showed as %v of the spinning thread's CPU", spun)
	}
	if t1-t0 >= spun/2 {
		t.Fatalf("a blocked thread's CPU rose %v while another spun %v", t1-t0, spun)
	}
}
