package rls

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// newJSONServer serves POST /json over a real loopback listener, backed
// by a standalone agent with a frozen clock.
func newJSONServer(t testing.TB, maxBody int64) (*Server, string) {
	t.Helper()
	a, srv := newTestServer(t)
	mux := http.NewServeMux()
	mux.Handle(JSONPath, srv.JSONHandler(maxBody))
	hs := httptest.NewServer(mux)
	t.Cleanup(func() {
		hs.Close()
		a.Close(context.Background())
	})
	return srv, hs.URL + JSONPath
}

func postJSON(t *testing.T, url, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func TestJSONOKThenOverLimit(t *testing.T) {
	_, url := newJSONServer(t, 0)
	const req = `{"domain":"rls-test","descriptors":[{"entries":[{"key":"api_key","value":"k1"}]}]}`
	for i := 1; i <= 10; i++ {
		resp, body := postJSON(t, url, req)
		if resp.StatusCode != 200 {
			t.Fatalf("call %d: %d %s", i, resp.StatusCode, body)
		}
		var out rlsv3.RateLimitResponse
		if err := protojson.Unmarshal(body, &out); err != nil {
			t.Fatalf("call %d: %v in %s", i, err, body)
		}
		if out.OverallCode != rlsv3.RateLimitResponse_OK || out.Statuses[0].LimitRemaining != uint32(10-i) ||
			out.Statuses[0].CurrentLimit.GetName() != "per_key" {
			t.Fatalf("call %d: %s", i, body)
		}
		if got := resp.Header.Get("RateLimit-Policy"); got != `"per_key";q=10;w=60` {
			t.Fatalf("call %d: RateLimit-Policy %q", i, got)
		}
		if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"per_key";r=`) || resp.Header.Get("Cache-Control") != "no-store" ||
			resp.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("call %d: headers %v", i, resp.Header)
		}
	}
	resp, body := postJSON(t, url, req)
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("11th call: %d %s", resp.StatusCode, body)
	}
	var out rlsv3.RateLimitResponse
	if err := protojson.Unmarshal(body, &out); err != nil || out.OverallCode != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("11th call: %v %s", err, body)
	}
	// 10/minute: the next token in 6 s.
	if resp.Header.Get("Retry-After") != "6" || resp.Header.Get("RateLimit") != `"per_key";r=0;t=6` {
		t.Fatalf("11th call headers: %v", resp.Header)
	}
}

// TestJSONAnswersAsGRPC: the JSON endpoint answers what ShouldRateLimit
// answers for the same request (one code path).
func TestJSONAnswersAsGRPC(t *testing.T) {
	srv, url := newJSONServer(t, 0)
	const req = `{"domain":"rls-test","hitsAddend":2,"descriptors":[{"entries":[{"key":"team","value":"a"}]},{"entries":[{"key":"free","value":"x"}]},{"entries":[{"key":"nothing","value":"x"}]}]}`
	_, body := postJSON(t, url, req)
	var viaJSON rlsv3.RateLimitResponse
	if err := protojson.Unmarshal(body, &viaJSON); err != nil {
		t.Fatal(err)
	}
	var in rlsv3.RateLimitRequest
	if err := protojson.Unmarshal([]byte(req), &in); err != nil {
		t.Fatal(err)
	}
	direct, err := srv.ShouldRateLimit(context.Background(), &in) // 2 more hits: remaining counts down by 2
	if err != nil {
		t.Fatal(err)
	}
	if direct.Statuses[0].LimitRemaining+2 != viaJSON.Statuses[0].LimitRemaining {
		t.Fatalf("remaining: gRPC %d after JSON %d", direct.Statuses[0].LimitRemaining, viaJSON.Statuses[0].LimitRemaining)
	}
	direct.Statuses[0].LimitRemaining = viaJSON.Statuses[0].LimitRemaining
	direct.Statuses[0].DurationUntilReset = viaJSON.Statuses[0].DurationUntilReset
	if !proto.Equal(direct, &viaJSON) {
		t.Fatalf("gRPC %v\nJSON %v", direct, &viaJSON)
	}
}

func TestJSONBadInput(t *testing.T) {
	_, url := newJSONServer(t, 1024)
	big := `{"domain":"rls-test","descriptors":[{"entries":[{"key":"api_key","value":"` + strings.Repeat("k", 2000) + `"}]}]}`
	for _, tc := range []struct {
		name, body string
		code       int
		msg        string
	}{
		{"garbage", "not json", 400, "syntax error"},
		{"unknown field", `{"domain":"d","bogus":1}`, 400, "unknown field"},
		{"wrong type", `{"domain":7}`, 400, "domain"},
		{"no domain", `{"descriptors":[{"entries":[{"key":"a","value":"b"}]}]}`, 400, "domain must not be empty"},
		{"no descriptors", `{"domain":"d"}`, 400, "descriptors must not be empty"},
		{"negative hits", `{"domain":"d","descriptors":[{"entries":[{"key":"a","value":"b"}],"isNegativeHits":true}]}`, 400, "is_negative_hits"},
		{"oversized", big, 413, "over 1024 bytes"},
	} {
		resp, body := postJSON(t, url, tc.body)
		var e struct{ Error, Message string }
		if resp.StatusCode != tc.code || json.Unmarshal(body, &e) != nil || !strings.Contains(e.Message, tc.msg) {
			t.Errorf("%s: %d %s, want %d with %q", tc.name, resp.StatusCode, body, tc.code, tc.msg)
		}
	}
	// Oversized without a Content-Length (chunked): 413 as well.
	r, err := http.NewRequest("POST", url, io.MultiReader(strings.NewReader(big)))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("chunked oversized: %d", resp.StatusCode)
	}
	resp, err = http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "POST" {
		t.Fatalf("GET: %d %v", resp.StatusCode, resp.Header)
	}
}

// FuzzJSONHandler: any body gets 200, 429, 400 or 413 with a JSON body,
// never a panic; a 200 or 429 is a RateLimitResponse with one status per
// descriptor.
func FuzzJSONHandler(f *testing.F) {
	f.Add([]byte(`{"domain":"rls-test","descriptors":[{"entries":[{"key":"api_key","value":"k1"}]}]}`))
	f.Add([]byte(`{"domain":"rls-test","hitsAddend":"3","descriptors":[{"entries":[{"key":"path","value":"/a"}],"hitsAddend":0}]}`))
	f.Add([]byte(`{"domain":"rls-test","descriptors":[{"entries":[]}]}`))
	f.Add([]byte(`{"domain":"x","descriptors":[{"entries":[{"key":"","value":"v"}]}]}`))
	f.Add([]byte(`{`))
	f.Add([]byte{0xff, 0xfe})
	srv, _ := newJSONServer(f, 4096)
	h := srv.JSONHandler(4096)
	f.Fuzz(func(t *testing.T, body []byte) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("POST", JSONPath, bytes.NewReader(body)))
		if !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("%d: body is not JSON: %q", rec.Code, rec.Body)
		}
		switch rec.Code {
		case 200, 429:
			var req rlsv3.RateLimitRequest
			var resp rlsv3.RateLimitResponse
			if err := protojson.Unmarshal(body, &req); err != nil {
				t.Fatalf("%d for a body that does not parse: %v", rec.Code, err)
			}
			if err := protojson.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
				t.Fatal(err)
			}
			if len(resp.Statuses) != len(req.Descriptors) {
				t.Fatalf("%d statuses for %d descriptors", len(resp.Statuses), len(req.Descriptors))
			}
			if (rec.Code == 429) != (resp.OverallCode == rlsv3.RateLimitResponse_OVER_LIMIT) {
				t.Fatalf("status %d with overall code %v", rec.Code, resp.OverallCode)
			}
		case 400, 413:
		default:
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
	})
}
