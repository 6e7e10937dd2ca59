// Package allocproc runs cmd/allocator processes for the benchmark
// harnesses (bench/acquire, bench/load): start with a log file, wait for
// /readyz, kill or terminate, and pick free loopback addresses. Tests use
// internal/testproc, which builds on testing.TB.
package allocproc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// Node is one allocator process: its id, addresses and flags, set by the
// caller before Start.
type Node struct {
	ID, GRPC, Raft, HTTP string
	Args                 []string
	// Env is added to the benchmark's own environment (e.g.
	// GODEBUG=gctrace=1, GOGC=200).
	Env     []string
	LogPath string // stdout and stderr are appended here

	cmd    *exec.Cmd
	exited chan struct{}
}

// Start runs bin with n.Args. A goroutine owned by n reaps the process and
// closes the log when it exits.
func (n *Node) Start(bin string) error {
	f, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	n.cmd = exec.Command(bin, n.Args...)
	n.cmd.Stdout, n.cmd.Stderr = f, f
	if len(n.Env) > 0 {
		n.cmd.Env = append(os.Environ(), n.Env...)
	}
	if err := n.cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", bin, err)
	}
	n.exited = make(chan struct{})
	cmd, exited := n.cmd, n.exited
	go func() {
		_ = cmd.Wait()
		f.Close()
		close(exited)
	}()
	return nil
}

// running reports whether the process was started and has not exited.
func (n *Node) running() bool {
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.exited:
		return false
	default:
		return true
	}
}

// Pid is the process id of the latest Start (0 before any).
func (n *Node) Pid() int {
	if n.cmd == nil || n.cmd.Process == nil {
		return 0
	}
	return n.cmd.Process.Pid
}

// Kill sends SIGKILL and waits until the process is reaped.
func (n *Node) Kill() {
	if !n.running() {
		return
	}
	_ = n.cmd.Process.Kill()
	<-n.exited
}

// Terminate sends SIGTERM, waits up to grace, then SIGKILL, and waits until
// the process is reaped.
func (n *Node) Terminate(grace time.Duration) {
	if !n.running() {
		return
	}
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-n.exited:
	case <-t.C:
		_ = n.cmd.Process.Kill()
		<-n.exited
	}
}

// WaitReady polls /readyz on n.HTTP until it answers 200, the process
// exits, timeout passes or ctx ends.
func (n *Node) WaitReady(ctx context.Context, timeout time.Duration) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if n.cmd != nil && !n.running() {
			return fmt.Errorf("allocator %s exited (log: %s)", n.ID, n.LogPath)
		}
		if resp, err := client.Get("http://" + n.HTTP + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("allocator %s not ready within %v (log: %s)", n.ID, timeout, n.LogPath)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// FreeAddrs returns n distinct free 127.0.0.1 addresses (all listened on at
// once, then released).
func FreeAddrs(n int) ([]string, error) {
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	var out []string
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, ln)
		out = append(out, ln.Addr().String())
	}
	return out, nil
}

// AdminToken writes a fresh admin token file into dir and returns the
// allocator flags that use it (-admin-token-file, and -pprof: the
// benchmarks profile the nodes, which pprof allows only to an admin token)
// and the token. Agents still lease without it; admin calls and pprof
// requests must carry it (Bearer, GetWithToken).
func AdminToken(dir string) (args []string, token string, err error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return nil, "", err
	}
	token = hex.EncodeToString(b)
	path := filepath.Join(dir, "admin-tokens")
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		return nil, "", err
	}
	return []string{"-admin-token-file", path, "-pprof"}, token, nil
}

// Bearer sends an admin token as gRPC "authorization: Bearer" metadata
// (grpc.WithPerRPCCredentials), over plaintext loopback too.
type Bearer string

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (b Bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials.
func (Bearer) RequireTransportSecurity() bool { return false }

// GetWithToken GETs url with "Authorization: Bearer token" (pprof).
func GetWithToken(ctx context.Context, url, token string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	return http.DefaultClient.Do(req)
}
