package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The Admin reads of a cluster with several groups are served from this
// node's replicas of every data group, merged.

// inspectKey names the key's slot and group and reads the key from the
// replica of that group.
func (s *Server) inspectKey(req *allotv1.InspectKeyRequest, now int64) (*allotv1.InspectKeyResponse, error) {
	resp, err := s.st.InspectKey(req, now)
	if err != nil || resp.GetKey() == "" {
		return resp, err
	}
	sl := slots.OfKey(resp.GetKey())
	if !s.multi() {
		resp.Slot = uint32(sl)
		return resp, nil
	}
	var owner slots.GroupID
	s.grp.meta.view(func(st *meta.State) { m := st.SlotMap(); owner = m.Owner(sl) })
	g, err := s.hostedGroup(owner)
	if err != nil {
		return nil, err
	}
	if resp, err = g.st.InspectKey(req, now); err != nil {
		return nil, err
	}
	resp.Slot, resp.Group = uint32(sl), uint32(owner)
	return resp, nil
}

// listLeases pages through the leases of every data group in id order.
// Its page token is "<group>/<the group's own token>".
func (s *Server) listLeases(req *allotv1.ListLeasesRequest, now int64) (*allotv1.ListLeasesResponse, error) {
	if !s.multi() {
		return s.st.ListLeases(req, now)
	}
	size := int(req.GetPageSize())
	if size <= 0 {
		size = 100
	}
	size = min(size, allotv1.MaxPageSize)
	from, tok := slots.GroupID(0), ""
	if t := req.GetPageToken(); t != "" {
		gs, inner, ok := strings.Cut(t, "/")
		g, err := slots.ParseGroup(gs)
		if !ok || err != nil {
			return nil, fmt.Errorf("%w: bad page_token %q", state.ErrInvalid, t)
		}
		from, tok = g, inner
	}
	out := &allotv1.ListLeasesResponse{}
	unknown := 0
	groups := s.dataGroups()
	for i, g := range groups {
		if g.id < from {
			continue
		}
		sub := proto.Clone(req).(*allotv1.ListLeasesRequest)
		sub.PageSize = int32(size - len(out.Leases))
		sub.PageToken = ""
		if g.id == from {
			sub.PageToken = tok
		}
		r, err := g.st.ListLeases(sub, now)
		if errors.Is(err, state.ErrUnknownAgent) {
			unknown++
			continue
		}
		if err != nil {
			return nil, err
		}
		out.Leases = append(out.Leases, r.GetLeases()...)
		out.NowUnixMs = r.GetNowUnixMs()
		if r.GetNextPageToken() != "" {
			out.NextPageToken = strconv.FormatUint(uint64(g.id), 10) + "/" + r.GetNextPageToken()
			return out, nil
		}
		if len(out.Leases) >= size && i+1 < len(groups) {
			out.NextPageToken = strconv.FormatUint(uint64(groups[i+1].id), 10) + "/"
			return out, nil
		}
	}
	if unknown > 0 && unknown == len(groups) {
		return nil, fmt.Errorf("%w: %q", state.ErrUnknownAgent, req.GetAgentId())
	}
	return out, nil
}

// listAgents merges the agents every data group has seen.
func (s *Server) listAgents(now int64) *allotv1.ListAgentsResponse {
	if !s.multi() {
		return s.st.ListAgents(now)
	}
	out := &allotv1.ListAgentsResponse{}
	seen := map[string]*allotv1.AgentInfo{}
	for _, g := range s.dataGroups() {
		r := g.st.ListAgents(now)
		out.NowUnixMs = r.GetNowUnixMs()
		for _, a := range r.GetAgents() {
			if prev := seen[a.GetAgentId()]; prev == nil {
				seen[a.GetAgentId()] = a
				out.Agents = append(out.Agents, a)
			} else if a.GetLastContactUnixMs() > prev.GetLastContactUnixMs() {
				prev.LastContactUnixMs = a.GetLastContactUnixMs()
			}
		}
	}
	slices.SortFunc(out.Agents, func(a, b *allotv1.AgentInfo) int { return cmp.Compare(a.GetAgentId(), b.GetAgentId()) })
	return out
}

// topKeys merges every data group's top keys (a key lives in one group).
func (s *Server) topKeys(req *allotv1.TopKeysRequest, now int64) *allotv1.TopKeysResponse {
	if !s.multi() {
		return s.st.TopKeys(req, now)
	}
	out := &allotv1.TopKeysResponse{}
	for _, g := range s.dataGroups() {
		r := g.st.TopKeys(req, now)
		out.Keys = append(out.Keys, r.GetKeys()...)
		out.NowUnixMs = r.GetNowUnixMs()
	}
	byDeny := req.GetOrder() == "deny"
	slices.SortStableFunc(out.Keys, func(a, b *allotv1.KeyRate) int {
		if byDeny {
			return cmp.Compare(b.GetDenyRate(), a.GetDenyRate())
		}
		return cmp.Compare(b.GetGrantRate(), a.GetGrantRate())
	})
	limit := int(req.GetLimit())
	if limit <= 0 {
		limit = 20
	}
	if len(out.Keys) > limit {
		out.Keys = out.Keys[:limit]
	}
	return out
}

// groupsStatus adds the groups of a cluster with several groups to a
// ClusterStatus answer, and sums the data groups' keys and leases.
func (s *Server) groupsStatus(resp *allotv1.ClusterStatusResponse) {
	if !s.multi() {
		return
	}
	var m slots.Map
	var metaGroups []meta.Group
	s.grp.meta.view(func(st *meta.State) { m, metaGroups = st.SlotMap(), st.Groups() })
	resp.ClusterId = s.grp.layout.ClusterID
	resp.TopologyVersion = m.Version()
	ids := []slots.GroupID{0}
	members := map[slots.GroupID][]string{}
	for _, g := range metaGroups {
		members[g.ID] = g.Members
		if g.ID != 0 {
			ids = append(ids, g.ID)
		}
	}
	for _, g := range s.dataGroups() {
		if !slices.Contains(ids, g.id) {
			ids = append(ids, g.id)
		}
	}
	slices.Sort(ids)
	resp.Keys, resp.Leases = 0, 0
	for _, id := range ids {
		gs := &allotv1.GroupStatus{Id: uint32(id), State: "none", Members: members[id]}
		if id != 0 && m.Version() > 0 {
			gs.Slots = slots.FormatRanges(m.RangesOf(id))
		}
		var r *raft.Raft
		var st *state.State
		if id == 0 {
			r, st = s.node.raft, s.st
		} else if g := s.dataGroup(id); g != nil {
			r, st = g.node.raft, g.st
		}
		if r != nil {
			_, leader := r.LeaderWithID()
			gs.LeaderId = string(leader)
			gs.State = roleName(r.State())
			gs.AppliedIndex, gs.CommitIndex = r.AppliedIndex(), r.CommitIndex()
			if v, err := voterIDs(r); err == nil {
				slices.Sort(v)
				gs.Members = v
			}
			stats := st.Stats()
			gs.Keys = stats.Keys
			if id != 0 {
				resp.Keys += stats.Keys
				resp.Leases += stats.Leases
				resp.Agents = max(resp.Agents, stats.Agents)
			}
		}
		resp.Groups = append(resp.Groups, gs)
	}
}

// addVoterToGroups adds a node that joined the meta group to every data
// group, and records it as a member of each (meta leader).
func (s *Server) addVoterToGroups(req *allotv1.AddVoterRequest) error {
	if !s.multi() {
		return nil
	}
	// The call may have been forwarded here; the data groups' leaders are
	// other nodes, which this node's own calls may reach.
	ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.ForwardTimeout)
	defer cancel()
	var groups []meta.Group
	var ok bool
	s.grp.meta.view(func(st *meta.State) { groups, ok = st.Groups(), st.Bootstrapped() })
	if !ok {
		return errNoGroups // the joining node retries
	}
	for _, g := range groups {
		if g.ID != 0 {
			sub := proto.Clone(req).(*allotv1.AddVoterRequest)
			sub.Group = uint32(g.ID)
			if _, err := s.addGroupVoter(ctx, sub); err != nil {
				return fmt.Errorf("allocator: add voter %s to group %d: %w", req.GetId(), g.ID, err)
			}
		}
		if slices.Contains(g.Members, req.GetId()) {
			continue
		}
		_, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Meta{Meta: &allotv1.MetaCommand{
			Op: allotv1.MetaOp_META_OP_SET_MEMBERS, Group: uint32(g.ID), Members: append(slices.Clone(g.Members), req.GetId()),
		}}})
		if err != nil {
			return err
		}
	}
	return nil
}

// addGroupVoter adds a voter to data group req.Group, on its leader.
func (s *Server) addGroupVoter(ctx context.Context, req *allotv1.AddVoterRequest) (*allotv1.AddVoterResponse, error) {
	r, err := s.groupRaft(req.GetGroup())
	if err != nil {
		return nil, err
	}
	err = s.onRaftLeader(ctx, r, true,
		func(ctx context.Context) error {
			return r.AddVoter(raft.ServerID(req.GetId()), raft.ServerAddress(req.GetRaftAddr()), 0, s.cfg.ApplyTimeout).Error()
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := allotv1.NewAdminClient(cc).AddVoter(ctx, req)
			return err
		})
	if err != nil {
		return nil, toStatus(err, s.hintFor(r))
	}
	return &allotv1.AddVoterResponse{}, nil
}

// removeFromGroups removes a server from every data group and from the
// groups' member lists in the meta state (meta leader).
func (s *Server) removeFromGroups(id string) error {
	if !s.multi() {
		return nil
	}
	ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.ForwardTimeout)
	defer cancel()
	var groups []meta.Group
	s.grp.meta.view(func(st *meta.State) { groups = st.Groups() })
	for _, g := range groups {
		if g.ID != 0 {
			if _, err := s.removeGroupServer(ctx, &allotv1.RemoveServerRequest{Id: id, Group: uint32(g.ID)}); err != nil {
				return fmt.Errorf("allocator: remove server %s from group %d: %w", id, g.ID, err)
			}
		}
		rest := slices.DeleteFunc(slices.Clone(g.Members), func(m string) bool { return m == id })
		if len(rest) == len(g.Members) || len(rest) == 0 {
			continue
		}
		if _, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Meta{Meta: &allotv1.MetaCommand{
			Op: allotv1.MetaOp_META_OP_SET_MEMBERS, Group: uint32(g.ID), Members: rest,
		}}}); err != nil {
			return err
		}
	}
	return nil
}

// removeGroupServer removes a server from data group req.Group, on its
// leader (a leader that removes itself steps down).
func (s *Server) removeGroupServer(ctx context.Context, req *allotv1.RemoveServerRequest) (*allotv1.RemoveServerResponse, error) {
	r, err := s.groupRaft(req.GetGroup())
	if err != nil {
		return nil, err
	}
	err = s.onRaftLeader(ctx, r, true,
		func(ctx context.Context) error {
			return r.RemoveServer(raft.ServerID(req.GetId()), 0, s.cfg.ApplyTimeout).Error()
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := allotv1.NewAdminClient(cc).RemoveServer(ctx, req)
			return err
		})
	if err != nil {
		return nil, toStatus(err, s.hintFor(r))
	}
	return &allotv1.RemoveServerResponse{}, nil
}
