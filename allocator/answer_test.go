package allocator

import (
	"testing"

	"google.golang.org/protobuf/proto"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestAnswerForms: an answer recorded with its grants packed (as the FSM
// builds them) or as messages (recorded by an older binary, restored from
// its snapshot) reaches the caller in the form it asked for, with the same
// grants (a region's share included), the leader named and
// reads_packed_keys set; the recorded answer is not modified.
func TestAnswerForms(t *testing.T) {
	l := &allotv1.Limit{Name: "r", Burst: 10}
	grants := []*allotv1.KeyGrant{
		{Status: allotv1.KeyStatus_KEY_STATUS_OK, Key: "d:k=a", Granted: 3, Limit: l, Agents: 1},
		{Status: allotv1.KeyStatus_KEY_STATUS_NO_RULE, Key: "d:k=b"},
		{Status: allotv1.KeyStatus_KEY_STATUS_OK, Key: "d:k=c", Granted: 5, Limit: l, Agents: 3, Share: proto.Float64(33.333)},
	}
	p, lims := allotv1.AppendPackedGrants(nil, nil, grants)
	for _, rec := range []*allotv1.AcquireResponse{
		{Grants: grants, LiveAgents: 2, RulesVersion: 3, NowUnixMs: 4},
		{PackedGrants: p, Limits: lims, LiveAgents: 2, RulesVersion: 3, NowUnixMs: 4},
	} {
		before := proto.Clone(rec)
		for _, packed := range []bool{false, true} {
			out, err := answer(rec, "n1", packed)
			if err != nil {
				t.Fatal(err)
			}
			if got := len(out.GetPackedGrants()) > 0; got != packed || packed == (len(out.GetGrants()) > 0) {
				t.Fatalf("asked packed=%v, got %v", packed, out)
			}
			got, err := allotv1.GrantsOf(out)
			if err != nil || len(got) != len(grants) {
				t.Fatalf("%d grants, %v", len(got), err)
			}
			for i := range grants {
				if !proto.Equal(got[i], grants[i]) {
					t.Errorf("grant %d: %v, want %v", i, got[i], grants[i])
				}
			}
			if out.GetLeaderId() != "n1" || !out.GetReadsPackedKeys() || out.GetLiveAgents() != 2 || out.GetRulesVersion() != 3 || out.GetNowUnixMs() != 4 {
				t.Errorf("answer fields: %v", out)
			}
		}
		if !proto.Equal(rec, before) {
			t.Errorf("the recorded answer changed: %v, was %v", rec, before)
		}
	}
}
