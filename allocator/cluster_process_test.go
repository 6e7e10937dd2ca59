package allocator

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestClusterProcesses builds cmd/allocator, runs three processes on
// loopback, drives lease takers through them, SIGKILLs the leader, restarts
// it with the same flags and data dir, and checks invariants (a)–(d).
func TestClusterProcesses(t *testing.T) {
	c := startProcessCluster(t)
	procs := c.Nodes
	_, admin := dial(t, procs[0].GRPC)
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
	addrs := []string{procs[0].GRPC, procs[1].GRPC, procs[2].GRPC}
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
	var leader *testproc.Node
	for _, p := range procs {
		if p.ID == st.GetLeaderId() {
			leader = p
		}
	}
	if leader == nil {
		t.Fatalf("leader %q is not one of the processes", st.GetLeaderId())
	}
	log.markKill(leader.ID)
	leader.Proc.Kill()
	waitFor(t, 10*time.Second, "a grant from a new leader", func() bool { return log.recovery() >= 0 })
	rec := log.recovery()
	t.Logf("time to first grant after SIGKILL of leader %s: %v", leader.ID, rec)
	if rec > 10*time.Second {
		t.Errorf("first grant %v after the kill, want < 10s", rec)
	}

	// Restart it with the same flags and data dir (-bootstrap/-join are
	// ignored now).
	leader.Proc.Start(t)
	testproc.Eventually(t, 20*time.Second, leader.ID+" /readyz", leader.Ready)
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
	first, _ := dial(t, procs[(indexOf(procs, leader)+1)%3].GRPC)
	ra, _ := dial(t, leader.GRPC)
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
			_, ad := dial(t, p.GRPC)
			resp, err := ad.ListLeases(context.Background(), &allotv1.ListLeasesRequest{})
			if err != nil || len(resp.GetLeases()) != 0 {
				return false
			}
		}
		return true
	})

	resp, err := http.Get("http://" + procs[0].HTTP + "/metrics")
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
	var stopped sync.WaitGroup
	for _, p := range procs {
		stopped.Go(func() {
			if err := p.Proc.Signal(syscall.SIGTERM, 20*time.Second); err != nil {
				t.Errorf("%s after SIGTERM: %v", p.ID, err)
			}
		})
	}
	stopped.Wait()
}

func indexOf(ps []*testproc.Node, p *testproc.Node) int {
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
	return takerLastIn(ctx, t, agent, 0, addrs, keys, log)
}

// takerLastIn is takerLast with its calls addressed to group.
func takerLastIn(ctx context.Context, t *testing.T, agent string, group uint32, addrs []string, keys []string, log *grantLog) lastCall {
	var last lastCall
	clients := make([]allotv1.AllocatorClient, len(addrs))
	for i, a := range addrs {
		clients[i], _ = dial(t, a)
	}
	var reqID uint64
	node := 0
	for ctx.Err() == nil {
		reqID++
		req := &allotv1.AcquireRequest{AgentId: agent, RequestId: reqID, Group: group}
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

// startProcessCluster builds cmd/allocator and starts a 3-node cluster of
// real processes on loopback with short lease, agent and expiry timings;
// bootArgs are added to the bootstrapping node's flags (e.g. -groups N).
// It skips under -short.
func startProcessCluster(t *testing.T, bootArgs ...string) *testproc.Cluster {
	t.Helper()
	return startProcessClusterOf(t, 3, bootArgs...)
}

// startProcessClusterOf is startProcessCluster with size nodes.
func startProcessClusterOf(t *testing.T, size int, bootArgs ...string) *testproc.Cluster {
	t.Helper()
	return startProcessClusterArgs(t, size, []string{"-lease-ttl", "1s", "-max-lease-ttl", "2s", "-refresh-interval", "200ms",
		"-agent-ttl", "3s", "-expire-interval", "200ms"}, bootArgs...)
}

// startProcessClusterArgs starts size allocator processes, every node
// with args (the lease policy flags must be the same on all), node 0 also
// with bootArgs.
func startProcessClusterArgs(t *testing.T, size int, args []string, bootArgs ...string) *testproc.Cluster {
	t.Helper()
	return startProcessClusterConfig(t, testproc.ClusterConfig{Size: size, Args: args, BootstrapArgs: bootArgs})
}

// startProcessClusterConfig starts cfg with the allocator binary built
// for it and the test rules (cfg's Bin, Dir and Rules are set here).
func startProcessClusterConfig(t *testing.T, cfg testproc.ClusterConfig) *testproc.Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("multi-process cluster: skipped with -short")
	}
	dir := t.TempDir()
	if err := testproc.GoBuild(dir, false, "github.com/allot/allot/cmd/allocator"); err != nil {
		t.Fatal(err)
	}
	rulesPath := testproc.WriteFile(t, dir, "test.yaml", testRules)
	cfg.Bin, cfg.Dir, cfg.Rules = filepath.Join(dir, "allocator"), dir, []string{rulesPath}
	return testproc.StartCluster(t, cfg)
}
