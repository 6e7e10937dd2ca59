package rls_test

import (
	"context"
	"fmt"
	"log"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/rls"
	"github.com/allot/allot/pkg/rules"
)

// exampleRules lets every API key make 2 requests a minute, with a burst
// of 2.
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

// The Server answers Envoy's ShouldRateLimit from an agent. A gateway
// registers it on its gRPC server (Server.Register) and Envoy's global
// rate limit filter points at that address; here the calls are made
// directly.
func ExampleServer() {
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

	srv, err := rls.New(a, rls.Options{})
	if err != nil {
		log.Fatal(err)
	}
	req := &rlsv3.RateLimitRequest{
		Domain: "example",
		Descriptors: []*rlcommon.RateLimitDescriptor{{
			Entries: []*rlcommon.RateLimitDescriptor_Entry{{Key: "api_key", Value: "k_123"}},
		}},
	}
	for i := 1; i <= 3; i++ {
		resp, err := srv.ShouldRateLimit(context.Background(), req)
		if err != nil {
			log.Fatal(err)
		}
		st := resp.GetStatuses()[0]
		fmt.Printf("%s: %s remaining %d of %d per %s\n", resp.GetOverallCode(), st.GetCurrentLimit().GetName(),
			st.GetLimitRemaining(), st.GetCurrentLimit().GetRequestsPerUnit(), st.GetCurrentLimit().GetUnit())
	}
	// Output:
	// OK: per_key remaining 1 of 2 per MINUTE
	// OK: per_key remaining 0 of 2 per MINUTE
	// OVER_LIMIT: per_key remaining 0 of 2 per MINUTE
}
