package agent

import (
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Group routing. An allocator cluster with several Raft groups divides the
// key space into slots (pkg/slots: the low ten bits of the canonical key's
// xxhash64) and each slot is served by one group, whose leader is the one
// node that grants for it. The cluster's Topology (the slot map, at a
// version, and each group's leader) reaches the agent on the rule watch
// stream (RuleSet.topology; a RuleSet at the version the agent already
// holds carries only a topology change) and in Acquire answers (when the
// call routed by an older slot map, or a key was answered MOVED). The
// agent keeps the newest one it has seen.
//
// With a topology, a refill tick splits its picked keys by the group that
// owns their slot and sends each group's keys in their own calls
// (AcquireRequest.group, topology_version), straight to that group's
// leader: the address the topology names, or a leader hint an answer for
// that group gave since (the x-allot-leader-addr header of a forwarded
// answer, or the ErrorInfo of an Unavailable one, retried there at once).
// A group leader outside Config.Allocators is dialed as a hinted leader is
// (route.go), with room for one connection per group. While a group has no
// known leader, or its leader's call failed within hintBackoff, its calls
// go where calls without a group go (any node forwards them).
//
// A key answered KEY_STATUS_MOVED (its slot is another group's, or between
// groups in a slot move) was neither granted nor charged: its charges and
// returned tokens go back to the key, as for a rejected call, and it is
// sent again at its next refill, to the owner the newest topology names.
// Meanwhile it is decided, as always, from its lease and its fallback
// bucket: a move never fails a check. Without a topology (a cluster of one
// group) none of this applies and every call goes as route.go describes.
//
// Release calls carry no group: they go to the node the loop calls, which
// hands each key to its group.

// topology is a validated Topology: the owner of every slot and each
// group's leader address. Immutable once built.
type topology struct {
	version uint64
	owner   [slots.Count]slots.GroupID
	leader  map[slots.GroupID]string // gRPC address; absent: no leader known
	groups  int
	data    int // groups that own slots
}

// parseTopology checks that t names each group once and assigns every slot
// to exactly one group.
func parseTopology(t *allotv1.Topology) (*topology, error) {
	out := &topology{version: t.GetVersion(), leader: make(map[slots.GroupID]string, len(t.GetGroups()))}
	var covered [slots.Count]bool
	n := 0
	seen := make(map[slots.GroupID]bool, len(t.GetGroups()))
	for _, g := range t.GetGroups() {
		id := slots.GroupID(g.GetId())
		if seen[id] {
			return nil, fmt.Errorf("agent: topology %d: group %d listed twice", t.GetVersion(), id)
		}
		seen[id] = true
		if g.GetLeaderAddr() != "" {
			out.leader[id] = g.GetLeaderAddr()
		}
		if g.GetSlots() == "" {
			continue // a group without slots (just added, or emptied)
		}
		rs, err := slots.ParseRanges(g.GetSlots())
		if err != nil {
			return nil, fmt.Errorf("agent: topology %d: group %d: %w", t.GetVersion(), id, err)
		}
		for _, r := range rs {
			for s := int(r.First); s <= int(r.Last); s++ {
				if covered[s] {
					return nil, fmt.Errorf("agent: topology %d: slot %d owned twice", t.GetVersion(), s)
				}
				covered[s] = true
				out.owner[s] = id
				n++
			}
		}
	}
	if n != slots.Count {
		return nil, fmt.Errorf("agent: topology %d: %d of %d slots have an owner", t.GetVersion(), n, slots.Count)
	}
	out.groups = len(seen)
	data := map[slots.GroupID]bool{}
	for _, g := range out.owner {
		data[g] = true
	}
	out.data = len(data)
	return out, nil
}

// ownerOf is the group that serves ks.
func (t *topology) ownerOf(ks *keyState) slots.GroupID { return t.owner[slots.OfKey(ks.key)] }

// noteTopology keeps t when it is at least as new as the one held (a
// topology of the same version may name other leaders). A topology that
// does not parse is logged and dropped. Safe for concurrent use (the rule
// watch and the refill loop both call it).
func (a *Agent) noteTopology(t *allotv1.Topology) {
	if t == nil {
		return
	}
	nt, err := parseTopology(t)
	if err != nil {
		a.logs.log(a.log, "topology", "agent: topology rejected; keeping the last one", "err", err)
		return
	}
	for {
		cur := a.rt.topo.Load()
		if cur != nil && nt.version < cur.version {
			return
		}
		if a.rt.topo.CompareAndSwap(cur, nt) {
			if nt.data > 1 {
				// Several data groups: no static shares (static.go).
				a.ss.validUntil.Store(0)
			}
			return
		}
	}
}

// groupRun is a run of picked keys that one group serves.
type groupRun struct {
	group slots.GroupID
	n     int
}

// splitByGroup reorders picks (stably) so that each group's keys are
// contiguous, in group order, and returns the runs. Owned by the refill
// loop.
func (a *Agent) splitByGroup(t *topology, picks []*keyState) []groupRun {
	rt := &a.rt
	rt.owners = rt.owners[:0]
	for _, ks := range picks {
		rt.owners = append(rt.owners, t.ownerOf(ks))
	}
	rt.runs = rt.runs[:0]
	for _, g := range rt.owners {
		if i := slices.IndexFunc(rt.runs, func(r groupRun) bool { return r.group == g }); i >= 0 {
			rt.runs[i].n++
		} else {
			rt.runs = append(rt.runs, groupRun{g, 1})
		}
	}
	if len(rt.runs) == 1 {
		return rt.runs
	}
	slices.SortFunc(rt.runs, func(x, y groupRun) int { return int(x.group) - int(y.group) })
	rt.sorted = append(rt.sorted[:0], picks...)
	at := 0
	for _, r := range rt.runs {
		for i, ks := range rt.sorted {
			if rt.owners[i] == r.group {
				picks[at] = ks
				at++
			}
		}
	}
	clear(rt.sorted)
	return rt.runs
}

// sendGroups sends rf.pick, which splitByGroup ordered into runs, in
// batches of one group each. It reports the index of the first pick not
// sent and whether the loop may go on (see send).
func (a *Agent) sendGroups(ctx context.Context, now int64, t *topology, runs []groupRun) (int, bool) {
	rf := &a.rf
	i := 0
	for _, r := range runs {
		end := i + r.n
		for i < end {
			n := policy.BatchLen(rf.pick[i:end], keyOfState, maxBatchKeys)
			b := a.buildFor(now, rf.pick[i:i+n], t, r.group, true)
			i += n
			if !a.send(ctx, b) {
				return i, false
			}
		}
	}
	return i, true
}

// groupLeader is what the loop learned of a group's leader since the
// topology it routes by.
type groupLeader struct {
	addr     string    // a leader hint from an answer for the group ("": none)
	bad      string    // an address whose call for the group failed
	badUntil time.Time // … not called for the group again before then
}

// groupTarget returns the client for a call to group g and its address:
// its leader, as far as the loop knows it, or the loop's usual target.
func (a *Agent) groupTarget(g slots.GroupID) (allotv1.AllocatorClient, string) {
	rt := &a.rt
	t := rt.topo.Load()
	if t != rt.learnedFor {
		clear(rt.learned) // a newer topology names the leaders
		rt.learnedFor = t
	}
	gl := rt.learned[g]
	addr := gl.addr
	if addr == "" && t != nil {
		addr = t.leader[g]
	}
	if addr != "" && (addr != gl.bad || time.Now().After(gl.badUntil)) {
		if c := a.clientFor(addr, max(t.groupCount(), 1)); c != nil {
			return c, addr
		}
	}
	return a.target()
}

// dataGroupCount is how many groups own slots in t (0 for nil).
func (t *topology) dataGroupCount() int {
	if t == nil {
		return 0
	}
	return t.data
}

// groupCount is how many groups t names (0 for nil).
func (t *topology) groupCount() int {
	if t == nil {
		return 0
	}
	return t.groups
}

// clientFor returns a client for addr: the configured connection of that
// address, else a dialed one (room for extra connections beyond
// maxHintConns); nil when none may be had now.
func (a *Agent) clientFor(addr string, extra int) allotv1.AllocatorClient {
	for i, n := range a.names {
		if n == addr {
			return a.clients[i]
		}
	}
	if h := a.hintConn(addr, extra); h != nil {
		return h.client
	}
	return nil
}

// learn records a leader hint for group g (from an answer for it).
func (rt *router) learn(g slots.GroupID, addr string) {
	if rt.learned == nil {
		rt.learned = make(map[slots.GroupID]groupLeader)
	}
	gl := rt.learned[g]
	gl.addr = addr
	rt.learned[g] = gl
}

// groupFailed records that the call for group g to addr failed: the group
// is not sent to addr for hintBackoff (its calls go to the loop's usual
// target, which forwards them), nor is the hint that named it followed.
func (rt *router) groupFailed(g slots.GroupID, addr string) {
	if rt.learned == nil {
		rt.learned = make(map[slots.GroupID]groupLeader)
	}
	gl := rt.learned[g]
	if gl.addr == addr {
		gl.addr = ""
	}
	gl.bad, gl.badUntil = addr, time.Now().Add(hintBackoff)
	rt.learned[g] = gl
}

// callGroup sends req, addressed to group req.Group, to that group's
// leader, and at most once more to the leader an Unavailable answer names.
// ctx bounds both.
func (a *Agent) callGroup(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	g := slots.GroupID(req.Group)
	for redirected := false; ; redirected = true {
		c, addr := a.groupTarget(g)
		var md metadata.MD
		resp, err := c.Acquire(ctx, req, grpc.Header(&md))
		if err == nil {
			if h := a.rt.conns[addr]; h != nil {
				h.fails = 0
			}
			if v := md.Get(allotv1.LeaderAddrHeader); len(v) > 0 && v[0] != addr {
				a.rt.learn(g, v[0])
			}
			return resp, nil
		}
		a.callFailedAt(addr)
		a.rt.groupFailed(g, addr)
		hint := hintOf(err)
		if redirected || hint == "" || hint == addr || ctx.Err() != nil {
			return resp, err
		}
		a.rt.learn(g, hint)
	}
}

// moved takes a key the allocator answered MOVED: nothing was applied for
// it in this attempt, so what its entry k carried goes back to it, and it
// is sent again at its next refill (to the owner of the newest topology).
// On a retry (retried: the same request id sent again after a lost
// answer) the first attempt may have been applied by the group that owned
// the key then, whose answer the MOVED one replaces: the charges go back
// (at worst charged twice) but not the returned tokens (credited to the
// bucket already, at worst wasted).
func (a *Agent) moved(ks *keyState, k *allotv1.KeyAcquire, retried bool) {
	if retried {
		unsendRetried(ks, k)
	} else {
		unsend(ks, k, a.loopNow())
	}
	ks.Inflight = false
	a.rf.awaken(ks)
	a.met.keysMoved.Inc()
}
