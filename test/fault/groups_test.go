package fault

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
	"github.com/allot/allot/test/linearizability"
)

// The -groups 4 variants of the scenarios that tell most about the
// groups: kill -9 of the node that leads the most data groups, that node
// cut off from its peers, a full-cluster restart and a full outage. Each
// group is its own Raft instance with its own log, state machine and
// snapshots, so each scenario checks invariants (a)–(d) group by group:
// the linearizability clients have a key in every data group and every
// group's history is checked with porcupine on its own (a, b, d); the
// load's keys cover every group and each is held to the documented
// bound (a, d); the clients' leases end in every group once they stop
// (c); a restart brings every group's state back from its own snapshot
// and log under groups/<id>/ (b, d).

// testGroups is the number of data groups of the -groups variants.
const testGroups = 4

// TestLeaderKillGroups: TestLeaderKill on a -groups 4 cluster, killing the
// node that leads the most data groups. Every group has a live leader
// within recoveryBound, the gateways lease again, the killed node rejoins
// and leads groups again, and every group's history is linearizable.
func TestLeaderKillGroups(t *testing.T) { runKill(t, true, testGroups) }

// TestAllocatorIsolatedGroups: TestAllocatorIsolated on a -groups 4
// cluster, cutting off the node that leads the most data groups: no group
// it led grants anything without quorum, every group has a leader on the
// majority side, the node catches up in every group after the heal.
func TestAllocatorIsolatedGroups(t *testing.T) { runIsolated(t, testGroups) }

// TestFullClusterRestartGroups: TestFullClusterRestart on a -groups 4
// cluster, with the frozen agent holding a slow key in every data group:
// every group's lease, bucket and idempotency record come back from that
// group's own snapshot and log.
func TestFullClusterRestartGroups(t *testing.T) { runFullRestart(t, testGroups) }

// TestFullClusterOutageNoSecondBurstGroups:
// TestFullClusterOutageNoSecondBurst on a -groups 4 cluster with a key in
// every data group: no group hands out a second burst.
func TestFullClusterOutageNoSecondBurstGroups(t *testing.T) { runOutage(t, testGroups) }

// groupsView is one node's view of the data groups.
type groupsView struct {
	node    string
	leader  map[int]string // data group → its leader's id ("" none)
	state   map[int]string // the answering node's Raft state in the group
	applied map[int]uint64 // … its applied index
	commit  map[int]uint64 // … its commit index
	slots   slots.Map
}

// ledBy counts the data groups each node leads.
func (v groupsView) ledBy() map[string]int {
	out := map[string]int{}
	for _, l := range v.leader {
		if l != "" {
			out[l]++
		}
	}
	return out
}

// groupsOf asks n for the cluster's groups.
func (e *env) groupsOf(n *testproc.Node) (groupsView, error) {
	st, err := n.Status(e.t)
	if err != nil {
		return groupsView{}, err
	}
	v := groupsView{node: n.ID, leader: map[int]string{}, state: map[int]string{},
		applied: map[int]uint64{}, commit: map[int]uint64{}}
	var runs []string
	for _, g := range st.GetGroups() {
		if g.GetId() == 0 {
			continue
		}
		id := int(g.GetId())
		v.leader[id], v.state[id] = g.GetLeaderId(), g.GetState()
		v.applied[id], v.commit[id] = g.GetAppliedIndex(), g.GetCommitIndex()
		rs, err := slots.ParseRanges(g.GetSlots())
		if err != nil {
			return groupsView{}, fmt.Errorf("group %d's slots %q: %w", id, g.GetSlots(), err)
		}
		for _, r := range rs {
			runs = append(runs, fmt.Sprintf("%v=%d", r, id))
		}
	}
	if len(v.leader) != e.groups {
		return groupsView{}, fmt.Errorf("%s reports %d data groups, want %d", n.ID, len(v.leader), e.groups)
	}
	if v.slots, err = slots.ParseMap(st.GetTopologyVersion(), strings.Join(runs, ",")); err != nil {
		return groupsView{}, fmt.Errorf("%s's slot map: %w", n.ID, err)
	}
	return v, nil
}

// groupLeaders returns a running node's view of the data groups when it
// reports every group led by a running node.
func (e *env) groupLeaders() (groupsView, bool) {
	for _, n := range e.c.Running() {
		v, err := e.groupsOf(n)
		if err != nil {
			continue
		}
		ok := true
		for _, l := range v.leader {
			if m := e.c.ByID(l); m == nil || !m.Proc.Running() {
				ok = false
			}
		}
		if ok {
			return v, true
		}
	}
	return groupsView{}, false
}

// waitGroupLeaders waits until a running node reports every data group
// led by a running node, and returns its view.
func (e *env) waitGroupLeaders(within time.Duration) groupsView {
	e.t.Helper()
	var v groupsView
	testproc.Eventually(e.t, within, "every data group led by a running node", func() bool {
		var ok bool
		v, ok = e.groupLeaders()
		return ok
	})
	return v
}

// waitSpread waits until the data groups' leaders are spread over the
// running nodes (each leads ⌊G/N⌋ or ⌈G/N⌉), and records the slot map.
func (e *env) waitSpread(within time.Duration) groupsView {
	e.t.Helper()
	var v groupsView
	running := e.c.Running()
	lo, hi := e.groups/len(running), (e.groups+len(running)-1)/len(running)
	testproc.Eventually(e.t, within, "the data groups' leaders spread over the nodes", func() bool {
		var ok bool
		if v, ok = e.groupLeaders(); !ok {
			return false
		}
		led := v.ledBy()
		for _, n := range running {
			if led[n.ID] < lo || led[n.ID] > hi {
				return false
			}
		}
		return true
	})
	e.owner = v.slots
	return v
}

// leaderOfMost is the running node that leads the most data groups in v,
// and the groups it leads.
func (e *env) leaderOfMost(v groupsView) (*testproc.Node, []int) {
	led := v.ledBy()
	var best *testproc.Node
	for _, n := range e.c.Running() {
		if best == nil || led[n.ID] > led[best.ID] {
			best = n
		}
	}
	return best, v.ledByNode(best.ID)
}

// ledByNode returns the data groups node leads, in id order.
func (v groupsView) ledByNode(node string) []int {
	var gs []int
	for g := 1; g <= len(v.leader); g++ {
		if v.leader[g] == node {
			gs = append(gs, g)
		}
	}
	return gs
}

// groupOfKey is the data group that owns a canonical budget key.
func (e *env) groupOfKey(key string) int {
	return int(e.owner.Owner(slots.OfKey(key)))
}

// keysPerGroup returns per values prefix0, prefix1, … for every data group
// (group 1's first), each the value of a canonical key canon+value that
// the group owns.
func (e *env) keysPerGroup(canon, prefix string, per int) []string {
	byGroup := make([][]string, e.groups+1)
	need := per * e.groups
	for i := 0; need > 0; i++ {
		v := fmt.Sprintf("%s%d", prefix, i)
		if g := e.groupOfKey(canon + v); g >= 1 && g <= e.groups && len(byGroup[g]) < per {
			byGroup[g] = append(byGroup[g], v)
			need--
		}
	}
	var out []string
	for _, vs := range byGroup {
		out = append(out, vs...)
	}
	return out
}

// linKey is the linearizability clients' key in data group g: its
// canonical key and its entries.
func (e *env) linKey(g int) (string, []*allotv1.Entry) {
	vs := e.keysPerGroup("lin:k=", strings.ToLower(e.t.Name())+"-", 1)
	return "lin:k=" + vs[g-1], []*allotv1.Entry{{Key: "k", Value: vs[g-1]}}
}

// splitByGroup splits a history by the data group that owns each op's
// key.
func (e *env) splitByGroup(ops []linearizability.Op) map[int][]linearizability.Op {
	out := map[int][]linearizability.Op{}
	for _, op := range ops {
		g := e.groupOfKey(op.Key)
		out[g] = append(out[g], op)
	}
	return out
}

// checkLeasesEnd checks invariant (c) in every data group: once the
// linearizability clients have stopped, the leases the allocator records
// in the lin domain end within the longest lease TTL (4 s, FastLeaseArgs)
// plus two expiry intervals and 3 s for a commit, which may wait on a
// leadership change (the leaders are spread again after a fault) on a
// loaded machine; it logs how many tokens each group held, and the leases
// left when they do not end.
func (e *env) checkLeasesEnd(l *linRun) {
	t := e.t
	t.Helper()
	leases := func() ([]*allotv1.Lease, error) {
		n := e.c.Running()[0]
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		ctx = metadata.AppendToOutgoingContext(ctx, "x-allot-show-keys", "1")
		var out []*allotv1.Lease
		req := &allotv1.ListLeasesRequest{Domain: "lin", PageSize: 1000}
		for {
			resp, err := n.Admin(t).ListLeases(ctx, req)
			if err != nil {
				return nil, err
			}
			out = append(out, resp.GetLeases()...)
			if resp.GetNextPageToken() == "" {
				return out, nil
			}
			req.PageToken = resp.GetNextPageToken()
		}
	}
	stopped := l.stopped
	at, err := leases()
	if err != nil {
		t.Fatal(err)
	}
	byGroup := map[int]int64{}
	for _, l := range at {
		byGroup[e.groupOfKey(l.GetKey())] += l.GetTokens()
	}
	t.Logf("leases of the stopped linearizability clients, tokens by group: %v", byGroup)
	const within = 4*time.Second + 2*200*time.Millisecond + 3*time.Second
	var left []*allotv1.Lease
	deadline := time.Now().Add(3 * within)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for ; ; <-tick.C {
		if left, err = leases(); err == nil && len(left) == 0 {
			break
		}
		if time.Now().After(deadline) {
			for _, l := range left {
				t.Logf("left: group %d: %s %s %d tokens, granted at %d, expires in %d ms",
					e.groupOfKey(l.GetKey()), l.GetAgentId(), l.GetKey(), l.GetTokens(), l.GetGrantedUnixMs(), l.GetExpiresInMs())
			}
			t.Fatalf("%d leases of the stopped clients left %v after they stopped (err %v)", len(left), time.Since(stopped), err)
		}
	}
	if took := time.Since(stopped); took > within {
		t.Errorf("the stopped clients' leases ended %v after they stopped, want ≤ %v", took, within)
	}
}

// leadsNone reports whether n, asked itself, is the leader of none of gs.
func (e *env) leadsNone(n *testproc.Node, gs []int) bool {
	v, err := e.groupsOf(n)
	if err != nil {
		return false
	}
	for _, g := range gs {
		if v.state[g] == "leader" {
			return false
		}
	}
	return true
}

// ledElsewhere reports whether every data group has a leader other than
// node.
func (v groupsView) ledElsewhere(node string) bool {
	for _, l := range v.leader {
		if l == "" || l == node {
			return false
		}
	}
	return true
}

// groupsNote tells a report line apart for a cluster with groups.
func groupsNote(groups int) string {
	if groups > 1 {
		return fmt.Sprintf(", -groups %d", groups)
	}
	return ""
}

// logBetween returns the lines of an allocator's log (text format) stamped
// within [from, to].
func logBetween(log string, from, to time.Time) []string {
	var out []string
	for line := range strings.Lines(log) {
		stamp, ok := strings.CutPrefix(line, "time=")
		if !ok {
			continue
		}
		stamp, _, _ = strings.Cut(stamp, " ")
		at, err := time.Parse(time.RFC3339Nano, stamp)
		if err == nil && !at.Before(from) && !at.After(to) {
			out = append(out, strings.TrimSpace(line))
		}
	}
	return out
}
