package main

import (
	"os"
	"testing"
	"time"
)

// TestMain lets this test binary serve as a burner (startBurners starts
// the running executable).
func TestMain(m *testing.M) {
	burnIfAsked()
	os.Exit(m.Run())
}

// TestBurnersSpinAndStop: a burner uses a core's time until stopped, and
// stop leaves no process behind.
func TestBurnersSpinAndStop(t *testing.T) {
	b, err := startBurners(1)
	if err != nil {
		t.Fatal(err)
	}
	defer b.stop()
	pids := b.pids()
	if len(pids) != 1 {
		t.Fatalf("pids %v, want one", pids)
	}
	deadline := time.Now().Add(30 * time.Second)
	for b.cpu() < 100*time.Millisecond {
		if time.Now().After(deadline) {
			t.Fatalf("burner used %v of CPU in 30 s", b.cpu())
		}
		time.Sleep(20 * time.Millisecond)
	}
	cmd := b.cmds[0]
	b.stop()
	if cmd.ProcessState == nil {
		t.Fatal("burner not waited for after stop")
	}
	if len(b.pids()) != 0 {
		t.Fatalf("pids after stop: %v", b.pids())
	}
	b.stop() // a second stop is harmless
}

func TestStartNoBurners(t *testing.T) {
	b, err := startBurners(0)
	if err != nil {
		t.Fatal(err)
	}
	if len(b.pids()) != 0 || b.cpu() != 0 {
		t.Fatalf("no burners asked, got %v", b.pids())
	}
	b.stop()
}
