package main

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/agent/rls"
)

// startCheck serves the check endpoints on addr: POST /json (the RLS
// service as envoyproxy/ratelimit's JSON API) and any path under
// /forward-auth/ (the proxy's decision for a forwarded request). It
// returns the bound address.
func (g *gateway) startCheck(addr string, srv *rls.Server, ex *httplimit.Extractor, reg prometheus.Registerer, tc *tls.Config) (string, error) {
	met, err := httplimit.NewForwardAuthMetrics(reg)
	if err != nil {
		return "", err
	}
	fa := &httplimit.ForwardAuth{Middleware: &httplimit.Middleware{Checker: g.agent, Extractor: ex, Metrics: met, Logger: g.logger}}
	mux := http.NewServeMux()
	mux.Handle(rls.JSONPath, srv.JSONHandler(0))
	mux.Handle("/forward-auth/", fa)
	ln, err := listen(addr, tc)
	if err != nil {
		return "", fmt.Errorf("-check-addr: %w", err)
	}
	g.check = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(g.logger.Handler(), slog.LevelWarn),
	}
	g.serve("check", func() error { return g.check.Serve(ln) })
	return ln.Addr().String(), nil
}
