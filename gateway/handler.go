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
	"os"
	"sync/atomic"
	"time"

	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/internal/proxybuf"
)

// NewHandler is the proxy listener's request path: the body bounds (size
// and read time), then the limiter, then the reverse proxy. mw nil leaves
// the limiter out; bodyLimit ≤ 0 leaves the size bound out (see
// LimitBody), bodyTimeout ≤ 0 the time bound (see TimeBody).
func NewHandler(mw *httplimit.Middleware, proxy http.Handler, bodyLimit int64, bodyTimeout time.Duration) http.Handler {
	if mw != nil {
		proxy = mw.Wrap(proxy)
	}
	return LimitBody(TimeBody(proxy, bodyTimeout), bodyLimit)
}

// errBodyTimeout is the error a request body read returns once the body
// has taken longer than its bound; the proxy answers 408.
var errBodyTimeout = errors.New("gateway: request body read timed out")

// TimeBody bounds the time spent reading a request's body to d (≤ 0: no
// bound) with a read deadline on the client connection, lifted once the
// body has been read (so the upstream's answer may take as long as it
// takes). A read past the deadline fails, and NewProxy answers 408.
func TimeBody(next http.Handler, d time.Duration) http.Handler {
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

// writeNotFound answers a check listener path that serves nothing.
func writeNotFound(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusNotFound)
	io.WriteString(w, `{"error":"not_found","message":"No check endpoint here: use POST /json or /forward-auth."}`)
}

// NewProxy is the reverse proxy to target (tc: the transport's TLS config,
// nil for Go's defaults). It appends the client address to
// X-Forwarded-For, drops the upstream's own RateLimit fields (the
// gateway's win), answers 413 JSON when LimitBody's bound is hit while
// streaming, 408 JSON when TimeBody's bound is, and 502 JSON when the
// upstream fails.
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
			if bodyTimedOut(resp.Request) {
				return errBodyTimeout // the upstream answered a truncated body
			}
			resp.Header.Del(httplimit.HeaderRateLimit)
			resp.Header.Del(httplimit.HeaderRateLimitPolicy)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			// A body read past its deadline also cancels the request's
			// context: check it first.
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

// copyBuffers is the proxies' copy-buffer pool.
var copyBuffers proxybuf.Pool
