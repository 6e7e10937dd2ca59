package redislimit

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"go.uber.org/goleak"
	"go.yaml.in/yaml/v3"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-redis probes a dead server from a pool goroutine that sleeps 1s
		// between dials and notices the pool's Close after its sleep.
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
	)
}

func TestCRC16(t *testing.T) {
	// The CRC16/XMODEM check value, and examples from the Redis Cluster spec.
	if got := crc16("123456789"); got != 0x31C3 {
		t.Fatalf("crc16(123456789) = %#x, want 0x31c3", got)
	}
	for key, want := range map[string]int{
		"foo": 12182, "bar": 5061, "{user1000}.following": keySlot("user1000"),
		"foo{}{bar}": keySlot("foo{}{bar}"), "{}x": int(crc16("{}x")) % numSlots,
	} {
		if got := keySlot(key); got != want {
			t.Errorf("keySlot(%q) = %d, want %d", key, got, want)
		}
	}
}

func TestSlotTags(t *testing.T) {
	for s := range numSlots {
		tag := slotTag(s)
		if tag == "" || strings.ContainsAny(tag, "{}") || keySlot("x{"+tag+"}y") != s {
			t.Fatalf("slotTag(%d) = %q lands on slot %d", s, tag, keySlot("x{"+tag+"}y"))
		}
	}
}

// TestSubSlotSpread: for 3 contiguous equal slot ranges (redis-cli's
// layout), n = 3·k sub-keys put k on each range, for any key hash.
func TestSubSlotSpread(t *testing.T) {
	owner := func(slot int) int {
		switch {
		case slot <= 5460:
			return 0
		case slot <= 10922:
			return 1
		}
		return 2
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		h := r.Uint64()
		for _, n := range []int{3, 6, 9, 12, 30} {
			var per [3]int
			for i := range n {
				s := subSlot(h, n, i)
				if s < 0 || s >= numSlots {
					t.Fatalf("subSlot(%d, %d, %d) = %d", h, n, i, s)
				}
				per[owner(s)]++
			}
			if per != [3]int{n / 3, n / 3, n / 3} {
				t.Fatalf("n=%d, h=%d: sub-keys per master %v", n, h, per)
			}
		}
	}
}

func TestSplitExact(t *testing.T) {
	for _, c := range []struct{ quota, burst int64 }{{1000, 100}, {7, 3}, {1, 1}, {10, 1000}, {999_999, 12345}} {
		lim := mustLimit(t, bucket.TokenBucket, c.quota, time.Second, c.burst)
		for _, shards := range []int{1, 2, 3, 7, 16, 5000} {
			n := Shards(lim, shards)
			if n < 1 || n > MaxShards || int64(n) > c.quota || int64(n) > c.burst {
				t.Fatalf("Shards(%v, %d) = %d", lim, shards, n)
			}
			var q, b int64
			for i := range n {
				sub, err := subLimit(lim, n, i)
				if err != nil {
					t.Fatal(err)
				}
				q += sub.Quota()
				b += sub.Burst()
			}
			if q != c.quota || b != c.burst {
				t.Fatalf("%v split %d ways sums to quota %d burst %d", lim, n, q, b)
			}
		}
	}
}

func TestConfigValidate(t *testing.T) {
	bad := []func(*Config){
		func(c *Config) { c.Addrs = nil },
		func(c *Config) { c.Mode = "ring" },
		func(c *Config) { c.Mode = ModeSentinel },
		func(c *Config) { c.Mode = ModeSingle; c.Addrs = []string{"a:1", "b:1"} },
		func(c *Config) { c.Mode = ModeCluster; c.DB = 1 },
		func(c *Config) { c.Timeout = 0 },
		func(c *Config) { c.BreakerFailures = 0 },
		func(c *Config) { c.BreakerCooldown = 0 },
		func(c *Config) { c.KeyPrefix = "a{b" },
		func(c *Config) { c.TTLSlack = 0 },
	}
	for i, mutate := range bad {
		c := DefaultConfig()
		mutate(&c)
		if err := c.Validate(); err == nil || !strings.HasPrefix(err.Error(), "redislimit: ") {
			t.Errorf("case %d: Validate() = %v, want a redislimit error", i, err)
		}
		if _, err := New(c); err == nil {
			t.Errorf("case %d: New accepted an invalid config", i)
		}
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Addrs: []string{"a:1"}}, ModeSingle},
		{Config{Addrs: []string{"a:1", "b:1"}}, ModeCluster},
		{Config{Addrs: []string{"a:1"}, MasterName: "m"}, ModeSentinel},
		{Config{Addrs: []string{"a:1"}, Mode: ModeCluster}, ModeCluster},
	} {
		if got := c.cfg.mode(); got != c.want {
			t.Errorf("mode(%+v) = %s, want %s", c.cfg, got, c.want)
		}
	}
}

// failingStore fails every call (a dead Redis, with no network).
type failingStore struct{ calls atomic.Int64 }

func (s *failingStore) do(context.Context, *call) (outcome, error) {
	s.calls.Add(1)
	return outcome{}, errors.New("dial tcp: connection refused")
}
func (s *failingStore) close() error { return nil }

// TestBreakerFastFails: once open, calls fail with ErrBreakerOpen and no
// store call, until the cooldown (on the injected clock) lets a probe
// through.
func TestBreakerFastFails(t *testing.T) {
	var now atomic.Int64
	now.Store(base)
	cfg := DefaultConfig()
	cfg.Now = now.Load
	st := &failingStore{}
	b, err := newBackend(cfg, st)
	if err != nil {
		t.Fatal(err)
	}
	lim := mustLimit(t, bucket.TokenBucket, 10, time.Second, 10)
	for i := range 3 {
		if _, err := b.AllowN(bg, "k", lim, 1, 1); !errors.Is(err, ErrUnavailable) || errors.Is(err, ErrBreakerOpen) {
			t.Fatalf("call %d: %v, want a plain ErrUnavailable", i, err)
		}
	}
	if b.Healthy() {
		t.Fatal("healthy after 3 failures")
	}
	for range 100 {
		if _, err := b.AllowN(bg, "k", lim, 1, 1); !errors.Is(err, ErrBreakerOpen) || !errors.Is(err, ErrUnavailable) {
			t.Fatalf("open breaker: %v", err)
		}
	}
	if got := st.calls.Load(); got != 3 {
		t.Fatalf("store called %d times, want 3 (the open breaker does no I/O)", got)
	}
	now.Add(int64(cfg.BreakerCooldown))
	_, _ = b.AllowN(bg, "k", lim, 1, 1)
	if got := st.calls.Load(); got != 4 {
		t.Fatalf("store called %d times after the cooldown, want 4 (one probe)", got)
	}
	if s := b.Stats(); s.FastFails != 100 || s.Errors != 4 {
		t.Fatalf("stats %+v", s)
	}
	_ = b.Close()
	if _, err := b.AllowN(bg, "k", lim, 1, 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

func newInmem(t testing.TB, mutate func(*Config)) *Backend {
	t.Helper()
	cfg := DefaultConfig()
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := NewInmem(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

// poisson returns arrival instants at rate per second over d, from r.
func poisson(r *rand.Rand, rate float64, d time.Duration) []int64 {
	var out []int64
	for at := 0.0; ; {
		at += r.ExpFloat64() / rate
		if at >= d.Seconds() {
			return out
		}
		out = append(out, base+int64(at*1e9))
	}
}

// TestShardingAccuracy measures what splitting a key into sub-keys costs:
// Poisson traffic at several utilisations of a 1000/s (burst 100) limit,
// decided unsharded and with 4 and 16 sub-keys (one try, a second on deny).
// Sharding never over-admits (asserted); the false-reject cost is logged
// (docs/redis.md quotes it).
func TestShardingAccuracy(t *testing.T) {
	if testing.Short() {
		t.Skip("measurement")
	}
	const rate, burst = 1000, 100
	lim := mustLimit(t, bucket.TokenBucket, rate, time.Second, burst)
	d := 10 * time.Second
	for _, u := range []float64{0.5, 0.9, 1.1, 2} {
		arrivals := poisson(rand.New(rand.NewPCG(7, uint64(u*10))), u*rate, d)
		var unsharded int
		for _, shards := range []int{1, 4, 16} {
			b := newInmem(t, nil)
			admitted := 0
			for _, at := range arrivals {
				r, err := b.AllowNAt(bg, "acc", lim, shards, at, 1)
				if err != nil {
					t.Fatal(err)
				}
				if r.Allowed {
					admitted++
				}
			}
			if bound := burst + int(rate*d.Seconds()); admitted > bound {
				t.Fatalf("u=%.1f shards=%d: admitted %d > %d", u, shards, admitted, bound)
			}
			if shards == 1 {
				unsharded = admitted
			}
			falseRejects := float64(unsharded-admitted) / float64(len(arrivals))
			t.Logf("utilisation %.1f, %2d shards: offered %d, admitted %d (%.2f%% of unsharded), extra rejects %.2f%% of requests, second tries %d",
				u, shards, len(arrivals), admitted, 100*float64(admitted)/float64(unsharded), 100*falseRejects, b.Stats().SecondTries)
		}
	}
}

// TestRedisPromotion: a promoted key is split for every agent; the sub-keys
// start with the key's remaining tokens, and demotion never over-admits.
func TestRedisPromotion(t *testing.T) {
	t.Run("inmem", func(t *testing.T) { testPromotion(t, newInmem(t, nil), newInmem(t, nil)) })
	t.Run("redis", func(t *testing.T) {
		srv := startRedis(t)
		testPromotion(t, newTestBackend(t, nil, srv.addr()), newTestBackend(t, nil, srv.addr()))
	})
}

func testPromotion(t *testing.T, a, other *Backend) {
	if _, ok := a.st.(*memStore); ok {
		other.st = a.st // two agents, one store
	}
	lim := mustLimit(t, bucket.TokenBucket, 8, time.Hour, 800) // no refill to speak of
	now := base
	take := func(b *Backend, k int) int {
		got := 0
		for range k {
			r, err := b.AllowNAt(bg, "hot", lim, 1, now, 1)
			if err != nil {
				t.Fatal(err)
			}
			if r.Allowed {
				got++
			}
		}
		return got
	}
	if got := take(a, 300); got != 300 {
		t.Fatalf("admitted %d of 300 before promotion", got)
	}
	n, until, err := a.Promote(bg, "hot", lim, 8, now, 10*time.Second)
	if err != nil || n != 8 || until.UnixNano() != now+int64(10*time.Second) {
		t.Fatalf("Promote = %d, %v, %v", n, until, err)
	}
	// The other agent learns of the promotion from the key itself.
	got := take(other, 1000) + take(a, 1000)
	if got > 500 {
		t.Fatalf("after promotion the agents admitted %d, but only 500 were left", got)
	}
	if p, ok := other.promotion("hot", now); !ok || p.shards != 8 {
		t.Fatalf("the other agent did not learn the promotion: %+v %v", p, ok)
	}
	// Renewal extends; a second promotion does not re-seed.
	if n2, until2, err := other.Promote(bg, "hot", lim, 8, now+int64(time.Second), 20*time.Second); err != nil || n2 != 8 || !until2.After(until) {
		t.Fatalf("extend: %d %v %v", n2, until2, err)
	}
	// After the promotion ends the key restarts empty at its end.
	now += int64(21 * time.Second)
	if got := take(a, 10); got != 0 {
		t.Fatalf("admitted %d right after demotion, want 0 (restart empty)", got)
	}
	if a.Stats().Promotions != 1 {
		t.Fatalf("stats %+v", a.Stats())
	}
	// Byte-level: TakeUpTo on a promoted key says so.
	now2 := base + int64(time.Hour)
	if _, _, err := a.Promote(bg, "hot2", lim, 4, now2, time.Minute); err != nil {
		t.Fatal(err)
	}
	var pe *PromotedError
	if _, err := other.TakeUpTo(bg, "hot2", lim, 1, 0, now2, 1); !errors.As(err, &pe) || pe.Shards != 4 || !errors.Is(err, ErrPromoted) {
		t.Fatalf("TakeUpTo on a promoted key: %v", err)
	}
}

func TestPromoter(t *testing.T) {
	cfg := DefaultPromoterConfig()
	cfg.Threshold = 100
	cfg.MaxKeys = 64
	p, err := NewPromoter(cfg)
	if err != nil {
		t.Fatal(err)
	}
	now := base
	hot := false
	for range 1000 { // 200/s for 5 s
		now += int64(5 * time.Millisecond)
		hot = p.Observe("k", now, 1)
	}
	if r := p.Rate("k", now); !hot || math.Abs(r-200) > 20 {
		t.Fatalf("after 5s at 200/s: hot %v, rate %.1f", hot, r)
	}
	for range 300 { // 70/s: above half the threshold, stays hot
		now += int64(time.Second / 70)
		hot = p.Observe("k", now, 1)
	}
	if !hot {
		t.Fatalf("cooled at 70/s (rate %.1f), want hysteresis to keep it hot", p.Rate("k", now))
	}
	for range 200 { // 20/s: cools
		now += int64(50 * time.Millisecond)
		hot = p.Observe("k", now, 1)
	}
	if hot {
		t.Fatalf("still hot at 20/s (rate %.1f)", p.Rate("k", now))
	}
	// Bounded: many cold keys do not grow the table without end.
	for i := range 10_000 {
		p.Observe(string(rune('a'+i%26))+strings.Repeat("x", i%500), now+int64(i)*int64(time.Second), 1)
	}
	total := 0
	for i := range p.shards {
		total += len(p.shards[i].m)
	}
	if total > 64+promoShards {
		t.Fatalf("%d keys tracked, bound 64", total)
	}
	if _, err := NewPromoter(DefaultPromoterConfig()); err == nil {
		t.Fatal("a promoter without a threshold was accepted")
	}
}

// TestRedisBatcher: batched mode spends local tokens, never admits more than
// the limit plus what refills during the hold, and gives unspent tokens back
// on Close.
func TestRedisBatcher(t *testing.T) {
	t.Run("inmem", func(t *testing.T) { testBatcher(t, newInmem(t, nil)) })
	t.Run("redis", func(t *testing.T) {
		srv := startRedis(t)
		testBatcher(t, newTestBackend(t, nil, srv.addr()))
	})
}

func testBatcher(t *testing.T, b *Backend) {
	lim := mustLimit(t, bucket.TokenBucket, 1000, time.Second, 200)
	bt, err := NewBatcher(b, DefaultBatchConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer bt.Close(bg)
	now := base
	admitted := 0
	for i := range 4000 { // 2000/s offered for 2 s against 1000/s
		now = base + int64(i)*int64(500*time.Microsecond)
		r, err := bt.AllowNAt(bg, "batched", lim, 1, now, 1)
		if err != nil {
			t.Fatal(err)
		}
		if r.Allowed {
			admitted++
		}
	}
	elapsed := time.Duration(now - base)
	bound := 200 + int(1000*(elapsed+DefaultBatchConfig().Hold).Seconds())
	calls := b.Stats().Calls
	t.Logf("batched: %d of 4000 admitted (bound %d) with %d script calls (%.3f per admitted)", admitted, bound, calls, float64(calls)/float64(admitted))
	if admitted > bound || admitted < 1000 {
		t.Fatalf("admitted %d, want within [1000, %d]", admitted, bound)
	}
	if calls*5 > uint64(admitted) {
		t.Fatalf("%d calls for %d admitted: batching is not batching", calls, admitted)
	}
	// Unspent tokens go back on Close.
	held := bt.Held("batched")
	if err := bt.Close(bg); err != nil {
		t.Fatal(err)
	}
	if bt.Held("batched") != 0 {
		t.Fatal("tokens held after Close")
	}
	if err := bt.Close(bg); err != nil {
		t.Fatal("second Close:", err)
	}
	_ = held
}

// TestBatcherGivesBackIdle: the sweeper returns tokens of a key gone idle.
func TestBatcherGivesBackIdle(t *testing.T) {
	b := newInmem(t, nil)
	cfg := DefaultBatchConfig()
	cfg.Hold = 20 * time.Millisecond
	bt, err := NewBatcher(b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer bt.Close(bg)
	lim := mustLimit(t, bucket.TokenBucket, 100000, time.Second, 10000)
	for range 200 {
		if _, err := bt.AllowN(bg, "idle", lim, 1, 1); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 5*time.Second, "idle tokens to be given back", func() bool { return bt.Held("idle") == 0 })
}

// RuleLimiter has the shape of agent.RemoteLimiter (declared here rather
// than imported: pkg/ does not depend on agent).
var _ interface {
	AllowN(ctx context.Context, r *rules.Rule, key []byte, n int64) (bucket.Result, error)
} = (*RuleLimiter)(nil)

// TestRuleLimiter plugs the backend into the agent's seam shape with a
// compiled rule, and promotes a key that turns hot.
func TestRuleLimiter(t *testing.T) {
	set, err := rules.Compile(1, []rules.File{{Name: "t.yaml", Source: []byte(`
domain: api
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 50, backend: redis}
  - key: route
    rate_limit: {unit: minute, requests_per_unit: 10, backend: redis, shards: 4}
`)}})
	if err != nil {
		t.Fatal(err)
	}
	var now atomic.Int64
	now.Store(base)
	b := newInmem(t, func(c *Config) { c.Now = now.Load })
	pcfg := DefaultPromoterConfig()
	pcfg.Threshold = 500
	p, err := NewPromoter(pcfg)
	if err != nil {
		t.Fatal(err)
	}
	rl := &RuleLimiter{Backend: b, Promoter: p}
	entries := []rules.Entry{{Key: "user", Value: "alice"}}
	r := set.Match("api", entries)
	if r == nil {
		t.Fatal("no rule")
	}
	key := rules.AppendKey(nil, r, "api", entries)
	for range 2000 { // 2000/s: hot
		now.Add(int64(500 * time.Microsecond))
		if _, err := rl.AllowN(bg, r, key, 1); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := b.promotion(string(key), now.Load()); !ok || b.Stats().Promotions != 1 {
		t.Fatalf("hot key not promoted: %+v", b.Stats())
	}
	if err := rl.GiveBack(bg, r, key, 1); err != nil {
		t.Fatal(err)
	}
	// The sharded rule: 10/minute over 4 sub-keys admits at most 10.
	route := []rules.Entry{{Key: "route", Value: "/x"}}
	r2 := set.Match("api", route)
	key2 := rules.AppendKey(nil, r2, "api", route)
	got := 0
	for range 50 {
		res, err := rl.AllowN(bg, r2, key2, 1)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed {
			got++
		}
	}
	if got > 10 || got < 8 {
		t.Fatalf("sharded rule admitted %d of 50, limit 10", got)
	}
}

func TestFileConfig(t *testing.T) {
	var f struct {
		Redis FileConfig `yaml:"redis"`
	}
	src := `
redis:
  addrs: [10.0.0.1:7000, 10.0.0.2:7000]
  mode: cluster
  username: allot
  password: secret
  timeout: 8ms
  breaker: {failures: 5, cooldown: 1s}
  tls: {insecure_skip_verify: true, server_name: redis.internal}
  batched: {hold: 100ms}
  promote: {threshold: 5000, shards: 16}
`
	if err := yaml.Unmarshal([]byte(src), &f); err != nil {
		t.Fatal(err)
	}
	c, err := f.Redis.Config()
	if err != nil {
		t.Fatal(err)
	}
	if c.mode() != ModeCluster || len(c.Addrs) != 2 || c.Username != "allot" || c.Timeout != 8*time.Millisecond ||
		c.BreakerFailures != 5 || c.BreakerCooldown != time.Second || c.TLS == nil || c.TLS.ServerName != "redis.internal" ||
		c.KeyPrefix != "allot:" {
		t.Fatalf("Config() = %+v", c)
	}
	bc, ok, err := f.Redis.BatchConfig()
	if err != nil || !ok || bc.Hold != 100*time.Millisecond || bc.MaxBatch != 64 {
		t.Fatalf("BatchConfig() = %+v %v %v", bc, ok, err)
	}
	pc, ok, err := f.Redis.PromoterConfig()
	if err != nil || !ok || pc.Threshold != 5000 || pc.Shards != 16 || pc.TTL != 30*time.Second {
		t.Fatalf("PromoterConfig() = %+v %v %v", pc, ok, err)
	}
	f.Redis.TLS = &TLSFileConfig{CAFile: "/nonexistent"}
	if _, err := f.Redis.Config(); err == nil {
		t.Fatal("a missing CA file was accepted")
	}
}

// TestRedisServerTime: with ServerTime the script reads Redis's clock, so
// agents whose clocks disagree wildly still share one consistent bucket.
func TestRedisServerTime(t *testing.T) {
	srv := startRedis(t)
	b := newTestBackend(t, func(c *Config) { c.ServerTime = true }, srv.addr())
	lim := mustLimit(t, bucket.TokenBucket, 10, time.Hour, 10)
	admitted := 0
	for i := range 20 {
		skew := []int64{0, base, base + int64(100*365*24*time.Hour), 1}[i%4]
		r, err := b.AllowNAt(bg, "servertime", lim, 1, skew, 1)
		if err != nil {
			t.Fatal(err)
		}
		if r.Allowed {
			admitted++
		} else if r.RetryAfter <= 0 || r.RetryAfter > 6*time.Minute {
			t.Fatalf("denied with RetryAfter %v, want (0, 6m]", r.RetryAfter)
		}
	}
	if admitted != 10 {
		t.Fatalf("admitted %d, want the burst 10", admitted)
	}
}

// TestRedisForeignValue: a value the script did not write counts as an
// absent key instead of failing every check of the key.
func TestRedisForeignValue(t *testing.T) {
	srv := startRedis(t)
	b := newTestBackend(t, nil, srv.addr())
	for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.FixedWindow, bucket.SlidingWindow} {
		lim := mustLimit(t, alg, 5, time.Second, 5)
		key := "foreign:" + alg.String()
		for _, v := range []string{"garbage", "b:1:2", "b:x:y:z:w:v", "f:", "s:1:2:3:4:5:6", "p:notanumber:3", ":::"} {
			srv.cli("SET", b.mainKey(key, xxh64(key)), v)
			r, err := b.AllowNAt(bg, key, lim, 1, base, 1)
			if err != nil || !r.Allowed || r.Remaining != 4 {
				t.Fatalf("%v, value %q: %+v, %v; want a fresh key", alg, v, r, err)
			}
		}
	}
}

// FuzzStateFrom: no script reply, however malformed, panics the Go side.
func FuzzStateFrom(f *testing.F) {
	f.Add(uint8(0), int64(0), int64(0), int64(0), int64(base/1e6))
	f.Add(uint8(1), int64(-1), int64(math.MaxInt64), int64(1), int64(-5))
	f.Add(uint8(2), int64(math.MinInt64), int64(3), int64(math.MaxInt64), int64(math.MaxInt64))
	lims := []bucket.Limit{
		mustLimit(f, bucket.TokenBucket, 7, 3*time.Second, 3),
		mustLimit(f, bucket.GCRA, 1_000_000, time.Hour, 1000),
		mustLimit(f, bucket.FixedWindow, 10, time.Minute, 10),
		mustLimit(f, bucket.SlidingWindow, 10, time.Minute, 10),
	}
	f.Fuzz(func(t *testing.T, which uint8, v0, v1, v2, nowMs int64) {
		lim := lims[int(which)%len(lims)]
		p, err := limitParams(lim)
		if err != nil {
			t.Fatal(err)
		}
		now := max(min(nowMs, bucket.MaxTime/nsPerMs), 0) * nsPerMs
		for n := range 4 {
			st, err := p.stateFrom(lim, now, []int64{v0, v1, v2}[:n])
			if err != nil {
				continue
			}
			_ = resultFrom(lim, v0%2 == 0, st, now, v1%5)
		}
	})
}
