package fault

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// TestStaticShares: three gateways against allocators with static shares
// (-static-slots 4, docs/static-shares.md), cold keys well under their
// share at every gateway and hot keys driven past their limit, with a
// kill -9 of the leader in the middle. The cold keys are decided from
// static shares: every request answered, none denied, and far fewer keys
// sent to the allocator than requests admitted. The hot keys are promoted
// and leased. Every key stays within the bound of the other fault tests.
func TestStaticShares(t *testing.T) {
	checkLeaks(t)
	e := newEnv(t, envConfig{args: []string{"-static-slots", "4", "-static-ttl", "1s"}})
	for _, name := range []string{"gw-a", "gw-b", "gw-c"} {
		e.gateway(name, e.c.GRPCAddrs())
	}
	proxies := make([]string, len(e.gws))
	for i, g := range e.gws {
		proxies[i] = g.Proxy
	}
	prefix := strings.ToLower(t.Name())
	// Cold: 300 keys at 0.5 requests/s each, about 0.17/s at each
	// gateway, against a share of 5/s (R = 20/s over 4 slots), burst 5.
	var cold []string
	for i := range 300 {
		cold = append(cold, fmt.Sprintf("%s-cold%d", prefix, i))
	}
	// Hot: 3 keys at 50 requests/s each, over their 20/s.
	e.keys = []string{prefix + "-hot0", prefix + "-hot1", prefix + "-hot2"}
	// A warm-up key makes every gateway call the allocator and take a
	// slot; keys a gateway first sees before it holds one stay ordinary.
	warm := &testproc.Load{Proxies: proxies, Keys: []string{prefix + "-warm"}, Rate: 30}
	warm.Start()
	t.Cleanup(warm.Stop)
	for _, g := range e.gws {
		testproc.Eventually(t, 30*time.Second, g.Name+" holding a static slot", func() bool {
			return g.Metric(`allot_agent_static_slots`) == 4
		})
	}
	warm.Stop()
	coldLoad := &testproc.Load{Proxies: proxies, Keys: cold, Rate: 150}
	e.load = &testproc.Load{Proxies: proxies, Keys: e.keys, Rate: 150}
	for _, l := range []*testproc.Load{coldLoad, e.load} {
		l.Start()
		t.Cleanup(l.Stop)
	}
	e.breakers = e.watchBreakers()
	e.waitLeasing()
	keysBefore := e.sample(`allot_agent_acquire_keys_total`)
	staticBefore := e.sample(`allot_agent_decisions_total{result="allowed",source="static"}`)
	coldFrom := len(coldLoad.Results())
	e.runFor(3 * time.Second)

	// Before the kill: the cold keys are decided from static shares.
	rs := coldLoad.Results()
	tally := testproc.Count(rs[coldFrom:], nil)
	t.Logf("cold load, 3 s before the kill: %d requests: %d × 200, %d × 429, %d other", tally.Total, tally.OK, tally.Denied, tally.Total-tally.OK-tally.Denied)
	if tally.OK == 0 || tally.OK != tally.Total {
		t.Errorf("cold keys: %d of %d requests admitted; want all", tally.OK, tally.Total)
	}
	var static, promoted, sent float64
	keysAfter := e.sample(`allot_agent_acquire_keys_total`)
	staticAfter := e.sample(`allot_agent_decisions_total{result="allowed",source="static"}`)
	for i, g := range e.gws {
		static += staticAfter[i] - staticBefore[i]
		promoted += g.Metric(`allot_agent_static_promotions_total`)
		sent += keysAfter[i] - keysBefore[i]
	}
	t.Logf("static decisions %.0f, promotions %.0f, keys sent to the allocator %.0f while %d cold requests were admitted", static, promoted, sent, tally.OK)
	if static < float64(tally.OK)*9/10 {
		t.Errorf("%.0f static decisions for %d cold admissions: the cold keys were not decided from static shares", static, tally.OK)
	}
	if promoted == 0 {
		t.Error("no promotion: the hot keys were never coordinated")
	}
	// No cold key was ever coordinated: the hot-key set holds the three
	// hot keys and the warm-up key, and no more.
	for _, g := range e.gws {
		if hot := g.Metric(`allot_agent_static_hot_keys`); hot > 4 {
			t.Errorf("%s: %.0f hot keys; want at most the 3 hot keys and the warm-up key", g.Name, hot)
		}
	}

	n := e.liveAgents()
	lead := e.c.Leader(t, 10*time.Second)
	okBefore := e.sample(mCallsOK)
	killed := time.Now()
	t.Logf("killing the leader %s with %d live agents", lead.ID, n)
	lead.Proc.Kill()
	rec := e.waitRecovered(allGateways(len(e.gws)), okBefore, killed, recoveryBound)
	t.Logf("gateways leasing again %v after the kill", rec)
	e.runFor(3 * time.Second)
	coldLoad.Stop()
	if all := testproc.Count(coldLoad.Results(), nil); all.FiveXX+all.Transport+all.Other != 0 {
		t.Errorf("cold load: %d × 5xx, %d transport errors, %d other codes; want none", all.FiveXX, all.Transport, all.Other)
	}
	rep := &report{recovery: rec, fault: "kill -9 of the leader, static shares (4 slots)",
		bound: "B+R·T + B + per breaker opening ⌈B/N⌉ + R·T_open/N"}
	e.checkLoad(rep, n)
	rep.log(t)
}
