package regions

import (
	"context"
	"testing"
	"time"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func TestDebugRegion(t *testing.T) {
	w := newWorld(t, 1, 1, 1)
	r := w.regions[0]
	desc := []agent.Descriptor{{Entries: []rules.Entry{{Key: "k", Value: "one"}}}}
	srcs := map[string]int{}
	for i := 0; i < 400; i++ {
		d, err := r.agents[0].Check(context.Background(), "reg", desc, 1)
		if err != nil {
			t.Fatal(err)
		}
		srcs[d.Source.String()+" "+map[bool]string{true: "ok", false: "deny"}[d.Allowed]]++
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("sources %v", srcs)
	st := regionStatus(t, r)
	t.Logf("status %v", st.GetUpstream())
	ik, err := r.c.Nodes[0].Admin(t).InspectKey(context.Background(), &allotv1.InspectKeyRequest{Domain: "reg", Entries: []*allotv1.Entry{{Key: "k", Value: "one"}}})
	t.Logf("inspect %v %v", ik, err)
}
