package main

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"
)

// TestRequestBodyLimit: a body over max_request_body_bytes gets 413 with a
// JSON body, whether Content-Length declares it (the upstream is never
// called) or a chunked body runs over while the proxy streams it.
func TestRequestBodyLimit(t *testing.T) {
	var upstreamCalls int
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		upstreamCalls++
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	}))
	defer up.Close()
	target, _ := url.Parse(up.URL)
	h := limitBody(newProxy(target, nil, slog.New(slog.DiscardHandler)), 16)
	srv := httptest.NewServer(h)
	defer srv.Close()

	post := func(body io.Reader, size int64) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/x", body)
		req.ContentLength = size
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := post(strings.NewReader("small"), 5); code != 200 {
		t.Fatalf("small body: %d, want 200", code)
	}
	calls := upstreamCalls
	code, body := post(strings.NewReader(strings.Repeat("x", 17)), 17)
	if code != http.StatusRequestEntityTooLarge || !strings.Contains(body, `"error":"request_too_large"`) {
		t.Fatalf("declared 17 bytes: %d %s, want 413 JSON", code, body)
	}
	if upstreamCalls != calls {
		t.Fatalf("the upstream was called for a declared oversized body")
	}
	// Chunked (length unknown): the overflow is found while streaming.
	code, body = post(io.MultiReader(strings.NewReader(strings.Repeat("y", 64))), -1)
	if code != http.StatusRequestEntityTooLarge {
		t.Fatalf("chunked 64 bytes: %d %s, want 413", code, body)
	}
}

// TestRequestBodyTimeout pins a slow request body that held a client and
// an upstream connection open indefinitely: a body not read within
// request_body_timeout gets a 408 with a JSON body, and a body that
// arrives in time is proxied even when the upstream then answers slowly.
func TestRequestBodyTimeout(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		time.Sleep(300 * time.Millisecond) // a slow answer after the body
		io.WriteString(w, "got "+string(b))
	}))
	defer up.Close()
	target, _ := url.Parse(up.URL)
	h := proxyHandler(nil, newProxy(target, nil, slog.New(slog.DiscardHandler)), 1<<20, 200*time.Millisecond)
	srv := httptest.NewServer(h)
	defer srv.Close()

	resp, err := http.Post(srv.URL+"/x", "text/plain", strings.NewReader("quick"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "got quick" {
		t.Fatalf("a body in time: %d %q, want 200 \"got quick\"", resp.StatusCode, b)
	}

	pr, pw := io.Pipe()
	defer pw.Close()
	go func() { _, _ = pw.Write([]byte("slow")) }() // then nothing more
	start := time.Now()
	resp, err = http.Post(srv.URL+"/x", "text/plain", pr)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(b), `"error":"request_timeout"`) {
		t.Fatalf("a stalled body: %d %s, want 408 JSON", resp.StatusCode, b)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("a stalled body answered after %v", d)
	}
}
