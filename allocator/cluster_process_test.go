package allocator

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// proc is one allocator process of the multi-process test.
type proc struct {
	id               string
	grpc, raft, http string
	dataDir, logPath string
	args             []string
	cmd              *exec.Cmd
	exited           chan struct{}
	exitErr          error
}

// TestClusterProcesses builds cmd/allocator, runs three processes on
// loopback, drives lease takers through them, SIGKILLs the leader, restarts
// it with the same flags and data dir, and checks invariants (a)–(d).
func TestClusterProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("multi-process cluster: skipped with -short")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "allocator")
	build := exec.Command("go", "build", "-o", bin, "github.com/allot/allot/cmd/allocator")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	rulesPath := filepath.Join(dir, "test.yaml")
	if err := os.WriteFile(rulesPath, []byte(testRules), 0o600); err != nil {
		t.Fatal(err)
	}

	ports := freePorts(t, 9)
	procs := make([]*proc, 3)
	for i := range procs {
		p := &proc{
			id:      fmt.Sprintf("p%d", i),
			grpc:    ports[3*i],
			raft:    ports[3*i+1],
			http:    ports[3*i+2],
			dataDir: filepath.Join(dir, fmt.Sprintf("data-p%d", i)),
			logPath: filepath.Join(dir, fmt.Sprintf("p%d.log", i)),
		}
		p.args = []string{
			"-node-id", p.id, "-data-dir", p.dataDir,
			"-grpc-addr", p.grpc, "-raft-addr", p.raft, "-http-addr", p.http,
			"-lease-ttl", "1s", "-max-lease-ttl", "2s", "-refresh-interval", "200ms",
			"-agent-ttl", "3s", "-expire-interval", "200ms", "-log-level", "info",
		}
		if i == 0 {
			p.args = append(p.args, "-bootstrap", "-rules", rulesPath)
		} else {
			p.args = append(p.args, "-join", procs[0].grpc)
		}
		procs[i] = p
	}
	t.Cleanup(func() {
		for _, p := range procs {
			p.kill()
		}
		if t.Failed() {
			for _, p := range procs {
				b, _ := os.ReadFile(p.logPath)
				t.Logf("---- %s log (tail) ----\n%s", p.id, tail(string(b), 60))
			}
		}
	})
	for _, p := range procs {
		p.start(t, bin)
	}
	for _, p := range procs {
		waitHTTPReady(t, p, 20*time.Second)
	}
	_, admin := dial(t, procs[0].grpc)
	waitFor(t, 20*time.Second, "3 members with addresses", func() bool {
		st, err := admin.ClusterStatus(context.Background(), &allotv1.ClusterStatusRequest{})
		if err != nil || len(st.GetMembers()) != 3 {
			return false
		}
		for _, m := range st.GetMembers() {
			if m.GetGrpcAddr() == "" {
				return false
			}
		}
		return true
	})

	// Lease takers through every node.
	addrs := []string{procs[0].grpc, procs[1].grpc, procs[2].grpc}
	keys := []string{"k1", "k2", "k3"}
	log := &grantLog{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	lasts := make([]lastCall, 4)
	for a := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lasts[a] = takerLast(ctx, t, fmt.Sprintf("agent-%d", a), addrs, keys, log)
		}()
	}
	count := func() int { log.mu.Lock(); defer log.mu.Unlock(); return len(log.grants) }
	waitFor(t, 20*time.Second, "grants before the kill", func() bool { return count() > 300 })

	st, err := admin.ClusterStatus(context.Background(), &allotv1.ClusterStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var leader *proc
	for _, p := range procs {
		if p.id == st.GetLeaderId() {
			leader = p
		}
	}
	if leader == nil {
		t.Fatalf("leader %q is not one of the processes", st.GetLeaderId())
	}
	log.markKill(leader.id)
	leader.kill()
	waitFor(t, 10*time.Second, "a grant from a new leader", func() bool { return log.recovery() >= 0 })
	rec := log.recovery()
	t.Logf("time to first grant after SIGKILL of leader %s: %v", leader.id, rec)
	if rec > 10*time.Second {
		t.Errorf("first grant %v after the kill, want < 10s", rec)
	}

	// Restart it with the same flags and data dir (-bootstrap/-join are
	// ignored now).
	leader.start(t, bin)
	waitHTTPReady(t, leader, 20*time.Second)
	after := count()
	waitFor(t, 20*time.Second, "grants after the restart", func() bool { return count() > after+300 })
	cancel()
	wg.Wait()

	// (a) and (d): no key got more than its budget in any window, across
	// the kill and the restart.
	checkBudget(t, log.grants, 50, 100)

	// (b) idempotent retry: a new call per agent through one node, sent
	// again to the restarted node, gets the recorded answer; an older id is
	// rejected.
	first, _ := dial(t, procs[(indexOf(procs, leader)+1)%3].grpc)
	ra, _ := dial(t, leader.grpc)
	for _, lc := range lasts {
		if lc.req == nil {
			continue
		}
		req := proto.Clone(lc.req).(*allotv1.AcquireRequest)
		req.RequestId += 1000 // past any call cut off by the stop
		resp, err := unthrottled(func() (*allotv1.AcquireResponse, error) { return first.Acquire(context.Background(), req) })
		if err != nil {
			t.Fatalf("call %s/%d: %v", req.GetAgentId(), req.GetRequestId(), err)
		}
		again, err := unthrottled(func() (*allotv1.AcquireResponse, error) { return ra.Acquire(context.Background(), req) })
		if err != nil {
			t.Fatalf("retry of %s/%d: %v", req.GetAgentId(), req.GetRequestId(), err)
		}
		if again.GetNowUnixMs() != resp.GetNowUnixMs() || !grantsEqual(again, resp) {
			t.Errorf("retry of %s/%d = %v, want the recorded %v", req.GetAgentId(), req.GetRequestId(), again, resp)
		}
		req.RequestId--
		if _, err := unthrottled(func() (*allotv1.AcquireResponse, error) { return ra.Acquire(context.Background(), req) }); status.Code(err) != codes.FailedPrecondition {
			t.Errorf("older id for %s: %v, want FailedPrecondition", req.GetAgentId(), err)
		}
	}

	// (c) leases expire once renewals stop (TTL ≤ 2 s, expiry every 200 ms).
	waitFor(t, 15*time.Second, "every lease to expire", func() bool {
		for _, p := range procs {
			_, ad := dial(t, p.grpc)
			resp, err := ad.ListLeases(context.Background(), &allotv1.ListLeasesRequest{})
			if err != nil || len(resp.GetLeases()) != 0 {
				return false
			}
		}
		return true
	})

	resp, err := http.Get("http://" + procs[0].http + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "allot_allocator_leases_expired_total ") ||
		strings.Contains(string(body), "allot_allocator_leases_expired_total 0\n") {
		t.Errorf("/metrics does not count the expired leases")
	}

	// Graceful stop: SIGTERM, exit status 0.
	for _, p := range procs {
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range procs {
		select {
		case <-p.exited:
			if p.exitErr != nil {
				t.Errorf("%s exited with %v after SIGTERM", p.id, p.exitErr)
			}
		case <-time.After(20 * time.Second):
			t.Errorf("%s did not exit after SIGTERM", p.id)
		}
	}
}

func indexOf(ps []*proc, p *proc) int {
	for i, q := range ps {
		if q == p {
			return i
		}
	}
	return -1
}

type lastCall struct {
	req  *allotv1.AcquireRequest
	resp *allotv1.AcquireResponse
}

// takerLast is a lease taker: it Acquires the keys in a loop, retrying a
// failed call with the same request id on the next node, records every
// grant, and returns its last successful call.
func takerLast(ctx context.Context, t *testing.T, agent string, addrs []string, keys []string, log *grantLog) lastCall {
	var last lastCall
	clients := make([]allotv1.AllocatorClient, len(addrs))
	for i, a := range addrs {
		clients[i], _ = dial(t, a)
	}
	var reqID uint64
	node := 0
	for ctx.Err() == nil {
		reqID++
		req := &allotv1.AcquireRequest{AgentId: agent, RequestId: reqID}
		for _, k := range keys {
			req.Keys = append(req.Keys, key("user", k, 10))
		}
		for ctx.Err() == nil {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			resp, err := clients[node].Acquire(cctx, req)
			cancel()
			if err == nil {
				log.add(agent, reqID, resp)
				last = lastCall{req: req, resp: resp}
				break
			}
			node = (node + 1) % len(clients)
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	return last
}

// unthrottled calls f again while it is refused with ResourceExhausted,
// for up to 5 s. The guard refuses an agent over its call rate (200/s per
// node, burst 400) before doing any work, and the closed-loop takers that
// ran just before may have spent an agent's burst on that node; a client
// backs off and retries such a refusal. Regression: TestClusterProcesses
// failed with "retry of agent-0/3686: ResourceExhausted ... agent over its
// call rate" once commits got faster (two batches in flight).
func unthrottled(f func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := f()
		if status.Code(err) != codes.ResourceExhausted || time.Now().After(deadline) {
			return resp, err
		}
		time.Sleep(10 * time.Millisecond) // past the refusal's retry-after (ms at 200/s)
	}
}

func grantsEqual(a, b *allotv1.AcquireResponse) bool {
	if len(a.GetGrants()) != len(b.GetGrants()) {
		return false
	}
	for i := range a.GetGrants() {
		x, y := a.GetGrants()[i], b.GetGrants()[i]
		if x.GetGranted() != y.GetGranted() || x.GetKey() != y.GetKey() || x.GetRemaining() != y.GetRemaining() {
			return false
		}
	}
	return true
}

func (p *proc) start(t *testing.T, bin string) {
	t.Helper()
	f, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(bin, p.args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	if err := p.cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", p.id, err)
	}
	p.exited = make(chan struct{})
	cmd, exited := p.cmd, p.exited
	go func() { // ends when the process exits; kill/cleanup make sure it does
		err := cmd.Wait()
		f.Close()
		p.exitErr = err
		close(exited)
	}()
}

// kill sends SIGKILL and waits for the process to be reaped.
func (p *proc) kill() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}

func waitHTTPReady(t *testing.T, p *proc, timeout time.Duration) {
	t.Helper()
	client := &http.Client{Timeout: time.Second}
	waitFor(t, timeout, p.id+" /readyz", func() bool {
		resp, err := client.Get("http://" + p.http + "/readyz")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var rd readiness
		_ = json.NewDecoder(resp.Body).Decode(&rd)
		return resp.StatusCode == http.StatusOK && rd.Ready
	})
}

// freePorts returns n distinct loopback addresses with ports free now.
func freePorts(t *testing.T, n int) []string {
	t.Helper()
	var lns []net.Listener
	var out []string
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		out = append(out, ln.Addr().String())
	}
	for _, ln := range lns {
		ln.Close()
	}
	return out
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}
