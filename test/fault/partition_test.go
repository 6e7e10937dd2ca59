package fault

import (
	"context"
	"math"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/internal/faultnet"
	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestAgentPartition: gateway A reaches the allocators only through
// faultnet proxies; they black-hole all its traffic for 5 s (30 s with
// ALLOT_SOAK=1), then heal. Gateway B stays connected. A's breaker opens
// and it decides from its fallback buckets: during the cut it admits, per
// key, at most what it held plus its fallback share ⌈B/N⌉ + R·T/N; B is
// unaffected. After the heal A leases again and the keys are held to their
// rate again. Zero 5xx throughout.
func TestAgentPartition(t *testing.T) {
	checkLeaks(t)
	cut := 5 * time.Second
	if soak() {
		cut = 30 * time.Second
	}
	e := newEnv(t, envConfig{})
	var proxies []*faultnet.Proxy
	var via []string
	for _, n := range e.c.Nodes {
		p, err := faultnet.Listen(n.GRPC)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		proxies = append(proxies, p)
		via = append(via, p.Addr())
	}
	e.gateway("gw-a", via)
	e.gateway("gw-b", e.c.GRPCAddrs())
	e.startLoad(200, 4)
	e.waitLeasing()
	e.runFor(2 * time.Second)

	n := e.liveAgents()
	okBefore := e.sample(mCallsOK)
	bLease := e.gws[1].Metric(mLeaseAllowed)
	cutAt := time.Now()
	for _, p := range proxies {
		p.Partition()
	}
	// What A holds now is what it may spend on top of its fallback bucket.
	held := heldBy(t, e, "gw-a")
	t.Logf("gw-a cut off with %d live agents; it holds %v", n, held)
	testproc.Eventually(t, 5*time.Second, "gw-a's fallback to engage", func() bool { return e.gws[0].Metric(mFallback) == 1 })
	engaged := time.Since(cutAt)
	e.runFor(cut)
	// gw-b, still connected, kept leasing. (Not "its breaker never
	// opened": on a loaded machine three commits slower than the agent's
	// 200 ms call timeout open it for a moment; the bound counts that.)
	if v := e.gws[1].Metric(mLeaseAllowed); v < bLease+keyRate*cut.Seconds()/2 {
		t.Errorf("gw-b, still connected, admitted %v from leases during the %v cut", v-bLease, cut)
	}
	healAt := time.Now()
	for _, p := range proxies {
		p.Heal()
	}
	rec := e.waitRecovered([]int{0}, okBefore, healAt, recoveryBound)
	t.Logf("fallback engaged %v after the cut; leasing again %v after the heal", engaged, rec)

	// Enforcement: from 1 s after recovery, each key is held to B + R·W
	// (the bucket, possibly full after the cut) plus one fallback burst.
	e.runFor(time.Second)
	from := time.Now().UnixNano()
	e.runFor(3 * time.Second)

	rs := e.load.Results()
	cutNs, healNs := cutAt.UnixNano(), healAt.UnixNano()
	span := healAt.Sub(cutAt)
	worstCut := math.Inf(-1)
	for k, key := range e.keys {
		during := testproc.Count(rs, func(r testproc.Request) bool {
			return r.Gateway == 0 && r.Key == k && r.Start >= cutNs && r.End <= healNs
		})
		bound := float64(held[key]) + math.Ceil(float64(keyBurst)/float64(n)) + math.Ceil(keyRate*span.Seconds()/float64(n))
		t.Logf("key %s: gw-a admitted %d during the %.1fs cut; bound held %d + ⌈B/N⌉ + R·T/N = %.0f",
			key, during.OK, span.Seconds(), held[key], bound)
		if float64(during.OK) > bound {
			t.Errorf("key %s: gw-a admitted %d while cut off, bound %.0f", key, during.OK, bound)
		}
		worstCut = max(worstCut, float64(during.OK)-bound)

		after := testproc.Count(rs, func(r testproc.Request) bool { return r.Key == k && r.Start >= from })
		first, last := testproc.Span(filter(rs, func(r testproc.Request) bool { return r.Start >= from }))
		w := time.Duration(last - first).Seconds()
		limit := 2*keyBurst + keyRate*w
		if float64(after.OK) > limit {
			t.Errorf("key %s after recovery: admitted %d in %.1fs > 2B + R·W = %.0f", key, after.OK, w, limit)
		}
	}
	rep := &report{
		fault:    "gateway cut off from every allocator for " + cut.String() + ", then healed",
		bound:    "cut-off agent, per key: held + ⌈B/N⌉ + R·T_cut/N; whole run B+R·T + B + per breaker opening ⌈B/N⌉ + R·T_open/N",
		recovery: rec,
	}
	e.checkLoad(rep, n)
	t.Logf("worst key during the cut: %+.0f vs its bound", worstCut)
	rep.log(t)
}

// heldBy returns, per API key of the load, the tokens the allocator
// records agent as holding.
func heldBy(t *testing.T, e *env, agent string) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, k := range e.keys {
		out[k] = 0
	}
	n := e.c.Leader(t, 10*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// Raw keys: the cluster has no authentication, so any caller that asks
	// is an admin (allocator.ShowKeysMetadata).
	ctx = metadata.AppendToOutgoingContext(ctx, "x-allot-show-keys", "1")
	resp, err := n.Admin(t).ListLeases(ctx, &allotv1.ListLeasesRequest{AgentId: agent, PageSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range resp.GetLeases() {
		for _, k := range e.keys {
			if l.GetKey() == "fault:api_key="+k {
				out[k] += l.GetTokens()
			}
		}
	}
	return out
}

func filter(rs []testproc.Request, keep func(testproc.Request) bool) []testproc.Request {
	var out []testproc.Request
	for _, r := range rs {
		if keep(r) {
			out = append(out, r)
		}
	}
	return out
}
