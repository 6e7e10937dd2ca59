package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/agentsim"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/rules"
)

// benchRules admit everything the handler benchmark sends (domain
// public-api, the -dev extraction's three descriptors, two of them limited).
const benchRules = `
domain: public-api
descriptors:
  - key: tier
    value: free
    descriptors:
      - key: api_key
        rate_limit: {name: per_key, unit: second, requests_per_unit: 1000000000}
      - key: route
        value: /v1/search
        descriptors:
          - key: api_key
            rate_limit: {name: per_key_search, unit: second, requests_per_unit: 1000000000}
`

// upstreamBody is what the fake upstream answers.
const upstreamBody = `{"ok":true,"message":"hello from the benchmark upstream"}`

// cannedUpstream is a RoundTripper answering every request as an upstream
// would, without a network: a fresh response (headers and body) per call,
// as http.Transport builds one per response it parses.
type cannedUpstream struct{}

func (cannedUpstream) RoundTrip(r *http.Request) (*http.Response, error) {
	return &http.Response{
		StatusCode:    http.StatusOK,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{"Content-Type": {"application/json"}, "Content-Length": {strconv.Itoa(len(upstreamBody))}, "Date": {"Mon, 30 Nov 2026 04:00:00 GMT"}},
		Body:          io.NopCloser(strings.NewReader(upstreamBody)),
		ContentLength: int64(len(upstreamBody)),
		Request:       r,
	}, nil
}

// discardWriter is a ResponseWriter with a fresh header map per request,
// as net/http's server gives each request; the body is dropped.
type discardWriter struct {
	h      http.Header
	status int
}

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *discardWriter) WriteHeader(code int)        { w.status = code }

// BenchmarkHandlerChain runs the proxy listener's handler as start builds
// it (body bound, middleware with metrics, reverse proxy with its Rewrite
// and ModifyResponse) over a canned upstream, without and with the limiter:
// the difference is the limiter's cost per request through the gateway,
// in allocations and CPU, free of the network and the load generator.
// The agent is standalone (local buckets) and manual (no goroutines); its
// lease path costs about the same (agent's BenchmarkCheckLeased).
//
// Instructions per request, load-independent (the difference of two runs
// cancels the setup; asynchronous preemption off, as callgrind needs):
//
//	go test -c -o /tmp/gw.test ./cmd/gateway/
//	GOMAXPROCS=1 GODEBUG=asyncpreemptoff=1 valgrind --tool=callgrind \
//	  /tmp/gw.test -test.run '^$' -test.bench 'HandlerChain/limited$' -test.benchtime 4000x -test.cpu 1
//	(again with 2000x; (Ir(4000) − Ir(2000)) / 2000)
func BenchmarkHandlerChain(b *testing.B) {
	set, err := rules.Compile(1, []rules.File{{Name: "bench.yaml", Source: []byte(benchRules)}})
	if err != nil {
		b.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelInfo}))
	acfg := agent.DefaultConfig()
	acfg.Rules, acfg.Logger = set, logger
	// No agent goroutine (coarse clock, refill loop): the benchmark then
	// measures only the request path, and instruction counts under
	// callgrind do not depend on how long the run takes. The clock stands
	// still; the rule's burst covers any run.
	now := time.Now().UnixNano()
	acfg.Now = func() int64 { return now }
	acfg.Registerer = prometheus.NewRegistry()
	ag, err := agentsim.New(acfg)
	if err != nil {
		b.Fatal(err)
	}
	defer ag.Close(context.Background())
	ex, err := httplimit.NewExtractor(devExtraction())
	if err != nil {
		b.Fatal(err)
	}
	met, err := httplimit.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	target, _ := url.Parse("http://127.0.0.1:9")
	newChain := func(limited bool) http.Handler {
		p := newProxy(target, nil, logger)
		p.Transport = cannedUpstream{}
		var mw *httplimit.Middleware
		if limited {
			mw = &httplimit.Middleware{Checker: ag.Agent, Extractor: ex, Metrics: met, Logger: logger}
		}
		return proxyHandler(mw, p, defaultMaxRequestBodyBytes, defaultRequestBodyTimeout)
	}
	for _, bc := range []struct {
		name    string
		limited bool
	}{{"bare", false}, {"limited", true}} {
		h := newChain(bc.limited)
		keys := make([]string, 64)
		for i := range keys {
			keys[i] = "k_bench_" + strconv.Itoa(i)
		}
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				r := httptest.NewRequest(http.MethodGet, "http://gw.example/v1/search", nil)
				r.RemoteAddr = "127.0.0.1:40000"
				w := &discardWriter{}
				for i := 0; pb.Next(); i++ {
					r.Header = http.Header{"X-Api-Key": {keys[i%len(keys)]}, "Accept": {"*/*"}, "User-Agent": {"Go-http-client/1.1"}}
					w.h, w.status = http.Header{}, 0
					h.ServeHTTP(w, r)
					if w.status != 0 && w.status != http.StatusOK {
						b.Fatalf("status %d", w.status)
					}
				}
			})
		})
	}
}
