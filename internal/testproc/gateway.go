package testproc

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Gateway is a running cmd/gateway.
type Gateway struct {
	Name  string
	Proxy string // the proxy's address
	HTTP  string // /metrics, /readyz
	Check string // POST /json and /forward-auth/ ("" unless -check-addr is in args)
	Proc  *Proc
}

var listeningRE = regexp.MustCompile(`allot gateway listening: proxy=(\S*) rls=(\S*) http=(\S*) check=(\S*)`)

// StartGateway runs the gateway binary with config (the -config YAML
// content) and allocators, on free loopback ports, and waits for its
// listening line. The agent id is the gateway's name.
func StartGateway(t testing.TB, bin, dir, name, config string, allocators []string, args ...string) *Gateway {
	t.Helper()
	cfg := WriteFile(t, dir, name+".yaml", config)
	all := []string{"-config", cfg, "-listen", "127.0.0.1:0", "-rls-addr", "", "-check-addr", "", "-http-addr", "127.0.0.1:0",
		"-agent-id", name, "-log-level", "info"}
	if len(allocators) > 0 {
		all = append(all, "-allocators", strings.Join(allocators, ","))
	}
	all = append(all, args...)
	g := &Gateway{Name: name, Proc: NewProc(name, dir, bin, all...)}
	g.Proc.Start(t)
	var m []string
	Eventually(t, 60*time.Second, name+"'s listening line", func() bool {
		if !g.Proc.Running() {
			t.Fatalf("%s exited: %v\n%s", name, g.Proc.ExitErr(), Tail(g.Proc.Output(), 30))
		}
		m = listeningRE.FindStringSubmatch(g.Proc.Output())
		return m != nil
	})
	g.Proxy, g.HTTP, g.Check = m[1], m[3], m[4]
	return g
}

// get fetches url without keeping the connection, so that no client
// goroutine outlives a test.
func get(url string) (int, string, error) {
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Timeout: 2 * time.Second, Transport: tr}
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// Ready reports the gateway's /readyz (rules, and an answer from an
// allocator).
func (g *Gateway) Ready() bool {
	code, _, err := get("http://" + g.HTTP + "/readyz")
	return err == nil && code == http.StatusOK
}

// Metrics scrapes the gateway's /metrics.
func (g *Gateway) Metrics() (Metrics, error) { return Scrape("http://" + g.HTTP + "/metrics") }

// Metric returns one series' value, or -1 when the scrape fails or the
// series is absent.
func (g *Gateway) Metric(series string) float64 {
	m, err := g.Metrics()
	if err != nil {
		return -1
	}
	return m.Get(series)
}

// Metrics is a scraped Prometheus text exposition: series → value.
type Metrics map[string]float64

// Get returns the series' value, -1 when absent.
func (m Metrics) Get(series string) float64 {
	if v, ok := m[series]; ok {
		return v
	}
	return -1
}

// Scrape reads a Prometheus text exposition.
func Scrape(url string) (Metrics, error) {
	code, body, err := get(url)
	if err != nil {
		return nil, err
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("testproc: %s: HTTP %d", url, code)
	}
	m := Metrics{}
	sc := bufio.NewScanner(strings.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		m[line[:i]] = v
	}
	return m, sc.Err()
}

// Upstream is an in-process HTTP server that answers 200 "ok" to
// everything; the gateways proxy to it. It is closed by the test's cleanup.
type Upstream struct {
	URL string
	srv *http.Server
}

// StartUpstream starts an Upstream.
func StartUpstream(t testing.TB) *Upstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &Upstream{URL: "http://" + ln.Addr().String()}
	u.srv = &http.Server{
		Handler:           http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }),
		ReadHeaderTimeout: 5 * time.Second,
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = u.srv.Serve(ln) }()
	t.Cleanup(func() {
		u.srv.Close()
		<-done
	})
	return u
}

// Serve runs h on a free loopback port until the test ends and returns
// its address (host:port).
func Serve(t testing.TB, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
	})
	return ln.Addr().String()
}
