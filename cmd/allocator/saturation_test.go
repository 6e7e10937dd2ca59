package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/internal/cpuburn"
	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestMeasureSaturation is the allocator half of the overload measurement
// (docs/security.md): it runs the binary with and without N goroutines
// spinning in this test process (internal/cpuburn) on the same cores
// and logs the Acquire latency an agent sees, so the agent-side p99 check
// latency can be compared under the same saturation. It asserts nothing
// about time. Run it with
//
//	ALLOT_MEASURE=1 [ALLOT_BURN=4] go test -run TestMeasureSaturation -v ./cmd/allocator/
func TestMeasureSaturation(t *testing.T) {
	if os.Getenv("ALLOT_MEASURE") == "" {
		t.Skip("a measurement: set ALLOT_MEASURE=1 to run it")
	}
	burn := 4
	if v := os.Getenv("ALLOT_BURN"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("ALLOT_BURN: %v", err)
		}
		burn = n
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "allocator")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	rulesPath := filepath.Join(dir, "rules.yaml")
	if err := os.WriteFile(rulesPath, []byte("domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 100000}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{0, burn} {
		lat := measureAcquire(t, bin, rulesPath, filepath.Join(dir, fmt.Sprint("data", n)), n, 3*time.Second)
		slices.Sort(lat)
		q := func(p float64) time.Duration { return lat[min(len(lat)-1, int(p*float64(len(lat))))] }
		t.Logf("burn %d: %d sequential Acquire calls (10 keys each), p50 %v p99 %v max %v",
			n, len(lat), q(0.5), q(0.99), lat[len(lat)-1])
	}
}

func measureAcquire(t *testing.T, bin, rulesPath, dataDir string, burn int, d time.Duration) []time.Duration {
	grpcAddr := testproc.FreeAddr(t)
	cmd := exec.Command(bin, "-node-id", "m", "-data-dir", dataDir, "-bootstrap", "-rules", rulesPath,
		"-grpc-addr", grpcAddr, "-raft-addr", testproc.FreeAddr(t), "-http-addr", "", "-log-level", "warn",
		"-agent-rate", "-1")
	burner := cpuburn.Start(burn)
	defer burner.Stop()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	cc, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	alloc := allotv1.NewAllocatorClient(cc)
	ctx, cancel := context.WithTimeout(context.Background(), d+30*time.Second)
	defer cancel()
	keys := make([]*allotv1.KeyAcquire, 10)
	for i := range keys {
		keys[i] = &allotv1.KeyAcquire{Domain: "api", Entries: []*allotv1.Entry{{Key: "user", Value: fmt.Sprint("u", i)}}, Want: 10, Demand: 10}
	}
	req := uint64(0)
	waitUntil(t, ctx, "the allocator to grant", func() bool {
		req++
		r, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "m", RequestId: req, Keys: keys})
		return err == nil && r.GetGrants()[0].GetGranted() > 0
	})
	var lat []time.Duration
	for end := time.Now().Add(d); time.Now().Before(end); {
		req++
		start := time.Now()
		if _, err := alloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "m", RequestId: req, Keys: keys}); err != nil {
			t.Fatalf("Acquire: %v", err)
		}
		lat = append(lat, time.Since(start))
	}
	return lat
}
