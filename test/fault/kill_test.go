package fault

import (
	"testing"
	"time"
)

// recoveryBound is the stated recovery time for a node kill: a new leader
// is elected in ~1 s with the default 500/500/500 ms Raft timeouts
// (docs/performance.md); agents probe again within their breaker's 2 s
// maximum backoff.
const recoveryBound = 10 * time.Second

// TestLeaderKill: kill -9 of the allocator leader under load through two
// gateways, with linearizability clients on their own key. Zero 5xx,
// admission within the bound, the gateways lease again within
// recoveryBound, the killed node rejoins, and the Acquire/Release history
// is linearizable.
func TestLeaderKill(t *testing.T) { runKill(t, true, 1) }

// TestFollowerKill: the same with a follower: the agents rotate to another
// node; no breaker should open at all.
func TestFollowerKill(t *testing.T) { runKill(t, false, 1) }

// runKill kills the leader (with groups: the node that leads the most
// data groups) or a follower, with groups data groups and the allocators'
// extra flags args.
func runKill(t *testing.T, leader bool, groups int, args ...string) {
	checkLeaks(t)
	e := newEnv(t, envConfig{groups: groups, args: args})
	e.gateway("gw-a", e.c.GRPCAddrs())
	e.gateway("gw-b", e.c.GRPCAddrs())
	lin := e.startLin(4)
	e.startLoad(200, 4)
	e.waitLeasing()
	e.runFor(2 * time.Second)

	n := e.liveAgents()
	lead := e.c.Leader(t, 10*time.Second)
	var led []int
	if groups > 1 {
		lead, led = e.leaderOfMost(e.waitGroupLeaders(10 * time.Second))
	}
	victim := lead
	if !leader {
		victim = e.c.Followers(lead.ID)[0]
	}
	okBefore := e.sample(mCallsOK)
	openBefore := e.sample(mToOpen)
	t.Logf("killing %s (leader %s, of data groups %v) with %d live agents", victim.ID, lead.ID, led, n)
	killed := time.Now()
	victim.Proc.Kill()

	rec := e.waitRecovered(allGateways(len(e.gws)), okBefore, killed, recoveryBound)
	if leader {
		e.c.Leader(t, recoveryBound) // a new one
	}
	if groups > 1 {
		e.waitGroupLeaders(recoveryBound)
		t.Logf("every data group led by a live node %v after the kill", time.Since(killed))
	}
	t.Logf("gateways leasing again %v after the kill", rec)
	e.runFor(2 * time.Second)

	// The killed node restarts on its data dir and catches up.
	victim.Proc.Start(t)
	e.c.WaitReady(t, 30*time.Second)
	if groups > 1 {
		// …and leads data groups again.
		e.waitSpread(30 * time.Second)
	}
	e.runFor(2 * time.Second)

	ops := lin.stop()
	opened := 0
	for i, v := range e.sample(mToOpen) {
		opened += int(v - openBefore[i])
	}
	rep := &report{recovery: rec}
	if leader {
		rep.fault = "kill -9 of the leader (3 nodes)"
		if groups > 1 {
			rep.fault = "kill -9 of the node leading the most data groups (3 nodes)" + groupsNote(groups)
		}
		rep.bound = "B+R·T + B + per breaker opening ⌈B/N⌉ + R·T_open/N"
		e.logFirstGrants(ops, killed, victim.ID, led, "the new leader", "the kill")
	} else {
		rep.fault = "kill -9 of a follower"
		rep.bound = "B+R·T + B + per breaker opening ⌈B/N⌉+R·T_open/N (none expected: agents rotate)"
		if opened > 0 {
			// Not a failure: the agents rotate past a dead node, so a
			// breaker opens only when calls to the live ones time out too
			// (a commit slower than the agent's 200 ms CallTimeout, seen
			// on an overloaded machine); the bound covers it.
			t.Logf("note: breakers opened %d times after a follower's kill (slow commits?)", opened)
		}
	}
	e.checkLoad(rep, n)
	e.checkLin(ops)
	if groups > 1 {
		e.checkLeasesEnd(lin)
	}
	rep.log(t)
}
