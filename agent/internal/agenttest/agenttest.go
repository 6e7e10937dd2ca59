// Package agenttest builds agents for the tests of the packages in front
// of the agent (agent/httplimit, agent/grpclimit, agent/rls).
package agenttest

import (
	"context"
	"testing"
	"time"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// Epoch is the instant a Frozen agent's clock stays at.
var Epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// Frozen returns a standalone agent deciding by the rules yaml (one file)
// on a clock frozen at Epoch, so nothing refills between checks. It is
// closed when the test ends (closing it before is allowed).
func Frozen(t testing.TB, yaml string) *agent.Agent {
	t.Helper()
	set, err := rules.Compile(1, []rules.File{{Name: "rules.yaml", Source: []byte(yaml)}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := agent.DefaultConfig()
	cfg.Rules = set
	now := Epoch.UnixNano()
	cfg.Now = func() int64 { return now }
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(context.Background()) })
	return a
}
