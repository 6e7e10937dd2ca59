// Package agentsim drives a real agent.Agent by hand, so that its
// behaviour is a function of its inputs: it starts no goroutine (no coarse
// clock, no refill loop, no rule watch), takes its time from Config.Now,
// reaches the allocator through Config.Clients, one call at a time, and
// draws its jitter from Config.Rand. Refill runs one tick of the refill
// loop; ApplyRuleSet delivers what the allocator's WatchRules stream
// would.
//
// It is the one way into the agent for the fleet simulator (bench/sim,
// which runs hundreds of real agents on a virtual clock) and for
// benchmarks that must measure the request path alone. A gateway never
// needs it: agent.New runs the loops itself. The agent's own tests drive
// the same functions from inside the package.
package agentsim

import (
	"context"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/internal/drive"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Agent is an agent.Agent that runs only when driven. Check, CheckStatuses
// and Close are the agent's own.
type Agent struct {
	*agent.Agent
}

// New validates cfg and makes an agent with no goroutines. cfg.Now is
// required, and cfg.RulesFiles must be empty (nothing would watch them).
func New(cfg agent.Config) (*Agent, error) {
	a, err := drive.New(cfg)
	if err != nil {
		return nil, err
	}
	return &Agent{Agent: a.(*agent.Agent)}, nil
}

// Refill runs one tick of the refill loop at the Now hook's time: the
// periodic scan (every ScanInterval), then the keys that need the
// allocator sent in batched Acquire calls, through Config.Clients, one
// call at a time. It must not run concurrently with itself or Close;
// checks may run concurrently.
func (a *Agent) Refill(ctx context.Context) error { return drive.Refill(a.Agent, ctx) }

// ApplyRuleSet delivers a rule set as the WatchRules stream would: it is
// compiled and swapped in if its version is newer than the allocator-
// delivered rules in use. A set that fails to compile keeps the old rules
// and is returned as an error (it is also logged and counted, as on the
// stream).
func (a *Agent) ApplyRuleSet(rs *allotv1.RuleSet) error { return drive.ApplyRuleSet(a.Agent, rs) }
