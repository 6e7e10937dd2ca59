package redislimit

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
)

// The Redis tests start their own redis-server processes (Debian's
// redis-server binary) on free loopback ports, in t.TempDir(), and kill them
// at cleanup.

// requireRedis skips the test when redis-server is not installed, or fails
// it when ALLOT_REQUIRE_REDIS=1 (CI).
func requireRedis(t testing.TB) {
	t.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			msg := fmt.Sprintf("%s not found: install the Debian packages redis-server and redis-tools (apt-get install redis-server redis-tools)", bin)
			if os.Getenv("ALLOT_REQUIRE_REDIS") == "1" {
				t.Fatal(msg + " (ALLOT_REQUIRE_REDIS=1)")
			}
			t.Skip(msg)
		}
	}
}

// redisServer is one redis-server process owned by a test.
type redisServer struct {
	t        testing.TB
	port     int
	dir      string
	args     []string
	sentinel string // a Sentinel's config file; empty for a server
	cmd      *exec.Cmd
}

func (s *redisServer) addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// freePort returns a loopback port that is free now, and whose cluster bus
// port (+10000) is free too when bus is set.
func freePort(t testing.TB, bus bool) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("listen: %v", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		if !bus {
			return port
		}
		if port+10000 > 65535 {
			continue
		}
		l2, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+10000))
		if err != nil {
			continue
		}
		_ = l2.Close()
		return port
	}
	t.Fatal("no free port")
	return 0
}

// startRedis starts a redis-server with no persistence (unless args say
// otherwise) and waits until it answers PING.
func startRedis(t testing.TB, args ...string) *redisServer {
	t.Helper()
	requireRedis(t)
	cluster := false
	for _, a := range args {
		if a == "--cluster-enabled" {
			cluster = true
		}
	}
	s := &redisServer{t: t, port: freePort(t, cluster), dir: t.TempDir(), args: args}
	s.start()
	t.Cleanup(s.kill)
	return s
}

// startSentinel starts a Redis Sentinel monitoring the primary at
// 127.0.0.1:primaryPort as "m", quorum 1, with short failure timeouts.
func startSentinel(t testing.TB, primaryPort int) *redisServer {
	t.Helper()
	requireRedis(t)
	s := &redisServer{t: t, port: freePort(t, false), dir: t.TempDir()}
	s.sentinel = filepath.Join(s.dir, "sentinel.conf")
	conf := fmt.Sprintf("sentinel monitor m 127.0.0.1 %d 1\n"+
		"sentinel down-after-milliseconds m 300\n"+
		"sentinel failover-timeout m 3000\n"+
		"sentinel parallel-syncs m 1\n", primaryPort)
	if err := os.WriteFile(s.sentinel, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	s.start()
	t.Cleanup(s.kill)
	return s
}

func (s *redisServer) start() {
	s.t.Helper()
	args := []string{
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--dir", s.dir, "--logfile", filepath.Join(s.dir, "redis.log"),
		"--save", "", "--appendonly", "no", "--protected-mode", "no",
	}
	if s.sentinel != "" {
		args = append([]string{s.sentinel, "--sentinel"}, args[:8]...) // no persistence flags
	}
	args = append(args, s.args...) // later flags win
	s.cmd = exec.Command("redis-server", args...)
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server: %v", err)
	}
	s.waitReady()
}

// waitReady waits, with a deadline, until the server answers PING.
func (s *redisServer) waitReady() {
	s.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := ping(s.addr()); err == nil {
			return
		} else if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			s.t.Fatalf("redis-server on %s not ready: %v\n%s", s.addr(), err, log)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ping sends one PING over a fresh connection.
func ping(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "+PONG") {
		return fmt.Errorf("PING: %q", line)
	}
	return nil
}

// kill sends SIGKILL and reaps the process; safe to call twice.
func (s *redisServer) kill() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// restart starts the server again on the same port and directory.
func (s *redisServer) restart() { s.start() }

// cli runs redis-cli against the server.
func (s *redisServer) cli(args ...string) string {
	s.t.Helper()
	out, err := exec.Command("redis-cli", append([]string{"-h", "127.0.0.1", "-p", strconv.Itoa(s.port)}, args...)...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("redis-cli %v: %v\n%s", args, err, out)
	}
	return strings.TrimSpace(string(out))
}

// newTestBackend returns a Backend on addrs with a generous timeout (the
// machine is shared; the 5 ms default is exercised by the failure tests) and
// closes it at cleanup.
func newTestBackend(t testing.TB, mutate func(*Config), addrs ...string) *Backend {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Addrs = addrs
	cfg.Timeout = 2 * time.Second
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

var bg = context.Background()

func xxh64(s string) uint64 { return xxhash.Sum64String(s) }
