package allocator

import (
	"encoding/json"
	"errors"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/allot/allot/pkg/tlsconfig"
)

// startHTTP serves /healthz, /readyz, /metrics and, with Config.Pprof,
// /debug/pprof/ (admin token only) on the Server's own mux (never
// http.DefaultServeMux).
func (s *Server) startHTTP() {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", s.handleReady)
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.gather, promhttp.HandlerOpts{}))
	if s.cfg.Pprof {
		mux.Handle("/debug/pprof/", s.adminOnly(http.HandlerFunc(pprof.Index)))
		mux.Handle("/debug/pprof/cmdline", s.adminOnly(http.HandlerFunc(pprof.Cmdline)))
		mux.Handle("/debug/pprof/profile", s.adminOnly(http.HandlerFunc(pprof.Profile)))
		mux.Handle("/debug/pprof/symbol", s.adminOnly(http.HandlerFunc(pprof.Symbol)))
		mux.Handle("/debug/pprof/trace", s.adminOnly(http.HandlerFunc(pprof.Trace)))
	}
	s.httpSrv = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 5 * time.Second,
		ErrorLog:          newHCLogAdapter(s.log, "http").StandardLogger(nil),
	}
	ln := s.httpLn
	s.serving.Go(func() {
		if err := s.httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("http server stopped", "err", err)
		}
	})
}

// adminOnly serves h only to a request with a valid admin bearer token
// ("Authorization: Bearer <token>"); others get 401 with a JSON error.
func (s *Server) adminOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, ok := tlsconfig.BearerToken(r.Header.Get("Authorization"))
		if !ok || !s.guard.tokens.Load().Valid(tok) {
			// At most a line a second, however fast refused requests come.
			if n, ok := s.pprofLog.allow(time.Now().UnixNano()); ok {
				s.log.Warn("pprof refused: no valid admin token", "from", r.RemoteAddr, "path", r.URL.Path, "suppressed", n)
			}
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("WWW-Authenticate", "Bearer")
			w.WriteHeader(http.StatusUnauthorized)
			_ = json.NewEncoder(w).Encode(map[string]string{"error": "an admin bearer token is required"})
			return
		}
		h.ServeHTTP(w, r)
	})
}

// handleReady answers 200 when the node is ready (see Server.WaitReady),
// 503 otherwise, with the details as JSON either way.
func (s *Server) handleReady(w http.ResponseWriter, _ *http.Request) {
	rd := s.readiness()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	if !rd.Ready {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	_ = json.NewEncoder(w).Encode(rd)
}
