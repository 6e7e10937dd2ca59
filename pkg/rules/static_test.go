package rules

import (
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// TestStaticShare: only leased, limiting, cluster-scoped token-bucket or
// GCRA rules whose 1/n share holds a token are static-eligible.
func TestStaticShare(t *testing.T) {
	l, err := bucket.NewLimit(bucket.TokenBucket, 1000, 1e9, 1000)
	if err != nil {
		t.Fatal(err)
	}
	ok := Rule{Backend: BackendLease, Algorithm: bucket.TokenBucket, Limit: l}
	if s, yes := ok.StaticShare(10, time.Second); !yes || s.Burst() != 100 {
		t.Fatalf("StaticShare(10, time.Second) = %v, %v", s, yes)
	}
	for name, r := range map[string]Rule{
		"redis":   {Backend: BackendRedis, Limit: l},
		"global":  {Backend: BackendLease, Scope: ScopeGlobal, Limit: l},
		"shadow":  {Backend: BackendLease, ShadowMode: true, Limit: l},
		"deny":    {Backend: BackendLease, DenyAll: true, Limit: l},
		"unlimit": {Backend: BackendLease, Unlimited: true},
	} {
		if _, yes := r.StaticShare(10, time.Second); yes {
			t.Errorf("%s: eligible", name)
		}
	}
	if _, yes := ok.StaticShare(1001, time.Hour); yes {
		t.Error("a share under one token: eligible")
	}
	if _, yes := ok.StaticShare(0, time.Hour); yes {
		t.Error("n = 0: eligible")
	}
	// A share of 100/s, burst 100 refills in 1 s: eligible under a 1 s
	// cap, not under 999 ms.
	if _, yes := ok.StaticShare(10, 999*time.Millisecond); yes {
		t.Error("a share refilling in 1 s eligible under 999 ms")
	}
	if d := RefillTime(l); d != time.Second {
		t.Errorf("RefillTime = %v, want 1s", d)
	}
}
