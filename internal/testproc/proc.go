// Package testproc runs allot's binaries as real processes, for the
// integration tests and the benchmark harnesses: it builds them, starts them
// on loopback with free ports, kills them with SIGKILL or stops them with
// SIGTERM, and offers the waits and scrapes the fault tests need (an
// allocator cluster, gateways, a load generator).
//
// The functions that take a testing.TB fail the test on error; each has an
// error-returning form for the benchmarks (FreeLoopbackAddrs, GoBuild,
// Proc.Run). Every process a test starts is killed and reaped by the test's
// cleanup, and its combined output is kept in a log file whose tail is
// printed when the test fails.
package testproc

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Binaries are the built executables.
type Binaries struct {
	Allocator string // cmd/allocator
	Gateway   string // cmd/gateway
}

var (
	buildOnce sync.Once
	buildDir  string
	buildBins Binaries
	buildErr  error
)

// RaceBinaries reports whether Build compiles the binaries with -race
// (ALLOT_FAULT_RACE=1). The default is off: the fault tests measure
// recovery and admission, and race-instrumented allocators are several
// times slower on the shared CI cores; the packages' own tests run -race.
func RaceBinaries() bool { return os.Getenv("ALLOT_FAULT_RACE") == "1" }

// Build builds the binaries once per test binary (later calls reuse them).
// It skips the test under -short.
func Build(t testing.TB) Binaries {
	t.Helper()
	if testing.Short() {
		t.Skip("process test: skipped with -short")
	}
	buildOnce.Do(func() {
		if buildDir, buildErr = os.MkdirTemp("", "allot-testproc-"); buildErr != nil {
			return
		}
		if buildErr = GoBuild(buildDir, RaceBinaries(), "github.com/allot/allot/cmd/allocator", "github.com/allot/allot/cmd/gateway"); buildErr != nil {
			return
		}
		buildBins = Binaries{
			Allocator: filepath.Join(buildDir, "allocator"),
			Gateway:   filepath.Join(buildDir, "gateway"),
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildBins
}

// GoBuild builds the packages' commands into dir (with -race when race is
// set), with the go command of the running toolchain. A build without
// -race is the one that ships: optimised with cmd/allocator/default.pgo,
// as go build does. A race build is not, so that it reuses the race build
// of the dependencies the test binaries already compiled.
func GoBuild(dir string, race bool, pkgs ...string) error {
	args := []string{"build", "-o", dir + string(os.PathSeparator)}
	if race {
		args = append(args, "-race", "-pgo=off")
	}
	args = append(args, pkgs...)
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), args...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("testproc: go build: %v\n%s", err, out)
	}
	return nil
}

// RemoveBuilds deletes the built binaries; call it from TestMain after
// m.Run.
func RemoveBuilds() {
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
}

// Proc is one process. A test starts it with Start, and the test's cleanup
// kills it if still running; a benchmark starts it with Run and stops it
// with Kill or Terminate.
type Proc struct {
	Name    string
	Bin     string
	Args    []string
	LogPath string
	// Env is added to this process's own environment (e.g.
	// GODEBUG=gctrace=1).
	Env []string

	mu      sync.Mutex // guards cmd, done, waitErr
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
	starts  int
}

// NewProc describes a process whose output goes to dir/name.log.
func NewProc(name, dir, bin string, args ...string) *Proc {
	return &Proc{Name: name, Bin: bin, Args: args, LogPath: filepath.Join(dir, name+".log")}
}

// Start runs the process (again, after an exit: same flags). The first
// Start registers a cleanup that kills it and, if the test failed, logs the
// tail of its output.
func (p *Proc) Start(t testing.TB) {
	t.Helper()
	p.mu.Lock()
	fresh := p.starts == 0
	p.mu.Unlock()
	if fresh && !slices.ContainsFunc(p.Env, func(e string) bool { return strings.HasPrefix(e, "TMPDIR=") }) {
		// What the process leaves in its temporary directory (a -dev
		// gateway killed before it removes its data dir) goes to one the
		// test removes after the kill below (cleanups run last first).
		p.Env = append(p.Env, "TMPDIR="+t.TempDir())
	}
	if err := p.Run(); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	first := p.starts == 1
	p.mu.Unlock()
	if first {
		t.Cleanup(func() {
			p.Kill()
			if t.Failed() {
				t.Logf("---- %s (tail of %s) ----\n%s", p.Name, p.LogPath, Tail(p.Output(), 40))
			}
		})
	}
}

// Run runs the process (again, after an exit: same flags), its output
// appended to LogPath. A goroutine owned by p reaps it when it exits; Kill
// and Terminate make sure it does.
func (p *Proc) Run() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		select {
		case <-p.done:
		default:
			return fmt.Errorf("testproc: %s is already running", p.Name)
		}
	}
	f, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	fmt.Fprintf(f, "==== start %d: %s %s\n", p.starts+1, p.Bin, strings.Join(p.Args, " "))
	cmd := exec.Command(p.Bin, p.Args...)
	cmd.Stdout, cmd.Stderr = f, f
	if len(p.Env) > 0 {
		cmd.Env = append(os.Environ(), p.Env...)
	}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("testproc: start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	p.cmd, p.done = cmd, done
	go func() { // ends when the process exits
		err := cmd.Wait()
		f.Close()
		p.mu.Lock()
		p.waitErr = err
		p.mu.Unlock()
		close(done)
	}()
	p.starts++
	return nil
}

// Running reports whether the process has been started and not exited.
func (p *Proc) Running() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// Done is closed when the current run exits.
func (p *Proc) Done() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

// ExitErr is the current run's exit error (after Done).
func (p *Proc) ExitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waitErr
}

// Pid is the current run's process id.
func (p *Proc) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Kill sends SIGKILL (kill -9) and waits until the process is reaped. A
// process not running is left alone.
func (p *Proc) Kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGKILL)
	<-done
}

// Terminate sends SIGTERM, waits up to grace, then kills the process, and
// waits until it is reaped. A process not running is left alone.
func (p *Proc) Terminate(grace time.Duration) {
	if !p.Running() {
		return
	}
	if p.Signal(syscall.SIGTERM, grace) != nil {
		p.Kill()
	}
}

// WaitHTTP polls url until it answers 200, the process exits, timeout
// passes or ctx ends.
func (p *Proc) WaitHTTP(ctx context.Context, url string, timeout time.Duration) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if !p.Running() {
			return fmt.Errorf("testproc: %s exited (log: %s)", p.Name, p.LogPath)
		}
		if resp, err := client.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testproc: %s not ready within %v (log: %s)", p.Name, timeout, p.LogPath)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// Signal sends sig and waits up to within for the exit.
func (p *Proc) Signal(sig os.Signal, within time.Duration) error {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return errors.New("testproc: not started")
	}
	if err := cmd.Process.Signal(sig); err != nil {
		return err
	}
	select {
	case <-done:
		return p.ExitErr()
	case <-time.After(within):
		return fmt.Errorf("testproc: %s did not exit within %v of %v", p.Name, within, sig)
	}
}

// Output returns everything the process wrote so far (all runs).
func (p *Proc) Output() string {
	b, _ := os.ReadFile(p.LogPath)
	return string(b)
}

// Tail returns the last n lines of s.
func Tail(s string, n int) string {
	ls := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

// FreeAddrs returns n distinct loopback addresses whose ports are free now.
func FreeAddrs(t testing.TB, n int) []string {
	t.Helper()
	out, err := FreeLoopbackAddrs(n)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// FreeAddr returns one loopback address whose port is free now.
func FreeAddr(t testing.TB) string {
	t.Helper()
	return FreeAddrs(t, 1)[0]
}

// FreeLoopbackAddrs returns n distinct 127.0.0.1 addresses whose ports are
// free now (all listened on at once, then released).
func FreeLoopbackAddrs(n int) ([]string, error) { return freeAddrsOn("127.0.0.1", n) }

// ClusterHost is the loopback address this process's clusters listen on:
// one of 127.0.0.0/8 other than 127.0.0.1, drawn once per process. A
// killed allocator's port is free until the node is restarted on it; on
// 127.0.0.1 another test binary running at the same time can bind it
// meanwhile, and its allocator then answers this cluster's gateways (with
// NO_RULE for rules it does not have, so they never fail open). On a host
// no other process uses, nothing else can answer on that port. It is
// 127.0.0.1 where the drawn address cannot be bound.
var ClusterHost = sync.OnceValue(func() string {
	var b [3]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "127.0.0.1"
	}
	host := net.IPv4(127, 1+b[0]%254, b[1], 1+b[2]%254).String()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return "127.0.0.1"
	}
	ln.Close()
	return host
})

// FreeClusterAddr returns an address on ClusterHost whose port is free
// now: for a server a test kills and restarts on the same address.
func FreeClusterAddr(t testing.TB) string {
	t.Helper()
	out, err := freeAddrsOn(ClusterHost(), 1)
	if err != nil {
		t.Fatal(err)
	}
	return out[0]
}

// freeAddrsOn returns n distinct addresses on host whose ports are free now.
func freeAddrsOn(host string, n int) ([]string, error) {
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	out := make([]string, 0, n)
	for range n {
		ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return nil, err
		}
		lns = append(lns, ln)
		out = append(out, ln.Addr().String())
	}
	return out, nil
}

// Eventually polls cond every 20ms until it holds, failing the test after
// within.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Within(within, cond) {
		t.Fatalf("timed out after %v waiting for %s", within, what)
	}
}

// Within polls cond every 20ms until it holds (true) or within passes
// (false).
func Within(within time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		<-tick.C
	}
	return true
}

// WriteFile writes content to dir/name and returns the path.
func WriteFile(t testing.TB, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
