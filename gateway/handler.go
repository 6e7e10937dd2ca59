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
	"net/http/httputil"
	"net/url"
	"time"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/internal/proxybuf"
)

// NewHandler is the proxy listener's request path: the body bound, then
// the limiter, then the reverse proxy. mw nil leaves the limiter out;
// bodyLimit ≤ 0 leaves the bound out (see LimitBody).
func NewHandler(mw *httplimit.Middleware, proxy http.Handler, bodyLimit int64) http.Handler {
	if mw != nil {
		proxy = mw.Wrap(proxy)
	}
	return LimitBody(proxy, bodyLimit)
}

// LimitBody answers 413 for a request whose declared body exceeds limit,
// and bounds the bytes read from any body to limit (the proxy's error
// handler turns the overflow into a 413). limit ≤ 0: no bound.
func LimitBody(next http.Handler, limit int64) http.Handler {
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

// NewProxy is the reverse proxy to target (tc: the transport's TLS config,
// nil for Go's defaults). It appends the client address to
// X-Forwarded-For, drops the upstream's own RateLimit fields (the
// gateway's win), answers 413 JSON when LimitBody's bound is hit while
// streaming, and 502 JSON when the upstream fails.
func NewProxy(target *url.URL, tc *tls.Config, logger *slog.Logger) *httputil.ReverseProxy {
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
			resp.Header.Del(httplimit.HeaderRateLimit)
			resp.Header.Del(httplimit.HeaderRateLimitPolicy)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
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

// copyBuffers is the proxies' copy-buffer pool.
var copyBuffers proxybuf.Pool
