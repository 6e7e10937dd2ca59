package allocator

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/upstream"
	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// A regional leader whose failed call's fail entry does not commit (an
// apply timeout) while it still leads commits it again before it sends
// anything: a new send would replace the pending one, and the failed
// call's outage charge, owed again by the key's policy, would be taken
// out of the ledger's owed a second time, so that a regional failover,
// which resumes from the ledger, would never report it. Every minted
// token stays owed in the ledger or reported by the pending send.
func TestRegionFailedCallSettledBeforeNextSend(t *testing.T) {
	s, _, pool := owingRegion(t, 5)
	// A second runner of this node's term, with an unreachable global
	// allocator: every call fails. The first fail entries do not commit.
	g := testRunner(s, []string{testproc.FreeAddr(t)},
		upstream.Config{CallTimeout: 200 * time.Millisecond, RetryBackoff: 20 * time.Millisecond, Tick: 20 * time.Millisecond})
	g.verified = true
	var mu sync.Mutex
	refused, committed := 0, 0
	g.settleCommit = func(data []byte) error {
		mu.Lock()
		defer mu.Unlock()
		if refused < 3 {
			refused++
			return errors.New("apply timeout")
		}
		committed++
		return g.commit(data)
	}
	ctx, cancel := context.WithCancel(ctxT(t))
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.run(ctx)
	}()
	waitFor(t, 20*time.Second, "failed calls settled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return committed >= 3
	})
	cancel()
	<-done
	p, ok := s.st.PoolOf(pool.Hash, time.Now().UnixNano())
	if !ok {
		t.Fatal("pool gone")
	}
	// What the pending send (if any) reports is owed by the next leader,
	// which makes the call again and gives it up if it fails.
	var pending int64
	if _, raw := s.st.PendingUpstream(); raw != nil {
		req := new(allotv1.AcquireRequest)
		if err := proto.Unmarshal(raw, req); err != nil {
			t.Fatal(err)
		}
		for _, k := range req.GetKeys() {
			if k.GetDomain() == "g" {
				pending += k.GetOutageCharged()
			}
		}
	}
	t.Logf("minted %d, owed %d, reported by the pending send %d (fail commits refused %d, committed %d)",
		p.Minted, p.Owed, pending, refused, committed)
	if p.Owed+pending != p.Minted {
		t.Errorf("owed %d + pending %d of %d minted tokens: %d minted tokens are owed nowhere",
			p.Owed, pending, p.Minted, p.Minted-p.Owed-pending)
	}
}
