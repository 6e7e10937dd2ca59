package httplimit

import (
	"net/http/httptest"
	"strconv"
	"testing"

	"github.com/allot/allot/pkg/bucket"
)

// TestNeverRetryAfterClamped: a denial that can never be admitted
// (bucket.Never: more hits than the rule's burst) still carries the
// contract's 429 with Retry-After and t at MaxRetryAfter's seconds (the
// longest window), not 292 years.
func TestNeverRetryAfterClamped(t *testing.T) {
	d := deniedDecision()
	d.RetryAfter = bucket.Never
	want := int64(MaxRetryAfter / 1e9)
	if MaxRetryAfter%1e9 != 0 {
		want++
	}
	if got := RetryAfterSeconds(d); got != want {
		t.Fatalf("RetryAfterSeconds(Never) = %d, want %d", got, want)
	}
	rec := httptest.NewRecorder()
	SetFields(rec.Header(), d, nil)
	WriteDenied(rec, nil, d)
	if rec.Code != 429 || rec.Header().Get("Retry-After") != strconv.FormatInt(want, 10) {
		t.Fatalf("%d, Retry-After %q, want 429 and %d", rec.Code, rec.Header().Get("Retry-After"), want)
	}
	if got, w := rec.Header().Get(HeaderRateLimit), `"free_search";r=0;t=`+strconv.FormatInt(want, 10); got != w {
		t.Fatalf("RateLimit %q, want %q", got, w)
	}
}
