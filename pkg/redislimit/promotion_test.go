package redislimit

import (
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// TestRedisPromotionLookup: Promotion reads the marker Promote wrote (what
// allotctl inspect --redis shows), and reports nothing for an unpromoted key
// or after the promotion ends.
func TestRedisPromotionLookup(t *testing.T) {
	srv := startRedis(t)
	b := newTestBackend(t, nil, srv.addr())
	lim := mustLimit(t, bucket.TokenBucket, 8, time.Hour, 800)
	now := base
	if _, err := b.AllowNAt(bg, "cold", lim, 1, now, 1); err != nil {
		t.Fatal(err)
	}
	if n, _, ok, err := b.Promotion(bg, "cold", now); err != nil || ok || n != 0 {
		t.Fatalf("unpromoted key: %d %v %v", n, ok, err)
	}
	if n, _, ok, err := b.Promotion(bg, "never-seen", now); err != nil || ok || n != 0 {
		t.Fatalf("absent key: %d %v %v", n, ok, err)
	}
	_, until, err := b.Promote(bg, "hot", lim, 4, now, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	n, got, ok, err := b.Promotion(bg, "hot", now)
	if err != nil || !ok || n != 4 || !got.Equal(until) {
		t.Fatalf("promoted key: %d %v %v %v, want 4 shards until %v", n, got, ok, err, until)
	}
	if _, _, ok, err := b.Promotion(bg, "hot", until.UnixNano()); err != nil || ok {
		t.Fatalf("at the promotion's end: ok %v err %v, want not promoted", ok, err)
	}
}

func TestParsePromotion(t *testing.T) {
	for _, tc := range []struct {
		v      string
		shards int
		ok     bool
		bad    bool
	}{
		{"p:2000:8", 8, true, false},
		{"p:500:8", 8, false, false}, // ended
		{"12:34:5", 0, false, false}, // a key's state, not a marker
		{"", 0, false, false},
		{"p:x:8", 0, false, true},
		{"p:2000", 0, false, true},
		{"p:2000:1", 0, false, true},
		{"p:99999999999999999999:8", 0, false, true},
	} {
		n, _, ok, err := parsePromotion(tc.v, 1000*int64(time.Millisecond))
		if (err != nil) != tc.bad || ok != tc.ok || (!tc.bad && ok && n != tc.shards) {
			t.Errorf("parsePromotion(%q) = %d, %v, %v", tc.v, n, ok, err)
		}
	}
}
