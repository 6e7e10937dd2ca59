package bucket

import (
	"testing"
	"time"

	"pgregory.net/rapid"
)

// TestShare: shares that add up to n admit, each from its own bucket, no
// more than the whole limit over any run of checks; a share holds at least
// a token; other algorithms and empty shares are refused.
func TestShare(t *testing.T) {
	tb, _ := NewLimit(TokenBucket, 100, time.Second, 50)
	if s, ok := tb.Share(1, 4); !ok || s.Burst() != 12 || s.Quota() != 100 || s.Window() != 4*time.Second {
		t.Errorf("Share(1, 4) = %v, %v", s, ok)
	}
	if s, ok := tb.Share(4, 4); !ok || s != tb {
		t.Errorf("Share(4, 4) = %v, %v; want the limit", s, ok)
	}
	for _, c := range []struct {
		l    Limit
		k, n uint32
	}{{tb, 0, 4}, {tb, 5, 4}, {tb, 1, 51}} {
		if _, ok := c.l.Share(c.k, c.n); ok {
			t.Errorf("%v.Share(%d, %d) ok", c.l, c.k, c.n)
		}
	}
	fw, _ := NewLimit(FixedWindow, 100, time.Second, 100)
	if _, ok := fw.Share(1, 2); ok {
		t.Error("a fixed window shared")
	}
	if _, ok := (Limit{}).Share(1, 2); ok {
		t.Error("the unlimited limit shared")
	}
	rapid.Check(t, func(t *rapid.T) {
		alg := rapid.SampledFrom([]Algorithm{TokenBucket, GCRA}).Draw(t, "alg")
		q := rapid.Int64Range(1, 1e6).Draw(t, "quota")
		w := time.Duration(rapid.Int64Range(1, int64(time.Hour)).Draw(t, "window"))
		b := rapid.Int64Range(1, 1e6).Draw(t, "burst")
		l, err := NewLimit(alg, q, w, b)
		if err != nil {
			t.Skip()
		}
		n := rapid.Uint32Range(1, 64).Draw(t, "n")
		// A split of n into parts.
		var parts []uint32
		for left := n; left > 0; {
			k := rapid.Uint32Range(1, left).Draw(t, "k")
			parts = append(parts, k)
			left -= k
		}
		var lims []Limit
		for _, k := range parts {
			s, ok := l.Share(k, n)
			if !ok {
				if b/int64(n) >= 1 && k < n {
					// Refused only for an out-of-range share.
					if _, err := NewLimit(alg, q*int64(k), w*time.Duration(n), b/int64(n)*int64(k)); err == nil && q*int64(k) <= MaxTokens {
						t.Fatalf("Share(%d, %d) of %v refused", k, n, l)
					}
				}
				t.Skip()
			}
			lims = append(lims, s)
		}
		// Each share's bucket takes greedily at random times; the sum
		// over any prefix window [0, T] is at most burst + rate·T.
		states := make([]State, len(lims))
		var total int64
		now := int64(0)
		for range rapid.IntRange(1, 200).Draw(t, "steps") {
			now += rapid.Int64Range(0, int64(w)).Draw(t, "dt")
			for i, s := range lims {
				total += s.TakeUpTo(&states[i], now, rapid.Int64Range(0, b).Draw(t, "n"))
			}
			// burst + quota·now/window, rounded up.
			allowed := b + (q*now+int64(w)-1)/int64(w)
			if now > 0 && q > (1<<62)/now {
				allowed = 1 << 62
			}
			if total > allowed {
				t.Fatalf("shares %v of %v admitted %d by %v, more than %d", parts, l, total, time.Duration(now), allowed)
			}
		}
	})
}
