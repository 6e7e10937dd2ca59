package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Groups (-groups N, N > 1). The cluster is bootstrapped with N data
// groups; the load learns the topology (the slot map and each group's
// leader) as an agent does, from the rule watch stream and from Acquire
// answers, and sends each call's keys split by the group that owns their
// slot, one Acquire per group (AcquireRequest.group, topology_version),
// straight to that group's leader. A group's calls follow the leader
// header of a forwarded answer, and move to the next node after a failed
// attempt, as the single group's do.

// topology is a parsed Topology: the slot map and each data group's
// leader address. Immutable once built.
type topology struct {
	version uint64
	m       slots.Map
	leader  map[slots.GroupID]string
}

// parseTopology reads t's slot map (every slot owned exactly once) and
// leaders.
func parseTopology(t *allotv1.Topology) (*topology, error) {
	out := &topology{version: t.GetVersion(), leader: map[slots.GroupID]string{}}
	var runs []string
	for _, g := range t.GetGroups() {
		id := slots.GroupID(g.GetId())
		if a := g.GetLeaderAddr(); a != "" {
			out.leader[id] = a
		}
		for r := range strings.SplitSeq(g.GetSlots(), ",") {
			if r != "" {
				runs = append(runs, r+"="+strconv.FormatUint(uint64(id), 10))
			}
		}
	}
	m, err := slots.ParseMap(t.GetVersion(), strings.Join(runs, ","))
	if err != nil {
		return nil, fmt.Errorf("topology %d: %w", t.GetVersion(), err)
	}
	out.m = m
	return out, nil
}

// noteTopology keeps t when it is at least as new as the one held, and
// points each group's calls at the leader it names.
func (l *load) noteTopology(t *allotv1.Topology) {
	if t == nil {
		return
	}
	nt, err := parseTopology(t)
	if err != nil {
		fmt.Println("acquire: topology rejected:", err)
		return
	}
	l.topoMu.Lock()
	defer l.topoMu.Unlock()
	if cur := l.topo.Load(); cur != nil && nt.version < cur.version {
		return
	}
	l.topo.Store(nt)
	for g, addr := range nt.leader {
		if i := slices.Index(l.addrs, addr); i >= 0 && int(g) < len(l.groupNode) {
			l.groupNode[g].Store(int32(i))
		}
	}
}

// watch follows the rule watch stream, as an agent does, for the
// topology, until ctx ends; it moves to the next node when a stream
// breaks.
func (l *load) watch(ctx context.Context, wg *sync.WaitGroup) {
	wg.Go(func() {
		for i := 0; ctx.Err() == nil; i++ {
			stream, err := allotv1.NewAllocatorClient(l.conns[i%len(l.conns)]).WatchRules(ctx, &allotv1.WatchRulesRequest{AgentId: "bench-watch"})
			for err == nil {
				var rs *allotv1.RuleSet
				if rs, err = stream.Recv(); err == nil {
					l.noteTopology(rs.GetTopology())
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
}

// waitTopology waits for the first topology.
func (l *load) waitTopology(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for l.topo.Load() == nil {
		if time.Now().After(deadline) {
			return errors.New("no topology from the watch stream")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// keySlots returns the slot of each key "bench", user=i of the key space,
// under the benchmark's rules (the canonical key's hash, as agents and
// allocators compute it).
func keySlots(rulesPath string, n int) (func(i int) slots.Slot, []slots.Slot, error) {
	set, err := rules.LoadFiles(1, rulesPath)
	if err != nil {
		return nil, nil, err
	}
	of := func(i int) slots.Slot {
		ents := []rules.Entry{{Key: "user", Value: strconv.Itoa(i)}}
		return slots.Of(rules.KeyHash(set.Match("bench", ents), "bench", ents))
	}
	out := make([]slots.Slot, n)
	for i := range out {
		out[i] = of(i)
	}
	return of, out, nil
}

// part is the keys of one call that one group serves (keys or key
// numbers).
type part[K any] struct {
	group slots.GroupID
	keys  []K
}

// split divides a call's keys (of slots sl) by the group that owns them
// under t, in group order and key order within a group.
func split[K any](t *topology, keys []K, sl []slots.Slot) []part[K] {
	var parts []part[K]
	for i, k := range keys {
		g := t.m.Owner(sl[i])
		j := slices.IndexFunc(parts, func(p part[K]) bool { return p.group == g })
		if j < 0 {
			parts = append(parts, part[K]{group: g})
			j = len(parts) - 1
		}
		parts[j].keys = append(parts[j].keys, k)
	}
	slices.SortFunc(parts, func(a, b part[K]) int { return int(a.group) - int(b.group) })
	return parts
}

// groupStats is what the load measured of one group's calls in the
// window (load.mu guards it).
type groupStats struct {
	intended *hdrhistogram.Histogram
	calls    int64
	ownOK    int64
}

func (l *load) groupStat(g slots.GroupID) *groupStats {
	st := l.perGroup[g]
	if st == nil {
		st = &groupStats{intended: hdrhistogram.New(1, 600_000_000, 3)}
		l.perGroup[g] = st
	}
	return st
}

// reportGroups prints each group's achieved key-grants/s and latency
// from the intended send (l.mu held).
func (l *load) reportGroups(secs float64) {
	ids := make([]slots.GroupID, 0, len(l.perGroup))
	for g := range l.perGroup {
		ids = append(ids, g)
	}
	slices.Sort(ids)
	for _, g := range ids {
		st := l.perGroup[g]
		h := st.intended
		fmt.Printf("group %d: achieved %.0f key-grants/s, %.0f calls/s; latency from the intended send p50 %s  p99 %s  max %s\n",
			g, float64(st.ownOK)/secs, float64(st.calls)/secs, fmtUs(h.ValueAtQuantile(50)), fmtUs(h.ValueAtQuantile(99)), fmtUs(h.Max()))
	}
}

// waitGroups waits until every group of a cluster of n data groups has a
// leader and three voters, and the data groups' leaders are spread over
// the nodes (each leads ⌊n/3⌋ or ⌈n/3⌉ of them), as the cluster arranges
// by itself after a bootstrap.
func waitGroups(admin allotv1.AdminClient, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		cancel()
		if err == nil && len(st.GetGroups()) == n+1 && st.GetTopologyVersion() > 0 {
			led := map[string]int{}
			ok := true
			for _, g := range st.GetGroups() {
				ok = ok && g.GetLeaderId() != "" && len(g.GetMembers()) == 3
				if g.GetId() != 0 {
					led[g.GetLeaderId()]++
				}
			}
			lo, hi := n/3, (n+2)/3
			for _, m := range st.GetMembers() {
				ok = ok && led[m.GetId()] >= lo && led[m.GetId()] <= hi
			}
			if ok {
				return nil
			}
			last = fmt.Sprint(led)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("the %d groups did not all get three voters and spread leaders (data groups led: %s)", n, last)
}

// roles names what each node leads: "leader" or "follower" in a cluster
// of one group, else the data groups it leads ("leads 1,3"; "leads
// none"). It also returns the nodes that lead a data group (the one
// leader in a cluster of one group).
func roles(admin allotv1.AdminClient, nodes []*node, groups, leader int) ([]string, []int, error) {
	out := make([]string, len(nodes))
	if groups <= 1 {
		for i := range out {
			out[i] = "follower"
		}
		out[leader] = "leader"
		return out, []int{leader}, nil
	}
	var st *allotv1.ClusterStatusResponse
	var err error
	for try := 0; try < 10; try++ { // a node under load may answer late
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		st, err = admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
		cancel()
		if err == nil {
			break
		}
	}
	if err != nil {
		return nil, nil, err
	}
	var leaders []int
	for i, n := range nodes {
		var led []string
		for _, g := range st.GetGroups() {
			if g.GetId() != 0 && g.GetLeaderId() == n.ID {
				led = append(led, strconv.Itoa(int(g.GetId())))
			}
		}
		if len(led) == 0 {
			out[i] = "leads none"
			continue
		}
		out[i] = "leads " + strings.Join(led, ",")
		leaders = append(leaders, i)
	}
	if len(leaders) == 0 {
		return nil, nil, errors.New("no node leads a data group")
	}
	return out, leaders, nil
}

// describeRoles is "b0 leads 1,3; b1 leads 2; …".
func describeRoles(nodes []*node, role []string) string {
	out := make([]string, len(nodes))
	for i, n := range nodes {
		out[i] = n.ID + " " + role[i]
	}
	return strings.Join(out, "; ")
}

// noteRecovered records a grant from a leader other than the killed one
// for group g since the kill; the recovery time is set once every group
// the killed node led has had one (with one group: at the first) (l.mu
// held).
func (l *load) noteRecovered(g slots.GroupID) {
	if len(l.unrecovered) == 0 {
		l.recovery = time.Since(l.killAt)
		return
	}
	if l.unrecovered[g] {
		delete(l.unrecovered, g)
		if len(l.unrecovered) == 0 {
			l.recovery = time.Since(l.killAt)
		}
	}
}

// busiestLeader returns the node that leads the most data groups and the
// groups it leads.
func busiestLeader(admin allotv1.AdminClient, nodes []*node) (int, []slots.GroupID, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
	if err != nil {
		return 0, nil, err
	}
	best, bestLed := -1, []slots.GroupID(nil)
	for i, n := range nodes {
		var led []slots.GroupID
		for _, g := range st.GetGroups() {
			if g.GetId() != 0 && g.GetLeaderId() == n.ID {
				led = append(led, slots.GroupID(g.GetId()))
			}
		}
		if len(led) > len(bestLed) {
			best, bestLed = i, led
		}
	}
	if best < 0 {
		return 0, nil, errors.New("no node leads a data group")
	}
	return best, bestLed, nil
}
