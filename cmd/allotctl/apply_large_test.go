package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// bigRules writes a rule set of about size bytes: one domain of distinct
// exact-value descriptors.
func bigRules(t *testing.T, dir, domain string, size int) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "domain: %s\ndescriptors:\n", domain)
	for i := 0; b.Len() < size; i++ {
		fmt.Fprintf(&b, "  - key: k\n    value: v%07d-%s\n    rate_limit: {unit: second, requests_per_unit: %d}\n",
			i, strings.Repeat("x", 40), 10+i%50)
	}
	path := filepath.Join(dir, domain+".yaml")
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestRulesApplyLargeWaits pins `rules apply` of a 3.9 MB rule set that
// said "did not answer within 5s" although the put was committed: apply
// waits for the commit (--wait, not --timeout), and when the answer does
// not come it reads the rules back and reports the truth.
func TestRulesApplyLargeWaits(t *testing.T) {
	if testing.Short() {
		t.Skip("a 4 MB rule set through a real allocator: skipped with -short")
	}
	nodes := startCluster(t, 1)
	addr := nodes[0].GRPCAddr()
	dir := t.TempDir()
	big := bigRules(t, dir, "big", 3_900_000)

	// --timeout is far shorter than sending, compiling and committing 4 MB;
	// --wait is what a machine loaded by the rest of the suite under the
	// race detector needs (the put has taken over a minute there).
	r := runCLI(t, "--addr", addr, "--timeout", "100ms", "rules", "apply", "--wait", "5m", "-f", big)
	if r.code != 0 || !strings.Contains(r.stdout, "rules version 0 -> 1") {
		t.Fatalf("apply of 3.9 MB: code %d\nstdout %s\nstderr %s", r.code, r.stdout, r.stderr)
	}

	// The read-back: a put committed behind apply's back is confirmed; one
	// whose files are not in place is not.
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	small := []byte("domain: small\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
	req := &allotv1.PutRulesRequest{ExpectedVersion: 1, Files: []*allotv1.RuleFile{{Name: "small.yaml", Domain: "small", Yaml: small}}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := allotv1.NewAdminClient(cc).PutRules(ctx, req); err != nil {
		t.Fatal(err)
	}
	a := &app{addr: addr, timeout: 5 * time.Second, stdout: os.Stdout, stderr: os.Stderr}
	defer func() {
		if a.conn != nil {
			a.conn.Close()
		}
	}()
	cmd := a.rulesApplyCmd()
	cmd.SetContext(ctx)
	if v, ok := a.confirmPut(cmd, req); !ok || v != 2 {
		t.Errorf("confirmPut of a committed put = %d, %v; want 2, true", v, ok)
	}
	other := &allotv1.PutRulesRequest{ExpectedVersion: 1, Files: []*allotv1.RuleFile{{Name: "small.yaml", Domain: "small", Yaml: append(small, '#')}}}
	if _, ok := a.confirmPut(cmd, other); ok {
		t.Error("confirmPut confirmed a put whose files are not in place")
	}
}
