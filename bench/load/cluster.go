package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/internal/proccpu"
	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// rulesYAML is the workload's rule file: every user value has its own budget
// of limit/s with the given burst, on the given backend (split into shards
// sub-keys when shards > 1), and one "probe" key
// with a limit far above anything the probe spends (for the batch-timed
// leased checks).
func rulesYAML(limit, burst int, backend string, shards int) []byte {
	sh := ""
	if shards > 1 {
		sh = fmt.Sprintf("\n      shards: %d", shards)
	}
	return fmt.Appendf(nil, `domain: %s
descriptors:
  - key: user
    rate_limit:
      unit: second
      requests_per_unit: %d
      burst: %d
      backend: %s%s
  - key: probe
    rate_limit:
      unit: second
      requests_per_unit: 1000000000
      burst: 1000000000
      backend: %s
`, domain, limit, burst, backend, sh, backend)
}

// cluster is the allocator cluster under test: processes the harness
// started, or a running cluster it connected to.
type cluster struct {
	nodes []*node // nil when connected to a running cluster
	addrs []string
	conns []*grpc.ClientConn
	admin allotv1.AdminClient
	// token is the admin token of a started cluster (admin calls and
	// pprof); "" for a running cluster connected to.
	token string
}

// node is one allocator process.

// startCluster starts three cmd/allocator processes on loopback with data
// directories under dir (bolt with fsync on every commit, the defaults),
// the first with -bootstrap and the others with -join, and waits until all
// three are voters.
func startCluster(ctx context.Context, o options, dir string) (*cluster, error) {
	bin, err := allocatorBinary(o.allocatorBin, dir)
	if err != nil {
		return nil, err
	}
	ports, err := testproc.FreeLoopbackAddrs(9)
	if err != nil {
		return nil, err
	}
	c := &cluster{}
	tokenArgs, token, err := testproc.AdminToken(dir)
	if err != nil {
		return nil, err
	}
	c.token = token
	for i := range 3 {
		n := &node{ID: fmt.Sprintf("load%d", i), GRPC: ports[3*i], Raft: ports[3*i+1], HTTP: ports[3*i+2]}
		n.Proc = testproc.NewProc(fmt.Sprintf("allocator%d", i), dir, bin)
		n.Proc.Args = []string{"-node-id", n.ID, "-data-dir", filepath.Join(dir, n.ID),
			"-grpc-addr", n.GRPC, "-raft-addr", n.Raft, "-http-addr", n.HTTP, "-log-level", "warn"}
		n.Proc.Args = append(n.Proc.Args, tokenArgs...)
		if o.staticSlots > 0 {
			n.Proc.Args = append(n.Proc.Args, "-static-slots", strconv.Itoa(o.staticSlots))
		}
		if i == 0 {
			n.Proc.Args = append(n.Proc.Args, "-bootstrap")
		} else {
			n.Proc.Args = append(n.Proc.Args, "-join", c.nodes[0].GRPC)
		}
		c.nodes = append(c.nodes, n)
		c.addrs = append(c.addrs, n.GRPC)
	}
	for _, n := range c.nodes {
		if err := n.Proc.Run(); err != nil {
			c.stop()
			return nil, err
		}
	}
	for _, n := range c.nodes {
		if err := n.WaitReady(ctx, 60*time.Second); err != nil {
			c.stop()
			return nil, err
		}
	}
	if err := c.dial(); err != nil {
		c.stop()
		return nil, err
	}
	if err := c.waitVoters(ctx, 3, 60*time.Second); err != nil {
		c.stop()
		return nil, err
	}
	return c, nil
}

// connectCluster uses a running cluster.
func connectCluster(addrs []string) (*cluster, error) {
	c := &cluster{addrs: addrs}
	if err := c.dial(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *cluster) dial() error {
	for _, a := range c.addrs {
		opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
		if c.token != "" {
			opts = append(opts, grpc.WithPerRPCCredentials(testproc.Bearer(c.token)))
		}
		cc, err := grpc.NewClient(a, opts...)
		if err != nil {
			c.closeConns()
			return fmt.Errorf("dial %s: %w", a, err)
		}
		c.conns = append(c.conns, cc)
	}
	c.admin = allotv1.NewAdminClient(c.conns[0])
	return nil
}

func (c *cluster) closeConns() {
	for _, cc := range c.conns {
		_ = cc.Close()
	}
	c.conns = nil
}

// stop closes the connections and stops the processes the harness started:
// SIGTERM (graceful shutdown), then SIGKILL after 10 s.
func (c *cluster) stop() {
	c.closeConns()
	for _, n := range c.nodes {
		n.Proc.Terminate(10 * time.Second)
	}
}

// putRules replaces the harness's domain (only it) and returns the new
// rules version.
func (c *cluster) putRules(ctx context.Context, src []byte) (uint64, error) {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := c.admin.PutRules(cctx, &allotv1.PutRulesRequest{
		Files: []*allotv1.RuleFile{{Name: domain + ".yaml", Domain: domain, Yaml: src}},
	})
	if err != nil {
		return 0, fmt.Errorf("PutRules: %w", err)
	}
	return resp.GetVersion(), nil
}

// leaderStatus returns the leader's member record and its own
// ClusterStatus (so that keys and leases are the leader's applied state).
func (c *cluster) leaderStatus(ctx context.Context) (*allotv1.Member, *allotv1.ClusterStatusResponse, error) {
	var lastErr error
	for _, cc := range c.conns {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		st, err := allotv1.NewAdminClient(cc).ClusterStatus(cctx, &allotv1.ClusterStatusRequest{})
		cancel()
		if err != nil {
			lastErr = err
			continue
		}
		for _, m := range st.GetMembers() {
			if m.GetId() != st.GetLeaderId() {
				continue
			}
			if st.GetNodeId() == m.GetId() {
				return m, st, nil
			}
			lc, err := grpc.NewClient(m.GetGrpcAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				return nil, nil, err
			}
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			lst, err := allotv1.NewAdminClient(lc).ClusterStatus(cctx, &allotv1.ClusterStatusRequest{})
			cancel()
			_ = lc.Close()
			if err != nil {
				return nil, nil, fmt.Errorf("ClusterStatus on the leader %s: %w", m.GetId(), err)
			}
			return m, lst, nil
		}
		lastErr = errors.New("no leader known")
	}
	return nil, nil, fmt.Errorf("cluster status: %w", lastErr)
}

func (c *cluster) waitVoters(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := c.admin.ClusterStatus(cctx, &allotv1.ClusterStatusRequest{})
		cancel()
		if err == nil && st.GetLeaderId() != "" && len(st.GetMembers()) == n {
			ok := true
			for _, m := range st.GetMembers() {
				ok = ok && m.GetGrpcAddr() != "" && m.GetSuffrage() == "voter"
			}
			if ok {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the cluster did not reach %d voters within %v (last error: %v)", n, timeout, err)
		}
		if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
			return err
		}
	}
}

// memSample is the leader's memory and tracked state at one instant.
type memSample struct {
	HeapInuse uint64 `json:"heap_inuse_bytes"` // after a forced GC
	RSS       uint64 `json:"rss_bytes,omitempty"`
	Keys      uint64 `json:"keys"`
	Leases    uint64 `json:"leases"`
	Leader    string `json:"leader"`
}

// memory samples the leader: HeapInuse from /debug/pprof/heap?gc=1&debug=1
// (which runs a GC first and ends with the runtime's MemStats; the
// allocator's /metrics has no Go runtime collector), RSS from /proc when the
// harness started the process, and keys and leases from ClusterStatus.
func (c *cluster) memory(ctx context.Context) (memSample, error) {
	m, st, err := c.leaderStatus(ctx)
	if err != nil {
		return memSample{}, err
	}
	s := memSample{Keys: st.GetKeys(), Leases: st.GetLeases(), Leader: m.GetId()}
	if m.GetHttpAddr() == "" {
		return s, errors.New("the leader has no HTTP address")
	}
	s.HeapInuse, err = heapInuse(ctx, m.GetHttpAddr(), c.token)
	if err != nil {
		return s, err
	}
	for _, n := range c.nodes {
		if n.ID == m.GetId() && n.Proc.Pid() != 0 {
			s.RSS, _ = procRSS(n.Proc.Pid())
		}
	}
	return s, nil
}

// memoryWithoutLeases waits (up to timeout) until the leader holds no
// leases, then samples its memory.
func (c *cluster) memoryWithoutLeases(ctx context.Context, timeout time.Duration) (memSample, error) {
	deadline := time.Now().Add(timeout)
	for {
		_, st, err := c.leaderStatus(ctx)
		if err != nil {
			return memSample{}, err
		}
		if st.GetLeases() == 0 {
			return c.memory(ctx)
		}
		if time.Now().After(deadline) {
			return memSample{}, fmt.Errorf("%d leases still live %v after the agents released them", st.GetLeases(), timeout)
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			return memSample{}, err
		}
	}
}

func heapInuse(ctx context.Context, httpAddr, token string) (uint64, error) {
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := testproc.GetWithToken(cctx, "http://"+httpAddr+"/debug/pprof/heap?gc=1&debug=1", token)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("heap profile: HTTP %d", resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "# HeapInuse = "); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, errors.New("heap profile: no HeapInuse line")
}

// procRSS reads VmRSS of a process.
func procRSS(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb * 1024, err
		}
	}
	return 0, errors.New("no VmRSS")
}

// cpuTime returns the CPU time (user + system) pids have used, from
// /proc/<pid>/stat; pid 0 means this process.
func cpuTime(pids ...int) (time.Duration, error) {
	var total time.Duration
	for _, pid := range pids {
		d, err := proccpu.Of(pid)
		if err != nil {
			return 0, err
		}
		total += d
	}
	return total, nil
}

func (c *cluster) pids() []int {
	var out []int
	for _, n := range c.nodes {
		if pid := n.Proc.Pid(); pid != 0 {
			out = append(out, pid)
		}
	}
	return out
}

// allocatorBinary returns path when it is set and exists, or builds
// cmd/allocator into dir.
func allocatorBinary(path, dir string) (string, error) {
	if path != "" {
		if st, err := os.Stat(path); err == nil && !st.IsDir() {
			return path, nil
		}
	}
	if err := testproc.GoBuild(dir, false, "github.com/allot/allot/cmd/allocator"); err != nil {
		return "", err
	}
	return filepath.Join(dir, "allocator"), nil
}

// node is one allocator process.
type node = testproc.Node

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
