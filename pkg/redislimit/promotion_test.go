package redislimit

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
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

// failOnce fails the next call of one of ops on the Redis key `key`, once
// armed (a timeout on that call).
type failOnce struct {
	store
	ops   []op
	key   string
	armed atomic.Bool
}

func (s *failOnce) do(ctx context.Context, c *call) (outcome, error) {
	if slices.Contains(s.ops, c.op) && c.key == s.key && s.armed.CompareAndSwap(true, false) {
		return outcome{}, errors.New("i/o timeout")
	}
	return s.store.do(ctx, c)
}

// TestRedisPromotePartialFailure: a Promote whose calls fail part way never
// admits more than the key had left, and a later Promote (a retry, then an
// extension) completes it. Failing to empty a sub-key (the first, a middle
// or the last), or to mark the key, leaves the key unpromoted and costs
// nothing. Failing to give a sub-key its share loses that share. With
// ServerTime every step runs at Redis's instant of the first call.
func TestRedisPromotePartialFailure(t *testing.T) {
	lim := mustLimit(t, bucket.TokenBucket, 8, time.Hour, 800) // no refill to speak of
	const shards = 8
	shares := make([]int64, shards) // of the 100 left
	for i := range shares {
		shares[i] = splitPart(100, shards, i)
	}
	empty := []op{opDrain, opDebit} // what empties a sub-key
	cases := []struct {
		name     string
		ops      []op
		shard    int // -1: the key itself
		promoted bool
		want     int64 // admitted after the retry
	}{
		{"empty first", empty, 0, false, 100},
		{"empty middle", empty, 3, false, 100},
		{"empty last", empty, shards - 1, false, 100},
		{"mark", []op{opPromote}, -1, false, 100},
		{"share first", []op{opGive}, 0, true, 100 - shares[0]},
		{"share middle", []op{opGive}, 3, true, 100 - shares[3]},
		{"share last", []op{opGive}, shards - 1, true, 100 - shares[shards-1]},
	}
	run := func(t *testing.T, mk func(func(*Config)) *Backend) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				a, other := mk(nil), mk(nil)
				key := "hot/" + c.name
				h := xxh64(key)
				fail := &failOnce{store: a.st, ops: c.ops, key: a.mainKey(key, h)}
				if c.shard >= 0 {
					fail.key = a.subKey(key, h, shards, c.shard)
				}
				a.st = fail
				now := base
				for range 700 {
					if r, err := a.AllowNAt(bg, key, lim, 1, now, 1); err != nil || !r.Allowed {
						t.Fatalf("%+v %v", r, err)
					}
				}
				fail.armed.Store(true)
				_, _, err := a.Promote(bg, key, lim, shards, now, 10*time.Second)
				if (err == nil) != c.promoted {
					t.Fatalf("Promote with a failing call: %v", err)
				}
				_, err = other.single(bg, key, lim, 1, 0, opPeek, now, 0)
				if promoted := errors.Is(err, ErrPromoted); promoted != c.promoted || err != nil && !promoted {
					t.Errorf("after the failed call the key is promoted: %v (%v), want %v", promoted, err, c.promoted)
				}
				for _, what := range []string{"retry", "extension"} {
					if n, _, err := a.Promote(bg, key, lim, shards, now, 10*time.Second); err != nil || n != shards {
						t.Fatalf("%s: Promote = %d, %v", what, n, err)
					}
				}
				var got int64
				for range 1000 {
					for _, b := range []*Backend{other, a} {
						r, err := b.AllowNAt(bg, key, lim, 1, now, 1)
						if err != nil {
							t.Fatal(err)
						}
						if r.Allowed {
							got++
						}
					}
				}
				if got > 100 {
					t.Fatalf("after promotion the agents admitted %d, but only 100 were left", got)
				}
				if got != c.want {
					t.Fatalf("after promotion the agents admitted %d, want %d", got, c.want)
				}
			})
		}
	}
	batcherBackends(t, run)
	t.Run("redis server time", func(t *testing.T) {
		srv := startRedis(t)
		run(t, func(func(*Config)) *Backend {
			return newTestBackend(t, func(c *Config) { c.ServerTime = true }, srv.addr())
		})
	})
}

// TestRedisPromoteRetriedAcrossWindows: sliding window, 80 a minute. Two
// Promotes fail to mark the key in one window (after emptying its
// sub-keys); the next window the key admits 30, then a Promote succeeds.
// Emptying the sub-keys twice must not leave them refilling faster than the
// key through that window: over the window at most 80 are admitted.
func TestRedisPromoteRetriedAcrossWindows(t *testing.T) {
	batcherBackends(t, func(t *testing.T, mk func(func(*Config)) *Backend) {
		a, other := mk(nil), mk(nil)
		lim := mustLimit(t, bucket.SlidingWindow, 80, time.Minute, 80)
		const key, shards = "hot", 8
		fail := &failOnce{store: a.st, ops: []op{opPromote}, key: a.mainKey(key, xxh64(key))}
		a.st = fail
		for _, at := range []time.Duration{time.Second, 2 * time.Second} {
			fail.armed.Store(true)
			if _, _, err := a.Promote(bg, key, lim, shards, base+int64(at), 10*time.Minute); err == nil {
				t.Fatal("Promote succeeded with a failing mark")
			}
		}
		w := base + int64(time.Minute) // the next window
		admitted := 0
		check := func(b *Backend, at time.Duration, k int) {
			for range k {
				r, err := b.AllowNAt(bg, key, lim, 1, w+int64(at), 1)
				if err != nil {
					t.Fatal(err)
				}
				if r.Allowed {
					admitted++
				}
			}
		}
		check(other, 500*time.Millisecond, 30)
		if _, _, err := a.Promote(bg, key, lim, shards, w+int64(time.Second), 10*time.Minute); err != nil {
			t.Fatal(err)
		}
		for _, at := range []time.Duration{time.Second, 30 * time.Second, 59 * time.Second} {
			check(other, at, 100)
			check(a, at, 100)
		}
		t.Logf("admitted %d in the window", admitted)
		if admitted > 80 {
			t.Fatalf("admitted %d in one window, limit 80", admitted)
		}
	})
}
