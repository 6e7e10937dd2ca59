package allocator

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// errNoGroups: the meta group has not recorded the cluster's groups yet
// (a new cluster, for the first second or so).
var errNoGroups = status.Error(codes.Unavailable, "allocator: the cluster's groups are not recorded yet; retry")

// router is a snapshot of what routing a key needs: the meta group's rule
// set (a key's canonical form depends on the rule it matches), the slot
// map and the moves in flight.
type router struct {
	set   *rules.Set
	m     slots.Map
	moves []meta.Move
	ok    bool // the meta state is bootstrapped
}

func (s *Server) router() router {
	rt := router{set: s.st.Rules()}
	s.grp.meta.view(func(st *meta.State) {
		rt.ok = st.Bootstrapped()
		rt.m = st.SlotMap()
		rt.moves = st.Moves()
	})
	return rt
}

// keyOf returns the canonical key's hash of (domain, entries) under the
// rule it matches, and that rule.
func (rt *router) keyOf(domain string, es []*allotv1.Entry) (uint64, *rules.Rule, []rules.Entry) {
	ents := make([]rules.Entry, len(es))
	for i, e := range es {
		ents[i] = rules.Entry{Key: e.GetKey(), Value: e.GetValue()}
	}
	var r *rules.Rule
	if rt.set != nil {
		r = rt.set.Match(domain, ents)
	}
	return rules.KeyHash(r, domain, ents), r, ents
}

// owner returns the group that owns the key hashed h, and whether its slot
// is between groups (a move past its freeze): no group serves it.
func (rt *router) owner(h uint64) (slots.GroupID, bool) {
	sl := slots.Of(h)
	for _, mv := range rt.moves {
		if mv.Range.Contains(sl) && mv.Phase >= meta.PhaseFrozen {
			return rt.m.Owner(sl), true
		}
	}
	return rt.m.Owner(sl), false
}

// topology is the slot map and every data group's leader, as this node
// knows them.
func (s *Server) topology() *allotv1.Topology {
	var m slots.Map
	var ids []slots.GroupID
	s.grp.meta.view(func(st *meta.State) {
		m = st.SlotMap()
		if st.Bootstrapped() {
			ids = st.DataGroups()
		}
	})
	t := &allotv1.Topology{Version: m.Version()}
	for _, id := range ids {
		gr := &allotv1.GroupRoute{Id: uint32(id), Slots: slots.FormatRanges(m.RangesOf(id))}
		h := s.groupHint(id)
		gr.LeaderId, gr.LeaderAddr = h.id, h.addr
		if g := s.dataGroup(id); g != nil {
			gr.RulesVersion = rulesVersionOf(g.st)
		}
		t.Groups = append(t.Groups, gr)
	}
	return t
}

// groupRaft returns the Raft of group id: the meta group (or the only
// group) for 0.
func (s *Server) groupRaft(id uint32) (*raft.Raft, error) {
	if id == 0 {
		return s.node.raft, nil
	}
	if !s.multi() {
		return nil, status.Errorf(codes.InvalidArgument, "allocator: group %d: this cluster has one group", id)
	}
	g := s.dataGroup(slots.GroupID(id))
	if g == nil {
		return nil, status.Errorf(codes.NotFound, "allocator: group %d: node %s hosts no replica of it", id, s.cfg.NodeID)
	}
	return g.node.raft, nil
}

// waitRulesIn waits, for at most ForwardWait, until data group g has
// applied the meta group's rules version: a group serves a key only under
// the rules version the cluster has.
func (s *Server) waitRulesIn(ctx context.Context, g *dataGroup, version uint64) error {
	if rulesVersionOf(g.st) >= version {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ForwardWait)
	defer cancel()
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for rulesVersionOf(g.st) < version {
		select {
		case <-ctx.Done():
			return status.Errorf(codes.Unavailable, "allocator: group %d has not applied rules version %d yet", g.id, version)
		case <-s.done:
			return errShutdown
		case <-t.C:
		}
	}
	return nil
}

// waitGroupRules waits until every data group replica on this node has
// applied rules version (a no-op in a single-group cluster).
func (s *Server) waitGroupRules(ctx context.Context, version uint64) error {
	if !s.multi() {
		return nil
	}
	for _, g := range s.dataGroups() {
		if err := s.waitRulesIn(ctx, g, version); err != nil {
			return err
		}
	}
	return nil
}

// noHeaderStream is a server transport stream that drops headers: the
// calls of a split Acquire go to several leaders, and none of them is
// the one the caller should send its next call to.
type noHeaderStream struct{ grpc.ServerTransportStream }

func (noHeaderStream) Method() string                  { return "" }
func (noHeaderStream) SetHeader(metadata.MD) error     { return nil }
func (noHeaderStream) SendHeader(metadata.MD) error    { return nil }
func (noHeaderStream) SetTrailer(md metadata.MD) error { return nil }

// acquirePart is the keys of one Acquire that one group serves.
type acquirePart struct {
	group slots.GroupID
	idx   []int // positions of the keys in the caller's request
	req   *allotv1.AcquireRequest
	resp  *allotv1.AcquireResponse
	err   error
}

// acquireRouted serves an Acquire in a cluster with several groups. A
// call addressed to a group (AcquireRequest.group) is served by that
// group's leader, and keys the group does not serve are answered
// KEY_STATUS_MOVED. A call to group 0 is split: each group gets its keys,
// concurrently. Keys between groups (a move past its freeze) are answered
// KEY_STATUS_MOVED either way. The answer carries the topology when the
// caller's is older or a key moved.
func (s *Server) acquireRouted(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, string, error) {
	rt := s.router()
	if !rt.ok {
		return nil, "", errNoGroups
	}
	keys := req.GetKeys()
	if p := req.GetPackedKeys(); len(p) > 0 {
		// Validated (state.ValidateAcquire): each group gets its keys as
		// messages.
		ks, err := allotv1.UnpackKeys(p)
		if err != nil {
			return nil, "", status.Error(codes.InvalidArgument, err.Error())
		}
		keys = ks
	}
	n := len(keys)
	grants := make([]*allotv1.KeyGrant, n)
	parts := map[slots.GroupID]*acquirePart{}
	part := func(g slots.GroupID) *acquirePart {
		p := parts[g]
		if p == nil {
			p = &acquirePart{group: g, req: &allotv1.AcquireRequest{
				AgentId: req.GetAgentId(), RequestId: req.GetRequestId(), RulesVersion: req.GetRulesVersion(),
				FallbackKeys: req.GetFallbackKeys(), Group: uint32(g), TopologyVersion: rt.m.Version(),
			}}
			parts[g] = p
		}
		return p
	}
	moved := false
	for i, k := range keys {
		h, r, ents := rt.keyOf(k.GetDomain(), k.GetEntries())
		g, between := rt.owner(h)
		if between || (req.GetGroup() != 0 && uint32(g) != req.GetGroup()) {
			grants[i] = &allotv1.KeyGrant{Status: allotv1.KeyStatus_KEY_STATUS_MOVED, Key: string(rules.AppendKey(nil, r, k.GetDomain(), ents))}
			moved = true
			continue
		}
		p := part(g)
		p.idx = append(p.idx, i)
		p.req.Keys = append(p.req.Keys, k)
	}
	if n == 0 {
		// A call without keys still registers the agent: with its group.
		g := slots.GroupID(req.GetGroup())
		if g == 0 {
			g = rt.m.Owner(0)
		}
		part(g)
	}
	list := make([]*acquirePart, 0, len(parts))
	for _, p := range parts {
		list = append(list, p)
	}
	slices.SortFunc(list, func(a, b *acquirePart) int { return int(a.group) - int(b.group) })
	path := "local"
	if len(list) == 1 {
		path = s.acquireOnGroup(ctx, list[0])
	} else if len(list) > 1 {
		sctx := grpc.NewContextWithServerTransportStream(ctx, noHeaderStream{})
		var wg sync.WaitGroup
		for _, p := range list {
			wg.Go(func() { s.acquireOnGroup(sctx, p) })
		}
		wg.Wait()
		path = "split"
	}
	// The answer's time is the earliest of the groups' commit times: a
	// lease the caller times from it ends no later than the group's.
	out := &allotv1.AcquireResponse{RulesVersion: ^uint64(0), NowUnixMs: -1}
	for _, p := range list {
		if p.err != nil {
			return nil, path, p.err
		}
		gs, err := allotv1.GrantsOf(p.resp)
		if err != nil {
			return nil, path, fmt.Errorf("allocator: group %d's answer: %w", p.group, err)
		}
		if len(gs) != len(p.idx) {
			return nil, path, fmt.Errorf("allocator: group %d answered %d grants for %d keys", p.group, len(gs), len(p.idx))
		}
		for j, i := range p.idx {
			grants[i] = gs[j]
		}
		out.LiveAgents = max(out.LiveAgents, p.resp.GetLiveAgents())
		out.RulesVersion = min(out.RulesVersion, p.resp.GetRulesVersion())
		if out.NowUnixMs < 0 || p.resp.GetNowUnixMs() < out.NowUnixMs {
			out.NowUnixMs = p.resp.GetNowUnixMs()
		}
		out.LeaderId = p.resp.GetLeaderId()
	}
	if len(list) == 0 {
		out.RulesVersion, out.NowUnixMs = s.rulesVersion(), time.Now().UnixMilli()
	}
	if len(list) != 1 {
		out.LeaderId = s.cfg.NodeID
	}
	out.Grants = grants
	if moved || req.GetTopologyVersion() < rt.m.Version() {
		out.Topology = s.topology()
	}
	resp, err := answer(out, out.LeaderId, req.GetPackedGrants())
	return resp, path, err
}

// acquireOnGroup serves p on its group's leader: this node's batcher when
// it leads the group, else the leader's, through a forwarded call (from a
// follower, or from a node that hosts no replica of the group). It
// returns the path taken.
func (s *Server) acquireOnGroup(ctx context.Context, p *acquirePart) string {
	path := "local"
	p.err = s.onGroup(ctx, p.group, true,
		func(ctx context.Context, g *dataGroup) error {
			path = "local"
			if err := s.waitRulesIn(ctx, g, s.rulesVersion()); err != nil {
				return err
			}
			r, err := g.batcher.submit(ctx, p.req)
			if err == nil {
				p.resp, err = answer(r, s.cfg.NodeID, false)
			}
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			path = "forwarded"
			r, err := allotv1.NewAllocatorClient(cc).Acquire(ctx, p.req)
			p.resp = r
			return err
		})
	return path
}

// releaseRouted serves a Release in a cluster with several groups: each
// group gets the keys it owns, and, with all, every group ends the agent's
// leases. Keys between groups are skipped: their tokens stay with the
// frozen state, which the move carries over.
func (s *Server) releaseRouted(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	rt := s.router()
	if !rt.ok {
		return nil, errNoGroups
	}
	parts := map[slots.GroupID]*allotv1.ReleaseRequest{}
	part := func(g slots.GroupID) *allotv1.ReleaseRequest {
		p := parts[g]
		if p == nil {
			p = &allotv1.ReleaseRequest{AgentId: req.GetAgentId(), RequestId: req.GetRequestId(), All: req.GetAll(), Group: uint32(g)}
			parts[g] = p
		}
		return p
	}
	for _, k := range req.GetKeys() {
		h, _, _ := rt.keyOf(k.GetDomain(), k.GetEntries())
		g, between := rt.owner(h)
		if between || (req.GetGroup() != 0 && uint32(g) != req.GetGroup()) {
			continue
		}
		p := part(g)
		p.Keys = append(p.Keys, k)
	}
	if req.GetAll() {
		if req.GetGroup() != 0 {
			part(slots.GroupID(req.GetGroup()))
		} else {
			for _, g := range rt.m.Groups() {
				part(g)
			}
		}
	}
	out := &allotv1.ReleaseResponse{}
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	sctx := grpc.NewContextWithServerTransportStream(ctx, noHeaderStream{})
	for g, p := range parts {
		wg.Go(func() {
			r, err := s.releaseOnGroup(sctx, g, p)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			out.Returned += r.GetReturned()
			out.LeasesEnded += r.GetLeasesEnded()
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		return nil, errs[0]
	}
	return out, nil
}

// releaseOnGroup applies req in data group id, on its leader (forwarded
// from a node that hosts no replica of the group).
func (s *Server) releaseOnGroup(ctx context.Context, id slots.GroupID, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	if g := s.dataGroup(id); g != nil {
		resp, err := s.releaseOn(ctx, g.node.raft, req)
		return resp, s.groupLeaderErr(err, g)
	}
	var resp *allotv1.ReleaseResponse
	err := s.onRemoteGroup(ctx, id, true, func(ctx context.Context, cc *grpc.ClientConn) error {
		out, err := allotv1.NewAllocatorClient(cc).Release(ctx, req)
		resp = out
		return err
	})
	return resp, err
}

// applyRelease commits a Release in the Raft group r.
func (s *Server) applyRelease(r *raft.Raft, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	res, err := s.applyOn(r, &allotv1.Command{Cmd: &allotv1.Command_Release{Release: req}})
	if err != nil {
		return nil, err
	}
	resp, ok := res.(*allotv1.ReleaseResponse)
	if !ok {
		return nil, fmt.Errorf("allocator: release applied with unexpected result %T", res)
	}
	return resp, nil
}

// checkGroup returns the data group that serves a Check in a cluster
// with several groups: the one that owns its keys. A check whose keys are
// in several groups is refused: a check-and-take is atomic only within
// one group. A check addressed to a group (CheckRequest.group) that does
// not own its keys is refused too (FailedPrecondition, naming the owner
// and its leader), as Acquire answers such keys KEY_STATUS_MOVED: a group
// serves a key only from the slot owner's bucket.
func (s *Server) checkGroup(req *allotv1.CheckRequest) (slots.GroupID, error) {
	rt := s.router()
	if !rt.ok {
		return 0, errNoGroups
	}
	var owner slots.GroupID
	for i, d := range req.GetDescriptors() {
		h, _, _ := rt.keyOf(req.GetDomain(), d.GetEntries())
		g, between := rt.owner(h)
		if between {
			return 0, status.Errorf(codes.Unavailable, "allocator: check: descriptor %d's key is between groups (a slot move); retry", i)
		}
		if i > 0 && g != owner {
			return 0, status.Errorf(codes.FailedPrecondition,
				"allocator: check: the descriptors' keys are in groups %d and %d; a check-and-take spans one group: check them separately", owner, g)
		}
		owner = g
	}
	if want := slots.GroupID(req.GetGroup()); want != 0 && want != owner {
		h := s.groupHint(owner)
		return 0, status.Errorf(codes.FailedPrecondition,
			"allocator: check: the keys are group %d's (leader %q at %q), not group %d's: address the check to group %d or to no group",
			owner, h.id, h.addr, want, owner)
	}
	return owner, nil
}

// watchRouted is WatchRules in a cluster with several groups: each
// message carries the topology too, and one is sent when the rules or the
// topology change.
func (s *Server) watchRouted(req *allotv1.WatchRulesRequest, stream grpc.ServerStreamingServer[allotv1.RuleSet]) error {
	ctx := stream.Context()
	if err := s.waitServable(ctx); err != nil {
		return err
	}
	known := req.GetKnownVersion()
	first := true
	var sent *allotv1.Topology
	for {
		changed, topoChanged := s.rulesChanged(), s.topologyChanged()
		rs := s.st.RuleSet()
		topo := s.topology()
		if rs.GetVersion() > known || (first && known == 0) || !proto.Equal(topo, sent) {
			msg := &allotv1.RuleSet{Version: rs.GetVersion(), Files: rs.GetFiles(), UpdatedUnixMs: rs.GetUpdatedUnixMs(), Topology: topo}
			if err := stream.Send(msg); err != nil {
				return err
			}
			known, sent = rs.GetVersion(), topo
		}
		first = false
		select {
		case <-changed:
		case <-topoChanged:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-s.done:
			return s.status(errShutdown)
		}
	}
}

// acquireGroups is Acquire in a cluster with several groups, with the
// same metrics: a call addressed to a group this node hosts goes whole to
// that group (acquireAddressed), any other is routed key by key.
func (a *allocatorService) acquireGroups(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	start := time.Now()
	resp, path, ok, err := a.s.acquireAddressed(ctx, req)
	if !ok {
		resp, path, err = a.s.acquireRouted(ctx, req)
	}
	return a.s.acquireAnswered(resp, err, path, start)
}
