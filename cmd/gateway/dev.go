package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/allocator"
	"github.com/allot/allot/internal/tracing"
	"github.com/allot/allot/pkg/rules"
)

// devEnv is what -dev adds: a single-node allocator with the example rules
// and a demo upstream, both in-process.
type devEnv struct {
	dir         string
	alloc       *allocator.Server
	upstream    *http.Server
	upstreamURL string
	wg          sync.WaitGroup
}

// devExtraction is the -dev descriptor configuration: the three
// descriptors the example rules expect (docs/rules.md).
func devExtraction() httplimit.Config {
	return httplimit.Config{
		Domain: "public-api",
		APIKey: httplimit.APIKeyConfig{Headers: []string{"Authorization", "X-API-Key"}},
		Tier: httplimit.TierConfig{
			Keys:    map[string]string{"k_free_demo": "free", "k_premium_demo": "premium", "k_live_abc123": "premium"},
			Default: "free",
		},
		Routes: httplimit.RoutesConfig{Paths: []string{"/v1/search"}, Default: "other"},
		Descriptors: []httplimit.DescriptorConfig{
			{{Source: httplimit.SourceTier}, {Source: httplimit.SourceAPIKey}},
			{{Source: httplimit.SourceTier}, {Source: httplimit.SourceRoute}, {Source: httplimit.SourceAPIKey}},
			{{Source: httplimit.SourceAPIKey}},
		},
	}
}

// startDev starts the allocator (real Raft and bolt, in a temporary
// directory removed on close) and the demo upstream, and waits until the
// allocator has a leader and the rules. tr, when set, traces the
// allocator's gRPC server.
func startDev(ctx context.Context, o options, logger *slog.Logger, reg prometheus.Registerer, tr *tracing.Tracing) (d *devEnv, err error) {
	d = &devEnv{}
	defer func() {
		if err != nil {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = d.close(sctx)
		}
	}()
	if d.dir, err = os.MkdirTemp("", "allot-dev-"); err != nil {
		return d, err
	}
	// Raft is chatty at info; the embedded allocator logs warnings unless
	// the gateway runs at debug level.
	alog := logger
	if !logger.Enabled(ctx, slog.LevelDebug) {
		alog = slog.New(levelFloor{logger.Handler(), slog.LevelWarn})
	}
	cfg := allocator.DefaultConfig()
	cfg.NodeID = "dev"
	cfg.DataDir = d.dir
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0", ""
	cfg.Bootstrap = true
	cfg.InitialRules = rules.ExampleFiles()
	cfg.Logger = alog.With("component", "allocator")
	// Labelled, so that cluster alerts can tell it from real allocators
	// (deploy/prometheus/alerts.yaml).
	cfg.Registerer = prometheus.WrapRegistererWith(prometheus.Labels{"embedded": "true"}, reg)
	if tr != nil {
		cfg.ServerOptions = append(cfg.ServerOptions, tr.ServerOption())
		cfg.DialOptions = append(cfg.DialOptions, tr.DialOption())
	}
	if d.alloc, err = allocator.New(cfg); err != nil {
		return d, fmt.Errorf("dev allocator: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err = d.alloc.WaitReady(wctx); err != nil {
		return d, fmt.Errorf("dev allocator not ready: %w", err)
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return d, fmt.Errorf("dev upstream: %w", err)
	}
	d.upstreamURL = "http://" + ln.Addr().String()
	d.upstream = &http.Server{Handler: http.HandlerFunc(demoUpstream), ReadHeaderTimeout: 10 * time.Second}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		if err := d.upstream.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("gateway: dev upstream stopped", "err", err)
		}
	}()
	return d, nil
}

// demoUpstream answers every request with a small JSON document.
func demoUpstream(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"ok":      true,
		"method":  r.Method,
		"path":    r.URL.Path,
		"message": "hello from the allot demo upstream",
	})
}

func (d *devEnv) close(ctx context.Context) error {
	var errs []error
	if d.upstream != nil {
		if err := d.upstream.Shutdown(ctx); err != nil {
			d.upstream.Close()
		}
		d.wg.Wait()
	}
	if d.alloc != nil {
		if err := d.alloc.Shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("dev allocator shutdown: %w", err))
		}
	}
	if d.dir != "" {
		if err := os.RemoveAll(d.dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func printDevHelp(w io.Writer, d *devEnv, a addrs, _ bool) {
	base := "http://" + a.proxy
	var b strings.Builder
	fmt.Fprintf(&b, `
allot gateway, dev mode
  proxy       %s  ->  demo upstream %s
  allocator   %s (single node, data in %s, removed on exit)
`, base, d.upstreamURL, d.alloc.GRPCAddr(), d.dir)
	if a.rls != "" {
		fmt.Fprintf(&b, "  Envoy RLS   %s (domain public-api)\n", a.rls)
	}
	if a.http != "" {
		fmt.Fprintf(&b, "  metrics     http://%s/metrics\n", a.http)
	}
	fmt.Fprintf(&b, `
Rules (domain public-api; descriptors [tier, api_key], [tier, route, api_key], [api_key]):
  k_free_demo     tier free:    30/minute, burst 10, on /v1/search   (policy free_search)
  k_premium_demo  tier premium: 1000/minute, burst 200               (policy premium)
  k_live_abc123   tier premium, dark-launched 5/minute override in shadow mode: never 429, counted

Try:
  for i in $(seq 12); do curl -s -o /dev/null -w '%%{http_code}\n' -H 'X-API-Key: k_free_demo' %[1]s/v1/search; done
  curl -i -H 'X-API-Key: k_free_demo' %[1]s/v1/search
  curl -i -H 'Authorization: Bearer k_premium_demo' %[1]s/v1/search
  for i in $(seq 8); do curl -s -o /dev/null -w '%%{http_code}\n' -H 'X-API-Key: k_live_abc123' %[1]s/v1/search; done
`, base)
	if a.http != "" {
		fmt.Fprintf(&b, "  curl -s http://%s/metrics | grep allot_gateway_requests_total\n", a.http)
	}
	fmt.Fprintln(&b, "\nCtrl-C stops everything.")
	io.WriteString(w, b.String())
}

// levelFloor drops records below min.
type levelFloor struct {
	slog.Handler
	min slog.Level
}

func (h levelFloor) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.min && h.Handler.Enabled(ctx, l)
}

func (h levelFloor) WithAttrs(as []slog.Attr) slog.Handler {
	return levelFloor{h.Handler.WithAttrs(as), h.min}
}

func (h levelFloor) WithGroup(name string) slog.Handler {
	return levelFloor{h.Handler.WithGroup(name), h.min}
}
