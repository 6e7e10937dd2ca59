package gateway

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/redislimit"
)

// DefaultMaxRequestBodyBytes is DefaultConfig's request body bound, 10 MiB.
const DefaultMaxRequestBodyBytes = 10 << 20

// DefaultRequestBodyTimeout is DefaultConfig's request body read bound.
const DefaultRequestBodyTimeout = 60 * time.Second

// DefaultRLSMaxRequestBytes is DefaultConfig's bound on one RLS request,
// 64 KiB: Envoy's requests carry a few descriptors, a few hundred bytes.
const DefaultRLSMaxRequestBytes = 64 << 10

// Config configures a Gateway. Start it from DefaultConfig: the zero value
// has no proxy listener and no upstream. Start calls Validate.
type Config struct {
	// Listeners. Each is a host:port; "" turns that listener off, except
	// Listen, which is required. Port 0 picks a free port (Gateway.Addrs
	// reports the bound addresses).

	// Listen is the reverse proxy's address. DefaultConfig: 127.0.0.1:8080.
	Listen string
	// RLSAddr serves Envoy's rate limit service (RLS v3, gRPC) and the
	// gRPC health service. DefaultConfig: 127.0.0.1:8081.
	RLSAddr string
	// HTTPAddr serves /metrics, /healthz and /readyz. DefaultConfig:
	// 127.0.0.1:9090.
	HTTPAddr string
	// CheckAddr serves the check endpoints: POST /json (envoyproxy/
	// ratelimit's JSON API over the RLS service) and /forward-auth with
	// any path under it (nginx auth_request, Caddy forward_auth, Traefik
	// ForwardAuth); any other path is a JSON 404. DefaultConfig:
	// 127.0.0.1:8082.
	CheckAddr string
	// TLS, when set, serves the proxy listener and the RLS listener over
	// TLS with it. nil: plain TCP.
	TLS *tls.Config

	// Upstream is the base URL requests are proxied to: http or https,
	// with a host. Required.
	Upstream *url.URL
	// UpstreamTLS is the proxy transport's TLS config for an https
	// upstream (nil: Go's defaults).
	UpstreamTLS *tls.Config
	// MaxRequestBodyBytes bounds a proxied request's body: a larger one is
	// answered 413. ≤ 0: no bound. DefaultConfig: DefaultMaxRequestBodyBytes.
	MaxRequestBodyBytes int64
	// RequestBodyTimeout bounds how long the proxy reads a request's body,
	// from the end of its headers: a slower body is answered 408 and the
	// upstream request is abandoned, so a slow client holds neither its
	// connection nor an upstream one for longer. ≤ 0: no bound.
	// DefaultConfig: DefaultRequestBodyTimeout.
	RequestBodyTimeout time.Duration
	// RLSMaxConns caps the RLS port's open connections; more wait in the
	// listen backlog. ≤ 0: no cap. DefaultConfig: 1024.
	RLSMaxConns int
	// RLSKeepalive is how long an RLS connection may be idle before the
	// server pings it, and how long the ping may go unanswered before the
	// connection is closed (half-open peers). DefaultConfig: 30s.
	RLSKeepalive time.Duration
	// RLSMaxRequestBytes bounds one RLS request message: a larger one is
	// refused with ResourceExhausted before it is decoded. 0 means
	// DefaultRLSMaxRequestBytes. The largest request the agent's bounds
	// admit (agent.MaxDescriptors descriptors of agent.MaxKeyBytes) is
	// about 260 KiB.
	RLSMaxRequestBytes int

	// RLSServerOptions are added to the RLS gRPC server's options, after
	// the gateway's own (a stats handler for tracing, say). nil: none.
	RLSServerOptions []grpc.ServerOption
	// CheckHandler, when set, wraps the check listener's handler (the
	// /json and /forward-auth routes), e.g. with tracing. nil: the
	// handler is served as is.
	CheckHandler func(http.Handler) http.Handler

	// Extraction says how descriptors are taken from a request (the
	// middleware's httplimit.Config).
	Extraction httplimit.Config
	// Agent configures the embedded agent: its allocators (none:
	// standalone, with Rules or RulesFiles), its id and dial options.
	// Start sets its Logger and Registerer when they are nil, and its Redis
	// limiter when Redis is set. DefaultConfig: agent.DefaultConfig().
	Agent agent.Config
	// Redis, when set, is the backend of rules with `backend: redis`;
	// without it such rules are decided by a local bucket.
	Redis *redislimit.FileConfig

	// Logger receives the gateway's logs. nil: slog.Default().
	Logger *slog.Logger
	// Registry collects the gateway's, the agent's and the middleware's
	// metrics and is served on HTTPAddr's /metrics. nil: a new registry
	// with the Go and process collectors.
	Registry *prometheus.Registry
	// ShutdownTimeout bounds the clean-up when Start fails part way.
	// DefaultConfig: 10s.
	ShutdownTimeout time.Duration
}

// DefaultConfig returns the gateway's defaults: the proxy on
// 127.0.0.1:8080, RLS on 127.0.0.1:8081, the check endpoints on
// 127.0.0.1:8082, metrics and health on 127.0.0.1:9090, a 10 MiB body bound read within 60 s, at most 1024 RLS
// connections pinged when idle for 30 s, RLS requests of at most 64 KiB,
// and agent.DefaultConfig(). Upstream and Extraction are left for the
// caller.
func DefaultConfig() Config {
	return Config{
		Listen:              "127.0.0.1:8080",
		RLSAddr:             "127.0.0.1:8081",
		HTTPAddr:            "127.0.0.1:9090",
		CheckAddr:           "127.0.0.1:8082",
		MaxRequestBodyBytes: DefaultMaxRequestBodyBytes,
		RequestBodyTimeout:  DefaultRequestBodyTimeout,
		RLSMaxConns:         1024,
		RLSKeepalive:        30 * time.Second,
		RLSMaxRequestBytes:  DefaultRLSMaxRequestBytes,
		Agent:               agent.DefaultConfig(),
		ShutdownTimeout:     10 * time.Second,
	}
}

// Validate reports the first problem of c: no proxy listener, no usable
// upstream, an invalid extraction or Redis config, an RLS keepalive under
// 1 s or a negative RLS request bound, a negative shutdown timeout. The agent's own fields are checked by agent.New.
func (c *Config) Validate() error {
	if c.Listen == "" {
		return errors.New("gateway: Listen is required")
	}
	if u := c.Upstream; u == nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("gateway: upstream %v: want an http:// or https:// URL with a host", c.Upstream)
	}
	if _, err := httplimit.NewExtractor(c.Extraction); err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	if c.Redis != nil {
		if _, err := c.Redis.Config(); err != nil {
			return fmt.Errorf("gateway: redis: %w", err)
		}
	}
	if c.RLSAddr != "" && c.RLSKeepalive < time.Second {
		return errors.New("gateway: RLSKeepalive must be at least 1s")
	}
	if c.RLSMaxRequestBytes < 0 {
		return errors.New("gateway: RLSMaxRequestBytes must not be negative")
	}
	if c.ShutdownTimeout < 0 {
		return errors.New("gateway: ShutdownTimeout must not be negative")
	}
	return nil
}
