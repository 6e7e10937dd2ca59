package deploy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// localCluster drives deploy/local/cluster.sh on free loopback ports.
type localCluster struct {
	t       *testing.T
	bin     string // allocator, gateway, allotctl
	dir     string // ALLOT_LOCAL_DIR
	base    int    // ALLOT_ALLOCATOR_PORT
	env     []string
	alloc   [3]struct{ grpc, raft, http string } // http without the scheme
	proxy   string                               // http://host:port
	rls     string
	gwHTTP  string // http://host:port
	allotct string
}

// portBlock finds a base port with every port the local cluster uses free:
// base+{0,1,2, 10,11,12, 20,21,22} for the allocators, base+{40,41,42} for
// alloc-3 at a new address, base+50 (proxy), +51 (RLS), +52 (gateway
// HTTP), +53 (upstream), +54 (gateway check endpoints). Ports are picked below Linux's ephemeral range so
// outgoing connections do not take them.
func portBlock(t *testing.T) int {
	t.Helper()
	offsets := []int{0, 1, 2, 10, 11, 12, 20, 21, 22, 40, 41, 42, 50, 51, 52, 53, 54}
	for range 50 {
		base := 10000 + rand.IntN(220)*100
		free := true
		for _, o := range offsets {
			ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+o))
			if err != nil {
				free = false
				break
			}
			ln.Close()
		}
		if free {
			return base
		}
	}
	t.Fatal("no free block of ports found")
	return 0
}

func newLocalCluster(t *testing.T) *localCluster {
	t.Helper()
	bin := binaries(t)
	base := portBlock(t)
	c := &localCluster{t: t, bin: bin, dir: filepath.Join(t.TempDir(), "allot-local"), base: base, allotct: filepath.Join(bin, "allotctl")}
	for i := range c.alloc {
		c.alloc[i].grpc = fmt.Sprintf("127.0.0.1:%d", base+10*i)
		c.alloc[i].raft = fmt.Sprintf("127.0.0.1:%d", base+10*i+1)
		c.alloc[i].http = fmt.Sprintf("127.0.0.1:%d", base+10*i+2)
	}
	c.proxy = fmt.Sprintf("http://127.0.0.1:%d", base+50)
	c.rls = fmt.Sprintf("127.0.0.1:%d", base+51)
	c.gwHTTP = fmt.Sprintf("http://127.0.0.1:%d", base+52)
	c.env = append(os.Environ(),
		"ALLOT_BIN="+bin,
		"ALLOT_LOCAL_DIR="+c.dir,
		"ALLOT_ALLOCATOR_PORT="+strconv.Itoa(base),
		"ALLOT_GATEWAY_PORT="+strconv.Itoa(base+50),
		"ALLOT_GATEWAY_HTTP_PORT="+strconv.Itoa(base+52),
		"ALLOT_UPSTREAM_PORT="+strconv.Itoa(base+53),
		"ALLOT_GATEWAY_CHECK_PORT="+strconv.Itoa(base+54),
		"ALLOT_LOG_FORMAT=json",
		"ALLOT_READY_TIMEOUT=90",
	)
	t.Cleanup(func() {
		// Whatever happened, nothing may outlive the test.
		out, err := c.script("stop")
		if err != nil {
			t.Errorf("cluster.sh stop: %v\n%s", err, out)
		}
		if t.Failed() {
			c.dumpLogs()
		}
	})
	return c
}

// script runs deploy/local/cluster.sh with args.
func (c *localCluster) script(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", append([]string{"local/cluster.sh"}, args...)...)
	cmd.Env = c.env
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (c *localCluster) mustScript(args ...string) string {
	c.t.Helper()
	out, err := c.script(args...)
	if err != nil {
		c.t.Fatalf("cluster.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	c.t.Logf("cluster.sh %s:\n%s", strings.Join(args, " "), out)
	return out
}

// allotctl runs bin/allotctl against alloc-1 (followers forward writes).
func (c *localCluster) allotctl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.allotct, append([]string{"--addr", c.alloc[0].grpc}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (c *localCluster) mustAllotctl(args ...string) string {
	c.t.Helper()
	out, err := c.allotctl(args...)
	if err != nil {
		c.t.Fatalf("allotctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

func (c *localCluster) dumpLogs() {
	logs, _ := filepath.Glob(filepath.Join(c.dir, "logs", "*.log"))
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		if len(lines) > 60 {
			lines = lines[len(lines)-60:]
		}
		c.t.Logf("---- %s (last %d lines)\n%s", l, len(lines), strings.Join(lines, "\n"))
	}
}

// pids returns the pids in the run directory's pid files.
func (c *localCluster) pids() map[string]int {
	out := map[string]int{}
	files, _ := filepath.Glob(filepath.Join(c.dir, "run", "*.pid"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			out[strings.TrimSuffix(filepath.Base(f), ".pid")] = pid
		}
	}
	return out
}

var httpClient = &http.Client{Timeout: 5 * time.Second}

// get sends GET url with headers and returns the status and header.
func get(t *testing.T, url string, headers map[string]string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(body)
}

// scrape returns the samples of a Prometheus text exposition as
// "name{labels}" → value, labels as exposed (sorted by the client library).
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	code, _, body := get(t, url, nil)
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d", url, code)
	}
	samples := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		samples[line[:i]] = v
	}
	return samples
}

// TestLocalCluster is docs/operations.md's walk-through, exercised: start
// the local cluster with cluster.sh, apply rules with allotctl, send traffic
// through the gateway until a 429 (over HTTP and over Envoy's RLS API with
// the descriptors deploy/envoy/envoy.yaml builds), read both kinds of
// /metrics, run allotctl status, leases and agents, replace a node
// (cluster remove, wipe, rejoin), back up and restore the data directories,
// and stop everything.
func TestLocalCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a 3-node cluster and a gateway: skipped with -short")
	}
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("needs bash")
	}
	_, curlErr := exec.LookPath("curl")
	_, wgetErr := exec.LookPath("wget")
	if curlErr != nil && wgetErr != nil {
		t.Skip("cluster.sh needs curl or wget")
	}
	c := newLocalCluster(t)

	// 1. Start: three allocators, the upstream, the gateway, all ready.
	c.mustScript("start")
	out := c.mustScript("status")
	for _, name := range []string{"alloc-1", "alloc-2", "alloc-3", "upstream", "gateway"} {
		if !strings.Contains(out, name) || strings.Contains(out, "NOT READY") || strings.Contains(out, "stopped") {
			t.Fatalf("cluster.sh status: %s not running and ready:\n%s", name, out)
		}
	}

	// 2. Rules: validate locally, apply through the cluster; the gateway's
	// agent receives the new version over WatchRules.
	out = c.mustAllotctl("rules", "validate", "-f", "local/rules")
	if !strings.Contains(out, "OK") {
		t.Fatalf("rules validate:\n%s", out)
	}
	out = c.mustAllotctl("rules", "apply", "-f", "local/rules")
	if !strings.Contains(out, "rules version 1 -> 2") {
		t.Fatalf("rules apply: want version 1 -> 2:\n%s", out)
	}
	eventually(t, 15*time.Second, "gateway agent has rules version 2", func() (bool, string) {
		v := scrape(t, c.gwHTTP+"/metrics")["allot_agent_rules_version"]
		return v == 2, fmt.Sprintf("allot_agent_rules_version = %v", v)
	})

	// 3. Traffic: a free key on /v1/search gets its burst of 10, then 429.
	start := time.Now()
	allowed, denied := 0, 0
	var deniedHeader http.Header
	for i := 0; i < 100 && denied == 0; i++ {
		code, h, body := get(t, c.proxy+"/v1/search", map[string]string{"X-API-Key": "k_free_demo"})
		switch code {
		case http.StatusOK:
			allowed++
		case http.StatusTooManyRequests:
			denied++
			deniedHeader = h
		default:
			t.Fatalf("request %d: status %d: %s", i, code, body)
		}
	}
	elapsed := time.Since(start)
	if denied == 0 {
		t.Fatalf("no 429 after %d allowed requests", allowed)
	}
	// The rule is 30/minute with a burst of 10: at most 10 plus what
	// refilled while the loop ran (0.5/s) can be admitted.
	if limit := 10 + int(math.Ceil(elapsed.Seconds()*0.5)); allowed < 1 || allowed > limit {
		t.Errorf("free_search admitted %d requests in %v before the first 429, want 1..%d", allowed, elapsed, limit)
	}
	if deniedHeader.Get("Retry-After") == "" || !strings.Contains(deniedHeader.Get("RateLimit-Policy"), `"free_search";q=30;w=60`) {
		t.Errorf("429 headers: Retry-After %q, RateLimit-Policy %q", deniedHeader.Get("Retry-After"), deniedHeader.Get("RateLimit-Policy"))
	}
	t.Logf("free key: %d allowed, then 429 after %v; Retry-After %s", allowed, elapsed, deniedHeader.Get("Retry-After"))

	// A premium key takes a lease.
	for range 5 {
		if code, _, body := get(t, c.proxy+"/v1/search", map[string]string{"Authorization": "Bearer k_premium_demo"}); code != http.StatusOK {
			t.Fatalf("premium request: %d %s", code, body)
		}
	}

	// 4. The same limits over Envoy's RLS API, with the descriptors the Envoy
	// example builds for a fresh free key on /v1/search.
	b := loadEnvoy(t)
	hcm, rl := envoyFilters(t, b)
	descs := envoyDescriptors(t, hcm, "/v1/search", map[string]string{"x-api-key": "k_free_envoy", "x-allot-tier": "free"})
	cc, err := grpc.NewClient(c.rls, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	rlsClient := rlsv3.NewRateLimitServiceClient(cc)
	req := &rlsv3.RateLimitRequest{Domain: rl.GetDomain()}
	for _, d := range descs {
		rd := &ratelimitv3.RateLimitDescriptor{}
		for _, e := range d {
			rd.Entries = append(rd.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: e.Key, Value: e.Value})
		}
		req.Descriptors = append(req.Descriptors, rd)
	}
	rlsOK, rlsOver := 0, 0
	for i := 0; i < 100 && rlsOver == 0; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := rlsClient.ShouldRateLimit(ctx, req)
		cancel()
		if err != nil {
			t.Fatalf("ShouldRateLimit: %v", err)
		}
		switch resp.GetOverallCode() {
		case rlsv3.RateLimitResponse_OK:
			rlsOK++
		case rlsv3.RateLimitResponse_OVER_LIMIT:
			rlsOver++
			var names []string
			for _, st := range resp.GetStatuses() {
				names = append(names, st.GetCurrentLimit().GetName())
			}
			if !strings.Contains(strings.Join(names, ","), "free_search") {
				t.Errorf("OVER_LIMIT statuses name %v, want free_search", names)
			}
		default:
			t.Fatalf("ShouldRateLimit: overall code %v", resp.GetOverallCode())
		}
	}
	if rlsOver == 0 || rlsOK == 0 {
		t.Fatalf("RLS: %d OK then %d OVER_LIMIT; want some of each", rlsOK, rlsOver)
	}
	t.Logf("RLS with the Envoy example's descriptors %v: %d OK, then OVER_LIMIT", descs, rlsOK)

	// 5. Metrics: the gateway counted the 429s; every allocator applied the
	// rules and exactly one leads.
	gm := scrape(t, c.gwHTTP+"/metrics")
	if gm[`allot_gateway_requests_total{result="denied"}`] < 1 || gm[`allot_gateway_requests_total{result="allowed"}`] < 1 {
		t.Errorf("gateway metrics: allowed %v, denied %v", gm[`allot_gateway_requests_total{result="allowed"}`], gm[`allot_gateway_requests_total{result="denied"}`])
	}
	if gm[`allot_rls_requests_total{code="over_limit"}`] < 1 {
		t.Errorf("gateway metrics: allot_rls_requests_total{code=over_limit} = %v", gm[`allot_rls_requests_total{code="over_limit"}`])
	}
	eventually(t, 15*time.Second, "allocator metrics", func() (bool, string) {
		leaders, granted := 0.0, 0.0
		var why []string
		for i, a := range c.alloc {
			m := scrape(t, "http://"+a.http+"/metrics")
			leaders += m["allot_allocator_is_leader"]
			granted = max(granted, m["allot_allocator_tokens_granted_total"])
			if m["allot_allocator_rules_version"] != 2 {
				why = append(why, fmt.Sprintf("alloc-%d rules_version %v", i+1, m["allot_allocator_rules_version"]))
			}
			if _, ok := m["allot_allocator_raft_applied_index"]; !ok {
				why = append(why, fmt.Sprintf("alloc-%d has no allot_allocator_raft_applied_index", i+1))
			}
		}
		if leaders != 1 {
			why = append(why, fmt.Sprintf("%v leaders", leaders))
		}
		if granted == 0 {
			why = append(why, "no tokens granted")
		}
		return len(why) == 0, strings.Join(why, "; ")
	})

	// 6. allotctl: status, leases, agents.
	var st struct {
		Members []struct {
			ID   string `json:"id"`
			Role string `json:"role"`
		} `json:"members"`
		LeaderID     string `json:"leader_id"`
		RulesVersion uint64 `json:"rules_version"`
	}
	if err := json.Unmarshal([]byte(c.mustAllotctl("status", "-o", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Members) != 3 || st.LeaderID == "" || st.RulesVersion != 2 {
		t.Fatalf("allotctl status: %+v", st)
	}
	t.Logf("allotctl status:\n%s", c.mustAllotctl("status"))
	const premiumKey = "public-api:tier=premium,api_key=k_premium_demo"
	eventually(t, 15*time.Second, "allotctl leases shows the premium key's lease", func() (bool, string) {
		out, err := c.allotctl("--show-keys", "leases", "--key", premiumKey)
		return err == nil && strings.Contains(out, premiumKey), out
	})
	t.Logf("allotctl leases:\n%s", c.mustAllotctl("leases"))
	if out := c.mustAllotctl("agents"); !strings.Contains(out, "AGENT") {
		t.Errorf("allotctl agents:\n%s", out)
	}

	// 7. Replace a node: remove it from the configuration, stop it, wipe its
	// data, start it again (it rejoins with -join).
	c.mustAllotctl("cluster", "remove", "alloc-3")
	c.mustScript("stop", "alloc-3")
	if err := os.RemoveAll(filepath.Join(c.dir, "data", "alloc-3")); err != nil {
		t.Fatal(err)
	}
	c.mustScript("start")
	eventually(t, 30*time.Second, "alloc-3 is a voter again", func() (bool, string) {
		out, err := c.allotctl("status")
		return err == nil && strings.Contains(out, "alloc-3") && strings.Count(out, "voter") == 3, out
	})

	// 8. A member comes back at a new address with its data (a node moved
	// without -advertise-*-addr; deploy/kubernetes advertises stable DNS
	// names instead): re-registering under the same id updates the Raft
	// configuration. Then back to its own address, under cluster.sh.
	c.mustScript("stop", "alloc-3")
	p := func(off int) string { return fmt.Sprintf("127.0.0.1:%d", c.base+off) }
	stopMoved := c.startAllocator("alloc-3", p(40), p(41), p(42))
	c.rejoin("alloc-3", p(40), p(41), p(42))
	stopMoved()
	// cluster.sh start waits for alloc-3's readiness, which needs the
	// re-registration: run both at once.
	type result struct {
		out string
		err error
	}
	started := make(chan result, 1)
	go func() {
		out, err := c.script("start")
		started <- result{out, err}
	}()
	c.rejoin("alloc-3", c.alloc[2].grpc, c.alloc[2].raft, c.alloc[2].http)
	if r := <-started; r.err != nil {
		t.Fatalf("cluster.sh start: %v\n%s", r.err, r.out)
	}

	// 9. Backup and restore: stop, copy the data directories, lose them,
	// restore, start; the replicated rules survive.
	c.mustScript("stop")
	for name, pid := range c.pids() {
		t.Errorf("after stop: pid file for %s (%d) remains", name, pid)
	}
	data := filepath.Join(c.dir, "data")
	backup := filepath.Join(t.TempDir(), "backup")
	if out, err := exec.Command("cp", "-a", data, backup).CombinedOutput(); err != nil {
		t.Fatalf("backup: %v %s", err, out)
	}
	if err := os.RemoveAll(data); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-a", backup, data).CombinedOutput(); err != nil {
		t.Fatalf("restore: %v %s", err, out)
	}
	c.mustScript("start")
	if err := json.Unmarshal([]byte(c.mustAllotctl("status", "-o", "json")), &st); err != nil {
		t.Fatal(err)
	}
	if st.RulesVersion != 2 || len(st.Members) != 3 {
		t.Fatalf("after restore: %+v", st)
	}
	if out := c.mustAllotctl("rules", "get", "--domain", "public-api"); !strings.Contains(out, "free_search") {
		t.Fatalf("after restore, rules get:\n%s", out)
	}

	// 10. Stop: every process exits.
	before := c.pids()
	c.mustScript("stop")
	for name, pid := range before {
		if processRunning(pid) {
			t.Errorf("%s (pid %d) still running after stop", name, pid)
		}
	}
	if out, err := c.script("status"); err == nil {
		t.Errorf("cluster.sh status exits 0 with everything stopped:\n%s", out)
	}
}

// startAllocator runs the allocator binary for node id (its data dir under
// the local cluster's) at the given addresses, outside cluster.sh; stop
// sends SIGTERM and waits (also run at cleanup; safe twice).
func (c *localCluster) startAllocator(id, grpcAddr, raftAddr, httpAddr string) (stop func()) {
	t := c.t
	t.Helper()
	cmd := exec.Command(filepath.Join(c.bin, "allocator"), "-node-id", id,
		"-data-dir", filepath.Join(c.dir, "data", id), "-grpc-addr", grpcAddr,
		"-raft-addr", raftAddr, "-http-addr", httpAddr, "-log-format", "json")
	logf, err := os.Create(filepath.Join(c.dir, "logs", id+"-at-"+strings.ReplaceAll(grpcAddr, ":", "_")+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(exited)
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(30 * time.Second):
				t.Errorf("%s at %s did not stop on SIGTERM; killing it", id, grpcAddr)
				_ = cmd.Process.Kill()
				<-exited
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// rejoin registers node id at the given addresses with allotctl cluster
// join (as allocator.sh does in Kubernetes) and waits until it is ready
// and the cluster lists it, a voter, at that Raft address.
func (c *localCluster) rejoin(id, grpcAddr, raftAddr, httpAddr string) {
	t := c.t
	t.Helper()
	eventually(t, 30*time.Second, id+" registered at "+raftAddr, func() (bool, string) {
		out, err := c.allotctl("cluster", "join", grpcAddr, "--id", id, "--raft-addr", raftAddr, "--http-addr", httpAddr)
		return err == nil, out
	})
	eventually(t, 30*time.Second, id+" ready at "+httpAddr, func() (bool, string) {
		resp, err := httpClient.Get("http://" + httpAddr + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false, string(body)
		}
		out, err := c.allotctl("status")
		return err == nil && strings.Contains(out, raftAddr) && strings.Count(out, "voter") == 3, out
	})
	t.Logf("%s is a voter at %s", id, raftAddr)
}

// processRunning reports whether pid is alive and not a zombie.
func processRunning(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) state ...
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z'
}
