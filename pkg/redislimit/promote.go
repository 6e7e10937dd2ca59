package redislimit

import (
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
)

// PromoterConfig configures a Promoter. Start from DefaultPromoterConfig
// and set Threshold.
type PromoterConfig struct {
	// Threshold is the rate (tokens/s, as this agent observes it) at which
	// a key turns hot. A key stays hot until its rate falls below half of
	// it (hysteresis).
	Threshold float64
	// Shards is the sub-key count of a promoted key (default 8).
	Shards int
	// HalfLife is the half-life of the rate estimate (default 1s).
	HalfLife time.Duration
	// TTL is how long one promotion lasts in Redis (default 30s); it is
	// renewed while some agent still sees the key hot.
	TTL time.Duration
	// MaxKeys bounds the keys tracked (default 10000); when full, keys far
	// below the threshold are forgotten, and if none are, new keys are not
	// tracked until some are.
	MaxKeys int
}

// DefaultPromoterConfig returns the defaults documented on PromoterConfig
// (Threshold must still be set).
func DefaultPromoterConfig() PromoterConfig {
	return PromoterConfig{Shards: 8, HalfLife: time.Second, TTL: 30 * time.Second, MaxKeys: 10_000}
}

// Validate reports the first problem with c.
func (c PromoterConfig) Validate() error {
	switch {
	case !(c.Threshold > 0) || math.IsInf(c.Threshold, 0):
		return fmt.Errorf("redislimit: promoter: threshold must be a positive rate, got %v", c.Threshold)
	case c.Shards < 2 || c.Shards > MaxShards:
		return fmt.Errorf("redislimit: promoter: shards must be in [2, %d], got %d", MaxShards, c.Shards)
	case c.HalfLife <= 0:
		return fmt.Errorf("redislimit: promoter: half-life must be > 0, got %v", c.HalfLife)
	case c.TTL < time.Second:
		return fmt.Errorf("redislimit: promoter: ttl must be ≥ 1s, got %v", c.TTL)
	case c.MaxKeys < 1:
		return fmt.Errorf("redislimit: promoter: max keys must be ≥ 1, got %d", c.MaxKeys)
	}
	return nil
}

// A Promoter tracks the rate of each key an agent checks and says when a
// key crosses the threshold, so that the agent promotes it to sharded
// sub-keys (Backend.Promote; RuleLimiter does both). It reads no clock:
// every call takes the time. Safe for concurrent use; keys are sharded over
// independent locks.
type Promoter struct {
	cfg    PromoterConfig
	lambda float64 // ln 2 / half-life, per ns
	shards [promoShards]promoShard
}

const promoShards = 32

type promoShard struct {
	mu sync.Mutex // guards m
	m  map[string]*keyRate
}

// keyRate is an exponentially decaying rate: rate·e^(−λ·dt) plus λ per
// token, which converges to the true rate of a steady stream.
type keyRate struct {
	rate float64 // tokens/s
	at   int64
	hot  bool
}

// NewPromoter returns a Promoter.
func NewPromoter(cfg PromoterConfig) (*Promoter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := &Promoter{cfg: cfg, lambda: math.Ln2 / float64(cfg.HalfLife)}
	for i := range p.shards {
		p.shards[i].m = make(map[string]*keyRate)
	}
	return p, nil
}

// Config returns the Promoter's configuration.
func (p *Promoter) Config() PromoterConfig { return p.cfg }

// Observe records n tokens asked for key at now (Unix ns) and reports
// whether the key is hot.
func (p *Promoter) Observe(key string, now, n int64) bool {
	sh := &p.shards[xxhash.Sum64String(key)%promoShards]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	k := sh.m[key]
	if k == nil {
		if len(sh.m) >= (p.cfg.MaxKeys+promoShards-1)/promoShards && !p.evict(sh, now) {
			return false
		}
		k = &keyRate{at: now}
		sh.m[key] = k
	}
	k.rate = p.decay(k, now) + float64(max(n, 0))*p.lambda*float64(time.Second)
	k.at = max(k.at, now)
	switch {
	case !k.hot && k.rate >= p.cfg.Threshold:
		k.hot = true
	case k.hot && k.rate < p.cfg.Threshold/2:
		k.hot = false
	}
	return k.hot
}

// Rate returns key's current rate estimate (tokens/s) at now.
func (p *Promoter) Rate(key string, now int64) float64 {
	sh := &p.shards[xxhash.Sum64String(key)%promoShards]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if k := sh.m[key]; k != nil {
		return p.decay(k, now)
	}
	return 0
}

func (p *Promoter) decay(k *keyRate, now int64) float64 {
	if dt := now - k.at; dt > 0 {
		return k.rate * math.Exp(-p.lambda*float64(dt))
	}
	return k.rate
}

// evict forgets the shard's keys whose rate fell below an eighth of the
// threshold; it reports whether any were.
func (p *Promoter) evict(sh *promoShard, now int64) bool {
	before := len(sh.m)
	for key, k := range sh.m {
		if p.decay(k, now) < p.cfg.Threshold/8 {
			delete(sh.m, key)
		}
	}
	return len(sh.m) < before
}
