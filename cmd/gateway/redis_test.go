package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// redisProc starts a redis-server on addr (no persistence) owned by t. It
// skips the test when the binary is missing, or fails it when
// ALLOT_REQUIRE_REDIS=1 (CI).
func redisProc(t *testing.T, addr string) *proc {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		msg := "redis-server not found: install the Debian package redis-server (apt-get install redis-server)"
		if os.Getenv("ALLOT_REQUIRE_REDIS") == "1" {
			t.Fatal(msg + " (ALLOT_REQUIRE_REDIS=1)")
		}
		t.Skip(msg)
	}
	host, port, _ := net.SplitHostPort(addr)
	p := startProc(t, "redis-server", "redis-server", "--bind", host, "--port", port,
		"--save", "", "--appendonly", "no", "--dir", t.TempDir())
	eventually(t, 10*time.Second, "redis-server to accept connections", func() bool {
		c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
	return p
}

// TestRedisGatewayKilledMidTraffic: rules with backend redis go to Redis
// through the real gateway binary; kill -9 Redis under traffic: no 5xx, the
// breaker opens and the rule's failure_mode (open) lets the local bucket
// decide; restart Redis on the same port: decisions go back to Redis by
// themselves. The Redis timeout is generous (1s): the test is about a
// killed Redis, whose connections fail at once, not about a slow one.
func TestRedisGatewayKilledMidTraffic(t *testing.T) {
	gw, _ := binaries(t)
	raddr := testproc.FreeClusterAddr(t) // restarted on it: see ClusterHost
	rp := redisProc(t, raddr)
	dir := t.TempDir()
	rulesFile := writeFile(t, dir, "rules.yaml", `
domain: shared
descriptors:
  - key: api_key
    rate_limit: {name: shared_counter, unit: hour, requests_per_unit: 5, backend: redis}
`)
	cfg := writeFile(t, dir, "gateway.yaml", fmt.Sprintf(`
upstream: %s
rules: [%s]
redis: {addrs: [%s], timeout: 1s, breaker: {failures: 3, cooldown: 200ms}}
domain: shared
api_key: {headers: [X-API-Key]}
descriptors:
  - [api_key]
`, backend(t), rulesFile, raddr))
	_, a := startGateway(t, gw, "-config", cfg, "-listen", "127.0.0.1:0", "-rls-addr", "", "-http-addr", "127.0.0.1:0")
	url := "http://" + a.proxy + "/x"
	redisDecisions := func() float64 {
		return metric(t, a.http, `allot_agent_decisions_total{result="allowed",source="redis"}`) +
			metric(t, a.http, `allot_agent_decisions_total{result="denied",source="redis"}`)
	}

	// Through Redis: 5 allowed, then 429.
	for i := range 5 {
		if r := get(t, url, "X-API-Key", "k1"); r.code != 200 {
			t.Fatalf("request %d: %d %s, want 200", i, r.code, r.body)
		}
	}
	if r := get(t, url, "X-API-Key", "k1"); r.code != 429 {
		t.Fatalf("6th request: %d, want 429 from the shared counter", r.code)
	}
	if n := redisDecisions(); n < 6 {
		t.Fatalf("redis decisions %v, want ≥ 6", n)
	}

	// Kill Redis under traffic: only 200s and 429s.
	rp.kill()
	codes := map[int]int{}
	for i := range 200 {
		r, err := tryGet(url, "X-API-Key", fmt.Sprint("k", i%20))
		if err != nil {
			t.Fatalf("request %d with Redis down: %v", i, err)
		}
		codes[r.code]++
	}
	if codes[200] == 0 || codes[200]+codes[429] != 200 {
		t.Fatalf("with Redis down: codes %v, want only 200 and 429, some 200 (fail open)", codes)
	}
	if n := metric(t, a.http, "allot_agent_redis_errors_total"); n < 1 {
		t.Fatalf("allot_agent_redis_errors_total %v, want ≥ 1", n)
	}

	// Restart Redis on the same address: the backend recovers on its own.
	redisProc(t, raddr)
	before := redisDecisions()
	eventually(t, 20*time.Second, "decisions through Redis again", func() bool {
		r, err := tryGet(url, "X-API-Key", "k-after")
		if err != nil || (r.code != 200 && r.code != 429) {
			t.Fatalf("after restart: %v %v", r.code, err)
		}
		return redisDecisions() > before
	})
	// The restarted Redis is empty: the key gets its 5 again, then 429.
	n200 := 0
	for range 10 {
		if r := get(t, url, "X-API-Key", "k-fresh"); r.code == 200 {
			n200++
		} else if r.code != 429 {
			t.Fatalf("after recovery: %d %s", r.code, strings.TrimSpace(r.body))
		}
	}
	if n200 != 5 {
		t.Fatalf("after recovery: %d admitted for a fresh key, want 5", n200)
	}
}
