// Package drive connects package agentsim to the unexported driving API of
// package agent; Go's internal rule keeps it from every other importer.
// Package agent sets the functions when it initialises.
package drive

import (
	"context"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Set by package agent. New makes an agent that starts no goroutine (cfg
// is an agent.Config, the result an *agent.Agent); Refill runs one tick of
// its refill loop; ApplyRuleSet delivers a rule set as the rule watch
// would.
var (
	New          func(cfg any) (any, error)
	Refill       func(a any, ctx context.Context) error
	ApplyRuleSet func(a any, rs *allotv1.RuleSet) error
)
