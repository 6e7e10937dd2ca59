package agent

import (
	"context"
	"fmt"
	"math"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// groupCluster stands for an allocator cluster of several Raft groups: one
// fake allocator (its own buckets and agent records) per group, served by
// nodes over real gRPC. The node that leads a group serves its calls; the
// others forward them (naming the leader in the response header, as an
// allocator follower does) or, with refuse, answer Unavailable with the
// leader hint. A group serves only the keys of the slots it owns and that
// are not frozen (a move in flight); the others are answered MOVED, with
// the topology.
type groupCluster struct {
	t     testing.TB
	set   *rules.Set
	fakes []*fakeAllocator // by group
	nodes []*groupNode

	mu       sync.Mutex // guards the fields below
	version  uint64
	owner    [slots.Count]slots.GroupID
	frozen   [slots.Count]bool
	leader   []int         // group → node
	noWatch  bool          // the watch stream carries no topology
	changed  chan struct{} // closed and replaced at every topology change
	watchSeq int
}

// groupNode is one node of a groupCluster.
type groupNode struct {
	allotv1.UnimplementedAllocatorServer
	c      *groupCluster
	idx    int
	addr   string
	refuse atomic.Bool

	mu    sync.Mutex
	calls []groupCall // guarded by mu
}

// groupCall is an Acquire a node received.
type groupCall struct {
	group     uint32
	version   uint64
	keys      []string // canonical
	forwarded bool
	req       *allotv1.AcquireRequest
}

// newGroupCluster starts n nodes serving n groups over an even slot map,
// node i leading group i.
func newGroupCluster(t *testing.T, clock *fakeClock, n int) *groupCluster {
	t.Helper()
	c := &groupCluster{t: t, set: mustCompile(t, 1, testRules), version: 1, changed: make(chan struct{})}
	ids := make([]slots.GroupID, n)
	for i := range n {
		ids[i] = slots.GroupID(i)
		c.fakes = append(c.fakes, newFake(t, clock.now, testRules))
		c.leader = append(c.leader, i)
	}
	m, err := slots.Even(1, ids)
	if err != nil {
		t.Fatal(err)
	}
	for s := range slots.Count {
		c.owner[s] = m.Owner(slots.Slot(s))
	}
	for i := range n {
		nd := &groupNode{c: c, idx: i}
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		nd.addr = lis.Addr().String()
		srv := grpc.NewServer()
		allotv1.RegisterAllocatorServer(srv, nd)
		go func() { _ = srv.Serve(lis) }()
		t.Cleanup(srv.Stop)
		c.nodes = append(c.nodes, nd)
	}
	return c
}

func (c *groupCluster) addrs() []string {
	out := make([]string, len(c.nodes))
	for i, nd := range c.nodes {
		out[i] = nd.addr
	}
	return out
}

// keyOf is the canonical key of a test-domain descriptor.
func (c *groupCluster) keyOf(d Descriptor) string {
	r := c.set.Match("test", d.Entries)
	if r == nil {
		c.t.Fatalf("no rule for %v", d.Entries)
	}
	return string(rules.AppendKey(nil, r, "test", d.Entries))
}

// topologyLocked is the cluster's Topology.
func (c *groupCluster) topologyLocked() *allotv1.Topology {
	var m slots.Map
	for s, g := range c.owner {
		m, _ = m.Assign(slots.Range{First: slots.Slot(s), Last: slots.Slot(s)}, g)
	}
	t := &allotv1.Topology{Version: c.version}
	for g := range c.fakes {
		nd := c.nodes[c.leader[g]]
		t.Groups = append(t.Groups, &allotv1.GroupRoute{Id: uint32(g), LeaderId: fmt.Sprint("n", nd.idx),
			LeaderAddr: nd.addr, Slots: slots.FormatRanges(m.RangesOf(slots.GroupID(g)))})
	}
	return t
}

// change applies fn to the cluster under its lock and wakes the watches.
func (c *groupCluster) change(fn func(c *groupCluster)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fn(c)
	close(c.changed)
	c.changed = make(chan struct{})
}

// move carries key's state (its bucket and every agent's holding) from its
// group to group to, and gives the key's slot to it at the next version:
// the commit of a slot move.
func (c *groupCluster) move(key string, to slots.GroupID) {
	c.change(func(c *groupCluster) {
		s := slots.OfKey(key)
		from := c.fakes[c.owner[s]]
		dst := c.fakes[to]
		from.mu.Lock()
		dst.mu.Lock()
		if st := from.buckets[key]; st != nil {
			cp := *st
			dst.buckets[key] = &cp
			delete(from.buckets, key)
		}
		for id, ag := range from.agents {
			h, ok := ag.held[key]
			if !ok {
				continue
			}
			da := dst.agents[id]
			if da == nil {
				da = &fakeAgent{held: make(map[string]int64), lastID: ag.lastID}
				dst.agents[id] = da
			}
			da.held[key] = h
			delete(ag.held, key)
		}
		dst.mu.Unlock()
		from.mu.Unlock()
		c.owner[s] = to
		c.frozen[s] = false
		c.version++
	})
}

func (n *groupNode) Acquire(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	c := n.c
	c.mu.Lock()
	g := int(req.Group)
	if g >= len(c.fakes) {
		c.mu.Unlock()
		return nil, fmt.Errorf("no group %d", g)
	}
	leader := c.nodes[c.leader[g]]
	forwarded := req.TopologyVersion != 0 && leader != n
	if forwarded && n.refuse.Load() {
		c.mu.Unlock()
		return nil, notLeaderStatus(leader.addr)
	}
	version, topo := c.version, c.topologyLocked()
	sub := &allotv1.AcquireRequest{AgentId: req.AgentId, RequestId: req.RequestId, RulesVersion: req.RulesVersion}
	keys := make([]string, len(req.Keys))
	served := make([]bool, len(req.Keys))
	moved := false
	for i, k := range req.Keys {
		entries := fromProto(k.Entries)
		r := c.set.Match(k.Domain, entries)
		keys[i] = string(rules.AppendKey(nil, r, k.Domain, entries))
		s := slots.OfKey(keys[i])
		served[i] = int(c.owner[s]) == g && !c.frozen[s]
		if served[i] {
			sub.Keys = append(sub.Keys, k)
		} else {
			moved = true
		}
	}
	c.mu.Unlock()
	n.mu.Lock()
	n.calls = append(n.calls, groupCall{group: req.Group, version: req.TopologyVersion, keys: keys, forwarded: forwarded, req: req})
	n.mu.Unlock()
	r, err := c.fakes[g].Acquire(ctx, sub)
	if err != nil {
		return nil, err
	}
	resp := &allotv1.AcquireResponse{LiveAgents: r.LiveAgents, RulesVersion: r.RulesVersion, NowUnixMs: r.NowUnixMs}
	j := 0
	for i := range req.Keys {
		if served[i] {
			resp.Grants = append(resp.Grants, r.Grants[j])
			j++
			continue
		}
		resp.Grants = append(resp.Grants, &allotv1.KeyGrant{Status: allotv1.KeyStatus_KEY_STATUS_MOVED, Key: keys[i]})
	}
	if moved || req.TopologyVersion < version {
		resp.Topology = topo
	}
	if forwarded {
		_ = grpc.SetHeader(ctx, metadata.Pairs(allotv1.LeaderAddrHeader, leader.addr))
	}
	return resp, nil
}

// Release hands each key to the group that owns it; all ends the agent's
// leases in every group.
func (n *groupNode) Release(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	c := n.c
	c.mu.Lock()
	subs := make([]*allotv1.ReleaseRequest, len(c.fakes))
	for g := range subs {
		subs[g] = &allotv1.ReleaseRequest{AgentId: req.AgentId, RequestId: req.RequestId, All: req.All}
	}
	for _, k := range req.Keys {
		entries := fromProto(k.Entries)
		key := string(rules.AppendKey(nil, c.set.Match(k.Domain, entries), k.Domain, entries))
		g := c.owner[slots.OfKey(key)]
		subs[g].Keys = append(subs[g].Keys, k)
	}
	c.mu.Unlock()
	out := &allotv1.ReleaseResponse{}
	for g, sub := range subs {
		if len(sub.Keys) == 0 && !sub.All {
			continue
		}
		r, err := c.fakes[g].Release(ctx, sub)
		if err != nil {
			return nil, err
		}
		out.Returned += r.Returned
		out.LeasesEnded += r.LeasesEnded
	}
	return out, nil
}

// WatchRules streams group 0's rule set with the topology, again at every
// topology change (same rules version: a topology-only message).
func (n *groupNode) WatchRules(req *allotv1.WatchRulesRequest, stream grpc.ServerStreamingServer[allotv1.RuleSet]) error {
	c := n.c
	for {
		c.mu.Lock()
		changed := c.changed
		c.fakes[0].mu.Lock()
		rs := &allotv1.RuleSet{Version: c.fakes[0].ruleSet.Version, Files: c.fakes[0].ruleSet.Files}
		c.fakes[0].mu.Unlock()
		if !c.noWatch {
			rs.Topology = c.topologyLocked()
		}
		c.mu.Unlock()
		if err := stream.Send(rs); err != nil {
			return err
		}
		select {
		case <-stream.Context().Done():
			return nil
		case <-changed:
		}
	}
}

// callsOf returns the Acquire calls node i received, from index from on.
func (n *groupNode) callsFrom(from int) []groupCall {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Clone(n.calls[min(from, len(n.calls)):])
}

// groupSetup is a stepped agent in front of c, listing every node.
func groupSetup(t *testing.T, n int, noWatch bool) (*steppedAgent, *groupCluster) {
	t.Helper()
	clock := newFakeClock()
	c := newGroupCluster(t, clock, n)
	c.noWatch = noWatch
	cfg := DefaultConfig()
	cfg.Allocators = c.addrs()
	cfg.Now = clock.now
	cfg.Rules = mustCompile(t, 0, testRules)
	cfg.CallTimeout = 5 * time.Second
	cfg.manual = true
	s := &steppedAgent{Agent: newAgent(t, cfg), clock: clock, fake: c.fakes[0]}
	if !noWatch {
		waitFor(t, 5*time.Second, "the watch stream's topology", func() bool { return s.rt.topo.Load() != nil })
	}
	return s, c
}

// groupKeys returns descriptors of count api keys and their canonical keys.
func groupKeys(c *groupCluster, count int) ([]Descriptor, []string) {
	ds := make([]Descriptor, count)
	ks := make([]string, count)
	for i := range ds {
		ds[i] = desc("api_key", fmt.Sprint("g", i))
		ks[i] = c.keyOf(ds[i])
	}
	return ds, ks
}

// checkAllowed checks d and fails unless it is allowed.
func checkAllowed(t *testing.T, a *Agent, d Descriptor) {
	t.Helper()
	if dec := check(t, a, d); !dec.Allowed {
		t.Fatalf("check %v denied: %+v", d.Entries, dec)
	}
}

// TestGroupsSplitPerGroup: with the topology from the watch stream, a tick
// sends one call per group, each to that group's leader, addressed to the
// group at the topology's version and carrying only the group's keys; no
// call is forwarded and no key is answered MOVED.
func TestGroupsSplitPerGroup(t *testing.T) {
	s, c := groupSetup(t, 3, false)
	ds, _ := groupKeys(c, 30)
	for _, d := range ds {
		checkAllowed(t, s.Agent, d)
	}
	s.step()
	seen := map[uint32]int{}
	for i, nd := range c.nodes {
		for _, call := range nd.callsFrom(0) {
			if call.forwarded || call.group != uint32(i) || call.version != 1 {
				t.Fatalf("node %d got a call for group %d at version %d (forwarded %v), want only its own group's, at version 1",
					i, call.group, call.version, call.forwarded)
			}
			for _, k := range call.keys {
				if g := c.owner[slots.OfKey(k)]; g != slots.GroupID(i) {
					t.Fatalf("group %d's call carries key %q of group %d", i, k, g)
				}
			}
			seen[call.group] += len(call.keys)
		}
	}
	if len(seen) != 3 || seen[0]+seen[1]+seen[2] != len(ds) {
		t.Fatalf("keys per group %v, want all %d keys over 3 groups", seen, len(ds))
	}
	if n := (dtoCounter{}).read(s.met.keysMoved); n != 0 {
		t.Fatalf("%v keys answered MOVED, want 0", n)
	}
	for _, d := range ds {
		if ks := keyOf(t, s.Agent, d); ks.balance.Load() <= 0 {
			t.Fatalf("key %v has no lease balance after its group answered", d.Entries)
		}
	}
}

// TestGroupsMovedRedirect: without a topology the first call goes to group
// 0, which answers the other groups' keys MOVED with the topology; their
// charges are not lost but reported, on the next tick, to the group that
// owns them, and no check fails meanwhile.
func TestGroupsMovedRedirect(t *testing.T) {
	s, c := groupSetup(t, 3, true)
	ds, keys := groupKeys(c, 12)
	for range 2 {
		for _, d := range ds {
			checkAllowed(t, s.Agent, d)
		}
	}
	s.step()
	first := c.nodes[0].callsFrom(0)
	if len(first) != 1 || first[0].version != 0 {
		t.Fatalf("first tick: %d calls to node 0, want 1 without a topology", len(first))
	}
	charged := map[string]int64{}
	for i, k := range first[0].req.Keys {
		charged[first[0].keys[i]] = k.Charged
	}
	if s.rt.topo.Load() == nil {
		t.Fatal("the MOVED answer's topology was not taken")
	}
	moved := (dtoCounter{}).read(s.met.keysMoved)
	if moved == 0 {
		t.Fatal("no key answered MOVED: every test key is in group 0's slots")
	}
	for _, d := range ds {
		checkAllowed(t, s.Agent, d) // decided from the fallback bucket meanwhile
	}
	s.clock.advance(6 * time.Second) // past the refresh: every key is sent again
	s.step()
	for _, k := range keys {
		g := c.owner[slots.OfKey(k)]
		for og, f := range c.fakes {
			b := f.booksOf(k)
			if slots.GroupID(og) != g {
				if b != (books{}) {
					t.Fatalf("key %q (group %d): group %d applied %+v, want nothing", k, g, og, b)
				}
				continue
			}
			if b.charged < charged[k] || b.granted == 0 {
				t.Fatalf("key %q: its group %d applied %+v, want its charge %d (reported first to group 0) and a grant",
					k, g, b, charged[k])
			}
		}
	}
}

// TestGroupsSlotMove: a key's slot frozen (a move in flight) is answered
// MOVED by its group; the key keeps being decided from its lease, and
// after the commit its calls go to the new owner, which carries on from
// the state moved over.
func TestGroupsSlotMove(t *testing.T) {
	s, c := groupSetup(t, 3, false)
	ds, keys := groupKeys(c, 12)
	var d Descriptor
	var key string
	for i, k := range keys {
		if c.owner[slots.OfKey(k)] == 1 {
			d, key = ds[i], k
			break
		}
	}
	if key == "" {
		t.Fatal("no test key in group 1")
	}
	checkAllowed(t, s.Agent, d)
	s.step()
	before := c.fakes[1].booksOf(key)
	if before.granted == 0 {
		t.Fatalf("group 1 granted nothing for %q: %+v", key, before)
	}
	c.change(func(c *groupCluster) { c.frozen[slots.OfKey(key)] = true })
	for range 5 {
		checkAllowed(t, s.Agent, d) // from the lease
	}
	s.clock.advance(6 * time.Second)
	s.step()
	if (dtoCounter{}).read(s.met.keysMoved) == 0 {
		t.Fatal("the frozen key was not answered MOVED")
	}
	if b := c.fakes[1].booksOf(key); b != before {
		t.Fatalf("group 1 applied %+v for the frozen key, want %+v unchanged", b, before)
	}
	c.move(key, 2)
	waitFor(t, 5*time.Second, "the new topology", func() bool { return s.rt.topo.Load().version == 2 })
	checkAllowed(t, s.Agent, d)
	from := len(c.nodes[2].calls)
	s.clock.advance(6 * time.Second)
	s.step()
	var got bool
	for _, call := range c.nodes[2].callsFrom(from) {
		got = got || call.group == 2 && slices.Contains(call.keys, key) && !call.forwarded
	}
	if !got {
		t.Fatalf("after the move, %q was not sent to group 2's leader", key)
	}
	after := c.fakes[2].booksOf(key)
	if after.charged+after.returned+after.granted == 0 {
		t.Fatalf("group 2 applied nothing for %q", key)
	}
	var st bucket.State
	c.fakes[1].with(func(f *fakeAllocator) {
		if p := f.buckets[key]; p != nil {
			st = *p
		}
	})
	if st != (bucket.State{}) {
		t.Fatalf("group 1 still holds %q's bucket after the move", key)
	}
}

// TestGroupsLeaderChange: a group's leader moves. The old leader forwards
// the call and names the new one, and the next call goes there directly;
// a node that answers Unavailable with a hint is retried at the hinted
// leader in the same tick, and nothing fails. A topology-only message on
// the watch stream (same rules version) moves the group back.
func TestGroupsLeaderChange(t *testing.T) {
	s, c := groupSetup(t, 3, false)
	ds, keys := groupKeys(c, 12)
	var d Descriptor
	for i, k := range keys {
		if c.owner[slots.OfKey(k)] == 1 {
			d = ds[i]
			break
		}
	}
	checkAllowed(t, s.Agent, d)
	s.step()
	// The leader of group 1 moves to node 2; the agent's topology still
	// names node 1 (no watch message).
	c.mu.Lock()
	c.leader[1] = 2
	c.mu.Unlock()
	tick := func() {
		t.Helper()
		checkAllowed(t, s.Agent, d)
		s.clock.advance(6 * time.Second)
		s.step()
	}
	n1, n2 := len(c.nodes[1].calls), len(c.nodes[2].calls)
	tick()
	if calls := c.nodes[1].callsFrom(n1); len(calls) != 1 || !calls[0].forwarded {
		t.Fatalf("old leader: %d calls, want 1 forwarded", len(calls))
	}
	tick()
	if calls := c.nodes[1].callsFrom(n1 + 1); len(calls) != 0 {
		t.Fatalf("old leader got %d more calls after naming the new one", len(calls))
	}
	if calls := c.nodes[2].callsFrom(n2); len(calls) != 1 || calls[0].forwarded || calls[0].group != 1 {
		t.Fatalf("new leader: calls %+v, want one direct call for group 1", calls)
	}
	// Node 2 steps down and refuses; node 0 leads group 1.
	c.mu.Lock()
	c.leader[1] = 0
	c.mu.Unlock()
	c.nodes[2].refuse.Store(true)
	failed := (dtoCounter{}).read(s.met.callsFailed)
	n0 := len(c.nodes[0].calls)
	tick()
	if calls := c.nodes[0].callsFrom(n0); len(calls) != 1 || calls[0].forwarded || calls[0].group != 1 {
		t.Fatalf("after the refusal: node 0 calls %+v, want the call for group 1 retried there", calls)
	}
	if f := (dtoCounter{}).read(s.met.callsFailed); f != failed {
		t.Fatalf("failed calls %v, want %v: a redirect is no failure", f, failed)
	}
	// A topology-only message names node 1 again.
	c.nodes[2].refuse.Store(false)
	old := s.rt.topo.Load()
	c.change(func(c *groupCluster) { c.leader[1] = 1 })
	waitFor(t, 5*time.Second, "the topology-only watch message", func() bool { return s.rt.topo.Load() != old })
	if tp := s.rt.topo.Load(); tp.version != 1 || tp.leader[1] != c.nodes[1].addr {
		t.Fatalf("topology version %d, group 1's leader %s; want 1, %s", tp.version, tp.leader[1], c.nodes[1].addr)
	}
	if v := s.rules.Load().Version(); v != 1 {
		t.Fatalf("rules version %d after a topology-only message, want 1", v)
	}
	n1 = len(c.nodes[1].calls)
	tick()
	if calls := c.nodes[1].callsFrom(n1); len(calls) != 1 || calls[0].forwarded {
		t.Fatalf("node 1: calls %+v, want one direct call", calls)
	}
}

// TestParseTopology: a topology must give every slot exactly one owner.
func TestParseTopology(t *testing.T) {
	ok := &allotv1.Topology{Version: 3, Groups: []*allotv1.GroupRoute{
		{Id: 0, Slots: "0-511", LeaderAddr: "a"}, {Id: 1, Slots: "512-1023"}, {Id: 2}}}
	tp, err := parseTopology(ok)
	if err != nil {
		t.Fatal(err)
	}
	if tp.owner[511] != 0 || tp.owner[512] != 1 || tp.leader[0] != "a" || tp.leader[1] != "" || tp.groups != 3 {
		t.Fatalf("parsed %+v", tp.leader)
	}
	for _, bad := range []*allotv1.Topology{
		{Groups: []*allotv1.GroupRoute{{Id: 0, Slots: "0-511"}}},
		{Groups: []*allotv1.GroupRoute{{Id: 0, Slots: "0-600"}, {Id: 1, Slots: "512-1023"}}},
		{Groups: []*allotv1.GroupRoute{{Id: 0, Slots: "0-1023"}, {Id: 0, Slots: ""}}},
		{Groups: []*allotv1.GroupRoute{{Id: 0, Slots: "0-10x"}}},
		{},
	} {
		if _, err := parseTopology(bad); err == nil {
			t.Fatalf("parseTopology(%v) = nil error", bad)
		}
	}
	// An older topology never replaces a newer one.
	s := newStepped(t)
	s.noteTopology(ok)
	s.noteTopology(&allotv1.Topology{Version: 2, Groups: []*allotv1.GroupRoute{{Id: 0, Slots: "0-1023"}}})
	if v := s.rt.topo.Load().version; v != 3 {
		t.Fatalf("topology version %d, want 3", v)
	}
}

// TestGroupsMoveAdmissionBound: while a key's slot is frozen, an agent
// admits at most its lease balance at the freeze plus its fallback
// bucket's burst ⌈B/N⌉ and refill R·D/N over the move's duration D; the
// fallback admissions are charged to the new owner once the move is done
// (each MOVED answer gave the charge back to the key), none lost.
func TestGroupsMoveAdmissionBound(t *testing.T) {
	s, c := groupSetup(t, 3, false)
	var d Descriptor
	var key string
	for i := 0; key == ""; i++ {
		dd := desc("small", fmt.Sprint("m", i))
		if k := c.keyOf(dd); c.owner[slots.OfKey(k)] == 1 {
			d, key = dd, k
		}
	}
	checkAllowed(t, s.Agent, d)
	s.step()
	ks := keyOf(t, s.Agent, d)
	b0 := ks.balance.Load()
	if b0 <= 0 {
		t.Fatalf("no lease balance before the move (%d)", b0)
	}
	before := c.fakes[1].booksOf(key)
	c.change(func(c *groupCluster) { c.frozen[slots.OfKey(key)] = true })
	const burst, perHour = 3, 3 // the "small" rule; N = 1 agent
	const moveFor = 20 * time.Minute
	admitted := int64(0)
	for i := range 20 {
		for range 5 {
			if dec := check(t, s.Agent, d); dec.Allowed {
				admitted++
			}
		}
		if i < 19 {
			s.clock.advance(moveFor / 19)
		}
		s.step()
	}
	refill := int64(math.Ceil(perHour * moveFor.Hours()))
	if bound := b0 + burst + refill; admitted > bound {
		t.Fatalf("admitted %d during the move, bound %d (lease %d + burst %d + refill %d)", admitted, bound, b0, burst, refill)
	}
	t.Logf("admitted %d during the move: lease %d, bound %d", admitted, b0, b0+burst+refill)
	if admitted <= b0 {
		t.Fatalf("admitted %d during the move: the fallback bucket admitted nothing beyond the lease %d", admitted, b0)
	}
	if b := c.fakes[1].booksOf(key); b != before {
		t.Fatalf("the frozen group applied %+v, want %+v unchanged", b, before)
	}
	c.move(key, 2)
	waitFor(t, 5*time.Second, "the new topology", func() bool { return s.rt.topo.Load().version == 2 })
	for range 2 {
		s.clock.advance(6 * time.Second)
		s.step()
	}
	if b := c.fakes[2].booksOf(key); b.charged != admitted-b0 {
		t.Fatalf("the new owner was charged %d, want the %d fallback admissions of the move", b.charged, admitted-b0)
	}
}

// TestGroupsMovedRetryKeepsReturnedTokens: a key answered MOVED on a retry
// (the same request id sent again after a lost answer) may have been
// applied by its former owner, which credited the tokens the call
// returned: the agent takes its charges back to report them again, but
// not its returned tokens, which would be admitted a second time. On a
// first attempt MOVED means nothing was applied, and both go back.
func TestGroupsMovedRetryKeepsReturnedTokens(t *testing.T) {
	s, c := groupSetup(t, 2, false)
	ds, _ := groupKeys(c, 1)
	checkAllowed(t, s.Agent, ds[0])
	s.step()
	ks := keyOf(t, s.Agent, ds[0])
	if ks.expiry.Load() <= s.loopNow() {
		t.Fatal("the key holds no lease")
	}
	checkUndone(t, "MOVED", ks, func(k *allotv1.KeyAcquire, retried bool) { s.moved(ks, k, retried) })
}
