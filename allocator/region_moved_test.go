package allocator

import (
	"testing"
	"time"

	"github.com/allot/allot/allocator/upstream"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// A multi-group global cluster answers a key whose slot is mid-move
// KEY_STATUS_MOVED: nothing granted, returned or charged. The region's
// outage charge for that key is then owed again, in the ledger and in the
// key's policy, and the next call reports it.
func TestRegionMovedAnswerOwesOutageChargeAgain(t *testing.T) {
	s, _, pool := owingRegion(t, 5)
	g := testRunner(s, []string{"127.0.0.1:1"}, upstream.Config{})
	k, err := upstream.NewKey(upstream.Config{}, upstream.Rule{Rate: 100, Burst: 100})
	if err != nil {
		t.Fatal(err)
	}
	k.Resume(0, 50, pool.Owed)
	now := time.Now().UnixNano()
	r, ok := k.Tick(now, 50)
	if !ok || r.OutageCharged != pool.Owed {
		t.Fatalf("tick: %v %+v", ok, r)
	}
	d := []due{{p: pool, rk: &regKey{k: k}, req: r}}
	res, ok := g.send(ctxT(t), d)
	if !ok {
		t.Fatal("send not committed")
	}
	afterSend, _ := s.st.PoolOf(pool.Hash, time.Now().UnixNano())
	res.resp = &allotv1.AcquireResponse{Grants: []*allotv1.KeyGrant{{Status: allotv1.KeyStatus_KEY_STATUS_MOVED}}}
	g.finish(ctxT(t), res)
	after, _ := s.st.PoolOf(pool.Hash, time.Now().UnixNano())
	t.Logf("charged %d; owed before send %d, after send %d, after MOVED answer %d (minted meanwhile %d)",
		r.OutageCharged, pool.Owed, afterSend.Owed, after.Owed, after.Minted-pool.Minted)
	if after.Owed-(after.Minted-pool.Minted) < r.OutageCharged {
		t.Errorf("outage charge of %d tokens owed nowhere after a MOVED answer (the global cluster charged nothing)", r.OutageCharged)
	}
	// The policy owes it again too: its next call reports it.
	next, ok := k.Tick(now+int64(10*time.Second), 50)
	if !ok || next.OutageCharged < r.OutageCharged {
		t.Errorf("the key's next call (%v) reports %d as outage_charged, want at least the %d the MOVED answer left uncharged",
			ok, next.OutageCharged, r.OutageCharged)
	}
}
