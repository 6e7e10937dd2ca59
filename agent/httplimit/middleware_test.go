package httplimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/sfv/sfvtest"
)

// fakeChecker returns a scripted decision and records what it was asked.
type fakeChecker struct {
	mu     sync.Mutex
	d      agent.Decision
	err    error
	calls  int
	domain string
	descs  []agent.Descriptor
	hits   uint32
}

func (f *fakeChecker) Check(_ context.Context, domain string, descs []agent.Descriptor, hits uint32) (agent.Decision, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	f.domain, f.hits = domain, hits
	f.descs = nil
	for _, d := range descs { // copy: the middleware reuses its buffers
		f.descs = append(f.descs, agent.Descriptor{Entries: append([]rules.Entry(nil), d.Entries...)})
	}
	return f.d, f.err
}

var freeSearch = &rules.Rule{Name: "free_search", RequestsPerUnit: 30, Unit: rules.UnitMinute, Burst: 10}
var shadowRule = &rules.Rule{Name: "key_override", RequestsPerUnit: 5, Unit: rules.UnitMinute, ShadowMode: true}

func allowedDecision() agent.Decision {
	return agent.Decision{Allowed: true, Source: agent.SourceLease, Policy: "free_search", Quota: 30,
		Window: time.Minute, Remaining: 9, ResetAfter: 1500 * time.Millisecond, NextAfter: 1500 * time.Millisecond, Rule: freeSearch}
}

func deniedDecision() agent.Decision {
	return agent.Decision{Allowed: false, Source: agent.SourceLease, Policy: "free_search", Quota: 30,
		Window: time.Minute, Remaining: 0, ResetAfter: 20 * time.Second, RetryAfter: 2 * time.Second, Rule: freeSearch}
}

type upstream struct{ hits int }

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.hits++
	io.WriteString(w, `{"ok":true}`)
}

func newMW(t *testing.T, c Checker) (*Middleware, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	return &Middleware{Checker: c, Extractor: mustExtractor(t, devYAML), Metrics: m,
		Logger: slog.New(slog.DiscardHandler)}, reg
}

func serve(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	return rec
}

func counter(t *testing.T, m *Middleware, r result) float64 {
	t.Helper()
	return float64(m.Metrics.count(r))
}

// TestAllowedTIsNextQuota: on an allowed response t counts to the next
// token (Decision.NextAfter), not to the limit being full (draft 10's "until
// additional quota"), and is 0 only when the limit is full.
func TestAllowedTIsNextQuota(t *testing.T) {
	for _, tc := range []struct {
		next time.Duration
		want string
	}{
		{1500 * time.Millisecond, `"free_search";r=2;t=2`},
		{time.Nanosecond, `"free_search";r=2;t=1`},
		{0, `"free_search";r=2;t=0`},
	} {
		d := allowedDecision()
		d.Remaining, d.ResetAfter, d.NextAfter = 2, 15500*time.Millisecond, tc.next
		h := http.Header{}
		SetFields(h, d, nil)
		if got := h.Get("RateLimit"); got != tc.want {
			t.Errorf("NextAfter %v, ResetAfter %v: RateLimit = %s, want %s", tc.next, d.ResetAfter, got, tc.want)
		}
	}
}

func TestAllowedForwardsWithFields(t *testing.T) {
	fc := &fakeChecker{d: allowedDecision()}
	m, _ := newMW(t, fc)
	up := &upstream{}
	rec := serve(m.Wrap(up), req("GET", "/v1/search", "X-API-Key", "k_free_demo"))
	if rec.Code != 200 || up.hits != 1 {
		t.Fatalf("code %d upstream hits %d, want 200 and 1", rec.Code, up.hits)
	}
	if got := rec.Header().Get("RateLimit-Policy"); got != `"free_search";q=30;w=60` {
		t.Errorf("RateLimit-Policy = %s", got)
	}
	if got := rec.Header().Get("RateLimit"); got != `"free_search";r=9;t=2` {
		t.Errorf("RateLimit = %s (t must round 1.5s up)", got)
	}
	if rec.Header().Get("Retry-After") != "" {
		t.Error("Retry-After on an allowed response")
	}
	if fc.domain != "public-api" || fc.hits != 1 || len(fc.descs) != 3 {
		t.Errorf("checker got domain %q hits %d descs %v", fc.domain, fc.hits, fc.descs)
	}
	if counter(t, m, resultAllowed) != 1 {
		t.Error("allowed not counted")
	}
}

func TestDeniedContract(t *testing.T) {
	fc := &fakeChecker{d: deniedDecision()}
	m, _ := newMW(t, fc)
	up := &upstream{}
	rec := serve(m.Wrap(up), req("GET", "/v1/search", "X-API-Key", "k_free_demo"))
	if rec.Code != http.StatusTooManyRequests || up.hits != 0 {
		t.Fatalf("code %d upstream hits %d, want 429 and 0", rec.Code, up.hits)
	}
	want := map[string]string{
		"Retry-After":      "2",
		"Cache-Control":    "no-store",
		"Content-Type":     "application/json",
		"RateLimit-Policy": `"free_search";q=30;w=60`,
		"RateLimit":        `"free_search";r=0;t=2`,
		"Content-Length":   strconv.Itoa(len(DeniedBody)),
	}
	for k, v := range want {
		if got := rec.Header().Get(k); got != v {
			t.Errorf("%s = %q, want %q", k, got, v)
		}
	}
	if rec.Body.String() != `{"error":"rate_limited","message":"API rate limit exceeded for this key."}` {
		t.Errorf("body %q", rec.Body.String())
	}
	if counter(t, m, resultDenied) != 1 {
		t.Error("denied not counted")
	}
}

func TestRetryAfterRounding(t *testing.T) {
	tests := []struct {
		retry time.Duration
		want  string
	}{
		{0, "1"}, {time.Nanosecond, "1"}, {time.Second, "1"}, {time.Second + 1, "2"},
		{1200 * time.Millisecond, "2"}, {59*time.Second + 999*time.Millisecond, "60"},
	}
	for _, tc := range tests {
		d := deniedDecision()
		d.RetryAfter = tc.retry
		fc := &fakeChecker{d: d}
		m, _ := newMW(t, fc)
		rec := serve(m.Wrap(&upstream{}), req("GET", "/v1/search", "X-API-Key", "k"))
		if got := rec.Header().Get("Retry-After"); got != tc.want {
			t.Errorf("RetryAfter %v: Retry-After %s, want %s", tc.retry, got, tc.want)
		}
		items, err := sfvtest.ParseList(rec.Header().Get("RateLimit"))
		if err != nil {
			t.Fatal(err)
		}
		tv, _ := items[0].Param("t")
		if ra, _ := strconv.ParseInt(tc.want, 10, 64); tv.(int64) > ra {
			t.Errorf("RetryAfter %v: t=%v is later than Retry-After %d", tc.retry, tv, ra)
		}
	}
}

func TestShadowForwardsAndCounts(t *testing.T) {
	d := agent.Decision{Allowed: true, Shadow: true, Policy: "key_override", Quota: 5, Window: time.Minute,
		Remaining: 0, Rule: shadowRule, Source: agent.SourceLease}
	fc := &fakeChecker{d: d}
	m, _ := newMW(t, fc)
	var shadowed int
	m.OnShadow = func(*http.Request, agent.Decision) { shadowed++ }
	up := &upstream{}
	rec := serve(m.Wrap(up), req("GET", "/v1/search", "X-API-Key", "k_live_abc123"))
	if rec.Code != 200 || up.hits != 1 || shadowed != 1 {
		t.Fatalf("code %d hits %d shadow hook %d", rec.Code, up.hits, shadowed)
	}
	if rec.Header().Get("RateLimit") != "" || rec.Header().Get("RateLimit-Policy") != "" {
		t.Errorf("a shadow limit was advertised: %v", rec.Header())
	}
	if counter(t, m, resultShadow) != 1 {
		t.Error("shadow not counted")
	}
	// The default hook logs at debug level without failing.
	m.OnShadow = nil
	serve(m.Wrap(up), req("GET", "/v1/search", "X-API-Key", "k_live_abc123"))
	if counter(t, m, resultShadow) != 2 {
		t.Error("shadow not counted with the default hook")
	}
}

func TestLimiterErrorFailsOpen(t *testing.T) {
	fc := &fakeChecker{err: errors.New("agent: boom")}
	m, _ := newMW(t, fc)
	up := &upstream{}
	rec := serve(m.Wrap(up), req("GET", "/v1/search", "X-API-Key", "k"))
	if rec.Code != 200 || up.hits != 1 {
		t.Fatalf("code %d hits %d, want the request forwarded", rec.Code, up.hits)
	}
	if counter(t, m, resultError) != 1 {
		t.Error("error not counted")
	}
	// A custom Descriptors hook failing (not a bad request) also fails open.
	m.Descriptors = func(*http.Request) ([]agent.Descriptor, error) { return nil, errors.New("x") }
	if rec := serve(m.Wrap(up), req("GET", "/")); rec.Code != 200 {
		t.Fatalf("code %d", rec.Code)
	}
}

func TestBadRequest(t *testing.T) {
	fc := &fakeChecker{d: allowedDecision()}
	m, _ := newMW(t, fc)
	up := &upstream{}
	rec := serve(m.Wrap(up), req("GET", "/v1/search", "X-API-Key", strings.Repeat("k", 1000)))
	if rec.Code != 400 || up.hits != 0 || fc.calls != 0 {
		t.Fatalf("code %d hits %d calls %d", rec.Code, up.hits, fc.calls)
	}
	if rec.Body.String() != `{"error":"bad_request","message":"API key is too long"}` {
		t.Errorf("body %q", rec.Body.String())
	}
	if rec.Header().Get("Content-Type") != "application/json" {
		t.Error("content type")
	}
	if counter(t, m, resultBadRequest) != 1 {
		t.Error("bad request not counted")
	}
}

// TestInvalidUTF8KeyIsBadRequest pins the poisoned-gateway bug: an API key
// that is not valid UTF-8 was admitted, and the agent's batched Acquire
// could no longer be encoded. It gets a 400 and never reaches the checker.
func TestInvalidUTF8KeyIsBadRequest(t *testing.T) {
	fc := &fakeChecker{d: allowedDecision()}
	m, _ := newMW(t, fc)
	up := &upstream{}
	rec := serve(m.Wrap(up), req("GET", "/v1/search", "X-API-Key", "k\xff"))
	if rec.Code != 400 || up.hits != 0 || fc.calls != 0 {
		t.Fatalf("code %d hits %d calls %d, want a 400 that reaches neither", rec.Code, up.hits, fc.calls)
	}
	if rec.Body.String() != `{"error":"bad_request","message":"API key is not valid UTF-8 text"}` {
		t.Errorf("body %q", rec.Body.String())
	}
	// A Descriptors hook that passes such bytes is refused by the agent
	// (ErrInvalid): a 400 too, not a forwarded request.
	fc.err = fmt.Errorf("%w: descriptor 0 entry 0 is not valid UTF-8 text", agent.ErrInvalid)
	m.Domain = "api"
	m.Descriptors = func(*http.Request) ([]agent.Descriptor, error) {
		return []agent.Descriptor{{Entries: []rules.Entry{{Key: "api_key", Value: "k\xff"}}}}, nil
	}
	rec = serve(m.Wrap(up), req("GET", "/v1/search"))
	if rec.Code != 400 || up.hits != 0 || !strings.Contains(rec.Body.String(), `"error":"bad_request"`) {
		t.Fatalf("hook: code %d hits %d body %q", rec.Code, up.hits, rec.Body.String())
	}
	if counter(t, m, resultBadRequest) != 2 || counter(t, m, resultError) != 0 {
		t.Error("bad requests not counted as such")
	}
}

func TestNoDescriptorsSkipsChecker(t *testing.T) {
	fc := &fakeChecker{d: deniedDecision()}
	m, _ := newMW(t, fc)
	up := &upstream{}
	rec := serve(m.Wrap(up), req("GET", "/v1/search")) // no API key
	if rec.Code != 200 || fc.calls != 0 || up.hits != 1 {
		t.Fatalf("code %d calls %d hits %d", rec.Code, fc.calls, up.hits)
	}
	if counter(t, m, resultUnlimited) != 1 {
		t.Error("unlimited not counted")
	}
}

func TestUnlimitedDecisionHasNoFields(t *testing.T) {
	fc := &fakeChecker{d: agent.Decision{Allowed: true, Source: agent.SourceUnlimited}}
	m, _ := newMW(t, fc)
	rec := serve(m.Wrap(&upstream{}), req("GET", "/v2", "X-API-Key", "k"))
	if rec.Code != 200 || rec.Header().Get("RateLimit") != "" || rec.Header().Get("RateLimit-Policy") != "" {
		t.Fatalf("code %d header %v", rec.Code, rec.Header())
	}
}

func TestHooks(t *testing.T) {
	fc := &fakeChecker{d: deniedDecision()}
	m, _ := newMW(t, fc)
	m.Domain = "other"
	m.Hits = func(*http.Request) uint32 { return 3 }
	m.OnDenied = func(w http.ResponseWriter, r *http.Request, d agent.Decision) { w.WriteHeader(418) }
	m.ErrorHandler = func(w http.ResponseWriter, r *http.Request, err error) { w.WriteHeader(431) }
	rec := serve(m.Wrap(&upstream{}), req("GET", "/v1/search", "X-API-Key", "k"))
	if rec.Code != 418 || fc.domain != "other" || fc.hits != 3 {
		t.Fatalf("code %d domain %q hits %d", rec.Code, fc.domain, fc.hits)
	}
	if rec.Header().Get("RateLimit") == "" {
		t.Error("fields must be set before OnDenied")
	}
	rec = serve(m.Wrap(&upstream{}), req("GET", "/v1/search", "X-API-Key", strings.Repeat("k", 1000)))
	if rec.Code != 431 {
		t.Fatalf("ErrorHandler not used: %d", rec.Code)
	}
}

func TestPolicyNameSanitised(t *testing.T) {
	d := allowedDecision()
	d.Policy = "we\"ird\\n\x01é"
	h := http.Header{}
	SetFields(h, d, nil)
	for _, f := range []string{"RateLimit", "RateLimit-Policy"} {
		items, err := sfvtest.ParseList(h.Get(f))
		if err != nil || len(items) != 1 || items[0].Value != "we\"ird\\n___" {
			t.Errorf("%s = %s: %v %v", f, h.Get(f), items, err)
		}
	}
}

// TestSetFieldsExactBytes pins the field values byte for byte on both
// sides of the one-allocation path (values up to fieldTextCap bytes share
// one object; longer ones take the string path), and checks that reusing
// the scratch buffer afterwards leaves the header values intact.
func TestSetFieldsExactBytes(t *testing.T) {
	for n := 1; n <= 128; n++ { // sfv truncates longer names
		d := allowedDecision()
		d.Policy = strings.Repeat("p", n)
		wantPol := `"` + d.Policy + `";q=30;w=60`
		wantRL := `"` + d.Policy + `";r=9;t=2`
		h := http.Header{}
		buf := SetFields(h, d, make([]byte, 0, 8))
		for i := range buf[:cap(buf)] {
			buf[:cap(buf)][i] = 'X' // the next request reuses the buffer
		}
		if got := h[HeaderRateLimitPolicy]; len(got) != 1 || got[0] != wantPol {
			t.Fatalf("name length %d: RateLimit-Policy = %q, want %q", n, got, wantPol)
		}
		if got := h[HeaderRateLimit]; len(got) != 1 || got[0] != wantRL {
			t.Fatalf("name length %d: RateLimit = %q, want %q", n, got, wantRL)
		}
		h.Add(HeaderRateLimit, "extra") // appending must not write into the other field
		if got := h[HeaderRateLimitPolicy]; len(got) != 1 || got[0] != wantPol {
			t.Fatalf("name length %d: RateLimit-Policy after Add = %q", n, got)
		}
	}
}

// TestSetFieldsAllocs pins SetFields to one allocation when the values fit
// fieldTextCap (the common case: the gateway's per-request cost).
func TestSetFieldsAllocs(t *testing.T) {
	d := allowedDecision()
	buf := make([]byte, 0, 256)
	h := http.Header{}
	if a := testing.AllocsPerRun(100, func() { buf = SetFields(h, d, buf) }); a != 1 {
		t.Fatalf("SetFields: %v allocations, want 1", a)
	}
}

// FuzzFields checks the header contract for arbitrary decisions: both
// fields parse as one-member sf-lists of the right shape, and on a denial
// Retry-After is a positive integer never earlier than t.
func FuzzFields(f *testing.F) {
	f.Add("free_search", int64(30), int64(60e9), int64(0), int64(20e9), int64(2e9), false)
	f.Add("p\"\\\x00", int64(-1), int64(-5), int64(-9), int64(-1), int64(-1), true)
	f.Add("", int64(1<<62), int64(1<<62), int64(1<<62), int64(1<<62), int64(1<<62), false)
	f.Fuzz(func(t *testing.T, name string, quota, window, remaining, reset, retry int64, allowed bool) {
		d := agent.Decision{Allowed: allowed, Policy: name, Quota: quota, Window: time.Duration(window),
			Remaining: remaining, ResetAfter: time.Duration(reset), RetryAfter: time.Duration(retry), Rule: freeSearch}
		rec := httptest.NewRecorder()
		SetFields(rec.Header(), d, nil)
		if !reported(d) {
			if rec.Header().Get("RateLimit") != "" {
				t.Fatal("fields for an unreported limit")
			}
			return
		}
		pol, err := sfvtest.ParseList(rec.Header().Get("RateLimit-Policy"))
		if err != nil || len(pol) != 1 {
			t.Fatalf("RateLimit-Policy %q: %v", rec.Header().Get("RateLimit-Policy"), err)
		}
		if q, _ := pol[0].Param("q"); q == nil || q.(int64) <= 0 {
			t.Fatalf("q = %v", q)
		}
		rl, err := sfvtest.ParseList(rec.Header().Get("RateLimit"))
		if err != nil || len(rl) != 1 {
			t.Fatalf("RateLimit %q: %v", rec.Header().Get("RateLimit"), err)
		}
		r, _ := rl[0].Param("r")
		tv, _ := rl[0].Param("t")
		if r == nil || r.(int64) < 0 || tv == nil || tv.(int64) < 0 {
			t.Fatalf("r = %v, t = %v", r, tv)
		}
		if pol[0].Value != rl[0].Value {
			t.Fatalf("names differ: %v vs %v", pol[0].Value, rl[0].Value)
		}
		if !allowed {
			WriteDenied(rec, nil, d)
			ra, err := strconv.ParseInt(rec.Header().Get("Retry-After"), 10, 64)
			if err != nil || ra < 1 || ra < tv.(int64) {
				t.Fatalf("Retry-After %q, t %v", rec.Header().Get("Retry-After"), tv)
			}
		}
	})
}

// nopChecker allows everything with a fixed decision, for benchmarks.
type nopChecker struct{ d agent.Decision }

func (c nopChecker) Check(context.Context, string, []agent.Descriptor, uint32) (agent.Decision, error) {
	return c.d, nil
}

type discardRW struct{ h http.Header }

func (w *discardRW) Header() http.Header         { return w.h }
func (w *discardRW) Write(b []byte) (int, error) { return len(b), nil }
func (w *discardRW) WriteHeader(int)             {}

// BenchmarkMiddleware measures the middleware's own cost per request
// (extraction of three descriptors, the fields), with a constant checker.
func BenchmarkMiddleware(b *testing.B) {
	x := mustExtractor(b, devYAML)
	m := &Middleware{Checker: nopChecker{allowedDecision()}, Extractor: x}
	h := m.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	r := req("GET", "/v1/search", "X-API-Key", "k_free_demo")
	w := &discardRW{h: http.Header{}}
	b.ReportAllocs()
	for b.Loop() {
		h.ServeHTTP(w, r)
	}
}

func BenchmarkMiddlewareParallel(b *testing.B) {
	x := mustExtractor(b, devYAML)
	m := &Middleware{Checker: nopChecker{allowedDecision()}, Extractor: x}
	h := m.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		r := req("GET", "/v1/search", "X-API-Key", "k_free_demo")
		w := &discardRW{h: http.Header{}}
		for pb.Next() {
			h.ServeHTTP(w, r)
		}
	})
}

// BenchmarkMiddlewareAgent is BenchmarkMiddleware with a real standalone
// agent deciding (three descriptors, two of them limited).
func BenchmarkMiddlewareAgent(b *testing.B) {
	for _, bc := range []struct {
		name, rules string
	}{
		{"allowed", `
domain: public-api
descriptors:
  - key: tier
    value: free
    descriptors:
      - key: api_key
        rate_limit: {unit: second, requests_per_unit: 1000000000}
      - key: route
        value: /v1/search
        descriptors:
          - key: api_key
            rate_limit: {unit: second, requests_per_unit: 1000000000}
`},
		{"denied", `
domain: public-api
descriptors:
  - key: api_key
    rate_limit: {unit: hour, requests_per_unit: 1}
`},
	} {
		b.Run(bc.name, func(b *testing.B) {
			set, err := rules.Compile(1, []rules.File{{Name: "b.yaml", Source: []byte(bc.rules)}})
			if err != nil {
				b.Fatal(err)
			}
			cfg := agent.DefaultConfig()
			cfg.Rules = set
			a, err := agent.New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer a.Close(context.Background())
			m := &Middleware{Checker: a, Extractor: mustExtractor(b, devYAML)}
			h := m.Wrap(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				r := req("GET", "/v1/search", "X-API-Key", "k_free_demo")
				w := &discardRW{h: http.Header{}}
				for pb.Next() {
					h.ServeHTTP(w, r)
				}
			})
		})
	}
}

// TestMetricsStripedSum: increments from many goroutines (so many stripes)
// are all in the scraped allot_gateway_requests_total, by result.
func TestMetricsStripedSum(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				m.inc(resultAllowed)
			}
			if g%4 == 0 {
				m.inc(resultDenied)
			}
		}()
	}
	wg.Wait()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "allot_gateway_requests_total" || mf.GetType() != dto.MetricType_COUNTER {
			continue
		}
		for _, mt := range mf.GetMetric() {
			got[mt.GetLabel()[0].GetValue()] = mt.GetCounter().GetValue()
		}
	}
	want := map[string]float64{"allowed": 6400, "denied": 16, "unlimited": 0, "shadow_denied": 0, "bad_request": 0, "limiter_error": 0}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("scraped %v, want %v", got, want)
	}
}
