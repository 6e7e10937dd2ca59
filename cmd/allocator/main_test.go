package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/internal/cpuburn"
	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/tlsconfig"
	"github.com/allot/allot/pkg/tlsconfig/tlstest"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type certs struct {
	dir                     string
	allocator, agent, admin tlsconfig.Options
	tokenFile               string
}

func newCerts(t *testing.T) *certs {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, "cmd test CA")
	c := &certs{
		dir:       dir,
		allocator: tlstest.Files(t, dir, "allocator", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAllocator, ""))),
		agent:     tlstest.Files(t, dir, "agent", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAgent, "gw-1"))),
		admin:     tlstest.Files(t, dir, "admin", ca, ca.Issue(t, tlstest.Role(tlsconfig.RoleAdmin, ""))),
		tokenFile: filepath.Join(dir, "tokens"),
	}
	if err := os.WriteFile(c.tokenFile, []byte("# admins\nfirst-token-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return c
}

func TestParseSecurityFlags(t *testing.T) {
	c := newCerts(t)
	base := []string{"-node-id", "n", "-data-dir", t.TempDir(), "-log-level", "error"}
	tls := []string{"-tls-cert", c.allocator.CertFile, "-tls-key", c.allocator.KeyFile, "-tls-ca", c.allocator.CAFile}

	o, err := parse(append(append(base, tls...), "-raft-tls", "-admin-token-file", c.tokenFile, "-agent-rate", "50", "-max-inflight-calls", "64"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := o.cfg
	if cfg.TLS.CertFile != c.allocator.CertFile || cfg.ClientAuth != tlsconfig.ClientAuthRequire || !cfg.RaftTLS ||
		len(cfg.AdminTokens) != 1 || cfg.AgentRate != 50 || cfg.MaxInflight != 64 {
		t.Errorf("parsed config: TLS %+v, client auth %v, raft TLS %v, %d tokens, agent rate %d, max in flight %d",
			cfg.TLS, cfg.ClientAuth, cfg.RaftTLS, len(cfg.AdminTokens), cfg.AgentRate, cfg.MaxInflight)
	}
	o, err = parse(append(append(base, tls...), "-peer-names", "n1,n2", "-peer-names", "n3"))
	if err != nil || strings.Join(o.cfg.PeerNames, ",") != "n1,n2,n3" {
		t.Errorf("-peer-names n1,n2 -peer-names n3: %v, %v; want PeerNames n1,n2,n3", o, err)
	}
	o, err = parse(append(append(base, tls...), "-tls-client-auth", "optional", "-tls-min-version", "1.3"))
	if err != nil || o.cfg.ClientAuth != tlsconfig.ClientAuthOptional || o.cfg.TLS.MinVersion != 0x0304 {
		t.Errorf("optional, 1.3: %+v, %v", o, err)
	}
	o, err = parse(append(base, "-tls-cert", c.allocator.CertFile, "-tls-key", c.allocator.KeyFile))
	if err != nil || o.cfg.ClientAuth != tlsconfig.ClientAuthNone {
		t.Errorf("TLS without a CA: client auth %v, %v; want none", o.cfg.ClientAuth, err)
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-tls-cert", c.allocator.CertFile}, "-tls-cert and -tls-key go together"},
		{[]string{"-tls-ca", c.allocator.CAFile}, "-tls-ca needs -tls-cert"},
		{append(append([]string{}, tls...), "-tls-client-auth", "maybe"), "-tls-client-auth"},
		{[]string{"-tls-cert", c.allocator.CertFile, "-tls-key", c.allocator.KeyFile, "-tls-client-auth", "require"}, "needs -tls-ca"},
		{append(append([]string{}, tls...), "-tls-min-version", "1.1"), "-tls-min-version"},
		{[]string{"-raft-tls"}, "-raft-tls needs"},
		{append(append([]string{}, tls...), "-peer-names", "n1,eu/1"), `-peer-names) "eu/1"`},
		{[]string{"-admin-token-file", c.tokenFile, "-peer-names", "n1"}, "-peer-names) needs verified client certificates"},
		{append(append([]string{}, tls...), "-tls-client-auth", "none", "-admin-token-file", c.tokenFile, "-peer-names", "n1"),
			"-peer-names) needs verified client certificates"},
		{[]string{"-admin-token-file", filepath.Join(c.dir, "missing")}, "-admin-token-file"},
		{[]string{"-max-concurrent-streams", "0"}, "-max-concurrent-streams"},
		{[]string{"-grpc-addr", "0.0.0.0:7420", "-advertise-grpc-addr", "a.example:7420"}, "not a loopback address"},
		{[]string{"-pprof"}, "Pprof needs AdminTokens"},
		{[]string{"-max-inflight-calls", "-5"}, "MaxInflight"},
	} {
		_, err := parse(append(append([]string{}, base...), tc.args...))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parse(%q) error = %v, want one mentioning %q", tc.args, err, tc.want)
		}
	}
}

func TestParseAdvertiseFlags(t *testing.T) {
	base := []string{"-node-id", "n", "-data-dir", t.TempDir(), "-log-level", "error", "-insecure"}
	o, err := parse(append(base, "-grpc-addr", "0.0.0.0:7420", "-raft-addr", "0.0.0.0:7421", "-http-addr", "0.0.0.0:7422",
		"-advertise-grpc-addr", "a-1.peers:7420", "-advertise-raft-addr", "a-1.peers:7421", "-advertise-http-addr", "a-1.peers:7422"))
	if err != nil {
		t.Fatal(err)
	}
	if c := o.cfg; c.AdvertiseGRPCAddr != "a-1.peers:7420" || c.AdvertiseRaftAddr != "a-1.peers:7421" ||
		c.AdvertiseHTTPAddr != "a-1.peers:7422" || c.RaftAddr != "0.0.0.0:7421" {
		t.Errorf("parsed %+v", c)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-raft-addr", "0.0.0.0:7421"}, "RaftAddr"},
		{[]string{"-advertise-raft-addr", "a-1.peers"}, "AdvertiseRaftAddr"},
		{[]string{"-advertise-grpc-addr", "0.0.0.0:7420"}, "AdvertiseGRPCAddr"},
		{[]string{"-http-addr", "", "-advertise-http-addr", "a:7422"}, "AdvertiseHTTPAddr"},
	} {
		_, err := parse(append(append([]string{}, base...), tc.args...))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parse(%q) error = %v, want one mentioning %q", tc.args, err, tc.want)
		}
	}
}

func TestBurnerStops(t *testing.T) {
	b := cpuburn.Start(2)
	b.Stop() // goleak in TestMain checks that the goroutines ended
	cpuburn.Start(0).Stop()
}

// TestTLSProcess runs the binary with TLS, mutual TLS for Raft and an
// admin token file: an admin certificate reads the status, an agent
// certificate is refused it, an agent leases as its own id only, and
// SIGHUP rotates the token.
func TestTLSProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary: skipped with -short")
	}
	c := newCerts(t)
	dir := t.TempDir()
	if err := testproc.GoBuild(dir, false, "github.com/allot/allot/cmd/allocator"); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "allocator")
	rulesPath := filepath.Join(dir, "rules.yaml")
	if err := os.WriteFile(rulesPath, []byte("domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 10}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	grpcAddr, raftAddr := testproc.FreeAddr(t), testproc.FreeAddr(t)
	cmd := exec.Command(bin, "-node-id", "p0", "-data-dir", filepath.Join(dir, "data"), "-bootstrap", "-rules", rulesPath,
		"-grpc-addr", grpcAddr, "-raft-addr", raftAddr, "-http-addr", "",
		"-tls-cert", c.allocator.CertFile, "-tls-key", c.allocator.KeyFile, "-tls-ca", c.allocator.CAFile,
		"-raft-tls", "-admin-token-file", c.tokenFile, "-log-format", "json")
	var logs syncBuffer
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Kill()
		<-exited
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, admin := dialTLS(t, grpcAddr, c.admin, "")
	waitUntil(t, ctx, "the node to lead with its rules", func() bool {
		st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		return err == nil && st.GetLeaderId() == "p0" && st.GetRulesVersion() > 0
	})

	agentAlloc, agentAdmin := dialTLS(t, grpcAddr, c.agent, "")
	if _, err := agentAdmin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("agent ClusterStatus: %v, want PermissionDenied", err)
	}
	key := []*allotv1.KeyAcquire{{Domain: "api", Entries: []*allotv1.Entry{{Key: "user", Value: "u"}}, Want: 1}}
	if _, err := agentAlloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "gw-1/a", RequestId: 1, Keys: key}); err != nil {
		t.Errorf("agent Acquire as itself: %v", err)
	}
	if _, err := agentAlloc.Acquire(ctx, &allotv1.AcquireRequest{AgentId: "gw-2", RequestId: 1, Keys: key}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("agent Acquire as another: %v, want PermissionDenied", err)
	}

	_, oldTok := dialTLS(t, grpcAddr, c.agent, "first-token-0123456789")
	if _, err := oldTok.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{}); err != nil {
		t.Fatalf("ClusterStatus with the token: %v", err)
	}
	if err := os.WriteFile(c.tokenFile, []byte("second-token-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	_, newTok := dialTLS(t, grpcAddr, c.agent, "second-token-0123456789")
	waitUntil(t, ctx, "the new token after SIGHUP", func() bool {
		_, err := newTok.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		return err == nil
	})
	if _, err := oldTok.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("old token after rotation: %v, want Unauthenticated", err)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		exited <- err
		if err != nil {
			t.Errorf("exit after SIGTERM: %v", err)
		}
	case <-ctx.Done():
		t.Fatal("no exit after SIGTERM")
	}
	if !strings.Contains(logs.String(), `"msg":"admin tokens replaced"`) {
		t.Errorf("no log of the token rotation in:\n%s", logs.String())
	}
}

// syncBuffer collects the process's log (exec copies into it from its
// own goroutine).
type syncBuffer struct {
	mu  sync.Mutex // guards buf
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func dialTLS(t *testing.T, addr string, o tlsconfig.Options, token string) (allotv1.AllocatorClient, allotv1.AdminClient) {
	t.Helper()
	l, err := tlsconfig.Load(o)
	if err != nil {
		t.Fatal(err)
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(l.ClientCredentials(""))}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer(token)))
	}
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return allotv1.NewAllocatorClient(cc), allotv1.NewAdminClient(cc)
}

type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}
func (b bearer) RequireTransportSecurity() bool { return true }

func waitUntil(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// TestParseGroupsFlags: -groups 0, and -groups with -join, are refused with
// errors naming the flags; -bootstrap -groups 4 reaches the Config.
func TestParseGroupsFlags(t *testing.T) {
	base := []string{"-node-id", "n", "-data-dir", t.TempDir(), "-log-level", "error"}
	o, err := parse(append(base, "-bootstrap", "-groups", "4"))
	if err != nil {
		t.Fatal(err)
	}
	if o.cfg.Groups != 4 || !o.cfg.Bootstrap {
		t.Errorf("Groups %d, Bootstrap %v; want 4, true", o.cfg.Groups, o.cfg.Bootstrap)
	}
	if o, err := parse(append(base, "-bootstrap", "-groups", "4", "-group-replicas", "3")); err != nil || o.cfg.GroupReplicas != 3 {
		t.Errorf("-group-replicas 3: %v, %v; want GroupReplicas 3", o, err)
	}
	if o, err := parse(base); err != nil || o.cfg.Groups != 1 {
		t.Errorf("default: Groups %v, %v; want 1", o, err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-bootstrap", "-groups", "0"}, "-groups 0"},
		{[]string{"-groups", "2", "-join", "127.0.0.1:7420"}, "-groups with -join"},
		{[]string{"-groups", "1", "-join", "127.0.0.1:7420"}, "-groups with -join"},
		{[]string{"-groups", "3"}, "Groups needs Bootstrap"},
		{[]string{"-bootstrap", "-group-replicas", "2"}, "-group-replicas needs -bootstrap -groups N"},
		{[]string{"-join", "127.0.0.1:7420", "-group-replicas", "2"}, "-group-replicas needs -bootstrap -groups N"},
		{[]string{"-bootstrap", "-groups", "2", "-group-replicas", "-1"}, "-group-replicas -1"},
	} {
		_, err := parse(append(base, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error containing %q", c.args, err, c.want)
		}
	}
}
