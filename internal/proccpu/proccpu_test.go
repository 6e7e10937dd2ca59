package proccpu

import (
	"os"
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
