package allotcaddy

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/internal/testproc"
)

// goBuild runs `go build -o out pkg` in dir.
func goBuild(t *testing.T, dir, out, pkg string) {
	t.Helper()
	start := time.Now()
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", out, pkg)
	cmd.Dir = dir
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	t.Logf("go build %s: %v", pkg, time.Since(start).Round(time.Millisecond))
}

// TestCaddyWithModule builds Caddy with http.handlers.allot as xcaddy does
// (cmd/caddy: caddy's cmd, the standard modules and this module), runs it
// with a Caddyfile in front of an upstream against a real allocator, and
// sends one key past its limit: 200s with the RateLimit fields, then the
// 429 with Retry-After and the fields; the upstream saw only the 200s.
func TestCaddyWithModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy and runs an allocator")
	}
	bin := t.TempDir()
	goBuild(t, "../..", filepath.Join(bin, "allocator"), "./cmd/allocator")
	goBuild(t, ".", filepath.Join(bin, "caddy"), "./cmd/caddy")

	dir := t.TempDir()
	rulesFile := testproc.WriteFile(t, dir, "rules.yaml", `domain: caddy
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 5}
`)
	cl := testproc.StartCluster(t, testproc.ClusterConfig{Bin: filepath.Join(bin, "allocator"), Dir: dir, Size: 1,
		Rules: []string{rulesFile}, Args: testproc.FastLeaseArgs})

	var seen atomic.Int64
	up := testproc.Serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-API-Key") == "k1" {
			seen.Add(1)
		}
		io.WriteString(w, "upstream ok\n")
	}))
	listen := testproc.FreeAddrs(t, 1)[0]
	conf := testproc.WriteFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	auto_https off
}

http://%s {
	allot {
		allocators %s
		domain caddy
		api_key_headers X-API-Key
		descriptors api_key
	}
	reverse_proxy %s
}
`, listen, cl.Nodes[0].GRPC, up))
	p := testproc.NewProc("caddy", dir, filepath.Join(bin, "caddy"), "run", "--config", conf, "--adapter", "caddyfile")
	p.Env = []string{"HOME=" + dir, "XDG_DATA_HOME=" + filepath.Join(dir, "data"), "XDG_CONFIG_HOME=" + filepath.Join(dir, "config")}
	p.Start(t)

	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	get := func(key string) (int, http.Header, string, error) {
		req, _ := http.NewRequest("GET", "http://"+listen+"/v1/search", nil)
		req.Header.Set("X-API-Key", key)
		resp, err := c.Do(req)
		if err != nil {
			return 0, nil, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b), err
	}
	// Caddy is up and its agent has the allocator's rules once a request
	// carries the fields.
	testproc.Eventually(t, 60*time.Second, "caddy with the allocator's rules", func() bool {
		if !p.Running() {
			t.Fatalf("caddy exited: %v\n%s", p.ExitErr(), testproc.Tail(p.Output(), 30))
		}
		code, h, _, err := get("probe")
		return err == nil && code == 200 && h.Get("RateLimit-Policy") == `"per_key";q=5;w=60`
	})

	allowed := 0
	for i := 1; ; i++ {
		code, h, body, err := get("k1")
		if err != nil {
			t.Fatal(err)
		}
		if code == 200 {
			allowed++
			if body != "upstream ok\n" || !strings.HasPrefix(h.Get("RateLimit"), `"per_key";r=`) || h.Get("RateLimit-Policy") != `"per_key";q=5;w=60` {
				t.Fatalf("request %d: %d %v %q", i, code, h, body)
			}
			if allowed > 5 {
				t.Fatalf("%d requests allowed under 5 a minute", allowed)
			}
			continue
		}
		if code != http.StatusTooManyRequests {
			t.Fatalf("request %d: %d %q", i, code, body)
		}
		ra, err := strconv.Atoi(h.Get("Retry-After"))
		if err != nil || ra < 1 || ra > 12 {
			t.Fatalf("Retry-After %q", h.Get("Retry-After"))
		}
		if h.Get("RateLimit") != `"per_key";r=0;t=`+strconv.Itoa(ra) || h.Get("RateLimit-Policy") != `"per_key";q=5;w=60` ||
			h.Get("Cache-Control") != "no-store" || body != httplimit.DeniedBody {
			t.Fatalf("429: %v %q", h, body)
		}
		break
	}
	if allowed < 1 || seen.Load() != int64(allowed) {
		t.Fatalf("allowed %d, the upstream saw %d", allowed, seen.Load())
	}
	// Cleanup: SIGINT stops Caddy gracefully (the agent hands its leases back).
	if err := p.Signal(os.Interrupt, 20*time.Second); err != nil {
		t.Fatalf("caddy stop: %v\n%s", err, testproc.Tail(p.Output(), 20))
	}
}
