package redislimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/allot/allot/pkg/bucket"
	"github.com/cespare/xxhash/v2"
)

// BatchConfig configures a Batcher. Start from DefaultBatchConfig.
type BatchConfig struct {
	// MaxBatch bounds the tokens one refill takes (default 64). A refill
	// also takes at most a quarter of the (sub-)key's burst, and at least
	// the request's n.
	MaxBatch int64
	// Horizon sizes a refill: the key's recent demand (tokens/s, an EWMA)
	// times Horizon (default 50ms).
	Horizon time.Duration
	// Hold is how long taken tokens may be spent (default 250ms): the
	// Batcher stops spending a batch Hold after it asked for it and gives
	// what is left back. Hold bounds over-admission (docs/redis.md).
	Hold time.Duration
	// Sweep is how often expired and idle holdings are given back
	// (default Hold/2).
	Sweep time.Duration
	// MaxKeys bounds the keys held at once (default 100000); past it new
	// keys are checked per request (Backend.AllowN).
	MaxKeys int
}

// DefaultBatchConfig returns the defaults documented on BatchConfig.
func DefaultBatchConfig() BatchConfig {
	return BatchConfig{MaxBatch: 64, Horizon: 50 * time.Millisecond, Hold: 250 * time.Millisecond, MaxKeys: 100_000}
}

// Validate reports the first problem with c.
func (c BatchConfig) Validate() error {
	switch {
	case c.MaxBatch < 1:
		return fmt.Errorf("redislimit: batch: max batch must be ≥ 1, got %d", c.MaxBatch)
	case c.Horizon <= 0:
		return fmt.Errorf("redislimit: batch: horizon must be > 0, got %v", c.Horizon)
	case c.Hold <= 0:
		return fmt.Errorf("redislimit: batch: hold must be > 0, got %v", c.Hold)
	case c.Sweep < 0:
		return fmt.Errorf("redislimit: batch: sweep must be ≥ 0, got %v", c.Sweep)
	case c.MaxKeys < 1:
		return fmt.Errorf("redislimit: batch: max keys must be ≥ 1, got %d", c.MaxKeys)
	}
	return nil
}

// A Batcher is batched mode: the lease model on top of Redis, for users who
// run no allocator cluster. Instead of one script call per check it takes a
// small batch of tokens from the key (or, for a sharded key, from one
// sub-key) with TakeUpTo and spends them locally; the batch is sized from
// the key's recent demand. Tokens left unspent Hold after they were taken,
// or when the key goes idle, or at Close, are given back (GiveBack).
//
// Batching trades accuracy for calls: tokens one agent holds are not
// available to the others (false rejects, bounded by the batch sizes), and a
// token may be spent up to Hold after it was taken, so over any interval the
// admitted count can exceed the limit by what refills during Hold. Use it
// for keys whose rate makes per-request calls too costly.
//
// A holding whose key turns out to be promoted (Backend.Promote) takes from
// one of its sub-keys until the promotion ends, then from the key again, so
// the bound holds across a promotion's start and end.
//
// A Batcher is safe for concurrent use; it owns one sweeper goroutine,
// stopped by Close.
type Batcher struct {
	b      *Backend
	cfg    BatchConfig
	shards [batchShards]batchShard

	stop      chan struct{}
	done      chan struct{}
	closed    atomic.Bool
	closeOnce sync.Once
	closeErr  error
}

const batchShards = 64

type batchShard struct {
	mu   sync.Mutex // guards m
	m    map[string]*holding
	size int
}

// holding is one key's local tokens.
type holding struct {
	mu         sync.Mutex // guards the fields below; never held across I/O
	lim        bucket.Limit
	ruleShards int     // the shards asked for with lim
	shards     int     // where the tokens come from: ≤ 1 the key, else sub-key `shard` of shards
	shard      int     //
	promoUntil int64   // > 0: shards is the key's promotion, which ends then (Unix ns)
	gen        int64   // counts changes of the source (lim, shards, shard)
	tokens     int64   // spendable until expiry
	takenAt    int64   // when the oldest of tokens was asked for
	remote     int64   // the key's remaining (estimate) at the last refill
	demand     float64 // tokens/s, EWMA
	last       int64   // last use
	refilling  chan struct{}
	// After a refill that could not give n, the key is denied locally
	// until deniedUntil (when a batch would have refilled), with deny.
	deniedUntil int64
	deny        bucket.Result
}

// NewBatcher returns a Batcher on b and starts its sweeper.
func NewBatcher(b *Backend, cfg BatchConfig) (*Batcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Sweep == 0 {
		cfg.Sweep = cfg.Hold / 2
	}
	bt := &Batcher{b: b, cfg: cfg, stop: make(chan struct{}), done: make(chan struct{})}
	for i := range bt.shards {
		bt.shards[i].m = make(map[string]*holding)
	}
	go bt.sweeper()
	return bt, nil
}

// AllowN is AllowNAt at the backend's current time.
func (bt *Batcher) AllowN(ctx context.Context, key string, lim bucket.Limit, shards int, n int64) (bucket.Result, error) {
	return bt.AllowNAt(ctx, key, lim, shards, bt.b.now(), n)
}

// AllowNAt takes n tokens for key at now from the local batch, refilling
// it from Redis when it runs short. The Result's Remaining is an estimate
// (the key's remaining at the last refill plus what this agent holds).
// n ≤ 0 checks without consuming. Errors are Backend's (ErrUnavailable).
func (bt *Batcher) AllowNAt(ctx context.Context, key string, lim bucket.Limit, shards int, now, n int64) (bucket.Result, error) {
	if lim.IsZero() || lim.DeniesAll() {
		return lim.AllowN(&bucket.State{}, now, n), nil
	}
	if bt.closed.Load() {
		// Closed: nothing may be held any more, so check per request.
		return bt.b.AllowNAt(ctx, key, lim, shards, now, n)
	}
	h := bt.holding(key, lim, shards, now)
	if h == nil {
		return bt.b.AllowNAt(ctx, key, lim, shards, now, n)
	}
	n = max(n, 0)
	hold := int64(bt.cfg.Hold)
	h.mu.Lock()
	h.observe(now, n, bt.cfg.Hold)
	for {
		if now < h.expiry(hold) && h.tokens >= n && (n > 0 || h.tokens > 0) {
			h.tokens -= n
			r := bucket.Result{Allowed: true, Remaining: max(h.remote, 0) + h.tokens}
			h.mu.Unlock()
			bt.b.met.decided(true)
			return r, nil
		}
		if n == 0 {
			h.mu.Unlock()
			return bt.b.AllowNAt(ctx, key, lim, shards, now, 0)
		}
		if now < h.deniedUntil {
			// Denied recently: deny without asking Redis until a batch
			// could have refilled (never longer than Hold).
			r := h.deny
			r.RetryAfter = max(time.Duration(h.deniedUntil-now), time.Millisecond)
			r.Remaining = h.tokens
			h.mu.Unlock()
			bt.b.met.decided(false)
			return r, nil
		}
		if wait := h.refilling; wait != nil {
			// Another caller is refilling this key: wait for it, then look
			// again.
			h.mu.Unlock()
			select {
			case <-wait:
				h.mu.Lock()
				continue
			case <-ctx.Done():
				return bucket.Result{}, fmt.Errorf("%w: %w", ErrUnavailable, ctx.Err())
			}
		}
		done := make(chan struct{})
		h.refilling = done
		r, err := bt.refill(ctx, h, key, now, n) // unlocks h.mu
		h.mu.Lock()
		h.refilling = nil
		h.mu.Unlock()
		close(done)
		if err == nil {
			bt.b.met.decided(r.Allowed)
		}
		return r, err
	}
}

// expiry returns when h's tokens stop being spendable: Hold after they were
// asked for, or when the promotion they were taken under ends, whichever
// comes first.
func (h *holding) expiry(hold int64) int64 {
	if h.promoUntil > 0 {
		return min(h.takenAt+hold, h.promoUntil)
	}
	return h.takenAt + hold
}

// observe updates the demand EWMA (time constant Hold) with n tokens at now.
func (h *holding) observe(now, n int64, tau time.Duration) {
	if dt := now - h.last; dt > 0 && h.last != 0 {
		h.demand *= math.Exp(-float64(dt) / float64(tau))
	}
	h.demand += float64(n) * float64(time.Second) / float64(tau)
	h.last = max(h.last, now)
}

// setSource points h (h.mu held) at a new source of tokens: sub-key
// `shard` of `shards` (the key itself when shards ≤ 1), under a promotion
// until promoUntil (0: the rule's own shards). A refill that began under the
// old source drops its result (see refill). Tokens h holds stay; they are
// the key's budget whichever of its (sub-)keys they go back to.
func (h *holding) setSource(shards, shard int, promoUntil int64) {
	h.shards, h.shard, h.promoUntil = shards, shard, promoUntil
	h.remote, h.deniedUntil = 0, 0
	h.gen++
}

// ruleSource points h back at the source its rule names: the key, or one
// of its rule's sub-keys.
func (bt *Batcher) ruleSource(h *holding, key string) {
	shard := 0
	if n := Shards(h.lim, h.ruleShards); n > 1 {
		shard = bt.b.pick(xxhash.Sum64String(key), n)
	}
	h.setSource(h.ruleShards, shard, 0)
}

// refill runs with h.mu held and h.refilling set; it unlocks h.mu for the
// I/O. It takes a batch, keeps n of it for this request when it can, and
// returns the decision.
//
// A holding that follows a promotion goes back to the key when the
// promotion has ended (unless this Backend has seen it extended): the key
// restarts empty at the promotion's end, so at every instant tokens come
// from one budget, the sub-keys' or the key's, never both. If the holding's
// source changed while the I/O ran (a new rule), the batch is not added to
// it: this request is decided from the batch and the rest is given back
// where it was taken.
func (bt *Batcher) refill(ctx context.Context, h *holding, key string, now, n int64) (bucket.Result, error) {
	hold := int64(bt.cfg.Hold)
	// Tokens past their hold or their promotion are no longer spendable:
	// give them back.
	var stale int64
	staleLim, staleShards, staleShard := h.lim, h.shards, h.shard
	if now >= h.expiry(hold) {
		stale, h.tokens = h.tokens, 0
	}
	if h.promoUntil > 0 && now >= h.promoUntil {
		if p, ok := bt.b.promotion(key, now); ok && p.shards == h.shards {
			h.promoUntil = p.until // extended: the sub-keys are still live
		} else {
			bt.ruleSource(h, key)
		}
	}
	gen := h.gen
	lim, shards, shard, promoUntil := h.lim, h.shards, h.shard, h.promoUntil
	have := h.tokens
	want := int64(math.Ceil(h.demand * bt.cfg.Horizon.Seconds()))
	h.mu.Unlock()

	if stale > 0 {
		_ = bt.b.GiveBack(ctx, key, staleLim, staleShards, staleShard, now, stale) // lost tokens only under-admit
	}
	tries := 1
	if Shards(lim, shards) > 1 {
		tries = 2 // a second sub-key when the first cannot give n
	}
	var last outcome
	var lastLim bucket.Limit
	for try := 0; try < tries; try++ {
		sub, err := bt.subLimit(lim, shards, shard)
		if err != nil {
			return bucket.Result{}, err
		}
		batch := min(max(want, n-have), bt.cfg.MaxBatch, max(sub.Burst()/4, 1))
		batch = max(batch, n-have)
		o, err := bt.b.single(ctx, key, lim, shards, shard, opTake, now, batch)
		var pe *PromotedError
		if errors.As(err, &pe) {
			// The key is promoted: hold tokens from one of its sub-keys
			// until the promotion ends.
			shards, promoUntil = pe.Shards, pe.Until.UnixNano()
			shard = bt.b.pick(xxhash.Sum64String(key), Shards(lim, shards))
			tries = 2
			o, err = bt.b.single(ctx, key, lim, shards, shard, opTake, now, batch)
			sub, _ = bt.subLimit(lim, shards, shard)
		}
		if err != nil {
			return bucket.Result{}, err
		}
		last, lastLim = o, sub
		if have+o.taken >= n || try == tries-1 {
			h.mu.Lock()
			if h.gen != gen {
				h.mu.Unlock()
				return bt.decideAside(ctx, key, lim, shards, shard, o, sub, now, n)
			}
			if shards != h.shards || shard != h.shard || promoUntil != h.promoUntil {
				h.setSource(shards, shard, promoUntil)
				gen = h.gen
			}
			// takenAt stays the oldest held token's: tokens are spent
			// oldest first, so it moves to now only when none is left.
			older := h.tokens
			h.tokens += o.taken
			h.remote = lastLim.Peek(o.state, o.now).Remaining * int64(Shards(lim, shards))
			if h.tokens >= n {
				h.tokens -= n
				if older <= n {
					h.takenAt = now
				}
				r := bucket.Result{Allowed: true, Remaining: max(h.remote, 0) + h.tokens}
				h.mu.Unlock()
				return r, nil
			}
			if older == 0 {
				h.takenAt = now
			}
			h.mu.Unlock()
			break
		}
		// This sub-key cannot give n: return what it gave, try another.
		if o.taken > 0 {
			if err := bt.b.GiveBack(ctx, key, lim, shards, shard, now, o.taken); err != nil {
				return bucket.Result{}, err
			}
		}
		bt.b.met.secondTry()
		shard = other(shard, Shards(lim, shards))
	}
	// Denied: say when n tokens will be there, and deny the key locally
	// until a batch could be taken (pacing refills to one per batch).
	r := denial(lastLim, last, n, have, Shards(lim, shards))
	st := last.state
	batch := min(max(want, n), bt.cfg.MaxBatch, max(lastLim.Burst()/4, 1))
	pace := lastLim.AllowN(&st, last.now, max(batch-have, 1)).RetryAfter
	pace = min(max(pace, r.RetryAfter), bt.cfg.Hold)
	h.mu.Lock()
	if h.gen == gen {
		h.deniedUntil, h.deny = now+int64(pace), r
	}
	h.mu.Unlock()
	return r, nil
}

// denial is the Result of a refill that could not give n tokens (have were
// held already): the (sub-)key's state o says when n will be there.
func denial(sub bucket.Limit, o outcome, n, have int64, shards int) bucket.Result {
	st := o.state
	r := sub.AllowN(&st, o.now, n-have)
	r.Allowed, r.Remaining = false, max(r.Remaining, 0)*int64(shards)+have
	if r.RetryAfter <= 0 {
		r.RetryAfter = time.Millisecond
	}
	return r
}

// decideAside decides a request from the o.taken tokens a refill took from
// sub-key `shard` of `shards` after its holding's source changed: n of them
// if there are that many, and the rest go back.
func (bt *Batcher) decideAside(ctx context.Context, key string, lim bucket.Limit, shards, shard int, o outcome, sub bucket.Limit, now, n int64) (bucket.Result, error) {
	keep := int64(0)
	if o.taken >= n {
		keep = n
	}
	if back := o.taken - keep; back > 0 {
		if err := bt.b.GiveBack(ctx, key, lim, shards, shard, now, back); err != nil {
			return bucket.Result{}, err
		}
	}
	if keep < n {
		return denial(sub, o, n, 0, Shards(lim, shards)), nil
	}
	return bucket.Result{Allowed: true, Remaining: max(sub.Peek(o.state, o.now).Remaining, 0) * int64(Shards(lim, shards))}, nil
}

func (bt *Batcher) subLimit(lim bucket.Limit, shards, shard int) (bucket.Limit, error) {
	n := Shards(lim, shards)
	if n <= 1 {
		return lim, nil
	}
	return subLimit(lim, n, shard)
}

// holding returns key's holding, creating it; nil when MaxKeys are held.
// A holding whose limit or shards changed (a new rule) gives its tokens
// back first.
func (bt *Batcher) holding(key string, lim bucket.Limit, shards int, now int64) *holding {
	hash := xxhash.Sum64String(key)
	sh := &bt.shards[hash%batchShards]
	sh.mu.Lock()
	h := sh.m[key]
	if h == nil {
		if sh.size >= (bt.cfg.MaxKeys+batchShards-1)/batchShards {
			sh.mu.Unlock()
			return nil
		}
		h = &holding{lim: lim, ruleShards: shards, shards: shards, last: now}
		if n := Shards(lim, shards); n > 1 {
			h.shard = bt.b.pick(hash, n)
		}
		sh.m[key] = h
		sh.size++
	}
	sh.mu.Unlock()
	h.mu.Lock()
	if h.lim != lim || h.ruleShards != shards {
		oldLim, oldShards, oldShard, oldTokens := h.lim, h.shards, h.shard, h.tokens
		h.lim, h.ruleShards, h.tokens = lim, shards, 0
		bt.ruleSource(h, key)
		h.mu.Unlock()
		if oldTokens > 0 {
			ctx, cancel := context.WithTimeout(context.Background(), bt.b.cfg.Timeout)
			_ = bt.b.GiveBack(ctx, key, oldLim, oldShards, oldShard, now, oldTokens)
			cancel()
		}
		return h
	}
	h.mu.Unlock()
	return h
}

// sweeper gives back expired and idle holdings every Sweep and forgets keys
// idle for 8 holds.
func (bt *Batcher) sweeper() {
	defer close(bt.done)
	t := time.NewTicker(bt.cfg.Sweep)
	defer t.Stop()
	for {
		select {
		case <-bt.stop:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), bt.cfg.Sweep)
			bt.sweep(ctx, bt.b.now(), false)
			cancel()
		}
	}
}

type giveBack struct {
	key           string
	lim           bucket.Limit
	shards, shard int
	n             int64
}

// sweep gives back the tokens of holdings past their hold or idle for a
// sweep period (all of them when all is set), and forgets long-idle keys.
func (bt *Batcher) sweep(ctx context.Context, now int64, all bool) error {
	hold := int64(bt.cfg.Hold)
	var out []giveBack
	for i := range bt.shards {
		sh := &bt.shards[i]
		sh.mu.Lock()
		for key, h := range sh.m {
			h.mu.Lock()
			if h.tokens > 0 && (all || now >= h.expiry(hold) || now-h.last >= int64(bt.cfg.Sweep)) {
				out = append(out, giveBack{key, h.lim, h.shards, h.shard, h.tokens})
				h.tokens = 0
			}
			if h.tokens == 0 && h.refilling == nil && now-h.last >= 8*hold {
				delete(sh.m, key)
				sh.size--
			}
			h.mu.Unlock()
		}
		sh.mu.Unlock()
	}
	var errs []error
	for _, g := range out {
		if err := bt.b.GiveBack(ctx, g.key, g.lim, g.shards, g.shard, now, g.n); err != nil && !errors.Is(err, ErrPromoted) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Held returns the tokens the Batcher holds for key (for tests and
// introspection).
func (bt *Batcher) Held(key string) int64 {
	sh := &bt.shards[xxhash.Sum64String(key)%batchShards]
	sh.mu.Lock()
	h := sh.m[key]
	sh.mu.Unlock()
	if h == nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.tokens
}

// Return puts n tokens taken by AllowN for key back into the local batch
// (a request that another descriptor denied). Tokens for a key no longer
// held are dropped, which can only under-admit.
func (bt *Batcher) Return(key string, n int64) {
	if n <= 0 {
		return
	}
	sh := &bt.shards[xxhash.Sum64String(key)%batchShards]
	sh.mu.Lock()
	h := sh.m[key]
	sh.mu.Unlock()
	if h == nil {
		return
	}
	h.mu.Lock()
	h.tokens += n
	h.mu.Unlock()
}

// Close stops the sweeper and gives every held token back (bounded by
// ctx); later calls check per request (Backend.AllowN). It does not close
// the Backend. Safe to call twice.
func (bt *Batcher) Close(ctx context.Context) error {
	bt.closeOnce.Do(func() {
		bt.closed.Store(true)
		close(bt.stop)
		<-bt.done
		bt.closeErr = bt.sweep(ctx, bt.b.now(), true)
	})
	return bt.closeErr
}
