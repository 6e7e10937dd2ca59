package integrations

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/internal/testproc"
)

// nginxMain wraps docs/integrations.md's nginx configuration with the
// process settings a test needs: foreground, one process, every path in
// the test's directory (%[1]s). %[2]s: the documented configuration.
const nginxMain = `daemon off;
master_process off;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log info;
events { worker_connections 64; }
http {
  access_log off;
  client_body_temp_path %[1]s/client_body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
%[2]s
}
`

// docConfig returns docs/integrations.md's first code block in lang, with
// the documented addresses (proxy 127.0.0.1:8080, upstream
// 127.0.0.1:9000, the gateway's -check-addr 127.0.0.1:8082) replaced by
// the test's.
func docConfig(t *testing.T, lang, listen, upstream, check string) string {
	t.Helper()
	b, err := os.ReadFile("../../docs/integrations.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "```"+lang+"\n")
	if i < 0 {
		t.Fatalf("docs/integrations.md has no %s block", lang)
	}
	block := doc[i+len("```"+lang+"\n"):]
	block = block[:strings.Index(block, "```")]
	for _, a := range []string{"127.0.0.1:8080", "127.0.0.1:9000", "127.0.0.1:8082"} {
		if !strings.Contains(block, a) {
			t.Fatalf("the documented %s configuration does not mention %s", lang, a)
		}
	}
	return strings.NewReplacer("127.0.0.1:8080", listen, "127.0.0.1:9000", upstream, "127.0.0.1:8082", check).Replace(block)
}

// TestNginxAuthRequest: nginx's auth_request asks the gateway's
// forward-auth endpoint; the error_page mapping carries its 429 and
// headers, its 400 and its 403 (on_missing: deny) to the client as JSON.
func TestNginxAuthRequest(t *testing.T) {
	nginx := requireProgram(t, "nginx")
	e := startEnv(t, "forward_auth: {on_missing: deny}\n")
	dir := t.TempDir()
	listen := testproc.FreeAddrs(t, 1)[0]
	conf := testproc.WriteFile(t, dir, "nginx.conf", fmt.Sprintf(nginxMain, dir, docConfig(t, "nginx", listen, e.upstream, e.gw.Check)))
	// -p: the prefix (nginx would otherwise open its compiled-in log path
	// before reading the config); -e: the early error log.
	p := testproc.NewProc("nginx", dir, nginx, "-p", dir, "-e", filepath.Join(dir, "early.log"), "-c", conf)
	p.Start(t)
	waitHTTP(t, p, "http://"+listen+"/ping")
	exhaust(t, e, "http://"+listen+"/v1/search?q=1", "k_nginx", true)

	// A key over max_value_bytes: the gateway's 400, a JSON body (nginx
	// does not pass the check's body on: the documented generic message).
	a := getWithKey(t, "http://"+listen+"/v1/search", strings.Repeat("k", 300))
	if a.code != 400 || !strings.HasPrefix(a.h.Get("Content-Type"), "application/json") ||
		a.body != `{"error":"bad_request","message":"The request could not be rate limited."}` {
		t.Fatalf("a key too long: %d %s %q, want 400 with the JSON body", a.code, a.h.Get("Content-Type"), a.body)
	}
	// No key with on_missing: deny: the gateway's 403 and its body.
	a = getWithKey(t, "http://"+listen+"/v1/search", "")
	if a.code != 403 || !strings.HasPrefix(a.h.Get("Content-Type"), "application/json") || a.body != httplimit.ForbiddenBody {
		t.Fatalf("no key: %d %s %q, want 403 with the JSON body", a.code, a.h.Get("Content-Type"), a.body)
	}
	if n := e.up.seen(""); n != 0 {
		t.Fatalf("the upstream saw %d requests without a key, want 0", n)
	}

	// The gateway away: nginx answers 500 (auth_request fails closed).
	if err := e.gw.Proc.Signal(syscall.SIGTERM, 30*time.Second); err != nil {
		t.Fatalf("gateway SIGTERM: %v", err)
	}
	if a := getWithKey(t, "http://"+listen+"/v1/search", "k_nginx_2"); a.code != 500 {
		t.Fatalf("gateway down: %d, want nginx's 500", a.code)
	}
}

// caddyGlobal are the global options a test needs before
// docs/integrations.md's Caddyfile: no admin endpoint, no certificates.
const caddyGlobal = `{
	admin off
	auto_https off
}

`

// TestCaddyForwardAuth: Debian's caddy with forward_auth in front of the
// upstream; a denial is the gateway's 429 returned as is.
func TestCaddyForwardAuth(t *testing.T) {
	caddy := requireProgram(t, "caddy")
	e := startEnv(t)
	listen := testproc.FreeAddrs(t, 1)[0]
	startCaddy(t, caddy, caddyGlobal+docConfig(t, "caddyfile", listen, e.upstream, e.gw.Check), listen)
	exhaust(t, e, "http://"+listen+"/v1/search?q=1", "k_caddy", true)
}

// startCaddy runs bin with the Caddyfile content, its home and data in a
// temporary directory, and waits until it answers on listen.
func startCaddy(t *testing.T, bin, content, listen string) *testproc.Proc {
	t.Helper()
	dir := t.TempDir()
	conf := testproc.WriteFile(t, dir, "Caddyfile", content)
	p := testproc.NewProc("caddy", dir, bin, "run", "--config", conf, "--adapter", "caddyfile")
	p.Env = []string{"HOME=" + dir, "XDG_DATA_HOME=" + filepath.Join(dir, "data"), "XDG_CONFIG_HOME=" + filepath.Join(dir, "config")}
	p.Start(t)
	waitHTTP(t, p, "http://"+listen+"/ping")
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return p
}
