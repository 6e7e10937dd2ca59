// Command gateway is allot's HTTP gateway: a reverse proxy that rate-limits
// every request in-process with an embedded agent, and an Envoy rate limit
// service (RLS v3) backed by the same agent.
//
//	gateway -dev                                   # everything in one process, zero configuration
//	gateway -upstream http://127.0.0.1:9000 -allocators 10.0.0.1:7420,10.0.0.2:7420 -config gateway.yaml
//	gateway -upstream http://127.0.0.1:9000 -config gateway.yaml   # standalone: rules from the config's rules files
//
// /readyz and the gRPC health service on the RLS port (grpc.health.v1)
// report ready once the agent has rules: with -allocators, a rule set of
// version ≥ 1 from them. SIGINT or SIGTERM shuts it down gracefully: both
// report not ready, the listeners stop accepting, in-flight proxy and RLS
// requests finish (bounded by -shutdown-timeout), and the agent hands its
// unspent leases back. docs/gateway.md documents the flags, the config
// file and the HTTP contract.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/allot/allot/gateway"
	"github.com/allot/allot/internal/cliflags"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, stop, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "gateway:", strings.TrimPrefix(err.Error(), "gateway: ")) // the library's errors carry the prefix too
		os.Exit(1)
	}
}

// options are the parsed flags.
type options struct {
	listen, upstream, configFile, httpAddr, rlsAddr string
	checkAddr                                       string
	allocators                                      []string
	log                                             cliflags.Log
	// tls, when given, is the gateway's identity towards the allocators
	// and the CA that verifies them: it replaces the config file's
	// allocator_tls.
	tls             cliflags.TLS
	dev             bool
	otel            bool // OpenTelemetry tracing (internal/tracing)
	shutdownTimeout time.Duration
	agentID         string
	// rlsMaxConns caps the RLS port's open connections (0: no cap);
	// rlsKeepalive is how long an RLS connection may be idle before the
	// server pings it, and how long the ping may go unanswered;
	// rlsMaxRequest bounds one RLS request's bytes.
	rlsMaxConns   int
	rlsKeepalive  time.Duration
	rlsMaxRequest int
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var allocators string
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "proxy listen address")
	fs.StringVar(&o.upstream, "upstream", "", "upstream base URL (overrides the config file's upstream)")
	fs.StringVar(&allocators, "allocators", "", "allocator gRPC addresses host:port,... (overrides the config file; none: standalone)")
	fs.StringVar(&o.configFile, "config", "", "YAML config file: descriptor extraction, domain, rules files, TLS, upstream")
	fs.StringVar(&o.httpAddr, "http-addr", "127.0.0.1:9090", "address for /metrics, /healthz and /readyz (empty: off)")
	fs.StringVar(&o.rlsAddr, "rls-addr", "127.0.0.1:8081", "Envoy RLS v3 gRPC address (empty: off)")
	fs.StringVar(&o.checkAddr, "check-addr", "127.0.0.1:8082", "POST /json (envoyproxy/ratelimit's JSON API) and /forward-auth[/...] (nginx auth_request, Caddy forward_auth, Traefik ForwardAuth) address (empty: off)")
	o.log.Register(fs)
	o.tls.Register(fs, cliflags.TLSUsage{
		Cert:   "PEM client certificate (agent role) presented to the allocators, with -tls-key (replaces the config file's allocator_tls)",
		CA:     "PEM CA bundle that verifies the allocators (replaces the config file's allocator_tls)",
		Client: true,
	})
	fs.BoolVar(&o.dev, "dev", false, "run an embedded single-node allocator, a demo upstream and the demo rules")
	fs.BoolVar(&o.otel, "otel", false, "OpenTelemetry tracing: export spans of RLS, /json and forward-auth checks and Acquire calls over OTLP, configured by the OTEL_* environment variables (docs/operations.md#tracing)")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 10*time.Second, "graceful shutdown bound")
	fs.StringVar(&o.agentID, "agent-id", "", "agent id (default: hostname-pid-random)")
	fs.IntVar(&o.rlsMaxConns, "rls-max-conns", 1024, "open connections the RLS port accepts at once; more wait in the listen backlog (0: no cap)")
	fs.DurationVar(&o.rlsKeepalive, "rls-keepalive", 30*time.Second, "an RLS connection idle this long is pinged, and closed if the ping is not answered within as long (half-open connections)")
	fs.IntVar(&o.rlsMaxRequest, "rls-max-request-bytes", gateway.DefaultRLSMaxRequestBytes, "largest RLS request accepted, in bytes; a larger one is refused (ResourceExhausted) before it is decoded")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.rlsMaxConns < 0 {
		return o, errors.New("-rls-max-conns must not be negative")
	}
	if o.rlsKeepalive < time.Second {
		return o, errors.New("-rls-keepalive must be at least 1s")
	}
	if o.rlsMaxRequest < 1 {
		return o, errors.New("-rls-max-request-bytes must be at least 1")
	}
	for _, a := range strings.Split(allocators, ",") {
		if a = strings.TrimSpace(a); a != "" {
			o.allocators = append(o.allocators, a)
		}
	}
	return o, nil
}

// run parses args, starts the gateway, waits for ctx (the signals) and
// shuts down. stopSignals, called once shutdown starts, lets a second
// signal kill the process.
func run(ctx context.Context, stopSignals func(), args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	logger, err := o.log.Logger(stderr)
	if err != nil {
		return err
	}
	var cfg fileConfig
	if o.configFile != "" {
		if cfg, err = loadConfig(o.configFile); err != nil {
			return err
		}
	}
	if o.tls.Enabled() {
		opts, err := o.tls.Options()
		if err != nil {
			return err
		}
		cfg.AllocatorTLS = tlsConfig{CertFile: opts.CertFile, KeyFile: opts.KeyFile, CAFile: opts.CAFile,
			ServerName: o.tls.ServerName, minVersion: opts.MinVersion}
	}
	g, err := start(ctx, o, cfg, logger, stdout)
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		logger.Info("gateway: signal received; shutting down", "timeout", o.shutdownTimeout)
	case err := <-g.Failed():
		logger.Error("gateway: a listener failed; shutting down", "err", err)
	}
	stopSignals()
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
	defer cancel()
	return g.shutdown(sctx)
}
