package main

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync"
	"time"

	"github.com/allot/allot/internal/cpuburn"
	"github.com/allot/allot/internal/proccpu"
)

// burnEnv, set to "1" in a process of this binary, makes it a CPU burner
// (-burners): it spins one thread until it is killed.
const burnEnv = "ALLOT_BENCH_ACQUIRE_BURN"

// burnIfAsked spins forever when this process was started as a burner; it
// returns at once otherwise. main calls it first.
func burnIfAsked() {
	if os.Getenv(burnEnv) != "1" {
		return
	}
	runtime.GOMAXPROCS(1)
	cpuburn.Start(1)
	select {} // until killed
}

// burners are the -burners processes: each a process of this binary
// spinning one thread at the nice value it inherits, a neighbour's load on
// the cores the allocators and the load client share.
type burners struct {
	mu   sync.Mutex // guards cmds: stop runs from the interrupt handler too
	cmds []*exec.Cmd
}

// startBurners starts n burners. They run until stop, and die with this
// process on Linux (the parent-death signal) if it exits without stopping
// them.
func startBurners(n int) (*burners, error) {
	b := &burners{}
	if n <= 0 {
		return b, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("-burners: %w", err)
	}
	for range n {
		cmd := exec.Command(exe)
		cmd.Env = append(os.Environ(), burnEnv+"=1")
		killWithParent(cmd)
		if err := cmd.Start(); err != nil {
			b.stop()
			return nil, fmt.Errorf("-burners: %w", err)
		}
		b.cmds = append(b.cmds, cmd)
	}
	return b, nil
}

// pids returns the burners' process ids.
func (b *burners) pids() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	var p []int
	for _, c := range b.cmds {
		p = append(p, c.Process.Pid)
	}
	return p
}

// cpu returns the CPU the burners have used so far (0 for one that cannot
// be read).
func (b *burners) cpu() time.Duration {
	var d time.Duration
	for _, p := range b.pids() {
		c, _ := proccpu.Of(p)
		d += c
	}
	return d
}

// stop kills the burners and waits for them. It may be called more than
// once.
func (b *burners) stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, c := range b.cmds {
		_ = c.Process.Kill()
	}
	for _, c := range b.cmds {
		_ = c.Wait()
	}
	b.cmds = nil
}
