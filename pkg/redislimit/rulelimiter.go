package redislimit

import (
	"context"
	"log/slog"
	"math/rand/v2"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

// RuleLimiter adapts a Backend to the agent's RemoteLimiter seam
// (agent.Config.Redis): it decides a rule's budget key with the rule's
// Limit and Shards. With a Batcher it uses batched mode; with a Promoter it
// promotes keys that turn hot (unsharded rules only) and keeps them
// promoted while they stay hot.
type RuleLimiter struct {
	Backend  *Backend  // required
	Batcher  *Batcher  // optional: batched mode for every redis rule
	Promoter *Promoter // optional: promotion of hot keys
	Logger   *slog.Logger
}

// AllowN takes n tokens (n == 0: checks without taking) from the budget key
// (rules.AppendKey) under r. Errors wrap ErrUnavailable (apply the rule's
// failure mode) or ErrUnsupportedLimit.
func (rl *RuleLimiter) AllowN(ctx context.Context, r *rules.Rule, key []byte, n int64) (bucket.Result, error) {
	if r.Unlimited || r.Limit.IsZero() {
		return bucket.Result{Allowed: true, Remaining: bucket.Unlimited}, nil
	}
	k := string(key)
	now := rl.Backend.now()
	if rl.Promoter != nil && r.Shards <= 1 && n > 0 && rl.Promoter.Observe(k, now, n) {
		rl.promote(ctx, k, r.Limit, now)
	}
	if rl.Batcher != nil {
		return rl.Batcher.AllowNAt(ctx, k, r.Limit, r.Shards, now, n)
	}
	return rl.Backend.AllowNAt(ctx, k, r.Limit, r.Shards, now, n)
}

// GiveBack returns n tokens AllowN took for key under r, for a request that
// was denied by another descriptor. For a sharded key the sub-key is not
// known, so the tokens go to a random one (capped at its burst); in batched
// mode they go back to the local batch's source.
func (rl *RuleLimiter) GiveBack(ctx context.Context, r *rules.Rule, key []byte, n int64) error {
	if r.Unlimited || r.Limit.IsZero() || r.Limit.DeniesAll() || n <= 0 {
		return nil
	}
	k := string(key)
	if rl.Batcher != nil {
		rl.Batcher.Return(k, n)
		return nil
	}
	now := rl.Backend.now()
	shards := Shards(r.Limit, r.Shards)
	if p, ok := rl.Backend.promotion(k, now); ok && shards <= 1 {
		shards = p.shards
	}
	shard := 0
	if shards > 1 {
		shard = rand.IntN(shards)
	}
	return rl.Backend.GiveBack(ctx, k, r.Limit, shards, shard, now, n)
}

// promote promotes k, or renews its promotion when less than half of the
// TTL is left.
func (rl *RuleLimiter) promote(ctx context.Context, k string, lim bucket.Limit, now int64) {
	cfg := rl.Promoter.Config()
	if p, ok := rl.Backend.promotion(k, now); ok && p.until-now > int64(cfg.TTL)/2 {
		return
	}
	if Shards(lim, cfg.Shards) <= 1 {
		return
	}
	if _, _, err := rl.Backend.Promote(ctx, k, lim, cfg.Shards, now, cfg.TTL); err != nil && rl.Logger != nil {
		// Retried on the key's next check; the key stays unsharded meanwhile.
		rl.Logger.Debug("redislimit: promoting a hot key failed", "key", rules.RedactKey(k), "err", err)
	}
}
