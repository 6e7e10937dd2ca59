// Package gateway is allot's HTTP gateway as a library: a reverse proxy
// that rate-limits every request in-process with an embedded agent
// (agent/httplimit's middleware), an Envoy rate limit service (agent/rls)
// backed by the same agent, and the metrics and health endpoints.
// cmd/gateway maps its flags and config file to a Config and runs Start.
//
// Start builds and starts everything; Shutdown drains it. The proxy
// listener serves NewHandler(middleware, NewProxy(upstream), body bounds):
// a program that wants only the request path, not the listeners, builds
// it from those two functions.
//
// Readiness (/readyz, the gRPC health service and Ready): standalone, once
// the agent has rules; with allocators, once it has a rule set of version
// ≥ 1 from them. Shutdown reports not ready first, then stops accepting,
// drains in-flight proxy and RLS requests together and closes the agent,
// which hands its unspent leases back.
package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/agent/rls"
	"github.com/allot/allot/pkg/redislimit"
)

// Gateway is a running gateway: its listeners, agent and Redis backend.
// Its methods are safe for concurrent use.
type Gateway struct {
	logger *slog.Logger
	agent  *agent.Agent
	domain string
	addrs  Addrs
	// withAllocators: rules come from the allocators (not standalone).
	withAllocators bool
	// stopping is set when shutdown starts: /readyz and the gRPC health
	// service report not ready while the listeners drain.
	stopping atomic.Bool
	// stop is closed when shutdown starts: the readiness watcher and the
	// health Watch streams end.
	stop   chan struct{}
	health *health.Server // nil without an RLS listener

	proxy        *http.Server
	admin        *http.Server // nil without an HTTP listener
	grpc         *grpc.Server // nil without an RLS listener
	check        *http.Server // POST /json and /forward-auth; nil without a check listener
	wg           sync.WaitGroup
	failed       chan error          // a listener stopped on its own
	redis        *redislimit.Backend // nil without Config.Redis
	redisBatcher *redislimit.Batcher // nil unless batched mode is on

	shutOnce sync.Once
	shutErr  error
}

// Addrs are the addresses a Gateway bound; "" for a listener that is off.
type Addrs struct{ Proxy, RLS, HTTP, Check string }

// Start validates cfg, builds the agent, the middleware and the proxy,
// and starts the listeners. On error, whatever was started is stopped
// again (bounded by cfg.ShutdownTimeout).
func Start(cfg Config) (g *Gateway, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.Default()
	}
	reg := cfg.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	g = &Gateway{logger: logger, failed: make(chan error, 4), stop: make(chan struct{})}
	defer func() {
		if err != nil {
			sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
			defer cancel()
			_ = g.Shutdown(sctx)
			g = nil
		}
	}()

	acfg := cfg.Agent
	g.withAllocators = len(acfg.Allocators) > 0 || len(acfg.Clients) > 0
	if acfg.Logger == nil {
		acfg.Logger = logger
	}
	if acfg.Registerer == nil {
		acfg.Registerer = reg
	}
	if cfg.Redis != nil {
		if acfg.Redis, err = g.startRedis(*cfg.Redis, logger, reg); err != nil {
			return g, err
		}
	}
	if g.agent, err = agent.New(acfg); err != nil {
		return g, err
	}

	ex, err := httplimit.NewExtractor(cfg.Extraction)
	if err != nil {
		return g, err
	}
	g.domain = ex.Domain()
	met, err := httplimit.NewMetrics(reg)
	if err != nil {
		return g, err
	}
	mw := &httplimit.Middleware{Checker: g.agent, Extractor: ex, Metrics: met, Logger: logger}
	handler := NewHandler(mw, NewProxy(cfg.Upstream, cfg.UpstreamTLS, logger), cfg.MaxRequestBodyBytes, cfg.RequestBodyTimeout)

	proxyLn, err := listen(cfg.Listen, cfg.TLS)
	if err != nil {
		return g, fmt.Errorf("gateway: proxy listener: %w", err)
	}
	g.addrs.Proxy = proxyLn.Addr().String()
	g.proxy = &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	g.serve("proxy", func() error { return g.proxy.Serve(proxyLn) })

	var srv *rls.Server // the RLS service: gRPC on RLSAddr, POST /json on CheckAddr
	if cfg.RLSAddr != "" || cfg.CheckAddr != "" {
		if srv, err = rls.New(g.agent, rls.Options{Logger: g.logger, Registerer: reg}); err != nil {
			return g, err
		}
	}
	if cfg.CheckAddr != "" {
		if err := g.startCheck(cfg, srv, ex, reg); err != nil {
			return g, err
		}
	}
	if cfg.RLSAddr != "" {
		if err := g.startRLS(cfg, srv); err != nil {
			return g, err
		}
	}
	if cfg.HTTPAddr != "" {
		if err := g.startHTTP(cfg.HTTPAddr, reg); err != nil {
			return g, err
		}
	}
	return g, nil
}

// startRLS serves the Envoy RLS and the gRPC health service on addr.
func (g *Gateway) startRLS(cfg Config, srv *rls.Server) error {
	ln, err := net.Listen("tcp", cfg.RLSAddr)
	if err != nil {
		return fmt.Errorf("gateway: RLS listener: %w", err)
	}
	g.addrs.RLS = ln.Addr().String()
	opts := rls.ServerOptions()
	if cfg.TLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(cfg.TLS)))
	}
	// Envoy's RateLimitRequests are small: bound what a client can send
	// (and so what decoding a request allocates before it is validated).
	// Pings more often than every 10 s (a ping flood) close the
	// connection; an idle connection is pinged after RLSKeepalive and
	// closed if the ping goes unanswered (a half-open peer); a handshake
	// must finish within 10 s; at most RLSMaxConns are open.
	maxRecv := cfg.RLSMaxRequestBytes
	if maxRecv == 0 {
		maxRecv = DefaultRLSMaxRequestBytes
	}
	opts = append(opts, grpc.MaxRecvMsgSize(maxRecv),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: cfg.RLSKeepalive, Timeout: cfg.RLSKeepalive}),
		grpc.ConnectionTimeout(10*time.Second))
	opts = append(opts, cfg.RLSServerOptions...)
	if cfg.RLSMaxConns > 0 {
		ln = netutil.LimitListener(ln, cfg.RLSMaxConns)
	}
	g.grpc = grpc.NewServer(opts...)
	srv.Register(g.grpc)
	// grpc.health.v1.Health: NOT_SERVING until ready (see Ready), and
	// again from the start of shutdown.
	g.health = health.NewServer()
	for _, svc := range healthServices {
		g.health.SetServingStatus(svc, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	healthpb.RegisterHealthServer(g.grpc, &drainingHealth{Server: g.health, stop: g.stop})
	g.serve("rls", func() error { return g.grpc.Serve(ln) })
	g.goFunc(g.watchReadiness)
	return nil
}

// ForwardAuthPath is the check listener's forward-auth endpoint: it and
// every path under it (ForwardAuthPath + "/...") answer a forward-auth
// check.
const ForwardAuthPath = "/forward-auth"

// IsForwardAuthPath reports whether the check listener answers path with a
// forward-auth check: ForwardAuthPath or a path under it.
func IsForwardAuthPath(path string) bool {
	rest, ok := strings.CutPrefix(path, ForwardAuthPath)
	return ok && (rest == "" || rest[0] == '/')
}

// startCheck serves the check endpoints on cfg.CheckAddr: POST /json (the
// RLS service as envoyproxy/ratelimit's JSON API) and ForwardAuthPath
// (the proxy's decision for a forwarded request).
func (g *Gateway) startCheck(cfg Config, srv *rls.Server, ex *httplimit.Extractor, reg prometheus.Registerer) error {
	met, err := httplimit.NewForwardAuthMetrics(reg)
	if err != nil {
		return err
	}
	fa := &httplimit.ForwardAuth{Middleware: &httplimit.Middleware{Checker: g.agent, Extractor: ex, Metrics: met, Logger: g.logger}}
	routes := checkRoutes(srv.JSONHandler(0), fa)
	ln, err := listen(cfg.CheckAddr, cfg.TLS)
	if err != nil {
		return fmt.Errorf("gateway: check listener: %w", err)
	}
	g.addrs.Check = ln.Addr().String()
	h := routes
	if cfg.CheckHandler != nil {
		h = cfg.CheckHandler(routes)
	}
	g.check = &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(g.logger.Handler(), slog.LevelWarn),
	}
	g.serve("check", func() error { return g.check.Serve(ln) })
	return nil
}

// checkRoutes routes the check listener: rls.JSONPath to jsonH,
// ForwardAuthPath and every path under it to fa, any other path to a JSON
// 404. Paths are taken as sent, never cleaned or redirected: nginx's
// auth_request answers a redirected check with a 500.
func checkRoutes(jsonH, fa http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch p := r.URL.Path; {
		case p == rls.JSONPath:
			jsonH.ServeHTTP(w, r)
		case IsForwardAuthPath(p):
			fa.ServeHTTP(w, r)
		default:
			writeNotFound(w)
		}
	})
}

// startHTTP serves /metrics, /healthz and /readyz on addr.
func (g *Gateway) startHTTP(addr string, reg *prometheus.Registry) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("gateway: HTTP listener: %w", err)
	}
	g.addrs.HTTP = ln.Addr().String()
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		if ok, why := g.Ready(); !ok {
			http.Error(w, "not ready: "+why, http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ready\n")
	})
	g.admin = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	g.serve("http", func() error { return g.admin.Serve(ln) })
	return nil
}

// Addrs returns the bound addresses.
func (g *Gateway) Addrs() Addrs { return g.addrs }

// Agent returns the embedded agent.
func (g *Gateway) Agent() *agent.Agent { return g.agent }

// Domain returns the rate limit domain of the proxied requests.
func (g *Gateway) Domain() string { return g.domain }

// Failed delivers the error of a listener that stopped on its own; the
// caller should then Shutdown.
func (g *Gateway) Failed() <-chan error { return g.failed }

// WaitReady polls Ready until it holds, ctx ends or within passes.
func (g *Gateway) WaitReady(ctx context.Context, within time.Duration) error {
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, why := g.Ready()
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline.C:
			return fmt.Errorf("not ready after %v: %s", within, why)
		case <-tick.C:
		}
	}
}

// Ready reports whether the gateway should get traffic, and why not:
// standalone, once the agent has its rules; with allocators, once it has a
// rule set from them with version ≥ 1 (an allocator that has not applied
// its bootstrap rules yet streams the empty version 0, and a gateway
// serving that would limit nothing). Once ready, it stays ready while
// the allocators are away (the agent decides from its leases and fallback
// buckets), until shutdown starts.
func (g *Gateway) Ready() (bool, string) {
	switch {
	case g.stopping.Load():
		return false, "shutting down"
	case !g.agent.Ready() && g.withAllocators:
		return false, "no answer from an allocator yet"
	case !g.agent.Ready():
		return false, "no rules yet"
	case g.withAllocators && g.agent.Rules().Version() < 1:
		return false, "the allocators have no rules yet (rule set version 0): apply rules, or wait for the bootstrap rules"
	}
	return true, ""
}

// healthServices are the names the gRPC health service answers for: the
// server as a whole ("") and the RLS service.
var healthServices = []string{"", rlsv3.RateLimitService_ServiceDesc.ServiceName}

// watchReadiness keeps the gRPC health status in step with Ready until
// shutdown (which sets NOT_SERVING for good).
func (g *Gateway) watchReadiness() {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	serving := false
	for {
		if ok, _ := g.Ready(); ok != serving {
			serving = ok
			st := healthpb.HealthCheckResponse_NOT_SERVING
			if ok {
				st = healthpb.HealthCheckResponse_SERVING
				g.logger.Info("gateway: ready")
			}
			for _, svc := range healthServices {
				g.health.SetServingStatus(svc, st)
			}
		}
		select {
		case <-g.stop:
			return
		case <-tick.C:
		}
	}
}

// drainingHealth is the health service, with Watch streams that end when
// shutdown starts (after NOT_SERVING is sent): a watcher's stream must not
// hold the RLS server's graceful stop until the shutdown timeout.
type drainingHealth struct {
	*health.Server
	stop <-chan struct{}
}

func (h *drainingHealth) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	done := make(chan struct{})
	defer func() { <-done }() // runs last, after cancel
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	go func() { // owned by this call: ends with it
		defer close(done)
		select {
		case <-h.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	err := h.Server.Watch(req, watchStream{stream, ctx})
	select {
	case <-h.stop:
		// The update from Shutdown may have lost the race with cancel.
		_ = stream.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_NOT_SERVING})
		return status.Error(codes.Unavailable, "gateway: shutting down")
	default:
		return err
	}
}

// watchStream is a Watch stream with a context that also ends at shutdown.
type watchStream struct {
	healthpb.Health_WatchServer
	ctx context.Context
}

func (w watchStream) Context() context.Context { return w.ctx }

// goFunc runs f as a goroutine owned by the gateway (Shutdown waits for
// it); f must return once g.stop is closed.
func (g *Gateway) goFunc(f func()) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		f()
	}()
}

// serve runs one listener loop as an owned goroutine.
func (g *Gateway) serve(name string, f func() error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		if err := f(); err != nil && !errors.Is(err, http.ErrServerClosed) && !errors.Is(err, grpc.ErrServerStopped) {
			select {
			case g.failed <- fmt.Errorf("%s: %w", name, err):
			default:
			}
		}
	}()
}

// Shutdown reports not ready (/readyz 503, gRPC health NOT_SERVING),
// stops accepting, drains the proxy's, the check listener's and the RLS
// server's in-flight requests together (bounded by ctx; past it, what is
// left is cut), closes the agent (releasing its leases), the Redis
// backend, then the HTTP endpoints. It returns every failure joined; an
// HTTP server whose drain was cut names itself ("check shutdown: context
// deadline exceeded"). Safe to call twice.
func (g *Gateway) Shutdown(ctx context.Context) error {
	g.shutOnce.Do(func() {
		g.stopping.Store(true)
		if g.health != nil {
			g.health.Shutdown()
		}
		close(g.stop)
		var errs []error
		var drain sync.WaitGroup // the drains, joined here
		var proxyErr, checkErr error
		if g.proxy != nil {
			drain.Add(1)
			go func() {
				defer drain.Done()
				proxyErr = shutdownHTTP(ctx, "proxy", g.proxy)
			}()
		}
		if g.check != nil {
			drain.Add(1)
			go func() {
				defer drain.Done()
				checkErr = shutdownHTTP(ctx, "check", g.check)
			}()
		}
		if g.grpc != nil {
			drain.Add(1)
			go func() {
				defer drain.Done()
				stopped := make(chan struct{})
				go func() { g.grpc.GracefulStop(); close(stopped) }()
				select {
				case <-stopped:
				case <-ctx.Done():
					g.grpc.Stop()
					<-stopped
				}
			}()
		}
		drain.Wait()
		errs = append(errs, proxyErr, checkErr)
		if g.agent != nil {
			if err := g.agent.Close(ctx); err != nil {
				errs = append(errs, err)
			}
		}
		if g.redisBatcher != nil {
			if err := g.redisBatcher.Close(ctx); err != nil {
				errs = append(errs, fmt.Errorf("redis batcher: %w", err))
			}
		}
		if g.redis != nil {
			if err := g.redis.Close(); err != nil {
				errs = append(errs, fmt.Errorf("redis: %w", err))
			}
		}
		if g.admin != nil {
			errs = append(errs, shutdownHTTP(ctx, "http", g.admin))
		}
		g.wg.Wait()
		g.shutErr = errors.Join(errs...)
	})
	return g.shutErr
}

// shutdownHTTP drains s within ctx and closes what is left past it; the
// error names the server.
func shutdownHTTP(ctx context.Context, name string, s *http.Server) error {
	if err := s.Shutdown(ctx); err != nil {
		s.Close()
		return fmt.Errorf("%s shutdown: %w", name, err)
	}
	return nil
}

func listen(addr string, tc *tls.Config) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	if tc != nil {
		ln = tls.NewListener(ln, tc)
	}
	return ln, nil
}

// startRedis builds the Redis backend for rules with `backend: redis`:
// optionally in batched mode and with hot-key promotion. Closed by
// Shutdown after the agent (the batcher hands back what it holds).
func (g *Gateway) startRedis(fc redislimit.FileConfig, logger *slog.Logger, reg prometheus.Registerer) (*redislimit.RuleLimiter, error) {
	rc, err := fc.Config()
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	rc.Logger, rc.Registerer = logger, reg
	if g.redis, err = redislimit.New(rc); err != nil {
		return nil, err
	}
	rl := &redislimit.RuleLimiter{Backend: g.redis, Logger: logger}
	if bc, ok, err := fc.BatchConfig(); err != nil {
		return nil, fmt.Errorf("redis: batched: %w", err)
	} else if ok {
		if g.redisBatcher, err = redislimit.NewBatcher(g.redis, bc); err != nil {
			return nil, err
		}
		rl.Batcher = g.redisBatcher
	}
	if pc, ok, err := fc.PromoterConfig(); err != nil {
		return nil, fmt.Errorf("redis: promote: %w", err)
	} else if ok {
		if rl.Promoter, err = redislimit.NewPromoter(pc); err != nil {
			return nil, err
		}
	}
	return rl, nil
}
