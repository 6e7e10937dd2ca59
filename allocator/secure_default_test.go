package allocator

import (
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestOpenAdminRefusedOffLoopback pins an allocator on a non-loopback
// address with no TLS and no token, which started with one INFO line and
// an open admin API.
func TestOpenAdminRefusedOffLoopback(t *testing.T) {
	base := DefaultConfig()
	base.NodeID, base.DataDir = "n", t.TempDir()
	base.GRPCAddr, base.AdvertiseGRPCAddr = "0.0.0.0:0", "n.example:7420"
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		ok   bool
	}{
		{"grpc on every interface", func(*Config) {}, false},
		{"raft on a LAN address", func(c *Config) {
			c.GRPCAddr, c.AdvertiseGRPCAddr, c.RaftAddr = "127.0.0.1:0", "", "10.1.2.3:7421"
		}, false},
		{"empty host", func(c *Config) { c.GRPCAddr = ":7420" }, false},
		{"insecure", func(c *Config) { c.Insecure = true }, true},
		{"admin token", func(c *Config) { c.AdminTokens = []string{testToken} }, true},
		{"loopback", func(c *Config) { c.GRPCAddr, c.AdvertiseGRPCAddr = "127.0.0.1:7420", "" }, true},
		{"localhost", func(c *Config) { c.GRPCAddr, c.AdvertiseGRPCAddr = "localhost:7420", "" }, true},
		{"pprof without a token", func(c *Config) { c.Insecure, c.Pprof = true, true }, false},
	} {
		c := base
		tc.mod(&c)
		err := c.Validate()
		if tc.ok != (err == nil) {
			t.Errorf("%s: Validate = %v, want ok %v", tc.name, err, tc.ok)
		}
		if err != nil && !tc.ok && !strings.Contains(err.Error(), "-insecure") && !strings.Contains(err.Error(), "Pprof") {
			t.Errorf("%s: error %q does not name -insecure", tc.name, err)
		}
	}
}

// TestInsecureWarns: an Insecure node warns at start; the warning
// goroutine ends with the Server (goleak in TestMain).
func TestInsecureWarns(t *testing.T) {
	logs := &syncBuffer{}
	tc := newTestCluster(t, 1, func(_ int, c *Config) {
		c.Insecure = true
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
	})
	waitFor(t, 5*time.Second, "the -insecure WARN", func() bool {
		return strings.Contains(logs.String(), "level=WARN msg=\"running with -insecure")
	})
	tc.stop(0, true)
}

// TestAuditWithoutAuth: every admin mutation is audit-logged (who, what,
// from where, result) even with authentication off.
func TestAuditWithoutAuth(t *testing.T) {
	logs := &syncBuffer{}
	tc := newTestCluster(t, 1, func(_ int, c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
	})
	_, admin := tc.clients(0)
	_, err := admin.TransferLeadership(ctxT(t), &allotv1.TransferLeadershipRequest{Id: "nobody"})
	if err == nil {
		t.Fatal("TransferLeadership to an unknown node succeeded")
	}
	line := grepLines(logs.String(), "TransferLeadership")
	for _, want := range []string{`msg="admin call"`, "caller=anonymous", "from=127.0.0.1:", "code=", "id=nobody"} {
		if !strings.Contains(line, want) {
			t.Errorf("audit line %q lacks %q", line, want)
		}
	}
}

// TestKeysRedactedUnlessAdminAsks: leases, top and inspect answer raw keys
// only to an admin that asks for them (allotctl --show-keys).
func TestKeysRedactedUnlessAdminAsks(t *testing.T) {
	tc := newTestCluster(t, 1, func(_ int, c *Config) {
		c.AdminTokens = []string{testToken}
		c.OpenReads = true
	})
	const secret = "sk_live_SECRET_42"
	alloc, _ := tc.clients(0)
	if _, err := alloc.Acquire(ctxT(t), acquireReq("agent-a", 1, key("user", secret, 3))); err != nil {
		t.Fatal(err)
	}
	raw := "test:user=" + secret
	addr := tc.node(0).GRPCAddr()
	for _, c := range []struct {
		name  string
		token string
		ask   bool
		want  bool
	}{
		{"anonymous", "", false, false},
		{"anonymous asking", "", true, false},
		{"admin not asking", testToken, false, false},
		{"admin asking", testToken, true, true},
	} {
		opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
		if c.token != "" {
			opts = append(opts, grpc.WithPerRPCCredentials(bearerCreds(c.token)))
		}
		if c.ask {
			opts = append(opts, grpc.WithChainUnaryInterceptor(withMD(ShowKeysMetadata, "1")))
		}
		cc, err := grpc.NewClient(addr, opts...)
		if err != nil {
			t.Fatal(err)
		}
		admin := allotv1.NewAdminClient(cc)
		ctx := ctxT(t)
		leases, err := admin.ListLeases(ctx, &allotv1.ListLeasesRequest{})
		if err != nil || len(leases.GetLeases()) == 0 {
			t.Fatalf("%s: ListLeases = %v, %v", c.name, leases, err)
		}
		top, err := admin.TopKeys(ctx, &allotv1.TopKeysRequest{})
		if err != nil || len(top.GetKeys()) == 0 {
			t.Fatalf("%s: TopKeys = %v, %v", c.name, top, err)
		}
		insp, err := admin.InspectKey(ctx, &allotv1.InspectKeyRequest{Key: raw})
		if err != nil {
			t.Fatalf("%s: InspectKey: %v", c.name, err)
		}
		want := redactKey(raw)
		if c.want {
			want = raw
		}
		for what, got := range map[string]string{
			"lease": leases.GetLeases()[0].GetKey(), "top": top.GetKeys()[0].GetKey(), "inspect": insp.GetKey(),
		} {
			if got != want {
				t.Errorf("%s: %s key = %q, want %q", c.name, what, got, want)
			}
		}
		cc.Close()
	}
}

// TestPprofOffByDefault: /debug/pprof/ is not served unless Pprof is on,
// and then only to an admin bearer token.
func TestPprofOffByDefault(t *testing.T) {
	get := func(addr, token string) int {
		req, _ := http.NewRequest("GET", "http://"+addr+"/debug/pprof/cmdline", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	off := newTestCluster(t, 1, func(_ int, c *Config) { c.HTTPAddr = "127.0.0.1:0" })
	if code := get(off.node(0).HTTPAddr(), ""); code != http.StatusNotFound {
		t.Errorf("pprof by default: %d, want 404", code)
	}
	on := newTestCluster(t, 1, func(_ int, c *Config) {
		c.HTTPAddr = "127.0.0.1:0"
		c.Pprof = true
		c.AdminTokens = []string{testToken}
	})
	addr := on.node(0).HTTPAddr()
	if code := get(addr, ""); code != http.StatusUnauthorized {
		t.Errorf("pprof without a token: %d, want 401", code)
	}
	if code := get(addr, "wrong-token-0123456789"); code != http.StatusUnauthorized {
		t.Errorf("pprof with a wrong token: %d, want 401", code)
	}
	if code := get(addr, testToken); code != http.StatusOK {
		t.Errorf("pprof with the admin token: %d, want 200", code)
	}
}

// TestPprofRefusalsLogged: refused /debug/pprof/ requests are logged at
// most once a second, with how many were not, so that anyone who can reach
// the HTTP port cannot flood the log.
func TestPprofRefusalsLogged(t *testing.T) {
	logs := &syncBuffer{}
	on := newTestCluster(t, 1, func(_ int, c *Config) {
		c.HTTPAddr = "127.0.0.1:0"
		c.Pprof = true
		c.AdminTokens = []string{testToken}
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	url := "http://" + on.node(0).HTTPAddr() + "/debug/pprof/cmdline"
	start := time.Now()
	const n = 200
	for range n {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("pprof without a token: %d, want 401", resp.StatusCode)
		}
	}
	secs := int(time.Since(start)/time.Second) + 1
	lines := strings.Count(logs.String(), "pprof refused")
	if lines < 1 || lines > secs+1 {
		t.Fatalf("%d refusals in %d s logged %d lines, want 1 to %d", n, secs, lines, secs+1)
	}
}
