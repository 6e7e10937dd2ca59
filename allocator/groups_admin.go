package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The Admin reads of a cluster with several groups are served from this
// node's replicas of the data groups, merged; a group this node hosts no
// replica of is read on its leader (readGroup), with the call's group
// set. A call forwarded here by another node is answered unredacted: the
// node that took the caller's call redacts the merged answer.

// readGroups returns the data groups of the meta state, in id order.
func (s *Server) readGroups() ([]slots.GroupID, error) {
	var ids []slots.GroupID
	ok := false
	s.grp.meta.view(func(st *meta.State) {
		if ok = st.Bootstrapped(); ok {
			ids = st.DataGroups()
		}
	})
	if !ok {
		return nil, errNoGroups
	}
	return ids, nil
}

// inspectKey names the key's slot and group and reads the key from the
// replica of that group: this node's, or the group leader's.
func (s *Server) inspectKey(ctx context.Context, req *allotv1.InspectKeyRequest, now int64) (*allotv1.InspectKeyResponse, error) {
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
	err = s.readGroup(ctx, owner,
		func(g *dataGroup) error {
			resp, err = g.st.InspectKey(req, now)
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			resp, err = allotv1.NewAdminClient(cc).InspectKey(ctx, req)
			return err
		})
	if err != nil {
		return nil, err
	}
	resp.Slot, resp.Group = uint32(sl), uint32(owner)
	return resp, nil
}

// leasesIn lists the leases of data group id (req.Group set), on this
// node's replica or the group leader's. Its page token is the group's
// own.
func (s *Server) leasesIn(ctx context.Context, id slots.GroupID, req *allotv1.ListLeasesRequest, now int64) (*allotv1.ListLeasesResponse, error) {
	var out *allotv1.ListLeasesResponse
	err := s.readGroup(ctx, id,
		func(g *dataGroup) error {
			var err error
			out, err = g.st.ListLeases(req, now)
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			sub := proto.CloneOf(req)
			sub.Group = uint32(id)
			var err error
			out, err = allotv1.NewAdminClient(cc).ListLeases(ctx, sub)
			if status.Code(err) == codes.NotFound {
				return fmt.Errorf("%w: %q", state.ErrUnknownAgent, req.GetAgentId())
			}
			return err
		})
	return out, err
}

// listLeases pages through the leases of every data group in id order.
// Its page token is "<group>/<the group's own token>" (the group's own
// token when the call names a group).
func (s *Server) listLeases(ctx context.Context, req *allotv1.ListLeasesRequest, now int64) (*allotv1.ListLeasesResponse, error) {
	if !s.multi() {
		return s.st.ListLeases(req, now)
	}
	if id := req.GetGroup(); id != 0 {
		return s.leasesIn(ctx, slots.GroupID(id), req, now)
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
	groups, err := s.readGroups()
	if err != nil {
		return nil, err
	}
	out := &allotv1.ListLeasesResponse{}
	unknown := 0
	for i, id := range groups {
		if id < from {
			continue
		}
		sub := proto.CloneOf(req)
		sub.PageSize = int32(size - len(out.Leases))
		sub.PageToken = ""
		if id == from {
			sub.PageToken = tok
		}
		r, err := s.leasesIn(ctx, id, sub, now)
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
			out.NextPageToken = strconv.FormatUint(uint64(id), 10) + "/" + r.GetNextPageToken()
			return out, nil
		}
		if len(out.Leases) >= size && i+1 < len(groups) {
			out.NextPageToken = strconv.FormatUint(uint64(groups[i+1]), 10) + "/"
			return out, nil
		}
	}
	if unknown > 0 && unknown == len(groups) {
		return nil, fmt.Errorf("%w: %q", state.ErrUnknownAgent, req.GetAgentId())
	}
	return out, nil
}

// eachGroup calls read with each data group's answer to a read (or only
// group's, when not 0), taken from this node's replica or the group
// leader's.
func eachGroup[R any](s *Server, ctx context.Context, group uint32,
	local func(g *dataGroup) R,
	remote func(ctx context.Context, cc *grpc.ClientConn, id slots.GroupID) (R, error),
	read func(R),
) error {
	groups := []slots.GroupID{slots.GroupID(group)}
	if group == 0 {
		var err error
		if groups, err = s.readGroups(); err != nil {
			return err
		}
	}
	for _, id := range groups {
		var r R
		err := s.readGroup(ctx, id,
			func(g *dataGroup) error { r = local(g); return nil },
			func(ctx context.Context, cc *grpc.ClientConn) error {
				var err error
				r, err = remote(ctx, cc, id)
				return err
			})
		if err != nil {
			return err
		}
		read(r)
	}
	return nil
}

// listAgents merges the agents every data group has seen.
func (s *Server) listAgents(ctx context.Context, req *allotv1.ListAgentsRequest, now int64) (*allotv1.ListAgentsResponse, error) {
	if !s.multi() {
		return s.st.ListAgents(now), nil
	}
	out := &allotv1.ListAgentsResponse{}
	seen := map[string]*allotv1.AgentInfo{}
	err := eachGroup(s, ctx, req.GetGroup(),
		func(g *dataGroup) *allotv1.ListAgentsResponse { return g.st.ListAgents(now) },
		func(ctx context.Context, cc *grpc.ClientConn, id slots.GroupID) (*allotv1.ListAgentsResponse, error) {
			return allotv1.NewAdminClient(cc).ListAgents(ctx, &allotv1.ListAgentsRequest{Group: uint32(id)})
		},
		func(r *allotv1.ListAgentsResponse) {
			out.NowUnixMs = r.GetNowUnixMs()
			for _, a := range r.GetAgents() {
				if prev := seen[a.GetAgentId()]; prev == nil {
					seen[a.GetAgentId()] = a
					out.Agents = append(out.Agents, a)
				} else if a.GetLastContactUnixMs() > prev.GetLastContactUnixMs() {
					prev.LastContactUnixMs = a.GetLastContactUnixMs()
				}
			}
		})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out.Agents, func(a, b *allotv1.AgentInfo) int { return cmp.Compare(a.GetAgentId(), b.GetAgentId()) })
	return out, nil
}

// topKeys merges every data group's top keys (a key lives in one group).
func (s *Server) topKeys(ctx context.Context, req *allotv1.TopKeysRequest, now int64) (*allotv1.TopKeysResponse, error) {
	if !s.multi() {
		return s.st.TopKeys(req, now), nil
	}
	out := &allotv1.TopKeysResponse{}
	err := eachGroup(s, ctx, req.GetGroup(),
		func(g *dataGroup) *allotv1.TopKeysResponse { return g.st.TopKeys(req, now) },
		func(ctx context.Context, cc *grpc.ClientConn, id slots.GroupID) (*allotv1.TopKeysResponse, error) {
			sub := proto.CloneOf(req)
			sub.Group = uint32(id)
			return allotv1.NewAdminClient(cc).TopKeys(ctx, sub)
		},
		func(r *allotv1.TopKeysResponse) {
			out.Keys = append(out.Keys, r.GetKeys()...)
			out.NowUnixMs = r.GetNowUnixMs()
		})
	if err != nil {
		return nil, err
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
	return out, nil
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

// addVoterToGroups records a node that joined the meta group as one of
// its members, and makes it a member of the data groups
// meta.GroupsToJoin names (meta leader): recorded in the meta state
// first, so that the node opens its replica (hostLoop), then added as a
// voter by the group's leader, which this node asks as itself
// (asNode). A retry finishes what a failed call began.
func (s *Server) addVoterToGroups(req *allotv1.AddVoterRequest) error {
	if !s.multi() {
		return nil
	}
	ctx, cancel := s.asNode()
	defer cancel()
	s.grp.joinMu.Lock()
	defer s.grp.joinMu.Unlock()
	var groups []meta.Group
	var join []slots.GroupID
	var ok bool
	s.grp.meta.view(func(st *meta.State) {
		if ok = st.Bootstrapped(); ok {
			groups, join = st.Groups(), st.GroupsToJoin(req.GetId())
		}
	})
	if !ok {
		return errNoGroups // the joining node retries
	}
	for _, g := range groups {
		member := slices.Contains(g.Members, req.GetId())
		if !member && (g.ID == 0 || slices.Contains(join, g.ID)) {
			if g.ID != 0 && len(g.Founders) > 0 {
				// Recording the member clears the founders (no node
				// bootstraps the group after): a new group is joined
				// once one of its founders has bootstrapped it.
				wctx, wcancel := context.WithTimeout(ctx, newGroupLeaderWait)
				_, err := s.waitGroupLeader(wctx, g.ID, g.Members)
				wcancel()
				if err != nil {
					return status.Errorf(codes.Unavailable, "allocator: add voter %s to group %d: the new group has no leader yet; retry: %v", req.GetId(), g.ID, err)
				}
			}
			_, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Meta{Meta: &allotv1.MetaCommand{
				Op: allotv1.MetaOp_META_OP_SET_MEMBERS, Group: uint32(g.ID), Members: append(slices.Clone(g.Members), req.GetId()),
			}}})
			if err != nil {
				return err
			}
			member = true
		}
		if g.ID == 0 || !member {
			continue
		}
		sub := proto.Clone(req).(*allotv1.AddVoterRequest)
		sub.Group = uint32(g.ID)
		if _, err := s.addGroupVoter(ctx, sub); err != nil {
			return fmt.Errorf("allocator: add voter %s to group %d: %w", req.GetId(), g.ID, err)
		}
	}
	return nil
}

// newGroupLeaderWait bounds how long a join waits for a new data group
// (one whose founders are still recorded) to have a leader before it
// records the joining node as a member.
const newGroupLeaderWait = 10 * time.Second

// addGroupVoter adds a voter to data group req.Group, on its leader.
func (s *Server) addGroupVoter(ctx context.Context, req *allotv1.AddVoterRequest) (*allotv1.AddVoterResponse, error) {
	id := slots.GroupID(req.GetGroup())
	err := s.onGroup(ctx, id, true,
		func(ctx context.Context, g *dataGroup) error {
			return g.node.raft.AddVoter(raft.ServerID(req.GetId()), raft.ServerAddress(req.GetRaftAddr()), 0, s.cfg.ApplyTimeout).Error()
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := allotv1.NewAdminClient(cc).AddVoter(ctx, req)
			return err
		})
	if err != nil {
		return nil, toStatus(err, s.groupHint(id))
	}
	return &allotv1.AddVoterResponse{}, nil
}

// removeFromGroups removes a server from every data group and from the
// groups' member lists in the meta state (meta leader), on behalf of the
// caller of ctx (asCaller): each data group's leader checks that caller.
// Each group's step is idempotent, and the meta group's list is changed
// last, so a retry after a failure finishes the removal.
func (s *Server) removeFromGroups(ctx context.Context, id string) error {
	if !s.multi() {
		return nil
	}
	ctx, cancel := s.asCaller(ctx)
	defer cancel()
	s.grp.joinMu.Lock()
	defer s.grp.joinMu.Unlock()
	var groups []meta.Group
	s.grp.meta.view(func(st *meta.State) { groups = st.Groups() })
	metaLast := func(g meta.Group) int {
		if g.ID == 0 {
			return 1
		}
		return 0
	}
	slices.SortStableFunc(groups, func(a, b meta.Group) int { return cmp.Compare(metaLast(a), metaLast(b)) })
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
	id := slots.GroupID(req.GetGroup())
	err := s.onGroup(ctx, id, true,
		func(ctx context.Context, g *dataGroup) error {
			return g.node.raft.RemoveServer(raft.ServerID(req.GetId()), 0, s.cfg.ApplyTimeout).Error()
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := allotv1.NewAdminClient(cc).RemoveServer(ctx, req)
			return err
		})
	if err != nil {
		return nil, toStatus(err, s.groupHint(id))
	}
	return &allotv1.RemoveServerResponse{}, nil
}
