package fault

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"

	"github.com/allot/allot/allocator/raftmux"
	"github.com/allot/allot/internal/faultnet"
	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
	"github.com/allot/allot/test/linearizability"
)

// raftSender names the sender of a hashicorp/raft NetworkTransport
// connection made through a raftmux.Mux: an optional group header (when
// the first byte is raftmux.Tagged; group 0 sends none), then the first
// RPC's type byte, then a msgpack map whose RPCHeader fields (inlined)
// carry the sender's server ID. Every RPC type (AppendEntries,
// RequestVote, RequestPreVote, InstallSnapshot, TimeoutNow) starts with
// the header, and a pooled connection carries only its dialer's RPCs of
// one group. The name is the node's, whatever the group, so Isolate cuts
// all of a node's groups.
func raftSender(r io.Reader) (string, error) {
	var hdr [raftmux.HeaderLen]byte
	if _, err := io.ReadFull(r, hdr[:1]); err != nil {
		return "", err
	}
	if raftmux.Tagged(hdr[0]) {
		if _, err := io.ReadFull(r, hdr[1:]); err != nil {
			return "", err
		}
		if _, err := raftmux.ParseHeader(hdr[:]); err != nil {
			return "", err
		}
		// The RPC type follows the header.
		if _, err := io.ReadFull(r, hdr[:1]); err != nil {
			return "", err
		}
	}
	var rpc struct{ ID []byte }
	if err := codec.NewDecoder(r, &codec.MsgpackHandle{}).Decode(&rpc); err != nil {
		return "", err
	}
	if len(rpc.ID) == 0 {
		return "", errors.New("fault: raft RPC without a sender id")
	}
	return string(rpc.ID), nil
}

// TestAllocatorIsolated: the leader is cut off from its peers, both ways,
// while agents and gateways still reach every node's gRPC port.
//
// Every node advertises (-advertise-raft-addr) a faultnet proxy in front of
// its Raft port, so all Raft traffic goes through the proxies. One proxy
// per destination cannot cut one node's outgoing traffic alone, so each
// proxy identifies the sending node from the Raft RPC header (raftSender)
// and isolates it.
//
// The minority side must grant nothing: no Acquire answered with the old
// leader's id may carry a stamp after the isolation (it could not have
// been committed), a client pinned to the isolated node gets no answer
// until the heal, the majority elects a leader and keeps granting, and the
// whole Acquire/Release history is linearizable. After the heal the node
// catches up. The isolation lasts 3 s past the election (30 s with
// ALLOT_SOAK=1).
func TestAllocatorIsolated(t *testing.T) { runIsolated(t, 1) }

// runIsolated isolates the leader with groups data groups (with groups:
// the node that leads the most data groups, the probe on a key of a group
// it leads).
func runIsolated(t *testing.T, groups int) {
	checkLeaks(t)
	// A proxy in front of every node's Raft port; the nodes know each other
	// only by the proxies' addresses.
	var proxies []*faultnet.Proxy
	var args []string
	if groups > 1 {
		// The probe pinned to the isolated node is silent from the
		// isolation to the heal, longer with groups (every group elects,
		// then the leaders are spread again). An allocator answers a retry
		// from its record only while it remembers the agent: past the agent
		// TTL (6 s, FastLeaseArgs) the probe's retry of a call the majority
		// committed is applied anew, a second time, which the model does not
		// allow (docs/architecture.md, invariant (b)).
		args = []string{"-agent-ttl", "30s"}
	}
	e := newEnv(t, envConfig{groups: groups, args: args, advertise: func(i int, raftBind string) string {
		p, err := faultnet.New(faultnet.Config{Target: raftBind, Identify: raftSender})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		proxies = append(proxies, p)
		return p.Addr()
	}})
	lead := e.c.Leader(t, 10*time.Second)
	var led []int
	if groups > 1 {
		lead, led = e.leaderOfMost(e.waitGroupLeaders(10 * time.Second))
	}
	for i, n := range e.c.Nodes {
		if n == lead {
			continue
		}
		testproc.Eventually(t, 10*time.Second, n.ID+"'s proxy carrying the leader's Raft traffic", func() bool {
			return proxies[i].Senders()[lead.ID] > 0 && proxies[i].Stats().Forwarded[faultnet.ToTarget] > 0
		})
	}

	e.gateway("gw-a", e.c.GRPCAddrs())
	e.gateway("gw-b", e.c.GRPCAddrs())
	var pin atomic.Int64
	pin.Store(-1)
	probe := &linearizability.Client{Agent: "probe", Seed: 1, Pin: func() int { return int(pin.Load()) }}
	if groups > 1 {
		// A key of a group the isolated node will lead: of another group,
		// it would forward the probe's calls to that group's leader over
		// gRPC, which the isolation leaves alone.
		probe.Key, probe.Entries = e.linKey(led[0])
	}
	lin := e.startLin(4, probe)
	e.startLoad(200, 4)
	e.waitLeasing()
	e.runFor(2 * time.Second)

	n := e.liveAgents()
	if groups > 1 {
		// The probe's group must still be led by the node to isolate (an
		// election on a loaded machine may have moved it): hand it back.
		var v groupsView
		testproc.Eventually(t, 20*time.Second, fmt.Sprintf("%s leading group %d", lead.ID, led[0]), func() bool {
			v = e.waitGroupLeaders(10 * time.Second)
			if v.leader[led[0]] == lead.ID {
				return true
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := e.c.Running()[0].Admin(t).TransferLeadership(ctx, &allotv1.TransferLeadershipRequest{Id: lead.ID, Group: uint32(led[0])})
			t.Logf("group %d led by %s, not %s: handing it back: %v", led[0], v.leader[led[0]], lead.ID, err)
			return false
		})
		led = v.ledByNode(lead.ID)
	} else {
		lead = e.c.Leader(t, 10*time.Second)
	}
	x := indexOf(e.c, lead)
	okBefore := e.sample(mCallsOK)
	pin.Store(int64(x))
	for i, p := range proxies {
		if i != x {
			p.Isolate(lead.ID)
		}
	}
	proxies[x].Partition()
	isolated := time.Now()
	t.Logf("isolated the leader %s (of data groups %v) from its peers (%d live agents)", lead.ID, led, n)

	// Poll both sides: the old leader stepping down (its leader lease) and
	// the majority electing a new one. With groups: in every group.
	var newLeader string
	var newGroups groupsView
	var steppedDown, elected time.Duration
	testproc.Eventually(t, recoveryBound, "a new leader on the majority side and the old one stepping down", func() bool {
		if steppedDown == 0 {
			if st, err := lead.Status(t); err == nil && st.GetState() != "leader" && (groups <= 1 || e.leadsNone(lead, led)) {
				steppedDown = time.Since(isolated)
			}
		}
		if elected == 0 {
			for _, f := range e.c.Followers(lead.ID) {
				st, err := f.Status(t)
				if err != nil || st.GetLeaderId() == "" || st.GetLeaderId() == lead.ID {
					continue
				}
				if groups > 1 {
					v, err := e.groupsOf(f)
					if err != nil || !v.ledElsewhere(lead.ID) {
						continue
					}
					newGroups = v
				}
				newLeader, elected = st.GetLeaderId(), time.Since(isolated)
			}
		}
		return steppedDown > 0 && elected > 0
	})
	rec := e.waitRecovered(allGateways(len(e.gws)), okBefore, isolated, recoveryBound)
	t.Logf("new leader %s elected %v after the isolation; %s stepped down after %v; gateways leasing %v after",
		newLeader, elected, lead.ID, steppedDown, rec)
	hold := 3 * time.Second
	if soak() {
		hold = 30 * time.Second
	}
	e.runFor(hold)

	healed := time.Now()
	pin.Store(-1)
	proxies[x].Heal()
	for i, p := range proxies {
		if i != x {
			p.Rejoin(lead.ID)
		}
	}
	// The isolated node catches up with the majority's log.
	st, err := e.c.ByID(newLeader).Status(t)
	if err != nil {
		t.Fatal(err)
	}
	target := st.GetCommitIndex()
	testproc.Eventually(t, 20*time.Second, lead.ID+" catching up", func() bool {
		s, err := lead.Status(t)
		return err == nil && s.GetAppliedIndex() >= target && s.GetLeaderId() != ""
	})
	if groups > 1 {
		// … in every data group, with the log of the group's new leader.
		for g := 1; g <= groups; g++ {
			v, err := e.groupsOf(e.c.ByID(newGroups.leader[g]))
			if err != nil {
				t.Fatal(err)
			}
			testproc.Eventually(t, 20*time.Second, fmt.Sprintf("%s catching up in group %d", lead.ID, g), func() bool {
				w, err := e.groupsOf(lead)
				return err == nil && w.applied[g] >= v.commit[g] && w.leader[g] != ""
			})
		}
	}
	rejoin := time.Since(healed)
	t.Logf("%s caught up %v after the heal", lead.ID, rejoin)
	for i, p := range proxies {
		if i != x && p.Stats().Dropped[faultnet.ToTarget] == 0 {
			t.Errorf("proxy of %s dropped nothing of %s's traffic: the partition did not bite", e.c.Nodes[i].ID, lead.ID)
		}
	}
	e.runFor(2 * time.Second)

	ops := lin.stop()
	isoMs, healMs := isolated.UnixMilli(), healed.UnixMilli()
	probeDuring, probeBlocked := 0, 0
	for _, op := range ops {
		if op.Agent == "probe" && op.Call/1e6 < healMs-1000 && op.Return/1e6 >= healMs {
			probeBlocked++ // pinned to the isolated node, answered only after the heal
		}
		// With groups, the healed node soon leads groups again (the
		// leaders are spread) and answers a retry of a call another leader
		// applied during the isolation from the group's record: the
		// applying leader's stamp with its own id (invariant (b)). Only
		// its answers before the heal count.
		if op.Kind == linearizability.Acquire && op.Leader == lead.ID && op.NowMs > isoMs && op.NowMs < healMs &&
			(groups <= 1 || op.Return/1e6 < healMs) {
			t.Errorf("granted by the isolated node without quorum: %v (leader %s, call %d ms, return %d ms)", op, op.Leader, op.Call/1e6, op.Return/1e6)
		}
		// An Acquire the node applied just before the isolation may be
		// answered just after it (its stamp tells): not counted.
		if op.Agent == "probe" && op.Return/1e6 > isoMs && op.Return/1e6 < healMs && op.Node == lead.ID &&
			(op.Kind == linearizability.Release || op.NowMs >= isoMs) {
			probeDuring++
			t.Logf("probe answered by the isolated node: %v (leader %s, call %d ms, return %d ms; isolated at %d ms)",
				op, op.Leader, op.Call/1e6, op.Return/1e6, isoMs)
		}
	}
	if groups > 1 {
		// No group's leader was asked to hand its leadership to the
		// isolated node while its Raft traffic was cut (its gRPC port
		// still answered): hashicorp/raft refuses the group's writes while
		// such a transfer is in progress, up to the transport's timeout.
		for _, n := range e.c.Nodes {
			for _, line := range logBetween(n.Proc.Output(), isolated, healed) {
				if strings.Contains(line, "leadership") && strings.Contains(line, " to="+lead.ID+" ") {
					t.Errorf("%s, during the isolation: %s", n.ID, line)
				}
			}
		}
	}
	if probeDuring > 0 {
		t.Errorf("the isolated node answered the probe %d times during the isolation", probeDuring)
	}
	if probeBlocked == 0 {
		t.Errorf("the probe pinned to the isolated node never waited on it")
	}
	rep := &report{
		fault:    isolatedFault(groups),
		bound:    "minority grants nothing; B+R·T + B + per breaker opening ⌈B/N⌉ + R·T_open/N",
		recovery: rec,
	}
	e.checkLoad(rep, n)
	e.logFirstGrants(ops, isolated, lead.ID, led, "the majority's leader", "the isolation")
	e.checkLin(ops)
	if groups > 1 {
		e.checkLeasesEnd(lin)
	}
	rep.log(t)
}

func indexOf(c *testproc.Cluster, n *testproc.Node) int {
	for i, m := range c.Nodes {
		if m == n {
			return i
		}
	}
	return -1
}

func isolatedFault(groups int) string {
	if groups > 1 {
		return "the node leading the most data groups cut off from its peers (Raft proxies, both ways)" + groupsNote(groups)
	}
	return "leader cut off from its peers (Raft proxies, both ways)"
}
