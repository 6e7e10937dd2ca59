package main

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
)

// TestAllocatorMutualTLS: the gateway leases from an allocator that
// requires client certificates. The agent's certificate names agent "gw-1",
// so the gateway's agent id becomes gw-1/<incarnation> (the allocator
// refuses any other id); a lease is granted and the key is enforced.
func TestAllocatorMutualTLS(t *testing.T) {
	gw, alloc := binaries(t)
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "allot-test-ca")
	srv := tlstest.Files(t, dir, "allocator", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, "")))
	cli := tlstest.Files(t, dir, "agent", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1")))

	rulesFile := writeFile(t, dir, "rules.yaml", `
domain: tls
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: hour, requests_per_unit: 5, burst: 5}
`)
	grpcAddr, raftAddr := testproc.FreeAddr(t), testproc.FreeAddr(t)
	startProc(t, "allocator", alloc, "-node-id", "a", "-data-dir", filepath.Join(dir, "data"),
		"-grpc-addr", grpcAddr, "-raft-addr", raftAddr, "-http-addr", "", "-bootstrap", "-rules", rulesFile,
		"-tls-cert", srv.CertFile, "-tls-key", srv.KeyFile, "-tls-ca", srv.CAFile, "-tls-client-auth", "require",
		"-log-level", "warn")
	cfg := writeFile(t, dir, "gateway.yaml", fmt.Sprintf(`
upstream: %s
allocator_tls: {ca_file: %s, cert_file: %s, key_file: %s, server_name: localhost}
domain: tls
descriptors: [[api_key]]
`, backend(t), cli.CAFile, cli.CertFile, cli.KeyFile))
	_, a := startGateway(t, gw, "-config", cfg, "-allocators", grpcAddr, "-listen", "127.0.0.1:0",
		"-rls-addr", "", "-http-addr", "127.0.0.1:0")
	eventually(t, 60*time.Second, "the allocator's rules over mutual TLS", func() bool {
		return metric(t, a.http, "allot_agent_rules_version") >= 1
	})
	ok := 0
	for range 8 {
		r := get(t, "http://"+a.proxy+"/", "X-API-Key", "k")
		if r.code == 200 {
			ok++
		} else if r.code != 429 {
			t.Fatalf("status %d: %s", r.code, r.body)
		}
	}
	if ok != 5 {
		t.Fatalf("admitted %d of 8 against a burst of 5, want 5", ok)
	}
	eventually(t, 30*time.Second, "tokens granted over mutual TLS", func() bool {
		return metric(t, a.http, `allot_agent_tokens_total{kind="granted"}`)+
			metric(t, a.http, `allot_agent_tokens_total{kind="charged"}`) > 0 &&
			metric(t, a.http, `allot_agent_acquire_calls_total{result="rejected"}`) <= 0
	})
}
