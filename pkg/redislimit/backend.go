package redislimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/allot/allot/pkg/breaker"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

// Errors. Callers branch on ErrUnavailable (apply the rule's failure mode).
var (
	// ErrUnavailable is wrapped by every error that means Redis could not
	// decide: timeouts, connection errors, Redis errors, the open breaker.
	ErrUnavailable = errors.New("redislimit: redis unavailable")
	// ErrBreakerOpen is returned, without I/O, while the breaker is open.
	// It wraps ErrUnavailable.
	ErrBreakerOpen = fmt.Errorf("%w: circuit breaker open", ErrUnavailable)
	// ErrClosed is returned after Close. It wraps ErrUnavailable.
	ErrClosed = fmt.Errorf("%w: backend closed", ErrUnavailable)
	// ErrPromoted is wrapped by the *PromotedError TakeUpTo, GiveBack and
	// Debit return for an unsharded key that is promoted to sub-keys.
	ErrPromoted = errors.New("redislimit: key is promoted to sharded sub-keys")
)

// PromotedError says an unsharded key is promoted to Shards sub-keys until
// Until: address its sub-keys instead.
type PromotedError struct {
	Shards int
	Until  time.Time
}

func (e *PromotedError) Error() string {
	return fmt.Sprintf("%v (%d shards until %v)", ErrPromoted, e.Shards, e.Until.UTC().Format(time.RFC3339Nano))
}

// Unwrap makes errors.Is(err, ErrPromoted) true.
func (e *PromotedError) Unwrap() error { return ErrPromoted }

// A Backend decides budget keys against Redis, one atomic script call per
// check. Construct it with New (or NewInmem for tests); it is safe for
// concurrent use. Most callers want AllowN.
//
// Budget keys are the canonical keys of pkg/rules (rules.AppendKey); the
// Redis key adds the prefix and a hash tag. Sharded calls (shards > 1) split
// the limit into sub-keys (see AllowN).
type Backend struct {
	cfg    Config
	st     store
	client redis.UniversalClient // nil for NewInmem
	br     *breaker.Shared
	met    *metrics
	log    *slog.Logger
	now    func() int64
	seed   uint64
	closed atomic.Bool

	promoN  atomic.Int64 // len(promos), read without the lock
	promoMu sync.RWMutex // guards promos
	promos  map[string]promotion
}

// promotion is a remembered promotion marker.
type promotion struct {
	shards int
	until  int64
}

// maxRedirects bounds the MOVED and ASK redirects a cluster call follows
// (a slot moved, a failover).
const maxRedirects = 3

// maxPromotions bounds the remembered promotions; past it the memory is
// cleared (forgetting costs one extra call per key, which finds the marker
// again).
const maxPromotions = 1 << 16

// New returns a Backend for cfg's Redis, using go-redis's UniversalClient:
// reads and writes go to the primary only (no replica reads; in cluster mode
// ReadOnly, RouteByLatency and RouteRandomly are off), and a script call is
// never sent twice: go-redis does not retry one after an error, which may
// have come after the script ran (a check has a 5 ms budget; the breaker
// and the caller's failure mode handle errors). In cluster mode it still
// follows up to maxRedirects MOVED or ASK redirects, which Redis answers
// without running the script. New does no I/O: an unreachable Redis shows
// up as errors on the first calls.
func New(cfg Config) (*Backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	opts := &redis.UniversalOptions{
		Addrs:                 cfg.Addrs,
		MasterName:            cfg.MasterName,
		Username:              cfg.Username,
		Password:              cfg.Password,
		SentinelPassword:      cfg.SentinelPassword,
		DB:                    cfg.DB,
		TLSConfig:             cfg.TLS,
		MaxRetries:            -1,
		MaxRedirects:          maxRedirects,
		DialTimeout:           max(cfg.Timeout, time.Second), // the call's context bounds it to Timeout
		DialerRetries:         1,
		ReadTimeout:           cfg.Timeout,
		WriteTimeout:          cfg.Timeout,
		ContextTimeoutEnabled: true,
		PoolSize:              cfg.PoolSize,
		PoolTimeout:           cfg.Timeout,
		ReadOnly:              false,
		RouteByLatency:        false,
		RouteRandomly:         false,
		IsClusterMode:         cfg.mode() == ModeCluster,
		DisableIdentity:       true,
		MaintNotificationsConfig: &maintnotifications.Config{
			Mode: maintnotifications.ModeDisabled,
		},
	}
	client := redis.NewUniversalClient(opts)
	st := &redisStore{
		client:   client,
		script:   redis.NewScript(scriptSource),
		slackMs:  max(int64(cfg.TTLSlack/time.Millisecond), 1),
		useTIME:  cfg.ServerTime,
		ownClose: true,
	}
	b, err := newBackend(cfg, st)
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	b.client = client
	return b, nil
}

// NewInmem returns a Backend whose keys live in process memory and are
// decided by pkg/bucket with the script's semantics (millisecond time,
// sharding, promotion markers): the in-memory twin of a Redis backend, for
// tests of code that uses one. Keys never expire. cfg's Redis fields are
// ignored (Addrs may be empty).
func NewInmem(cfg Config) (*Backend, error) {
	if len(cfg.Addrs) == 0 {
		cfg.Addrs = []string{"inmem"}
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return newBackend(cfg, newMemStore())
}

func newBackend(cfg Config, st store) (*Backend, error) {
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	b := &Backend{
		cfg:    cfg,
		st:     st,
		br:     breaker.NewShared(breaker.Config{Threshold: cfg.BreakerFailures, Cooldown: cfg.BreakerCooldown}),
		met:    met,
		log:    cfg.Logger,
		now:    cfg.Now,
		promos: make(map[string]promotion),
	}
	if b.log == nil {
		b.log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if b.now == nil {
		b.now = func() int64 { return time.Now().UnixNano() }
	}
	if cfg.AgentID != "" {
		b.seed = xxhash.Sum64String(cfg.AgentID)
	} else {
		b.seed = rand.Uint64()
	}
	names := [...]string{"closed", "open", "half-open"}
	b.br.OnChange = func(from, to breaker.State) {
		met.breaker(int32(to))
		lvl := slog.LevelInfo
		if to == breaker.Open {
			lvl = slog.LevelWarn
		}
		b.log.Log(context.Background(), lvl, "redislimit: circuit breaker "+names[to], "from", names[from])
	}
	return b, nil
}

// Client returns the underlying go-redis client (nil for NewInmem), for
// health checks and tests. Do not close it; Close does.
func (b *Backend) Client() redis.UniversalClient { return b.client }

// Healthy reports whether the circuit breaker is closed: Redis answered the
// last calls (or no call has failed K times in a row yet).
func (b *Backend) Healthy() bool { return b.br.State() == breaker.Closed && !b.closed.Load() }

// Stats returns the backend's counters.
func (b *Backend) Stats() Stats { return b.met.stats() }

// Close closes the Redis client. Calls after Close fail with ErrClosed. It
// is safe to call twice.
func (b *Backend) Close() error {
	if b.closed.Swap(true) {
		return nil
	}
	return b.st.close()
}

// do runs one call through the breaker with the configured timeout.
func (b *Backend) do(ctx context.Context, c *call) (outcome, error) {
	if b.closed.Load() {
		return outcome{}, ErrClosed
	}
	ok, probe := b.br.Allow(b.now())
	if !ok {
		b.met.fastFail()
		return outcome{}, ErrBreakerOpen
	}
	cctx, cancel := context.WithTimeout(ctx, b.cfg.Timeout)
	start := time.Now()
	o, err := b.st.do(cctx, c)
	cancel()
	b.met.call(time.Since(start).Seconds())
	if err == nil {
		b.br.Success(probe)
		return o, nil
	}
	if cerr := ctx.Err(); cerr != nil {
		// The caller gave up: that says nothing about Redis.
		if probe {
			b.br.Abandon()
		}
		return outcome{}, fmt.Errorf("%w: %w", ErrUnavailable, cerr)
	}
	b.met.failed()
	b.br.Failure(b.now(), probe)
	if errors.Is(err, errShortReply) {
		return outcome{}, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return outcome{}, fmt.Errorf("%w: %s: %w", ErrUnavailable, rules.RedactKey(c.key), err)
}

// checkLimit validates the limit and returns its script parameters.
func checkLimit(l bucket.Limit) (params, error) { return limitParams(l) }

// AllowN is AllowNAt at the current time (Config.Now).
func (b *Backend) AllowN(ctx context.Context, key string, lim bucket.Limit, shards int, n int64) (bucket.Result, error) {
	return b.AllowNAt(ctx, key, lim, shards, b.now(), n)
}

// AllowNAt takes n tokens from the budget key `key` under lim at now (Unix
// ns) if all n are available, as lim.AllowN would; n ≤ 0 checks without
// taking. With Config.ServerTime the script uses Redis's clock instead of
// now. The zero (unlimited) Limit allows without I/O.
//
// With shards > 1 (or when the key is promoted, see Promote) the budget is
// split into sub-keys, each with quota/N and burst/N: the check tries one
// sub-key (at random, or by affinity), and a second one, at random, when the
// first denies. Sharding never admits more than the key's limit (the
// sub-limits sum to it) but can deny while other sub-keys still hold tokens,
// and a request can take at most ⌈burst/N⌉ tokens. The Result is then an
// estimate: Remaining is the tried sub-key's times N, RetryAfter and
// ResetAfter are the tried sub-key's.
//
// Errors wrap ErrUnavailable (timeouts, Redis errors, open breaker) or
// ErrUnsupportedLimit.
func (b *Backend) AllowNAt(ctx context.Context, key string, lim bucket.Limit, shards int, now, n int64) (bucket.Result, error) {
	if lim.IsZero() || lim.DeniesAll() {
		// Unlimited, or blocked (requests_per_unit: 0): no state to keep.
		return lim.AllowN(&bucket.State{}, now, n), nil
	}
	p, err := checkLimit(lim)
	if err != nil {
		return bucket.Result{}, err
	}
	n = max(n, 0) // as pkg/bucket: n < 0 checks without taking
	h := xxhash.Sum64String(key)
	shards = effectiveShards(lim, shards)
	if shards <= 1 {
		if pr, ok := b.promotion(key, now); ok {
			shards = pr.shards
		}
	}
	if shards <= 1 {
		c := call{key: b.mainKey(key, h), lim: lim, p: p, op: opAllow, now: now, n: n}
		o, err := b.do(ctx, &c)
		if err != nil {
			return bucket.Result{}, err
		}
		if o.code != codePromoted {
			r := resultFrom(lim, o.code == codeOK, o.state, o.now, n)
			b.met.decided(r.Allowed)
			return r, nil
		}
		b.remember(key, promotion{shards: int(o.shards), until: o.until})
		shards = effectiveShards(lim, int(o.shards))
	}
	return b.allowSharded(ctx, key, h, lim, shards, now, n)
}

func (b *Backend) allowSharded(ctx context.Context, key string, h uint64, lim bucket.Limit, shards int, now, n int64) (bucket.Result, error) {
	i := b.pick(h, shards)
	r, err := b.allowSub(ctx, key, h, lim, shards, i, now, n)
	if err != nil || r.Allowed || shards < 2 || n <= 0 {
		if err == nil {
			b.met.decided(r.Allowed)
		}
		return r, err
	}
	b.met.secondTry()
	r2, err := b.allowSub(ctx, key, h, lim, shards, other(i, shards), now, n)
	if err != nil {
		// The first sub-key did decide: its denial stands.
		b.met.decided(false)
		return r, nil
	}
	b.met.decided(r2.Allowed)
	if !r2.Allowed && r.RetryAfter < r2.RetryAfter {
		r2.RetryAfter = r.RetryAfter
	}
	return r2, nil
}

// allowSub runs AllowN on sub-key i of shards and scales the result.
func (b *Backend) allowSub(ctx context.Context, key string, h uint64, lim bucket.Limit, shards, i int, now, n int64) (bucket.Result, error) {
	sub, err := subLimit(lim, shards, i)
	if err != nil {
		return bucket.Result{}, err
	}
	p, err := checkLimit(sub)
	if err != nil {
		return bucket.Result{}, err
	}
	c := call{key: b.subKey(key, h, shards, i), lim: sub, p: p, op: opAllow, now: now, n: n}
	o, err := b.do(ctx, &c)
	if err != nil {
		return bucket.Result{}, err
	}
	r := resultFrom(sub, o.code == codeOK, o.state, o.now, n)
	if r.Remaining > 0 {
		r.Remaining = min(r.Remaining*int64(shards), lim.Burst())
	} else {
		r.Remaining = max(r.Remaining*int64(shards), -lim.Burst())
	}
	return r, nil
}

// target resolves (key, shards, shard) to the Redis key and limit of one
// (sub-)key.
func (b *Backend) target(key string, lim bucket.Limit, shards, shard int) (string, bucket.Limit, params, error) {
	h := xxhash.Sum64String(key)
	n := effectiveShards(lim, shards)
	if n <= 1 {
		p, err := checkLimit(lim)
		return b.mainKey(key, h), lim, p, err
	}
	if shard < 0 || shard >= n {
		return "", bucket.Limit{}, params{}, fmt.Errorf("redislimit: shard %d out of range [0, %d) for %s", shard, n, lim)
	}
	sub, err := subLimit(lim, n, shard)
	if err != nil {
		return "", bucket.Limit{}, params{}, err
	}
	p, err := checkLimit(sub)
	return b.subKey(key, h, n, shard), sub, p, err
}

// Shards returns how many sub-keys AllowN uses for lim when asked for
// shards: at most the quota, the burst and MaxShards; 1 means unsharded.
func Shards(lim bucket.Limit, shards int) int { return effectiveShards(lim, shards) }

// TakeUpTo takes min(n, available) tokens from one (sub-)key at now and
// returns how many it took (lim.TakeUpTo's semantics). shards ≤ 1 addresses
// the key itself, which may be promoted: then the error is a *PromotedError.
// Otherwise shard ∈ [0, Shards(lim, shards)) picks the sub-key. Batcher is
// built on it.
func (b *Backend) TakeUpTo(ctx context.Context, key string, lim bucket.Limit, shards, shard int, now, n int64) (int64, error) {
	if lim.IsZero() {
		return max(n, 0), nil
	}
	if n <= 0 {
		return 0, nil
	}
	o, err := b.single(ctx, key, lim, shards, shard, opTake, now, n)
	if err != nil {
		return 0, err
	}
	return o.taken, nil
}

// GiveBack returns n unspent tokens to one (sub-)key at now, capped at full
// (lim.GiveBack's semantics). Addressing is as for TakeUpTo: give tokens
// back where they were taken.
func (b *Backend) GiveBack(ctx context.Context, key string, lim bucket.Limit, shards, shard int, now, n int64) error {
	if lim.IsZero() || n <= 0 {
		return nil
	}
	_, err := b.single(ctx, key, lim, shards, shard, opGive, now, n)
	return err
}

// Debit forcibly takes n tokens already admitted (for example while Redis
// was unreachable) from one (sub-)key, into bounded debt (lim.Debit's
// semantics). Addressing is as for TakeUpTo.
func (b *Backend) Debit(ctx context.Context, key string, lim bucket.Limit, shards, shard int, now, n int64) error {
	if lim.IsZero() || n <= 0 {
		return nil
	}
	_, err := b.single(ctx, key, lim, shards, shard, opDebit, now, n)
	return err
}

func (b *Backend) single(ctx context.Context, key string, lim bucket.Limit, shards, shard int, o op, now, n int64) (outcome, error) {
	rk, l, p, err := b.target(key, lim, shards, shard)
	if err != nil {
		return outcome{}, err
	}
	if o == opGive || o == opDebit {
		n = min(n, 2*l.Burst()) // more can never be outstanding (as pkg/bucket)
	}
	c := call{key: rk, lim: l, p: p, op: o, now: now, n: n}
	out, err := b.do(ctx, &c)
	if err != nil {
		return outcome{}, err
	}
	if out.code == codePromoted {
		b.remember(key, promotion{shards: int(out.shards), until: out.until})
		return outcome{}, &PromotedError{Shards: int(out.shards), Until: time.Unix(0, out.until)}
	}
	return out, nil
}

// Promote splits the unsharded key `key` into `shards` sub-keys for ttl
// from now, for every agent: it marks the key in Redis, so any agent's next
// check of the key finds the marker and moves to the sub-keys (and
// remembers that until the promotion ends). A key already promoted has its
// promotion extended to now + ttl if that is later. It returns the
// promotion's shard count (Shards(lim, shards)) and end.
//
// Promotion never admits more than the limit, even when calls fail part
// way. The sub-keys are emptied (bucket.Limit.Drain) before the marker
// makes them live: a failure there leaves the key unpromoted, with sub-keys
// no check uses, and Promote may simply be called again (emptying twice is
// emptying once). The marker is then set atomically with reading the key's
// remaining tokens, and each sub-key is given back its share of them; a
// failure there loses that share (the key under-admits until it refills)
// and cannot over-admit, nor can a marker call that ran although it failed
// (the key is then promoted with empty sub-keys). Every step runs at the
// instant of the first call (Redis's clock with Config.ServerTime), so
// nothing refills between the steps. A sub-key emptied after another
// agent's promotion gave it its share (two agents promoting at once) loses
// that share: under-admission again.
//
// When the promotion ends the key restarts empty at the end instant (its
// budget was with the sub-keys), so demotion under-admits for up to one
// refill of the burst instead of over-admitting.
func (b *Backend) Promote(ctx context.Context, key string, lim bucket.Limit, shards int, now int64, ttl time.Duration) (int, time.Time, error) {
	n := effectiveShards(lim, shards)
	if lim.IsZero() || n <= 1 {
		return 0, time.Time{}, fmt.Errorf("redislimit: cannot promote %s to %d shards", lim, shards)
	}
	if ttl < time.Millisecond {
		return 0, time.Time{}, fmt.Errorf("redislimit: promotion ttl must be ≥ 1ms, got %v", ttl)
	}
	p, err := checkLimit(lim)
	if err != nil {
		return 0, time.Time{}, err
	}
	h := xxhash.Sum64String(key)
	mark := call{key: b.mainKey(key, h), lim: lim, p: p, op: opExtend, now: now, shards: int64(n), ttl: int64(ttl)}
	o, err := b.do(ctx, &mark)
	if err != nil {
		return 0, time.Time{}, err
	}
	if o.code == codeExtended {
		b.remember(key, promotion{shards: int(o.shards), until: o.until})
		return int(o.shards), time.Unix(0, o.until), nil
	}
	at := o.now
	for i := range n {
		if _, err := b.subCall(ctx, key, lim, n, i, opDrain, at, 0); err != nil {
			return 0, time.Time{}, fmt.Errorf("redislimit: %s not promoted: emptying sub-key %d failed: %w", rules.RedactKey(key), i, err)
		}
	}
	mark.op, mark.now, mark.pinned = opPromote, at, true
	o, err = b.do(ctx, &mark)
	if err != nil {
		return 0, time.Time{}, err
	}
	if o.code == codeExtended {
		// Another agent promoted the key meanwhile: its sub-keys are
		// live, and what this call took from them stays taken.
		b.remember(key, promotion{shards: int(o.shards), until: o.until})
		return int(o.shards), time.Unix(0, o.until), nil
	}
	until := o.now + int64(ttl) - int64(ttl)%nsPerMs
	b.remember(key, promotion{shards: n, until: until})
	b.met.promoted()
	rem := max(lim.Peek(o.state, o.now).Remaining, 0)
	for i := range n {
		sub, err := subLimit(lim, n, i)
		if err != nil {
			return 0, time.Time{}, err
		}
		if share := min(splitPart(rem, n, i), sub.Burst()); share > 0 {
			if _, err := b.subCall(ctx, key, lim, n, i, opGive, at, share); err != nil {
				b.log.Warn("redislimit: promoted a key but could not give a sub-key its share (it under-admits until it refills)",
					"key", rules.RedactKey(key), "shard", i, "tokens", share, "err", err)
			}
		}
	}
	return n, time.Unix(0, until), nil
}

// subCall runs op with n tokens on sub-key i of shards at the instant at,
// whatever Config.ServerTime says.
func (b *Backend) subCall(ctx context.Context, key string, lim bucket.Limit, shards, i int, o op, at, n int64) (outcome, error) {
	rk, l, p, err := b.target(key, lim, shards, i)
	if err != nil {
		return outcome{}, err
	}
	c := call{key: rk, lim: l, p: p, op: o, now: at, n: n, pinned: true}
	return b.do(ctx, &c)
}

// promotion returns the remembered promotion of key, if still current.
func (b *Backend) promotion(key string, now int64) (promotion, bool) {
	if b.promoN.Load() == 0 {
		return promotion{}, false
	}
	b.promoMu.RLock()
	p, ok := b.promos[key]
	b.promoMu.RUnlock()
	return p, ok && p.until > now
}

func (b *Backend) remember(key string, p promotion) {
	b.promoMu.Lock()
	if len(b.promos) >= maxPromotions {
		clear(b.promos)
	}
	b.promos[key] = p
	b.promoN.Store(int64(len(b.promos)))
	b.promoMu.Unlock()
}

// Promotion reports whether key is promoted to sharded sub-keys at now
// (Unix ns): the marker Promote writes, read with one GET, with its shard
// count and end. For inspection tools (allotctl inspect --redis); checks
// find the marker themselves.
func (b *Backend) Promotion(ctx context.Context, key string, now int64) (shards int, until time.Time, ok bool, err error) {
	if b.client == nil {
		return 0, time.Time{}, false, errors.New("redislimit: Promotion needs a Redis client (not an in-memory backend)")
	}
	v, err := b.client.Get(ctx, b.mainKey(key, xxhash.Sum64String(key))).Result()
	if errors.Is(err, redis.Nil) {
		return 0, time.Time{}, false, nil
	}
	if err != nil {
		return 0, time.Time{}, false, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return parsePromotion(v, now)
}

// parsePromotion reads a stored value: "p:<until ms>:<shards>" is a
// promotion marker; anything else is an unsharded key's state.
func parsePromotion(v string, now int64) (shards int, until time.Time, ok bool, err error) {
	rest, isMarker := strings.CutPrefix(v, "p:")
	if !isMarker {
		return 0, time.Time{}, false, nil
	}
	u, n, found := strings.Cut(rest, ":")
	untilMs, err1 := strconv.ParseInt(u, 10, 64)
	sh, err2 := strconv.Atoi(n)
	if !found || err1 != nil || err2 != nil || sh < 2 || untilMs < 0 || untilMs > math.MaxInt64/nsPerMs {
		return 0, time.Time{}, false, fmt.Errorf("redislimit: malformed promotion marker %q", v)
	}
	end := untilMs * nsPerMs
	return sh, time.Unix(0, end), end > now, nil
}
