package agent_test

import (
	"context"
	"fmt"
	"log"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// exampleRules is a rules file: every API key may make 2 requests a
// minute, with a burst of 2.
const exampleRules = `
domain: example
descriptors:
  - key: api_key
    rate_limit:
      name: per_key
      unit: minute
      requests_per_unit: 2
      burst: 2
`

// A standalone agent (no allocators) decides every request from its rules
// alone; with Config.Allocators it spends tokens leased from the allocator
// cluster instead, and the same code holds the limit across every gateway.
func Example() {
	set, err := rules.Compile(1, []rules.File{{Name: "example.yaml", Source: []byte(exampleRules)}})
	if err != nil {
		log.Fatal(err)
	}
	cfg := agent.DefaultConfig()
	cfg.Rules = set
	a, err := agent.New(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close(context.Background())

	req := []agent.Descriptor{{Entries: []rules.Entry{{Key: "api_key", Value: "k_123"}}}}
	for i := 1; i <= 3; i++ {
		d, err := a.Check(context.Background(), "example", req, 1)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("request %d: allowed=%v remaining=%d policy=%s quota=%d/%s\n", i, d.Allowed, d.Remaining, d.Policy, d.Quota, d.Window)
	}
	// Output:
	// request 1: allowed=true remaining=1 policy=per_key quota=2/1m0s
	// request 2: allowed=true remaining=0 policy=per_key quota=2/1m0s
	// request 3: allowed=false remaining=0 policy=per_key quota=2/1m0s
}
