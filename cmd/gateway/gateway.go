package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
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
	"github.com/allot/allot/internal/proxybuf"
	"github.com/allot/allot/pkg/redislimit"
	"github.com/allot/allot/pkg/tlsconfig"
)

// gateway owns every component and goroutine of a running gateway.
type gateway struct {
	logger *slog.Logger
	agent  *agent.Agent
	dev    *devEnv // nil unless -dev
	// withAllocators: rules come from the allocators (not standalone).
	withAllocators bool
	// stopping is set when shutdown starts: /readyz and the gRPC health
	// service report not ready while the listeners drain.
	stopping atomic.Bool
	// stop is closed when shutdown starts: the readiness watcher and the
	// health Watch streams end.
	stop   chan struct{}
	health *health.Server // nil when -rls-addr is empty

	proxy        *http.Server
	admin        *http.Server // nil when -http-addr is empty
	grpc         *grpc.Server // nil when -rls-addr is empty
	check        *http.Server // POST /json and /forward-auth/; nil when -check-addr is empty
	wg           sync.WaitGroup
	failed       chan error          // a listener stopped on its own
	redis        *redislimit.Backend // nil without a redis: block
	redisBatcher *redislimit.Batcher // nil unless batched mode is on

	shutOnce sync.Once
	shutErr  error
}

// Addresses bound by the gateway, printed on start.
type addrs struct{ proxy, rls, http, check string }

// start builds and starts everything; on error, whatever was started is
// stopped again.
func start(ctx context.Context, o options, cfg fileConfig, logger *slog.Logger, stdout io.Writer) (g *gateway, err error) {
	g = &gateway{logger: logger, failed: make(chan error, 3), stop: make(chan struct{})}
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

	upstream := cfg.Upstream
	allocators := cfg.Allocators
	if o.dev {
		if g.dev, err = startDev(ctx, o, logger, reg); err != nil {
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
	target, err := parseUpstream(upstream)
	if err != nil {
		return g, err
	}

	// The agent.
	acfg := agent.DefaultConfig()
	if o.agentID != "" {
		acfg.ID = o.agentID
	}
	acfg.Allocators = allocators
	g.withAllocators = len(allocators) > 0
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
	acfg.Logger = logger
	acfg.Registerer = reg
	if cfg.Redis != nil {
		if acfg.Redis, err = g.startRedis(*cfg.Redis, logger, reg); err != nil {
			return g, err
		}
	}
	if g.agent, err = agent.New(acfg); err != nil {
		return g, err
	}

	// The middleware and the proxy.
	ex, err := httplimit.NewExtractor(cfg.Config)
	if err != nil {
		return g, err
	}
	met, err := httplimit.NewMetrics(reg)
	if err != nil {
		return g, err
	}
	upTLS, err := cfg.UpstreamTLS.clientTLS("upstream_tls")
	if err != nil {
		return g, err
	}
	mw := &httplimit.Middleware{Checker: g.agent, Extractor: ex, Metrics: met, Logger: logger}
	handler := proxyHandler(mw, newProxy(target, upTLS, logger), cfg.bodyLimit(), cfg.bodyTimeout())

	serverTLS, err := cfg.TLS.serverTLS()
	if err != nil {
		return g, err
	}
	var bound addrs
	proxyLn, err := listen(o.listen, serverTLS)
	if err != nil {
		return g, fmt.Errorf("-listen: %w", err)
	}
	bound.proxy = proxyLn.Addr().String()
	g.proxy = &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	g.serve("proxy", func() error { return g.proxy.Serve(proxyLn) })

	var srv *rls.Server // the RLS service: gRPC on -rls-addr, POST /json on -check-addr
	if o.rlsAddr != "" || o.checkAddr != "" {
		if srv, err = rls.New(g.agent, rls.Options{Logger: logger, Registerer: reg}); err != nil {
			return g, err
		}
	}
	if o.checkAddr != "" {
		if bound.check, err = g.startCheck(o.checkAddr, srv, ex, reg, serverTLS); err != nil {
			return g, err
		}
	}
	if o.rlsAddr != "" {
		ln, err := net.Listen("tcp", o.rlsAddr)
		if err != nil {
			return g, fmt.Errorf("-rls-addr: %w", err)
		}
		bound.rls = ln.Addr().String()
		opts := rls.ServerOptions()
		if serverTLS != nil {
			opts = append(opts, grpc.Creds(credentials.NewTLS(serverTLS)))
		}
		// Envoy's RateLimitRequests are small: bound what a client can send.
		// Pings more often than every 10 s (a ping flood) close the
		// connection; an idle connection is pinged after -rls-keepalive and
		// closed if the ping goes unanswered (a half-open peer); a handshake
		// must finish within 10 s; at most -rls-max-conns are open.
		opts = append(opts, grpc.MaxRecvMsgSize(rlsMaxRecvMsgSize),
			grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
			grpc.KeepaliveParams(keepalive.ServerParameters{Time: o.rlsKeepalive, Timeout: o.rlsKeepalive}),
			grpc.ConnectionTimeout(10*time.Second))
		if o.rlsMaxConns > 0 {
			ln = netutil.LimitListener(ln, o.rlsMaxConns)
		}
		g.grpc = grpc.NewServer(opts...)
		srv.Register(g.grpc)
		// grpc.health.v1.Health: NOT_SERVING until ready (see ready), and
		// again from the start of shutdown.
		g.health = health.NewServer()
		for _, svc := range healthServices {
			g.health.SetServingStatus(svc, healthpb.HealthCheckResponse_NOT_SERVING)
		}
		healthpb.RegisterHealthServer(g.grpc, &drainingHealth{Server: g.health, stop: g.stop})
		g.serve("rls", func() error { return g.grpc.Serve(ln) })
		g.goFunc(g.watchReadiness)
	}

	if o.httpAddr != "" {
		ln, err := net.Listen("tcp", o.httpAddr)
		if err != nil {
			return g, fmt.Errorf("-http-addr: %w", err)
		}
		bound.http = ln.Addr().String()
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok\n") })
		mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Cache-Control", "no-store")
			if ok, why := g.ready(); !ok {
				http.Error(w, "not ready: "+why, http.StatusServiceUnavailable)
				return
			}
			io.WriteString(w, "ready\n")
		})
		g.admin = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		g.serve("http", func() error { return g.admin.Serve(ln) })
	}

	if g.dev != nil {
		// The demo should work at once: wait (briefly) until the agent has
		// the rules from the embedded allocator.
		if err := g.waitReady(ctx, 15*time.Second); err != nil {
			return g, err
		}
	}
	logger.Info("gateway: listening", "proxy", bound.proxy, "rls", bound.rls, "http", bound.http, "check", bound.check,
		"upstream", target.String(), "allocators", strings.Join(allocators, ","), "domain", ex.Domain())
	fmt.Fprintf(stdout, "allot gateway listening: proxy=%s rls=%s http=%s check=%s\n", bound.proxy, bound.rls, bound.http, bound.check)
	if g.dev != nil {
		printDevHelp(stdout, g.dev, bound, o.listen != "127.0.0.1:8080" || bound.proxy != "127.0.0.1:8080")
	}
	return g, nil
}

// waitReady polls g.ready until it holds, ctx ends or within passes.
func (g *gateway) waitReady(ctx context.Context, within time.Duration) error {
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, why := g.ready()
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

// ready reports whether the gateway should get traffic, and why not:
// standalone, once the agent has its rules; with allocators, once it has a
// rule set from them with version ≥ 1 (an allocator that has not applied
// its bootstrap rules yet streams the empty version 0, and a gateway
// serving that would limit nothing). Once ready, it stays ready while
// the allocators are away (the agent decides from its leases and fallback
// buckets), until shutdown starts.
func (g *gateway) ready() (bool, string) {
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

// watchReadiness keeps the gRPC health status in step with ready until
// shutdown (which sets NOT_SERVING for good).
func (g *gateway) watchReadiness() {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	serving := false
	for {
		if ok, _ := g.ready(); ok != serving {
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

// goFunc runs f as a goroutine owned by the gateway (shutdown waits for
// it); f must return once g.stop is closed.
func (g *gateway) goFunc(f func()) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		f()
	}()
}

// serve runs one listener loop as an owned goroutine.
func (g *gateway) serve(name string, f func() error) {
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

// shutdown reports not ready (/readyz 503, gRPC health NOT_SERVING),
// stops accepting, drains the proxy's and the RLS server's in-flight
// requests together (bounded by ctx; past it, what is left is cut),
// closes the agent (releasing its leases), then the dev components and the
// HTTP endpoints. Safe to call twice.
func (g *gateway) shutdown(ctx context.Context) error {
	g.shutOnce.Do(func() {
		g.stopping.Store(true)
		if g.health != nil {
			g.health.Shutdown()
		}
		close(g.stop)
		var errs []error
		var drain sync.WaitGroup // the two drains, joined here
		var proxyErr error
		if g.proxy != nil {
			drain.Add(1)
			go func() {
				defer drain.Done()
				if err := g.proxy.Shutdown(ctx); err != nil {
					proxyErr = fmt.Errorf("proxy shutdown: %w", err)
					g.proxy.Close()
				}
			}()
		}
		if g.check != nil {
			drain.Add(1)
			go func() {
				defer drain.Done()
				if err := g.check.Shutdown(ctx); err != nil {
					g.check.Close()
				}
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
		if proxyErr != nil {
			errs = append(errs, proxyErr)
		}
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
		if g.dev != nil {
			if err := g.dev.close(ctx); err != nil {
				errs = append(errs, err)
			}
		}
		if g.admin != nil {
			if err := g.admin.Shutdown(ctx); err != nil {
				g.admin.Close()
			}
		}
		g.wg.Wait()
		g.shutErr = errors.Join(errs...)
		if g.shutErr == nil {
			g.logger.Info("gateway: stopped")
		}
	})
	return g.shutErr
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

// newProxy is the reverse proxy to target. It appends the client address to
// X-Forwarded-For, drops the upstream's own RateLimit fields (the
// gateway's win), and answers 502 JSON when the upstream fails.
func newProxy(target *url.URL, tc *tls.Config, logger *slog.Logger) *httputil.ReverseProxy {
	tr := &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          1024,
		MaxIdleConnsPerHost:   1024,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		TLSClientConfig:       tc,
		ForceAttemptHTTP2:     tc != nil,
	}
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			pr.SetXForwarded()
		},
		Transport:  tr,
		BufferPool: &copyBuffers,
		ModifyResponse: func(resp *http.Response) error {
			if bodyTimedOut(resp.Request) {
				return errBodyTimeout // the upstream answered a truncated body
			}
			resp.Header.Del(httplimit.HeaderRateLimit)
			resp.Header.Del(httplimit.HeaderRateLimitPolicy)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			// A body read past request_body_timeout also cancels the
			// request's context: check it first.
			if errors.Is(err, errBodyTimeout) || bodyTimedOut(r) {
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Connection", "close")
				w.WriteHeader(http.StatusRequestTimeout)
				io.WriteString(w, `{"error":"request_timeout","message":"The request body was not received in time."}`)
				return
			}
			if errors.Is(err, context.Canceled) {
				return // the client went away
			}
			if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
				writeTooLarge(w, mbe.Limit)
				return
			}
			logger.Warn("gateway: upstream error", "err", err, "method", r.Method) // no path: it may carry keys
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			io.WriteString(w, `{"error":"bad_gateway","message":"The upstream service is unavailable."}`)
		},
		ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
}

// copyBuffers is the proxy's copy-buffer pool.
var copyBuffers proxybuf.Pool

// startRedis builds the Redis backend for rules with `backend: redis`:
// optionally in batched mode and with hot-key promotion. Closed by shutdown
// after the agent (the batcher hands back what it holds).
func (g *gateway) startRedis(fc redislimit.FileConfig, logger *slog.Logger, reg prometheus.Registerer) (*redislimit.RuleLimiter, error) {
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

// rlsMaxRecvMsgSize bounds one RLS request (Envoy sends a few descriptors).
const rlsMaxRecvMsgSize = 1 << 20

// proxyHandler is the proxy listener's request path: the body bounds (size
// and read time), then the limiter, then the reverse proxy. mw nil leaves
// the limiter out (the handler benchmark's baseline).
func proxyHandler(mw *httplimit.Middleware, proxy http.Handler, bodyLimit int64, bodyTimeout time.Duration) http.Handler {
	if mw != nil {
		proxy = mw.Wrap(proxy)
	}
	return limitBody(timeBody(proxy, bodyTimeout), bodyLimit)
}

// errBodyTimeout is the error a request body read returns once the body
// has taken longer than request_body_timeout; the proxy answers 408.
var errBodyTimeout = errors.New("gateway: request body read timed out")

// timeBody bounds the time spent reading a request's body to d (0: no
// bound) with a read deadline on the client connection, lifted once the
// body has been read (so the upstream's answer may take as long as it
// takes). A read past the deadline fails with errBodyTimeout.
func timeBody(next http.Handler, d time.Duration) http.Handler {
	if d <= 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil && r.Body != http.NoBody {
			rc := http.NewResponseController(w)
			if err := rc.SetReadDeadline(time.Now().Add(d)); err == nil {
				tb := &timedBody{ReadCloser: r.Body, rc: rc}
				r = r.WithContext(context.WithValue(r.Context(), timedBodyKey{}, tb))
				r.Body = tb
			}
		}
		next.ServeHTTP(w, r)
	})
}

type timedBody struct {
	io.ReadCloser
	rc       *http.ResponseController
	done     bool
	timedOut atomic.Bool
}

// timedBodyKey is the request context key of its *timedBody (the proxy
// wraps the body it passes on, so the body itself is not found again).
type timedBodyKey struct{}

// bodyTimedOut reports whether r's body read ran past its deadline.
func bodyTimedOut(r *http.Request) bool {
	if r == nil {
		return false
	}
	tb, ok := r.Context().Value(timedBodyKey{}).(*timedBody)
	return ok && tb.timedOut.Load()
}

func (b *timedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == nil:
	case errors.Is(err, os.ErrDeadlineExceeded):
		b.timedOut.Store(true)
		err = errBodyTimeout
	default: // io.EOF or another end: lift the deadline
		b.lift()
	}
	return n, err
}

func (b *timedBody) Close() error {
	b.lift()
	return b.ReadCloser.Close()
}

func (b *timedBody) lift() {
	if !b.done {
		b.done = true
		_ = b.rc.SetReadDeadline(time.Time{})
	}
}

// limitBody answers 413 for a request whose declared body exceeds limit,
// and bounds the bytes read from any body to limit (the proxy's error
// handler turns the overflow into a 413). limit 0: no bound.
func limitBody(next http.Handler, limit int64) http.Handler {
	if limit <= 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > limit {
			writeTooLarge(w, limit)
			return
		}
		if r.Body != nil && r.Body != http.NoBody {
			r.Body = http.MaxBytesReader(w, r.Body, limit)
		}
		next.ServeHTTP(w, r)
	})
}

func writeTooLarge(w http.ResponseWriter, limit int64) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Connection", "close")
	w.WriteHeader(http.StatusRequestEntityTooLarge)
	fmt.Fprintf(w, `{"error":"request_too_large","message":"The request body is larger than %d bytes."}`, limit)
}
