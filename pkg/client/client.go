// Package client is the client side of allot's HTTP contract: an
// http.RoundTripper that waits and retries when a server answers 429 Too Many
// Requests, and that throttles itself adaptively when the server keeps
// refusing it.
//
// On a 429 (or a 503 that carries Retry-After) the Transport sleeps and
// retries, at most MaxRetries times, and only when the request can be
// replayed (no body, or a GetBody). The sleep is the server's Retry-After
// (delay-seconds or an HTTP-date; 0 without one) plus full-jitter
// exponential backoff, uniform(0, min(MaxDelay, BaseDelay·2^n)) before retry
// n+1: never earlier than Retry-After, and spread after it, so that clients
// told the same Retry-After do not come back in lockstep. A Retry-After longer than MaxRetryAfter, or one that would
// outlive the request's context deadline, is not waited for: the 429 is
// returned to the caller at once. Sleeping honours the request's context.
//
// With Throttle set, every attempt first passes a Throttler (Google SRE
// adaptive throttling, K = 2 over 2 minutes): when the backend refused most
// recent requests, some requests fail locally with ErrThrottled without being
// sent, which sheds load before it reaches the server.
//
// Most callers want
//
//	t, err := client.New(client.DefaultConfig())
//	hc := &http.Client{Transport: t}
//
// A Transport is safe for concurrent use.
package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// ErrThrottled is returned (wrapped in *url.Error by http.Client) when
// adaptive throttling rejects a request locally.
var ErrThrottled = errors.New("client: request rejected locally by adaptive throttling")

// maxBufferedBody is how much of a 429/503 body the Transport keeps in
// memory so that the connection can be reused while it waits. A larger body
// is not retried: the response is handed to the caller untouched.
const maxBufferedBody = 64 << 10

// Config configures a Transport. Start from DefaultConfig.
type Config struct {
	// Base sends the requests. nil means http.DefaultTransport.
	Base http.RoundTripper
	// MaxRetries is the number of retries after the first attempt (≥ 0).
	MaxRetries int
	// BaseDelay and MaxDelay shape the backoff: before retry n+1 (n from 0)
	// the Transport sleeps uniform(0, min(MaxDelay, BaseDelay·2^n)), but at
	// least the server's Retry-After.
	BaseDelay, MaxDelay time.Duration
	// MaxRetryAfter is the longest Retry-After the Transport waits for; a
	// longer one returns the response to the caller. 0 means MaxDelay.
	MaxRetryAfter time.Duration

	// Throttle enables adaptive throttling with ThrottleK over
	// ThrottleWindow, counted in ThrottleBuckets time buckets.
	Throttle        bool
	ThrottleK       float64
	ThrottleWindow  time.Duration
	ThrottleBuckets int

	// Now, Sleep and Rand are test hooks. nil means time.Now, a
	// context-aware timer, and math/rand/v2's Float64. Rand must return a
	// uniform number in [0, 1) and be safe for concurrent use.
	Now   func() time.Time
	Sleep func(ctx context.Context, d time.Duration) error
	Rand  func() float64
}

// DefaultConfig returns 3 retries, backoff from 100 ms capped at 10 s,
// Retry-After honoured up to 30 s, and adaptive throttling on with K = 2
// over 2 minutes in 1-second buckets.
func DefaultConfig() Config {
	return Config{
		MaxRetries:      3,
		BaseDelay:       100 * time.Millisecond,
		MaxDelay:        10 * time.Second,
		MaxRetryAfter:   30 * time.Second,
		Throttle:        true,
		ThrottleK:       2,
		ThrottleWindow:  2 * time.Minute,
		ThrottleBuckets: 120,
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case c.MaxRetries < 0:
		return errors.New("client: MaxRetries must be ≥ 0")
	case c.BaseDelay <= 0:
		return errors.New("client: BaseDelay must be > 0")
	case c.MaxDelay < c.BaseDelay:
		return errors.New("client: MaxDelay must be ≥ BaseDelay")
	case c.MaxRetryAfter < 0:
		return errors.New("client: MaxRetryAfter must be ≥ 0")
	}
	if c.Throttle {
		switch {
		case c.ThrottleK <= 0:
			return errors.New("client: ThrottleK must be > 0")
		case c.ThrottleBuckets <= 0:
			return errors.New("client: ThrottleBuckets must be > 0")
		case c.ThrottleWindow < time.Duration(c.ThrottleBuckets)*time.Millisecond:
			return errors.New("client: ThrottleWindow must be at least 1 ms per bucket")
		}
	}
	return nil
}

// Transport is an http.RoundTripper with Retry-After-aware retries and
// adaptive throttling. Create it with New.
type Transport struct {
	cfg      Config
	base     http.RoundTripper
	throttle *Throttler // nil when disabled
}

// New validates cfg and returns a Transport.
func New(cfg Config) (*Transport, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxRetryAfter == 0 {
		cfg.MaxRetryAfter = cfg.MaxDelay
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Sleep == nil {
		cfg.Sleep = sleep
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.Float64
	}
	t := &Transport{cfg: cfg, base: cfg.Base}
	if t.base == nil {
		t.base = http.DefaultTransport
	}
	if cfg.Throttle {
		t.throttle = NewThrottler(cfg.ThrottleK, cfg.ThrottleWindow, cfg.ThrottleBuckets)
	}
	return t, nil
}

// Throttler returns the adaptive throttler, or nil when disabled.
func (t *Transport) Throttler() *Throttler { return t.throttle }

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// replayable reports whether req can be sent again.
func replayable(req *http.Request) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	var last *http.Response // a buffered 429/503, returned if we stop retrying
	for attempt := 0; ; attempt++ {
		r := req
		if attempt > 0 {
			r = req.Clone(ctx)
			if req.Body != nil && req.Body != http.NoBody {
				body, err := req.GetBody()
				if err != nil {
					return last, nil // cannot replay: the caller gets the 429
				}
				r.Body = body
			}
		}
		if t.throttle != nil && !t.throttle.Attempt(t.cfg.Now(), t.cfg.Rand()) {
			if r.Body != nil {
				r.Body.Close() // RoundTrip must close the body, even on error
			}
			if last != nil {
				return last, nil // a retry was throttled: the caller gets the 429
			}
			return nil, ErrThrottled
		}
		resp, err := t.base.RoundTrip(r)
		if err != nil {
			return nil, err
		}
		retryAfter, hasRA := parseRetryAfter(resp.Header.Get("Retry-After"), t.cfg.Now())
		refused := resp.StatusCode == http.StatusTooManyRequests ||
			resp.StatusCode == http.StatusServiceUnavailable
		if t.throttle != nil && !refused {
			t.throttle.Accepted(t.cfg.Now())
		}
		retry := resp.StatusCode == http.StatusTooManyRequests ||
			(resp.StatusCode == http.StatusServiceUnavailable && hasRA)
		if !retry || attempt >= t.cfg.MaxRetries || !replayable(req) {
			return resp, nil
		}
		if hasRA && retryAfter > t.cfg.MaxRetryAfter {
			return resp, nil
		}
		// The jitter goes on top of Retry-After: flooring a jittered delay
		// at Retry-After would send every client back at the same instant
		// whenever Retry-After exceeds the backoff (bench/sim's retry storm:
		// 31k attempts per 100 ms with the floor, 4k with the jitter added).
		delay := retryAfter + t.backoff(attempt)
		if dl, ok := ctx.Deadline(); ok && t.cfg.Now().Add(delay).After(dl) {
			return resp, nil // waiting would outlive the caller
		}
		if !bufferBody(resp) {
			return resp, nil
		}
		last = resp
		if err := t.cfg.Sleep(ctx, delay); err != nil {
			return nil, fmt.Errorf("client: waiting to retry after %d: %w", resp.StatusCode, err)
		}
	}
}

// backoff returns the full-jitter delay before retry n+1.
func (t *Transport) backoff(n int) time.Duration {
	expo := t.cfg.MaxDelay
	if n < 62 {
		if d := t.cfg.BaseDelay << n; d>>n == t.cfg.BaseDelay && d > 0 && d < expo {
			expo = d
		}
	}
	return time.Duration(t.cfg.Rand() * float64(expo))
}

// bufferBody reads resp.Body into memory (at most maxBufferedBody) and
// closes the original, so the connection is free while we wait. It reports
// false, leaving a body that still reads in full, when the body is larger.
func bufferBody(resp *http.Response) bool {
	if resp.Body == nil || resp.Body == http.NoBody {
		return true
	}
	buf, err := io.ReadAll(io.LimitReader(resp.Body, maxBufferedBody+1))
	if err != nil || len(buf) > maxBufferedBody {
		resp.Body = readCloser{io.MultiReader(bytes.NewReader(buf), resp.Body), resp.Body}
		return false
	}
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(buf))
	return true
}

type readCloser struct {
	io.Reader
	io.Closer
}

// parseRetryAfter parses a Retry-After value (RFC 9110 §10.2.3): either
// delay-seconds (1*DIGIT) or an HTTP-date, relative to now. A date in the
// past is a zero delay. ok is false for an absent or malformed value.
func parseRetryAfter(v string, now time.Time) (d time.Duration, ok bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if v[0] >= '0' && v[0] <= '9' {
		for i := 0; i < len(v); i++ {
			if v[i] < '0' || v[i] > '9' {
				return 0, false
			}
		}
		secs, err := strconv.ParseInt(v, 10, 64)
		if err != nil || secs > int64(1<<62)/int64(time.Second) {
			return time.Duration(1<<62 - 1), true // absurdly long: saturate
		}
		return time.Duration(secs) * time.Second, true
	}
	at, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	d = at.Sub(now)
	if d < 0 {
		d = 0
	}
	return d, true
}
