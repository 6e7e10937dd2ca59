package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// e2eBins builds allotctl and allocator into a temporary directory.
func e2eBins(t *testing.T) (allotctl, allocatorBin string) {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "build", "-o", dir+string(filepath.Separator),
		"github.com/allot/allot/cmd/allotctl", "github.com/allot/allot/cmd/allocator")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return filepath.Join(dir, "allotctl"), filepath.Join(dir, "allocator")
}

// allocProc is one allocator process. Its stderr (JSON logs) is kept for
// the failure report; grpcAddr comes from its "allocator listening" line.
type allocProc struct {
	id       string
	cmd      *exec.Cmd
	grpcAddr string
	mu       sync.Mutex // guards logs
	logs     bytes.Buffer
	exited   chan struct{} // closed when the process has been waited for
}

func (p *allocProc) logText() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logs.String()
}

// startAllocProc starts an allocator process on free loopback ports and
// waits until it reports its gRPC address.
func startAllocProc(t *testing.T, bin, id, dataDir string, extra ...string) *allocProc {
	t.Helper()
	args := append([]string{
		"-node-id", id, "-data-dir", dataDir,
		"-grpc-addr", "127.0.0.1:0", "-raft-addr", "127.0.0.1:0", "-http-addr", "",
		"-log-format", "json", "-log-level", "info",
		"-lease-ttl", "5m", "-max-lease-ttl", "5m", "-agent-ttl", "10m",
	}, extra...)
	p := &allocProc{id: id, cmd: exec.Command(bin, args...), exited: make(chan struct{})}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", id, err)
	}
	addrCh := make(chan string, 1)
	// The reader ends when the process exits and the pipe closes; then the
	// process is reaped.
	go func() {
		defer close(p.exited)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Bytes()
			p.mu.Lock()
			p.logs.Write(line)
			p.logs.WriteByte('\n')
			p.mu.Unlock()
			var rec struct {
				Msg  string `json:"msg"`
				GRPC string `json:"grpc"`
			}
			if json.Unmarshal(line, &rec) == nil && rec.Msg == "allocator listening" && rec.GRPC != "" {
				select {
				case addrCh <- rec.GRPC:
				default:
				}
			}
		}
		_ = p.cmd.Wait()
	}()
	t.Cleanup(func() { p.stop(t) })
	select {
	case p.grpcAddr = <-addrCh:
	case <-p.exited:
		t.Fatalf("%s exited before listening:\n%s", id, p.logText())
	case <-time.After(60 * time.Second):
		t.Fatalf("%s did not report its address within 60s:\n%s", id, p.logText())
	}
	return p
}

// stop sends SIGTERM and waits for a graceful exit, then SIGKILLs.
func (p *allocProc) stop(t *testing.T) {
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(20 * time.Second):
		t.Logf("%s did not stop on SIGTERM; killing", p.id)
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	if t.Failed() {
		t.Logf("%s logs:\n%s", p.id, p.logText())
	}
}

// TestEndToEnd builds the allotctl and allocator binaries, starts a real
// 3-node cluster (bootstrap + -join), applies rules with allotctl, creates
// leases with an Acquire client, and runs the operator commands against it.
func TestEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("builds binaries and starts a 3-process allocator cluster")
	}
	ctl, alloc := e2eBins(t)
	base := t.TempDir()
	n1 := startAllocProc(t, alloc, "n1", filepath.Join(base, "n1"), "-bootstrap")
	n2 := startAllocProc(t, alloc, "n2", filepath.Join(base, "n2"), "-join", n1.grpcAddr)
	n3 := startAllocProc(t, alloc, "n3", filepath.Join(base, "n3"), "-join", n1.grpcAddr)
	procs := []*allocProc{n1, n2, n3}

	type out struct {
		stdout, stderr string
		code           int
	}
	run := func(addr string, args ...string) out {
		t.Helper()
		cmd := exec.Command(ctl, append([]string{"--addr", addr, "--timeout", "10s"}, args...)...)
		var so, se bytes.Buffer
		cmd.Stdout, cmd.Stderr = &so, &se
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("run allotctl: %v", err)
		}
		return out{so.String(), se.String(), code}
	}
	must := func(addr string, args ...string) string {
		t.Helper()
		r := run(addr, args...)
		if r.code != 0 {
			t.Fatalf("allotctl %s: exit %d, stderr %q", strings.Join(args, " "), r.code, r.stderr)
		}
		return r.stdout
	}
	type statusJSON struct {
		Members []struct {
			ID       string `json:"id"`
			Role     string `json:"role"`
			Suffrage string `json:"suffrage"`
		} `json:"members"`
		LeaderID     string `json:"leader_id"`
		RulesVersion uint64 `json:"rules_version"`
		Leases       uint64 `json:"leases"`
	}
	status := func(addr string) (statusJSON, bool) {
		var s statusJSON
		r := run(addr, "-o", "json", "status")
		return s, r.code == 0 && json.Unmarshal([]byte(r.stdout), &s) == nil
	}
	waitFor(t, 60*time.Second, "3 voters and a leader", func() bool {
		s, ok := status(n1.grpcAddr)
		if !ok || s.LeaderID == "" {
			return false
		}
		voters := 0
		for _, m := range s.Members {
			if m.Suffrage == "voter" {
				voters++
			}
		}
		return voters == 3
	})

	// Rules through a follower-or-leader: any node takes the put.
	if got := must(n2.grpcAddr, "rules", "apply", "-f", liveRules); got != "Applied domain(s) live: rules version 0 -> 1.\n" {
		t.Fatalf("rules apply printed %q", got)
	}
	for _, p := range procs {
		waitFor(t, 20*time.Second, p.id+" to have rules version 1", func() bool {
			s, ok := status(p.grpcAddr)
			return ok && s.RulesVersion == 1
		})
	}

	free1 := entries("tier=free", "api_key=k_1")
	acquire(t, n3.grpcAddr, "agent-a", 1, "live", free1, 6, 0.5, 0)
	acquire(t, n3.grpcAddr, "agent-b", 1, "live", free1, 6, 0.25, 4)
	// Reads are served by the node asked, and followers may lag a commit.
	for _, p := range procs {
		waitFor(t, 20*time.Second, p.id+" to see 2 leases", func() bool {
			s, ok := status(p.grpcAddr)
			return ok && s.Leases == 2
		})
	}

	st := must(n1.grpcAddr, "status")
	for _, want := range []string{"Leader:", "n1", "n2", "n3", "voter", "Rules version:  1", "Leases:         2"} {
		if !strings.Contains(st, want) {
			t.Errorf("status lacks %q:\n%s", want, st)
		}
	}

	var leases struct {
		Leases []struct {
			AgentID string `json:"agent_id"`
			Tokens  int64  `json:"tokens"`
			Key     string `json:"key"`
		} `json:"leases"`
	}
	if err := json.Unmarshal([]byte(must(n1.grpcAddr, "--show-keys", "-o", "json", "leases")), &leases); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, l := range leases.Leases {
		if l.Key != "live:tier=free,api_key=k_1" {
			t.Errorf("unexpected lease key %q", l.Key)
		}
		got[l.AgentID] = l.Tokens
	}
	if got["agent-a"] != 6 || got["agent-b"] != 4 || len(got) != 2 {
		t.Errorf("leases = %v, want agent-a 6, agent-b 4", got)
	}

	insp := must(n1.grpcAddr, "inspect", "--domain", "live", "-d", "tier=free", "-d", "api_key=k_1")
	for _, want := range []string{"Rule:    free_daily (tier=free/api_key)", "Global:  EMPTY (0 tokens), full in",
		"Leases (2, 10 tokens held):", "agent-a", "agent-b", "tier=free: exact value match"} {
		if !strings.Contains(insp, want) {
			t.Errorf("inspect lacks %q:\n%s", want, insp)
		}
	}
	if ag := must(n2.grpcAddr, "agents"); !strings.Contains(ag, "agent-a") || !strings.Contains(ag, "agent-b") {
		t.Errorf("agents:\n%s", ag)
	}
	if top := must(n3.grpcAddr, "--show-keys", "top", "--once"); !strings.Contains(top, "live:tier=free,api_key=k_1") {
		t.Errorf("top --once:\n%s", top)
	}
	chk := must(n2.grpcAddr, "check", "--domain", "live", "-d", "tier=free", "-d", "api_key=k_1")
	if !strings.HasPrefix(chk, "Overall: OVER_LIMIT") {
		t.Errorf("check of an exhausted key:\n%s", chk)
	}

	// Hand leadership to another node and see every node agree.
	s, _ := status(n1.grpcAddr)
	target := "n2"
	if s.LeaderID == "n2" {
		target = "n3"
	}
	if got := must(n1.grpcAddr, "cluster", "transfer-leader", target); got != "Leader is now "+target+".\n" {
		t.Errorf("transfer-leader printed %q", got)
	}
	for _, p := range procs {
		waitFor(t, 20*time.Second, p.id+" to report leader "+target, func() bool {
			s, ok := status(p.grpcAddr)
			return ok && s.LeaderID == target
		})
	}

	// Exit codes of the real binary.
	dead := testproc.FreeAddr(t)
	r := run(dead, "status")
	if want := fmt.Sprintf("allotctl: cannot reach allocator at %s: connection refused\n", dead); r.code != 1 || r.stderr != want {
		t.Errorf("unreachable: exit %d, stderr %q; want 1, %q", r.code, r.stderr, want)
	}
	if r := run(n1.grpcAddr, "status", "--no-such-flag"); r.code != 2 {
		t.Errorf("usage error: exit %d, want 2", r.code)
	}
	if r := run(n1.grpcAddr, "rules", "validate", "-f", badUnit); r.code != 1 || !strings.Contains(r.stderr, "bad-unit.yaml:5") {
		t.Errorf("invalid rules: exit %d, stderr %q", r.code, r.stderr)
	}
	if r := run(n1.grpcAddr, "completion", "bash"); r.code != 0 || !strings.Contains(r.stdout, "allotctl") {
		t.Errorf("completion bash: exit %d", r.code)
	}
}
