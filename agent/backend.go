package agent

import (
	"context"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

// RemoteLimiter decides keys whose rule has the redis backend: a counter
// shared by every agent and checked on each request, so (unlike leases) it
// costs a network round trip per check. Config.Redis plugs one in.
//
// AllowN takes n tokens (n ≥ 1) from the budget identified by key (the
// canonical budget key, rules.AppendKey) under r's limit, or, with n == 0,
// reports without taking. key is only valid during the call. An error means
// the backend could not decide: the agent then applies the rule's failure
// mode (open: the local bucket decides; closed: deny).
type RemoteLimiter interface {
	AllowN(ctx context.Context, r *rules.Rule, key []byte, n int64) (bucket.Result, error)
}

// RemoteRefunder is implemented by a RemoteLimiter that can give tokens
// back: when another descriptor of the same request denies it, the agent
// returns what the remote budget took (as it does for leased tokens).
type RemoteRefunder interface {
	GiveBack(ctx context.Context, r *rules.Rule, key []byte, n int64) error
}
