package main

import (
	"bytes"
	"testing"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// With static shares on, status has a line on them (and says when a
// settings change is under way), agents has a slot column, and inspect
// says how static shares treat the key.
func TestStaticOutput(t *testing.T) {
	var out bytes.Buffer
	a := &app{stdout: &out}
	st := &allotv1.StaticStatus{Slots: 16, TtlMs: 2000, SlotsHeld: 12, HotKeys: 630, HotVersion: 4411,
		Transitions: 3, MaxRefillMs: 118000}
	if err := a.printStatus(&allotv1.ClusterStatusResponse{LeaderId: "alloc-1", NodeId: "alloc-1", State: "leader", Static: st}); err != nil {
		t.Fatal(err)
	}
	st.Paused, st.NextSlots, st.NextTtlMs = true, 32, 2000
	out.WriteString("\n")
	if err := a.printStatus(&allotv1.ClusterStatusResponse{LeaderId: "alloc-1", NodeId: "alloc-1", State: "leader", Static: st}); err != nil {
		t.Fatal(err)
	}
	out.WriteString("\n")
	if err := a.printAgents(&allotv1.ListAgentsResponse{NowUnixMs: fakeNow, Agents: []*allotv1.AgentInfo{
		{AgentId: "gw-1-4242-ab12", LastContactUnixMs: fakeNow - 300, KeysHeld: 12, TokensHeld: 480, LastRequestId: 9001,
			StaticSlot: true, HotVersionAcked: 4411},
		{AgentId: "gw-2-4243-cd34", LastContactUnixMs: fakeNow - 700, KeysHeld: 3, TokensHeld: 30, LastRequestId: 77},
	}}); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*allotv1.InspectKeyResponse{
		{Key: "public-api:api_key=k_1", Matched: true, Limit: freeSearchLimit(), Static: "static", StaticSlots: 16, NowUnixMs: fakeNow},
		{Key: "public-api:api_key=k_2", Matched: true, Limit: freeSearchLimit(), Static: "transition", StaticShares: 5, StaticSlots: 16,
			Tracked: true, Tokens: 3, FullInMs: 900, NowUnixMs: fakeNow},
		{Key: "public-api:api_key=k_3", Matched: true, Limit: freeSearchLimit(), Static: "hot", StaticSlots: 16, Tracked: true, Tokens: 20, NowUnixMs: fakeNow},
		{Key: "public-api:api_key=k_4", Matched: true, Limit: freeSearchLimit(), Static: "not_eligible", StaticSlots: 16, NowUnixMs: fakeNow},
	} {
		out.WriteString("\n")
		if err := a.printInspect(r); err != nil {
			t.Fatal(err)
		}
	}
	checkGolden(t, "static", out.String())
}
