package main

import (
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// promiseRules are the two rules the Retry-After promise is checked on: a
// slow refill (one token every 2 s, burst 10) and a fast one (every 100 ms,
// burst 5).
const promiseRules = `
domain: promise
descriptors:
  - key: plan
    value: slow
    descriptors:
      - key: api_key
        rate_limit: {name: slow, unit: minute, requests_per_unit: 30, burst: 10}
  - key: plan
    value: fast
    descriptors:
      - key: api_key
        rate_limit: {name: fast, unit: second, requests_per_unit: 10, burst: 5}
`

// TestRetryAfterPromise: Retry-After is a promise. A client that sends a
// burst until it is denied, waits exactly Retry-After seconds and sends one
// request is admitted: 20 trials (each on its own key, run side by side)
// per rule, on the lease path (the allocator up, keys leased before their
// burst; the slow rule's spent budget is paced) and on the fallback path
// (the allocator killed). urllib3's Retry with respect_retry_after_header
// sees no second 429 for any request.
func TestRetryAfterPromise(t *testing.T) {
	gw, alloc := binaries(t)
	dir := t.TempDir()
	rulesFile := writeFile(t, dir, "rules.yaml", promiseRules)
	grpcAddr, raftAddr := testproc.FreeAddr(t), testproc.FreeAddr(t)
	ap := startProc(t, "allocator", alloc, "-node-id", "a", "-data-dir", filepath.Join(dir, "data"),
		"-grpc-addr", grpcAddr, "-raft-addr", raftAddr, "-http-addr", "", "-bootstrap",
		"-rules", rulesFile, "-log-level", "warn")
	cfg := writeFile(t, dir, "gateway.yaml", fmt.Sprintf(`
upstream: %s
domain: promise
descriptors:
  - [{key: plan, header: X-Plan}, api_key]
`, backend(t)))
	_, a := startGateway(t, gw, "-config", cfg, "-allocators", grpcAddr, "-listen", "127.0.0.1:0",
		"-rls-addr", "", "-http-addr", "127.0.0.1:0")
	eventually(t, 60*time.Second, "/readyz (the agent has the allocator's rules)", func() bool {
		r, err := tryGet("http://" + a.http + "/readyz")
		return err == nil && r.code == 200
	})
	base := "http://" + a.proxy + "/"
	plans := []string{"slow", "fast"}

	t.Run("lease", func(t *testing.T) {
		for _, plan := range plans {
			keys := promiseKeys("lease-"+plan, 20)
			// Lease the keys first, so that their bursts spend leases.
			sent := metric(t, a.http, "allot_agent_acquire_keys_total")
			for _, k := range keys {
				get(t, base, "X-Plan", plan, "X-API-Key", k)
			}
			eventually(t, 30*time.Second, "the keys' first Acquire", func() bool {
				return metric(t, a.http, "allot_agent_acquire_keys_total") >= sent+float64(len(keys))
			})
			promiseTrials(t, base, plan, keys)
		}
		if metric(t, a.http, `allot_agent_decisions_total{result="allowed",source="lease"}`) <= 0 {
			t.Error("no request was admitted from a lease")
		}
	})

	t.Run("urllib3", func(t *testing.T) {
		py := testproc.PythonModule(t, "urllib3")
		script := writeFile(t, dir, "retry.py", urllib3Retry)
		var wg sync.WaitGroup
		for _, tc := range []struct {
			plan string
			n    int
		}{{"slow", 13}, {"fast", 10}} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				out, err := exec.Command(py, script, base, tc.plan, "urllib3-"+tc.plan, strconv.Itoa(tc.n)).CombinedOutput()
				if err != nil {
					t.Errorf("urllib3 on %s: %v\n%s", tc.plan, err, out)
				}
			}()
		}
		wg.Wait()
	})

	if err := ap.signal(t, syscall.SIGKILL, 10*time.Second); err == nil {
		t.Fatal("allocator exited cleanly after SIGKILL?")
	}
	// Keep the dead allocator's port: another process on this machine that
	// binds it (another test's allocator) would answer the agent.
	holdPort(t, grpcAddr)
	eventually(t, 30*time.Second, "the fallback to engage (allot_agent_fallback 1)", func() bool {
		return metric(t, a.http, "allot_agent_fallback") == 1
	})
	t.Run("fallback", func(t *testing.T) {
		for _, plan := range plans {
			promiseTrials(t, base, plan, promiseKeys("fallback-"+plan, 20))
		}
	})
}

// holdPort listens on addr and closes every connection it accepts, until
// the test ends: the agent's calls fail at once, as to a dead host that
// answers with a reset.
func holdPort(t *testing.T, addr string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("holding the dead allocator's port %s: %v", addr, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
}

func promiseKeys(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return keys
}

// promiseTrials runs one trial per key, side by side: requests until a 429,
// a wait of exactly its Retry-After, and one request, which must be
// admitted. The 429's RateLimit t must equal its Retry-After.
func promiseTrials(t *testing.T, base, plan string, keys []string) {
	t.Helper()
	var wg sync.WaitGroup
	for _, key := range keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			hdr := []string{"X-Plan", plan, "X-API-Key", key}
			var denied reply
			for i := 0; ; i++ {
				r, err := tryGet(base, hdr...)
				if err != nil {
					t.Errorf("%s: %v", key, err)
					return
				}
				if r.code == 429 {
					denied = r
					break
				}
				if i == 40 {
					t.Errorf("%s: no 429 in 40 requests", key)
					return
				}
			}
			ra, err := strconv.Atoi(denied.h.Get("Retry-After"))
			if err != nil || ra < 1 {
				t.Errorf("%s: Retry-After %q", key, denied.h.Get("Retry-After"))
				return
			}
			if rl := denied.h.Get("RateLimit"); !strings.HasSuffix(rl, fmt.Sprintf(";t=%d", ra)) {
				t.Errorf("%s: 429 with RateLimit %q and Retry-After %d: t must equal Retry-After", key, rl, ra)
			}
			time.Sleep(time.Duration(ra) * time.Second) // the client's wait: exactly Retry-After
			r, err := tryGet(base, hdr...)
			if err != nil {
				t.Errorf("%s: %v", key, err)
				return
			}
			if r.code != 200 {
				t.Errorf("%s (%s): %d after waiting Retry-After %d s (RateLimit %q then %q)",
					key, plan, r.code, ra, denied.h.Get("RateLimit"), r.h.Get("RateLimit"))
			}
		}()
	}
	wg.Wait()
}

// urllib3Retry sends n requests through urllib3's Retry, which waits
// Retry-After on a 429 and tries again: each request must end in a 200
// after at most one 429.
const urllib3Retry = `
import sys, urllib3
from urllib3.util.retry import Retry

base, plan, key, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
retry = Retry(total=5, status_forcelist=[429], respect_retry_after_header=True,
              backoff_factor=0, allowed_methods=None, raise_on_status=False)
http = urllib3.PoolManager(retries=retry)
extra = 0
for i in range(n):
    r = http.request("GET", base, headers={"X-Plan": plan, "X-API-Key": key})
    tries = len(r.retries.history) if r.retries else 0
    print(i, r.status, "429s:", tries, r.headers.get("RateLimit"))
    if r.status != 200:
        sys.exit("request %d: status %d after %d retries" % (i, r.status, tries))
    extra += max(tries - 1, 0)
if extra:
    sys.exit("%d extra 429s" % extra)
`
