package testproc

import (
	"context"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Request is one request of a Load: which gateway and key, when, and the
// answer (Code 0: the request failed at the transport).
type Request struct {
	Gateway, Key int
	Start, End   int64 // Unix ns
	Code         int
}

// Load sends GET / to gateways at a fixed total rate (or one that follows
// RateAt), spread round-robin over the gateways and the API keys, from a
// pool of workers; it records every request. An arrival finding every
// worker busy is counted in Skipped rather than queued, so the offered
// rate never bursts after the gateways stall.
type Load struct {
	Proxies []string // gateway proxy addresses
	Keys    []string // API key values (header X-API-Key)
	Rate    float64  // requests per second, in total
	// RateAt, when set, replaces Rate: the rate at each instant, open-loop
	// (the next arrival is 1/RateAt(t) after the one at t, whatever the
	// answers). A rate ≤ 0 sends nothing until it rises (polled every
	// 10 ms). Arrivals the sender is late for go at once while it is less
	// than a second behind; further behind, the schedule restarts from
	// now. Two Loads with the same RateAt, started together, offer the
	// same arrivals.
	RateAt  func(time.Time) float64
	Workers int // default 32
	Timeout time.Duration

	mu      sync.Mutex // guards results
	results []Request
	skipped atomic.Int64
	sent    atomic.Int64

	cancel context.CancelFunc
	wg     sync.WaitGroup
	tr     *http.Transport
}

// Start starts the load; Stop ends it.
func (l *Load) Start() {
	if l.Workers <= 0 {
		l.Workers = 32
	}
	if l.Timeout <= 0 {
		l.Timeout = 5 * time.Second
	}
	l.tr = &http.Transport{MaxIdleConnsPerHost: l.Workers, IdleConnTimeout: 30 * time.Second}
	client := &http.Client{Timeout: l.Timeout, Transport: l.tr}
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	jobs := make(chan Request)
	for range l.Workers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for r := range jobs {
				l.do(client, r)
			}
		}()
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		defer close(jobs)
		g, k := len(l.Proxies), len(l.Keys)
		i := 0
		send := func() {
			select {
			case jobs <- Request{Gateway: i % g, Key: (i / g) % k}:
				i++
			default:
				l.skipped.Add(1)
			}
		}
		if l.RateAt == nil {
			t := time.NewTicker(time.Duration(float64(time.Second) / l.Rate))
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					send()
				}
			}
		}
		timer := time.NewTimer(0)
		defer timer.Stop()
		next := time.Now()
		for {
			select {
			case <-ctx.Done():
				return
			case <-timer.C:
			}
			if rt := l.RateAt(next); rt <= 0 {
				next = next.Add(10 * time.Millisecond)
			} else {
				send()
				next = next.Add(time.Duration(float64(time.Second) / rt))
			}
			d := time.Until(next)
			if d < -time.Second {
				next, d = time.Now(), 0 // fell behind: do not burst to catch up
			}
			timer.Reset(max(d, 0))
		}
	}()
}

func (l *Load) do(c *http.Client, r Request) {
	l.sent.Add(1)
	r.Start = time.Now().UnixNano()
	req, err := http.NewRequest(http.MethodGet, "http://"+l.Proxies[r.Gateway]+"/", nil)
	if err == nil {
		req.Header.Set("X-API-Key", l.Keys[r.Key])
		var resp *http.Response
		if resp, err = c.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			r.Code = resp.StatusCode
		}
	}
	r.End = time.Now().UnixNano()
	l.mu.Lock()
	l.results = append(l.results, r)
	l.mu.Unlock()
}

// Stop ends the load, waits for the requests in flight and closes the
// client's connections. Safe to call twice.
func (l *Load) Stop() {
	if l.cancel == nil {
		return
	}
	l.cancel()
	l.wg.Wait()
	l.tr.CloseIdleConnections()
}

// Results returns a copy of the finished requests.
func (l *Load) Results() []Request {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Request(nil), l.results...)
}

// Skipped is the number of ticks that found every worker busy.
func (l *Load) Skipped() int64 { return l.skipped.Load() }

// Tally counts requests by outcome.
type Tally struct {
	Total, OK, Denied, FiveXX, Other, Transport int
}

// Count tallies the requests that match keep (nil: all).
func Count(rs []Request, keep func(Request) bool) Tally {
	var t Tally
	for _, r := range rs {
		if keep != nil && !keep(r) {
			continue
		}
		t.Total++
		switch {
		case r.Code == 0:
			t.Transport++
		case r.Code == http.StatusOK:
			t.OK++
		case r.Code == http.StatusTooManyRequests:
			t.Denied++
		case r.Code >= 500:
			t.FiveXX++
		default:
			t.Other++
		}
	}
	return t
}

// Span returns the first start and the last end among rs (Unix ns).
func Span(rs []Request) (first, last int64) {
	for i, r := range rs {
		if i == 0 || r.Start < first {
			first = r.Start
		}
		if r.End > last {
			last = r.End
		}
	}
	return first, last
}
