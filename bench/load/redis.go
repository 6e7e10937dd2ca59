package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot/allot/internal/testproc"
)

// redisServer is a redis-server process the harness started: no
// persistence (no RDB, no AOF), so the baseline pays for the script and the
// round trip only.
type redisServer struct {
	addr   string
	cmd    *exec.Cmd
	exited chan struct{}
}

// startRedis starts bin on a free loopback port with its files in dir. It
// returns an error wrapping exec.ErrNotFound when bin is not installed.
func startRedis(ctx context.Context, bin, dir string) (*redisServer, error) {
	path, err := exec.LookPath(bin)
	if err != nil {
		return nil, err
	}
	ports, err := testproc.FreeLoopbackAddrs(1)
	if err != nil {
		return nil, err
	}
	port := ports[0][strings.LastIndexByte(ports[0], ':')+1:]
	rdir := filepath.Join(dir, "redis")
	if err := os.MkdirAll(rdir, 0o700); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(rdir, "redis.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(path, "--port", port, "--bind", "127.0.0.1", "--dir", rdir,
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, err
	}
	s := &redisServer{addr: "127.0.0.1:" + port, cmd: cmd, exited: make(chan struct{})}
	go func() { // owned by s: ends when the process does
		_ = cmd.Wait()
		logf.Close()
		close(s.exited)
	}()
	if err := waitRedis(ctx, s.addr, 20*time.Second); err != nil {
		s.stop()
		return nil, err
	}
	return s, nil
}

// waitRedis pings addr until it answers.
func waitRedis(ctx context.Context, addr string, timeout time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(timeout)
	for {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		err := c.Ping(cctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis at %s did not answer within %v: %w", addr, timeout, err)
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			return err
		}
	}
}

func (s *redisServer) pid() int { return s.cmd.Process.Pid }

// stop sends SIGTERM, then SIGKILL after 5 s, and waits for the process.
func (s *redisServer) stop() {
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(5 * time.Second)
	defer t.Stop()
	select {
	case <-s.exited:
	case <-t.C:
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}
