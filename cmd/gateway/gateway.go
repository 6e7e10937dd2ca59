package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/agent/rls"
	"github.com/allot/allot/gateway"
	"github.com/allot/allot/internal/tracing"
	"github.com/allot/allot/pkg/tlsconfig"
)

// gw is a running gateway: the library's, and the -dev components.
type gw struct {
	*gateway.Gateway
	logger *slog.Logger
	dev    *devEnv          // nil unless -dev
	tr     *tracing.Tracing // nil unless -otel
}

// Addresses bound by the gateway, printed on start.
type addrs struct{ proxy, rls, http, check string }

// start maps the flags and the config file to a gateway.Config, starts
// the -dev components when asked, and starts the gateway; on error,
// whatever was started is stopped again.
func start(ctx context.Context, o options, cfg fileConfig, logger *slog.Logger, stdout io.Writer) (g *gw, err error) {
	g = &gw{logger: logger}
	defer func() {
		if err != nil {
			sctx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
			defer cancel()
			_ = g.shutdown(sctx)
			g = nil
		}
	}()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	if o.otel {
		if tracing.Disabled() {
			logger.Warn("gateway: -otel is ignored: OTEL_SDK_DISABLED=true")
		} else if g.tr, err = tracing.Start(ctx, "allot-gateway", logger); err != nil {
			return g, err
		}
	}

	upstream := cfg.Upstream
	allocators := cfg.Allocators
	if o.dev {
		if g.dev, err = startDev(ctx, o, logger, reg, g.tr); err != nil {
			return g, err
		}
		if len(cfg.Descriptors) == 0 {
			cfg.Config = devExtraction()
		}
		upstream = g.dev.upstreamURL
		allocators = []string{g.dev.alloc.GRPCAddr()}
	}
	if o.upstream != "" {
		upstream = o.upstream
	}
	if len(o.allocators) > 0 {
		allocators = o.allocators
	}
	gc := gateway.DefaultConfig()
	if gc.Upstream, err = parseUpstream(upstream); err != nil {
		return g, err
	}
	gc.Listen, gc.RLSAddr, gc.HTTPAddr, gc.CheckAddr = o.listen, o.rlsAddr, o.httpAddr, o.checkAddr
	gc.Extraction = cfg.Config
	gc.MaxRequestBodyBytes = cfg.bodyLimit()
	gc.RequestBodyTimeout = cfg.bodyTimeout()
	gc.RLSMaxConns, gc.RLSKeepalive, gc.RLSMaxRequestBytes = o.rlsMaxConns, o.rlsKeepalive, o.rlsMaxRequest
	gc.Redis = cfg.Redis
	gc.Logger, gc.Registry, gc.ShutdownTimeout = logger, reg, o.shutdownTimeout
	if gc.UpstreamTLS, err = cfg.UpstreamTLS.clientTLS("upstream_tls"); err != nil {
		return g, err
	}
	if gc.TLS, err = cfg.TLS.serverTLS(); err != nil {
		return g, err
	}

	// The agent.
	acfg := &gc.Agent
	if o.agentID != "" {
		acfg.ID = o.agentID
	}
	acfg.Allocators = allocators
	if len(allocators) == 0 {
		acfg.RulesFiles = cfg.Rules
		if len(cfg.Rules) == 0 {
			logger.Warn("gateway: standalone without rules files: nothing is limited")
		}
	} else if len(cfg.Rules) > 0 {
		logger.Warn("gateway: rules files are ignored with -allocators: rules come from the allocator")
	}
	if cfg.AllocatorTLS.enabled() {
		creds, id, err := allocatorCredentials(cfg.AllocatorTLS, logger)
		if err != nil {
			return g, err
		}
		acfg.DialOptions = append(acfg.DialOptions, grpc.WithTransportCredentials(creds))
		if id != "" && !tlsconfig.AgentIDMatches(acfg.ID, id) {
			// Under mutual TLS the allocator accepts only agent ids that are
			// the certificate's agent name, or name/<incarnation>.
			acfg.ID = id + "/" + acfg.ID
		}
	}

	if g.tr != nil {
		gc.RLSServerOptions = append(gc.RLSServerOptions, g.tr.ServerOption())
		gc.CheckHandler = func(h http.Handler) http.Handler { return g.tr.HTTPHandler(h, checkSpanName) }
		acfg.DialOptions = append(acfg.DialOptions, g.tr.DialOption())
	}

	if g.Gateway, err = gateway.Start(gc); err != nil {
		return g, err
	}
	if g.dev != nil {
		// The demo should work at once: wait (briefly) until the agent has
		// the rules from the embedded allocator.
		if err := g.WaitReady(ctx, 15*time.Second); err != nil {
			return g, err
		}
	}
	ga := g.Addrs()
	bound := addrs{proxy: ga.Proxy, rls: ga.RLS, http: ga.HTTP, check: ga.Check}
	logger.Info("gateway: listening", "proxy", bound.proxy, "rls", bound.rls, "http", bound.http, "check", bound.check,
		"upstream", gc.Upstream.String(), "allocators", strings.Join(allocators, ","), "domain", g.Domain())
	fmt.Fprintf(stdout, "allot gateway listening: proxy=%s rls=%s http=%s check=%s\n", bound.proxy, bound.rls, bound.http, bound.check)
	if g.dev != nil {
		printDevHelp(stdout, g.dev, bound, o.listen != "127.0.0.1:8080" || bound.proxy != "127.0.0.1:8080")
	}
	return g, nil
}

// shutdown drains and stops the gateway (see gateway.Gateway.Shutdown),
// then the -dev components. Safe to call twice.
func (g *gw) shutdown(ctx context.Context) error {
	var errs []error
	if g.Gateway != nil {
		errs = append(errs, g.Gateway.Shutdown(ctx))
	}
	if g.dev != nil {
		errs = append(errs, g.dev.close(ctx))
	}
	if g.tr != nil {
		// Last, so that the spans of the drained calls are exported too.
		errs = append(errs, g.tr.Shutdown(ctx))
	}
	err := errors.Join(errs...)
	if err == nil {
		g.logger.Info("gateway: stopped")
	}
	return err
}

// checkSpanName names a check listener request's span: its route, never
// the raw path (forward-auth paths are the client's).
func checkSpanName(r *http.Request) string {
	switch p := r.URL.Path; {
	case p == rls.JSONPath:
		return "POST " + rls.JSONPath
	case gateway.IsForwardAuthPath(p):
		return "forward-auth"
	}
	return "not found"
}

func parseUpstream(s string) (*url.URL, error) {
	if s == "" {
		return nil, errors.New("no upstream: give -upstream URL, `upstream:` in the config file, or -dev")
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("upstream %q: want an http:// or https:// URL with a host", s)
	}
	return u, nil
}

// newProxy is the gateway's reverse proxy (gateway.NewProxy).
func newProxy(target *url.URL, tc *tls.Config, logger *slog.Logger) *httputil.ReverseProxy {
	return gateway.NewProxy(target, tc, logger)
}

// proxyHandler is the proxy listener's request path (gateway.NewHandler).
// mw nil leaves the limiter out (the handler benchmark's baseline).
func proxyHandler(mw *httplimit.Middleware, proxy http.Handler, bodyLimit int64, bodyTimeout time.Duration) http.Handler {
	return gateway.NewHandler(mw, proxy, bodyLimit, bodyTimeout)
}

// limitBody is the request body bound (gateway.LimitBody).
func limitBody(next http.Handler, limit int64) http.Handler { return gateway.LimitBody(next, limit) }

// allocatorCredentials builds the agent's gRPC credentials for allocator_tls
// with pkg/tlsconfig: the allocator must present an allocator certificate,
// files are re-read when they change (rotation), and a client certificate
// with an agent identity yields the agent name the allocator will demand
// (id is "" without one). insecure_skip_verify keeps plain crypto/tls
// without verification, for tests only.
func allocatorCredentials(t tlsConfig, logger *slog.Logger) (creds credentials.TransportCredentials, id string, err error) {
	if t.InsecureSkipVerify {
		tc, err := t.clientTLS("allocator_tls")
		if err != nil {
			return nil, "", err
		}
		logger.Warn("gateway: allocator_tls.insecure_skip_verify: the allocator's certificate is not verified")
		return credentials.NewTLS(tc), "", nil
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		return nil, "", errors.New("allocator_tls: cert_file and key_file go together")
	}
	l, err := tlsconfig.Load(tlsconfig.Options{CAFile: t.CAFile, CertFile: t.CertFile, KeyFile: t.KeyFile,
		OnReloadError: func(err error) {
			logger.Warn("gateway: allocator_tls reload failed; keeping the previous certificates", "err", err)
		}})
	if err != nil {
		return nil, "", fmt.Errorf("allocator_tls: %w", err)
	}
	if l.HasCertificate() {
		ident, err := l.Identity()
		switch {
		case err != nil:
			return nil, "", fmt.Errorf("allocator_tls: %w", err)
		case ident.Role == tlsconfig.RoleAgent:
			id = ident.Name
		default:
			logger.Warn("gateway: allocator_tls certificate is not an agent certificate; the allocator may refuse Acquire",
				"identity", ident.String())
		}
	}
	return l.ClientCredentials(t.ServerName, tlsconfig.RoleAllocator), id, nil
}
