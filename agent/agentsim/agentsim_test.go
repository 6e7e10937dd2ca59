package agentsim_test

import (
	"context"
	"runtime"
	"testing"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/agentsim"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const rulesYAML = `domain: d
descriptors:
  - key: k
    rate_limit:
      unit: second
      requests_per_unit: 1
`

// TestDriven: an agentsim agent starts no goroutine, needs a Now hook,
// refuses RulesFiles, takes rule sets from ApplyRuleSet and decides checks
// at the hook's time.
func TestDriven(t *testing.T) {
	if _, err := agentsim.New(agent.DefaultConfig()); err == nil {
		t.Fatal("New without Now: nil error")
	}
	cfg := agent.DefaultConfig()
	cfg.Now = func() int64 { return 1 }
	cfg.RulesFiles = []string{"r.yaml"}
	if _, err := agentsim.New(cfg); err == nil {
		t.Fatal("New with RulesFiles: nil error")
	}
	now := int64(1_000_000_000)
	cfg = agent.DefaultConfig()
	cfg.Now = func() int64 { return now }
	before := runtime.NumGoroutine()
	a, err := agentsim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close(context.Background())
	if n := runtime.NumGoroutine(); n > before {
		t.Fatalf("New started %d goroutines", n-before)
	}
	rs := &allotv1.RuleSet{Version: 2, Files: []*allotv1.RuleFile{{Name: "r.yaml", Yaml: []byte(rulesYAML)}}}
	if err := a.ApplyRuleSet(rs); err != nil || a.Rules().Version() != 2 {
		t.Fatalf("ApplyRuleSet: %v, version %d", err, a.Rules().Version())
	}
	d := []agent.Descriptor{{Entries: []rules.Entry{{Key: "k", Value: "v"}}}}
	for i, want := range []bool{true, false} {
		got, err := a.Check(context.Background(), "d", d, 1)
		if err != nil || got.Allowed != want {
			t.Fatalf("check %d: %+v %v, want allowed %v", i, got, err, want)
		}
	}
	now += 1_000_000_000 // a second later the bucket has refilled
	if err := a.Refill(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, _ := a.Check(context.Background(), "d", d, 1); !got.Allowed {
		t.Fatalf("check a second later: %+v, want allowed", got)
	}
}
