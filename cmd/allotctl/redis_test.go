package main

import (
	"context"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/redislimit"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestRedisInspectPromotion: `inspect --redis` shows a hot key the agents
// promoted to sharded sub-keys (a marker in Redis, which the allocator does
// not see), and an unpromoted redis-backed key as not promoted.
func TestRedisInspectPromotion(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		msg := "redis-server not found: install the Debian package redis-server"
		if os.Getenv("ALLOT_REQUIRE_REDIS") == "1" {
			t.Fatal(msg + " (ALLOT_REQUIRE_REDIS=1)")
		}
		t.Skip(msg)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	raddr := ln.Addr().String()
	ln.Close()
	_, port, _ := net.SplitHostPort(raddr)
	srv := exec.Command("redis-server", "--bind", "127.0.0.1", "--port", port, "--save", "", "--appendonly", "no", "--dir", t.TempDir())
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Process.Kill(); _ = srv.Wait() })

	cfg := redislimit.DefaultConfig()
	cfg.Addrs, cfg.Timeout = []string{raddr}, time.Second
	b, err := redislimit.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	lim, err := bucket.NewLimit(bucket.TokenBucket, 1000, time.Second, 1000)
	if err != nil {
		t.Fatal(err)
	}
	const hot, cold = "d:api_key=hot", "d:api_key=cold"
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, _, err = b.Promote(context.Background(), hot, lim, 4, time.Now().UnixNano(), time.Hour)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // redis-server is starting
	}
	if err != nil {
		t.Fatalf("Promote: %v", err)
	}

	f := newFakeAdmin()
	redisLimit := &allotv1.Limit{Name: "shared", RequestsPerUnit: 1000, Unit: "second", WindowSeconds: 1, Burst: 1000,
		Algorithm: "token_bucket", Backend: "redis", FailureMode: "open"}
	f.inspect = map[string]*allotv1.InspectKeyResponse{
		hot:  {Key: hot, Matched: true, Limit: redisLimit, RedisPromoted: true, Shards: 1, NowUnixMs: fakeNow},
		cold: {Key: cold, Matched: true, Limit: redisLimit, RedisPromoted: true, Shards: 1, NowUnixMs: fakeNow},
	}
	addr := startFake(t, f, nil)
	r := runCLI(t, "--addr", addr, "inspect", hot, "--redis", raddr)
	if r.code != 0 || !strings.Contains(r.stdout, "Redis promotion: promoted to 4 sub-keys until") {
		t.Fatalf("inspect hot: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, "--addr", addr, "inspect", cold, "--redis", raddr)
	if r.code != 0 || !strings.Contains(r.stdout, "Redis promotion: not promoted") {
		t.Fatalf("inspect cold: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// Without --redis the table says where run-time promotion is recorded.
	r = runCLI(t, "--addr", addr, "inspect", hot)
	if r.code != 0 || !strings.Contains(r.stdout, "unsharded (rule); run-time promotion: see --redis") {
		t.Fatalf("inspect hot without --redis: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}
