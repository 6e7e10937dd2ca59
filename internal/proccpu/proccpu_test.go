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
