package main

import (
	"bytes"
	"testing"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// A regional cluster's status shows its upstream and the global keys it
// holds; a global key inspected on it shows both levels.
func TestRegionOutput(t *testing.T) {
	var out bytes.Buffer
	a := &app{stdout: &out}
	lim := func(rpu uint32, burst int64) *allotv1.Limit {
		return &allotv1.Limit{Name: "shared", RequestsPerUnit: rpu, Unit: "second", WindowSeconds: 1, Burst: burst,
			Algorithm: "token_bucket", Backend: "lease"}
	}
	// A region whose copy is tighter (30/s) than the global cluster's
	// (100/s); a key the global cluster does not lease; a key that agrees.
	held := &allotv1.GlobalKeyHeld{Key: "reg:k=one", Available: 12, Demand: 60, Share: 33.3, FallbackRate: 33.3,
		Received: 1200, Returned: 20, Minted: 160, CutOff: true, RuleMismatch: true,
		Limit: lim(100, 100), RegionLimit: lim(30, 30), GlobalRulesVersion: 7}
	notLeased := &allotv1.GlobalKeyHeld{Key: "reg:k=two", RuleMismatch: true, RegionLimit: lim(50, 50),
		GlobalStatus: "KEY_STATUS_NO_RULE"}
	same := &allotv1.GlobalKeyHeld{Key: "reg:k=three", Available: 3, Received: 40, Limit: lim(100, 100),
		RegionLimit: lim(100, 100), GlobalRulesVersion: 7}
	st := &allotv1.ClusterStatusResponse{Region: "eu-west", Upstream: &allotv1.UpstreamStatus{
		Addrs: []string{"10.1.0.5:7420", "10.1.0.6:7420"}, State: "cut_off", AgentId: "region:eu-west",
		Error: "10.1.0.5:7420: context deadline exceeded",
		Keys:  []*allotv1.GlobalKeyHeld{held, notLeased, same}}}
	if err := a.printUpstream(st); err != nil {
		t.Fatal(err)
	}
	global := &allotv1.InspectKeyResponse{Key: "reg:k=one", Matched: true, Limit: freeSearchLimit(), Tracked: true, Tokens: 4,
		Leases: []*allotv1.Lease{{AgentId: "region:eu-west", Tokens: 40, ExpiresInMs: 1800, Demand: 60, GrantedUnixMs: fakeNow - 100},
			{AgentId: "region:us-east", Tokens: 25, ExpiresInMs: 1900, Demand: 40, GrantedUnixMs: fakeNow - 50}},
		NowUnixMs: fakeNow}
	if err := a.printLevels(&allotv1.InspectKeyResponse{Pool: held, Global: global}); err != nil {
		t.Fatal(err)
	}
	if err := a.printLevels(&allotv1.InspectKeyResponse{Pool: held, GlobalError: "no -global-allocators"}); err != nil {
		t.Fatal(err)
	}
	checkGolden(t, "region", out.String())
	// -o json: the mismatched key with both limits.
	js, err := protoJSON(&allotv1.GlobalKeyHeld{Key: held.Key, RuleMismatch: true, Limit: held.Limit,
		RegionLimit: held.RegionLimit, GlobalRulesVersion: 7})
	if err != nil {
		t.Fatal(err)
	}
	checkGolden(t, "region_mismatch.json", string(js))
}
