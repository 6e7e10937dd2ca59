package allocator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/groupdir"
	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// A data group is added to a running cluster in the meta state
// (Admin.AddGroup: AddGroup with members placed by meta.PlaceGroup among
// the meta group's voters, no slots). Every member then hosts it
// (hostLoop): it creates the group's directory, opens its Raft instance
// bootstrapped with the founders as voters (each founder bootstraps the
// same configuration, so the group elects a leader however the members
// start), and records it in hostedFile. Founders bootstrap only a new
// group (meta.Group.Bootstraps): the first change of its members clears
// them, and a node is made a member of a group that still has founders
// only once the group has a leader (addVoterToGroups), so that some
// founder has bootstrapped it. Slots come to it by moves (slots
// move, groups rebalance). A node that joins the cluster later becomes a
// member of the groups meta.GroupsToJoin names (addVoterToGroups): the
// meta state records it first, its hostLoop opens the group without a
// configuration, and the group's leader then adds it as a voter.

// hostInterval is how often a node checks, besides on every topology
// change, whether the meta state names it a member of a group it does
// not host yet.
const hostInterval = time.Second

// hostLoop opens the data groups the meta state adds with this node as a
// member. It stops when the Server does.
func (s *Server) hostLoop() {
	t := time.NewTicker(hostInterval)
	defer t.Stop()
	for {
		changed := s.topologyChanged()
		if err := s.hostNewGroups(); err != nil {
			s.log.Warn("a new data group not opened; retrying", "err", err)
		}
		select {
		case <-s.done:
			return
		case <-changed:
		case <-t.C:
		}
	}
}

// hostNewGroups opens every data group the meta state names this node a
// member of and that this node does not host.
func (s *Server) hostNewGroups() error {
	var groups []meta.Group
	s.grp.meta.view(func(st *meta.State) { groups = st.Groups() })
	addrs := map[string]string{}
	for _, m := range s.st.Members() {
		addrs[m.GetId()] = m.GetRaftAddr()
	}
	for _, g := range groups {
		if g.ID == 0 || !slices.Contains(g.Members, s.cfg.NodeID) || s.dataGroup(g.ID) != nil {
			continue
		}
		select {
		case <-s.done:
			return nil
		default:
		}
		// A founder of a new group bootstraps the group's configuration
		// (every founder the same); a member added later, or a founder
		// once the group's members changed (one back with an empty data
		// dir), waits for the leader to add it.
		boot := g.Bootstraps(s.cfg.NodeID)
		var peers []raft.Server
		if boot {
			for _, id := range g.Founders {
				if addrs[id] == "" {
					return fmt.Errorf("group %d: no Raft address recorded for member %s", g.ID, id)
				}
				peers = append(peers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(id), Address: raft.ServerAddress(addrs[id])})
			}
		}
		if _, err := s.grp.layout.OpenGroup(g.ID); errors.Is(err, groupdir.ErrMissingGroup) {
			if _, err := s.grp.layout.CreateGroup(g.ID); err != nil {
				return fmt.Errorf("allocator: %w", err)
			}
		} else if err != nil {
			return fmt.Errorf("allocator: %w", err)
		}
		if err := s.openDataGroup(g.ID, boot, peers); err != nil {
			return err
		}
		hosted, _, err := readHosted(s.cfg.DataDir)
		if err != nil {
			return err
		}
		if !slices.Contains(hosted, g.ID) {
			if err := writeHosted(s.cfg.DataDir, append(hosted, g.ID)); err != nil {
				return err
			}
		}
		s.log.Info("data group added", "group", g.ID, "members", g.Members)
		s.notifyTopology()
	}
	return nil
}

// AddGroup adds a data group on the meta group's leader, with members
// placed among the meta group's voters (all of them, or GroupReplicas
// of those that host the fewest groups), and answers once the group has
// a leader.
func (a *adminService) AddGroup(ctx context.Context, req *allotv1.AddGroupRequest) (*allotv1.AddGroupResponse, error) {
	s := a.s
	if !s.multi() {
		return nil, status.Error(codes.FailedPrecondition, "allocator: this cluster has one group: groups are added to a cluster bootstrapped with -groups N")
	}
	var resp *allotv1.AddGroupResponse
	err := s.onRaftLeader(ctx, s.node.raft, false,
		func(ctx context.Context) error {
			voters, err := voterIDs(s.node.raft)
			if err != nil {
				return err
			}
			var members []string
			s.grp.meta.view(func(st *meta.State) { members = st.PlaceGroup(voters) })
			res, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Meta{Meta: &allotv1.MetaCommand{
				Op: allotv1.MetaOp_META_OP_ADD_GROUP, Members: members,
			}}})
			if err != nil {
				return err
			}
			id, ok := res.(slots.GroupID)
			if !ok {
				return fmt.Errorf("allocator: AddGroup answered %T", res)
			}
			s.notifyTopology()
			leader, err := s.waitGroupLeader(ctx, id, members)
			resp = &allotv1.AddGroupResponse{Id: uint32(id), Members: members, LeaderId: leader}
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			r, err := allotv1.NewAdminClient(cc).AddGroup(ctx, req)
			resp = r
			return err
		})
	if err != nil {
		return nil, moveStatus(s, err)
	}
	return resp, nil
}

// waitGroupLeader waits until data group id has a leader, and returns
// the leader's id: known to this node's replica when it is a member, else
// to the group's members.
func (s *Server) waitGroupLeader(ctx context.Context, id slots.GroupID, members []string) (string, error) {
	for {
		if g := s.dataGroup(id); g != nil {
			if _, leader := g.node.raft.LeaderWithID(); leader != "" {
				return string(leader), nil
			}
		} else if !slices.Contains(members, s.cfg.NodeID) {
			s.learnLeaders([]meta.Group{{ID: id, Members: members}})
			if h := s.grp.remote.get(id); h.id != "" {
				return h.id, nil
			}
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("allocator: group %d added, no leader yet: %w", id, ctx.Err())
		case <-s.done:
			return "", errShutdown
		case <-time.After(20 * time.Millisecond):
		}
	}
}
