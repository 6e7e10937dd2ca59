package agent

import (
	"context"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// TestFallbackHitsOverShareBurstRetryAfter: with 4 live agents the
// fallback bucket's burst is ⌈4/4⌉ = 1. A request of 2 hits, which the
// rule's burst of 4 admits, is denied by the share but told a finite wait
// (the rule's rate refilling 2 tokens: 2 s at 60/minute), not
// bucket.Never. A request of more hits than the rule's burst is still
// never admissible.
func TestFallbackHitsOverShareBurstRetryAfter(t *testing.T) {
	s := newStepped(t, `
domain: test
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 60, burst: 4}
`)
	s.liveAgents.Store(4)
	d, err := s.Check(context.Background(), "test", []Descriptor{desc("api_key", "x")}, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("decision: allowed=%v source=%v retryAfter=%v (Never=%v) remaining=%d", d.Allowed, d.Source, d.RetryAfter, d.RetryAfter == bucket.Never, d.Remaining)
	if d.Allowed || d.Source != SourceFallback {
		t.Fatalf("2 hits over a fallback share of burst 1: allowed=%v source=%v, want a fallback denial", d.Allowed, d.Source)
	}
	if d.RetryAfter != 2*time.Second {
		t.Errorf("2 hits under burst 4 denied with RetryAfter %v, want 2s", d.RetryAfter)
	}
	d, err = s.Check(context.Background(), "test", []Descriptor{desc("api_key", "y")}, 5)
	if err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.RetryAfter != bucket.Never {
		t.Errorf("5 hits over burst 4: allowed=%v RetryAfter %v, want a denial with bucket.Never", d.Allowed, d.RetryAfter)
	}
}

// TestStaticHitsOverShareBurstRetryAfter: a static share of 4 slots has
// burst ⌈40/4⌉ = 10. A request of 20 hits, within the rule's burst of 40,
// is denied by the share with the rule's refill of 20 tokens (50 ms at
// 400/s), not bucket.Never; 41 hits is never admissible.
func TestStaticHitsOverShareBurstRetryAfter(t *testing.T) {
	s := newStatic(t)
	wantSource(t, s, desc("k", "a"), SourceStatic)
	d, err := s.Check(context.Background(), "test", []Descriptor{desc("k", "a")}, 20)
	if err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.Source != SourceStatic {
		t.Fatalf("20 hits over a static share of burst 10: allowed=%v source=%v, want a static denial", d.Allowed, d.Source)
	}
	if d.RetryAfter != 50*time.Millisecond {
		t.Errorf("20 hits under burst 40 denied with RetryAfter %v, want 50ms", d.RetryAfter)
	}
	d, err = s.Check(context.Background(), "test", []Descriptor{desc("k", "a")}, 41)
	if err != nil {
		t.Fatal(err)
	}
	if d.Allowed || d.RetryAfter != bucket.Never {
		t.Errorf("41 hits over burst 40: allowed=%v RetryAfter %v, want a denial with bucket.Never", d.Allowed, d.RetryAfter)
	}
}
