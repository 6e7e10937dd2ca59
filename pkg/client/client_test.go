package client

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeClock is a manual clock whose Sleep advances time at once and records
// every requested delay.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	sleeps []time.Duration
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func (c *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c.mu.Lock()
	c.sleeps = append(c.sleeps, d)
	c.now = c.now.Add(d)
	c.mu.Unlock()
	return nil
}

func (c *fakeClock) Sleeps() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.sleeps...)
}

func newTransport(t *testing.T, clk *fakeClock, mutate func(*Config)) *Transport {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Throttle = false
	cfg.Now, cfg.Sleep = clk.Now, clk.Sleep
	cfg.Rand = func() float64 { return 0.5 }
	if mutate != nil {
		mutate(&cfg)
	}
	tr, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// script serves the given statuses (and Retry-After values) in order, then
// 200s, and counts the hits.
type script struct {
	mu     sync.Mutex
	steps  []step
	hits   atomic.Int64
	bodies []string
}

type step struct {
	status     int
	retryAfter string
}

func (s *script) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.hits.Add(1)
	b, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.bodies = append(s.bodies, string(b))
	var st step
	if len(s.steps) > 0 {
		st, s.steps = s.steps[0], s.steps[1:]
	}
	s.mu.Unlock()
	if st.status == 0 {
		io.WriteString(w, "ok")
		return
	}
	if st.retryAfter != "" {
		w.Header().Set("Retry-After", st.retryAfter)
	}
	w.WriteHeader(st.status)
	io.WriteString(w, `{"error":"rate_limited"}`)
}

func get(t *testing.T, tr http.RoundTripper, url string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

func TestRetryAfterSecondsHonoured(t *testing.T) {
	s := &script{steps: []step{{429, "2"}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	clk := newFakeClock()
	tr := newTransport(t, clk, nil)
	resp := get(t, tr, srv.URL)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d, want 200 after one retry", resp.StatusCode)
	}
	if got := s.hits.Load(); got != 2 {
		t.Fatalf("hits = %d, want 2", got)
	}
	// Retry-After, plus the jitter on top (0.5·100ms with the fixed rand):
	// never earlier than Retry-After, and not in lockstep with others.
	if sl := clk.Sleeps(); len(sl) != 1 || sl[0] != 2*time.Second+50*time.Millisecond {
		t.Fatalf("sleeps = %v, want [2.05s]", sl)
	}
}

func TestRetryAfterHTTPDate(t *testing.T) {
	clk := newFakeClock()
	date := clk.Now().Add(7 * time.Second).Format(http.TimeFormat)
	s := &script{steps: []step{{429, date}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	tr := newTransport(t, clk, nil)
	if resp := get(t, tr, srv.URL); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if sl := clk.Sleeps(); len(sl) != 1 || sl[0] != 7*time.Second+50*time.Millisecond {
		t.Fatalf("sleeps = %v, want [7.05s] (Retry-After plus jitter)", sl)
	}
}

func TestFullJitterBackoff(t *testing.T) {
	s := &script{steps: []step{{429, ""}, {429, ""}, {429, ""}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	clk := newFakeClock()
	tr := newTransport(t, clk, func(c *Config) { c.MaxDelay = 300 * time.Millisecond })
	if resp := get(t, tr, srv.URL); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	// uniform(0, expo) with the rand hook at 0.5: expo = 100, 200, min(300, 400) ms.
	want := []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 150 * time.Millisecond}
	sl := clk.Sleeps()
	if len(sl) != len(want) {
		t.Fatalf("sleeps = %v, want %v", sl, want)
	}
	for i := range want {
		if sl[i] != want[i] {
			t.Fatalf("sleep %d = %v, want %v (all: %v)", i, sl[i], want[i], sl)
		}
	}
}

func TestBackoffBounds(t *testing.T) {
	clk := newFakeClock()
	for _, u := range []float64{0, 0.999999} {
		tr := newTransport(t, clk, func(c *Config) { c.Rand = func() float64 { return u } })
		for n := 0; n < 200; n++ {
			d := tr.backoff(n)
			if d < 0 || d > tr.cfg.MaxDelay {
				t.Fatalf("backoff(%d) = %v outside [0, %v]", n, d, tr.cfg.MaxDelay)
			}
		}
	}
}

func TestRetriesBounded(t *testing.T) {
	s := &script{steps: []step{{429, "1"}, {429, "1"}, {429, "1"}, {429, "1"}, {429, "1"}, {429, "1"}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	clk := newFakeClock()
	tr := newTransport(t, clk, func(c *Config) { c.MaxRetries = 2 })
	resp := get(t, tr, srv.URL)
	if resp.StatusCode != 429 {
		t.Fatalf("status %d, want the final 429", resp.StatusCode)
	}
	if got := s.hits.Load(); got != 3 {
		t.Fatalf("hits = %d, want 3 (1 + MaxRetries)", got)
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != `{"error":"rate_limited"}` {
		t.Fatalf("body %q", b)
	}
}

func TestRetryAfterTooLongReturnsAtOnce(t *testing.T) {
	s := &script{steps: []step{{429, "3600"}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	clk := newFakeClock()
	tr := newTransport(t, clk, nil)
	if resp := get(t, tr, srv.URL); resp.StatusCode != 429 {
		t.Fatalf("status %d, want 429", resp.StatusCode)
	}
	if len(clk.Sleeps()) != 0 || s.hits.Load() != 1 {
		t.Fatalf("slept %v, hits %d; want no wait and 1 hit", clk.Sleeps(), s.hits.Load())
	}
}

func TestNoRetryOnOtherStatuses(t *testing.T) {
	s := &script{steps: []step{{503, ""}, {500, "1"}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	clk := newFakeClock()
	tr := newTransport(t, clk, nil)
	if resp := get(t, tr, srv.URL); resp.StatusCode != 503 {
		t.Fatalf("status %d, want 503 (no Retry-After: not retried)", resp.StatusCode)
	}
	if resp := get(t, tr, srv.URL); resp.StatusCode != 500 {
		t.Fatalf("status %d, want 500", resp.StatusCode)
	}
	if s.hits.Load() != 2 {
		t.Fatalf("hits %d, want 2", s.hits.Load())
	}
	// 503 with Retry-After is retried.
	s.steps = []step{{503, "1"}}
	if resp := get(t, tr, srv.URL); resp.StatusCode != 200 {
		t.Fatalf("status %d, want 200 after retrying a 503 with Retry-After", resp.StatusCode)
	}
}

func TestReplayableBodyRetried(t *testing.T) {
	s := &script{steps: []step{{429, "1"}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	clk := newFakeClock()
	tr := newTransport(t, clk, nil)
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("payload"))
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if len(s.bodies) != 2 || s.bodies[0] != "payload" || s.bodies[1] != "payload" {
		t.Fatalf("bodies = %q, want the payload twice", s.bodies)
	}
}

func TestNonReplayableBodyNotRetried(t *testing.T) {
	s := &script{steps: []step{{429, "1"}}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	clk := newFakeClock()
	tr := newTransport(t, clk, nil)
	req, _ := http.NewRequest(http.MethodPost, srv.URL, io.NopCloser(strings.NewReader("once")))
	req.GetBody = nil
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 || s.hits.Load() != 1 {
		t.Fatalf("status %d hits %d, want 429 and 1 hit", resp.StatusCode, s.hits.Load())
	}
}

// rtFunc adapts a function to http.RoundTripper.
type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func tooMany(r *http.Request, retryAfter string) *http.Response {
	h := http.Header{}
	if retryAfter != "" {
		h.Set("Retry-After", retryAfter)
	}
	return &http.Response{StatusCode: 429, Header: h, Body: io.NopCloser(strings.NewReader("x")), Request: r}
}

func TestContextCancelledWhileWaiting(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	base := rtFunc(func(r *http.Request) (*http.Response, error) {
		cancel() // the caller gives up while the server says "wait"
		return tooMany(r, "5"), nil
	})
	cfg := DefaultConfig()
	cfg.Base, cfg.Throttle = base, false // real Sleep: must return on ctx.Done
	tr, _ := New(cfg)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:1/", nil)
	start := time.Now()
	_, err := tr.RoundTrip(req)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if time.Since(start) > 4*time.Second {
		t.Fatal("RoundTrip waited out Retry-After despite the cancelled context")
	}
}

func TestDeadlineShorterThanRetryAfter(t *testing.T) {
	calls := 0
	base := rtFunc(func(r *http.Request) (*http.Response, error) { calls++; return tooMany(r, "5"), nil })
	clk := newFakeClock()
	tr := newTransport(t, clk, func(c *Config) { c.Base = base; c.Now = time.Now })
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://x/", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil || resp.StatusCode != 429 || calls != 1 || len(clk.Sleeps()) != 0 {
		t.Fatalf("resp %v err %v calls %d sleeps %v; want the 429 at once", resp, err, calls, clk.Sleeps())
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	tests := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"", 0, false},
		{"0", 0, true},
		{"2", 2 * time.Second, true},
		{" 120 ", 120 * time.Second, true},
		{"-1", 0, false},
		{"1.5", 0, false},
		{"2s", 0, false},
		{"99999999999999999999999", time.Duration(1<<62 - 1), true},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true},
		{"Fri, 31 Dec 1999 23:59:59 GMT", 0, true},
		{"not a date", 0, false},
	}
	for _, tc := range tests {
		got, ok := parseRetryAfter(tc.in, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseRetryAfter(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	bad := []func(*Config){
		func(c *Config) { c.MaxRetries = -1 },
		func(c *Config) { c.BaseDelay = 0 },
		func(c *Config) { c.MaxDelay = c.BaseDelay - 1 },
		func(c *Config) { c.MaxRetryAfter = -1 },
		func(c *Config) { c.ThrottleK = 0 },
		func(c *Config) { c.ThrottleBuckets = 0 },
		func(c *Config) { c.ThrottleWindow = time.Microsecond },
	}
	for i, m := range bad {
		cfg := DefaultConfig()
		m(&cfg)
		if _, err := New(cfg); err == nil || !strings.HasPrefix(err.Error(), "client: ") {
			t.Errorf("case %d: New = %v, want a client: error", i, err)
		}
	}
}

// TestAdaptiveThrottling drives the Transport against a server that refuses
// everything: once enough refusals are counted, requests fail locally with
// ErrThrottled and never reach the server; after the window passes and the
// server recovers, nothing is throttled.
func TestAdaptiveThrottling(t *testing.T) {
	var refuse atomic.Bool
	refuse.Store(true)
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if refuse.Load() {
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		io.WriteString(w, "ok")
	}))
	defer srv.Close()
	clk := newFakeClock()
	var u atomic.Uint64 // the rand hook returns u/1000
	tr := newTransport(t, clk, func(c *Config) {
		c.Throttle, c.MaxRetries = true, 0
		c.Rand = func() float64 { return float64(u.Load()) / 1000 }
	})
	hc := &http.Client{Transport: tr}
	do := func() error {
		resp, err := hc.Get(srv.URL)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	u.Store(999) // p < 1 always: nothing is rejected yet
	for i := 0; i < 10; i++ {
		if err := do(); err != nil {
			t.Fatalf("request %d: %v (p was %v)", i, err, tr.Throttler().RejectProbability(clk.Now()))
		}
		clk.Advance(100 * time.Millisecond)
	}
	// 10 requests, 0 accepts: p = 10/11 > 0.5.
	u.Store(500)
	sent := hits.Load()
	if err := do(); !errors.Is(err, ErrThrottled) {
		t.Fatalf("err = %v, want ErrThrottled", err)
	}
	if hits.Load() != sent {
		t.Fatal("a throttled request reached the server")
	}
	reqs, accs := tr.Throttler().Counts(clk.Now())
	if reqs != 11 || accs != 0 {
		t.Fatalf("counts = %d/%d, want 11 requests (locally rejected ones count) and 0 accepts", reqs, accs)
	}
	// After the 2-minute window everything has aged out.
	clk.Advance(2*time.Minute + time.Second)
	refuse.Store(false)
	if p := tr.Throttler().RejectProbability(clk.Now()); p != 0 {
		t.Fatalf("p = %v after the window, want 0", p)
	}
	u.Store(0) // reject whenever p > 0
	for i := 0; i < 50; i++ {
		if err := do(); err != nil {
			t.Fatalf("healthy request %d: %v", i, err)
		}
	}
}
