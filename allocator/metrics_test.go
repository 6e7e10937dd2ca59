package allocator

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// histCount returns how many observations h holds.
func histCount(t *testing.T, h prometheus.Histogram) uint64 {
	t.Helper()
	var m dto.Metric
	if err := h.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount()
}

// TestAcquireBreakdownMetrics checks that one Acquire sent to a follower
// is seen by every stage of the latency breakdown bench/acquire prints:
// the follower's handler (forwarded) and hop, the leader's handler
// (local), batcher queue, raft.Apply, commit wait and FSM apply, and the
// follower's own commit wait and apply once it applies the entry.
func TestAcquireBreakdownMetrics(t *testing.T) {
	tc := newTestCluster(t, 3)
	f, l := tc.follower(), tc.leader()
	alloc, _ := tc.clients(f)
	if _, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{
		AgentId: "m1", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "dora", 3)},
	}); err != nil {
		t.Fatal(err)
	}
	fm, lm := tc.node(f).metrics, tc.node(l).metrics
	for name, h := range map[string]prometheus.Observer{
		"follower acquire_seconds{path=forwarded}": fm.acquireLatency.WithLabelValues("forwarded"),
		"follower forward_seconds":                 fm.forwardLatency,
		"leader acquire_seconds{path=local}":       lm.acquireLatency.WithLabelValues("local"),
		"leader batch_queue_seconds":               lm.batchQueue,
		"leader raft_apply_seconds":                lm.applyLatency,
		"leader raft_commit_seconds":               lm.raftCommit,
		"leader fsm_apply_seconds{type=acquire}":   lm.fsmApply.WithLabelValues("acquire"),
	} {
		if n := histCount(t, h.(prometheus.Histogram)); n == 0 {
			t.Errorf("%s: no observation after one forwarded Acquire", name)
		}
	}
	if n := histCount(t, lm.acquireLatency.WithLabelValues("forwarded").(prometheus.Histogram)); n != 0 {
		t.Errorf("leader acquire_seconds{path=forwarded} has %d observations, want 0 (the leader serves locally)", n)
	}
	// The follower applies the entry when it learns the commit index (the
	// next append or heartbeat).
	waitFor(t, 10*time.Second, "the follower to apply the acquire entry", func() bool {
		return histCount(t, fm.fsmApply.WithLabelValues("acquire").(prometheus.Histogram)) > 0 &&
			histCount(t, fm.raftCommit) > 0
	})
}
