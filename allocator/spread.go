package allocator

import (
	"context"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// spreadInterval is how often the meta group's leader checks that the
// data groups' leaders are spread over the nodes.
const spreadInterval = time.Second

// spreadLoop runs the meta group leader's periodic duties of a cluster
// with several groups: it records the groups of a new cluster in the meta
// state (once), and spreads the data groups' leaders evenly over the live
// nodes by leadership transfers (meta.PlanLeaders), so that each node
// leads ⌊G/N⌋ or ⌈G/N⌉ of G data groups, again after a node restarts or
// joins. The meta group's own leader is left where its election put it:
// it serves no keys.
func (s *Server) spreadLoop() {
	// A new cluster records its groups as soon as its meta group has a
	// leader: poll quickly until then.
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	fast := true
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
		}
		if fast && s.metaBootstrapped() {
			fast = false
			t.Reset(spreadInterval)
		}
		if !s.IsLeader() || s.barrierTerm.Load() != s.node.raft.CurrentTerm() {
			continue
		}
		if !s.metaBootstrapped() {
			if s.grp.bootstrapData > 0 {
				if err := s.bootstrapMeta(); err != nil {
					s.log.Warn("meta state not bootstrapped; retrying", "err", err)
				}
			}
			continue
		}
		s.spreadLeaders()
	}
}

func (s *Server) metaBootstrapped() bool {
	var ok bool
	s.grp.meta.view(func(st *meta.State) { ok = st.Bootstrapped() })
	return ok
}

// bootstrapMeta records the new cluster's groups: data groups
// 1..bootstrapData, owning the slots evenly, with this node as member.
func (s *Server) bootstrapMeta() error {
	_, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Meta{Meta: &allotv1.MetaCommand{
		Op: allotv1.MetaOp_META_OP_BOOTSTRAP, ClusterId: s.grp.layout.ClusterID,
		DataGroups: uint32(s.grp.bootstrapData), Members: []string{s.cfg.NodeID}, Replicas: uint32(s.cfg.GroupReplicas),
	}}})
	if err == nil {
		s.log.Info("groups recorded", "data_groups", s.grp.bootstrapData)
	}
	return err
}

// spreadLeaders plans and makes the leadership transfers that even out
// the data groups' leaders over the live voters of the meta group.
func (s *Server) spreadLeaders() {
	var groups []meta.Group
	leaders := map[slots.GroupID]string{}
	var all []meta.Group
	s.grp.meta.view(func(st *meta.State) { all = st.Groups() })
	var remote []meta.Group
	for _, mg := range all {
		if mg.ID == 0 {
			continue
		}
		g := s.dataGroup(mg.ID)
		if g == nil {
			// A group this node hosts no replica of: its members as the
			// meta state names them, its leader as they report it.
			remote = append(remote, mg)
			continue
		}
		voters, err := voterIDs(g.node.raft)
		if err != nil {
			return
		}
		groups = append(groups, meta.Group{ID: g.id, Members: voters})
		if _, id := g.node.raft.LeaderWithID(); id != "" {
			leaders[g.id] = string(id)
		}
	}
	if len(remote) > 0 {
		s.learnLeaders(remote)
		for _, g := range remote {
			groups = append(groups, g)
			if h := s.grp.remote.get(g.ID); h.id != "" {
				leaders[g.ID] = h.id
			}
		}
	}
	live := s.liveVoters()
	for _, tr := range meta.PlanLeaders(groups, leaders, live) {
		if err := s.transferGroup(tr); err != nil {
			s.log.Warn("leadership of a group not moved", "group", tr.Group, "from", tr.From, "to", tr.To, "err", err)
			return
		}
		s.log.Info("group leadership moved to spread the leaders", "group", tr.Group, "from", tr.From, "to", tr.To)
	}
}

// learnLeaders asks the members of groups (which this node hosts no
// replica of) who leads them, through Admin.ClusterStatus, one call per
// member at most, and records what they answer.
func (s *Server) learnLeaders(groups []meta.Group) {
	addrs := map[string]string{}
	for _, m := range s.st.Members() {
		addrs[m.GetId()] = m.GetGrpcAddr()
	}
	asked := map[string]bool{}
	for _, g := range groups {
		for _, m := range g.Members {
			if asked[m] || addrs[m] == "" || m == s.cfg.NodeID {
				continue
			}
			asked[m] = true
			cc, err := s.fwd.conn(addrs[m])
			if err != nil {
				continue
			}
			ctx, cancel := context.WithTimeout(s.baseCtx, 300*time.Millisecond)
			st, err := allotv1.NewAdminClient(cc).ClusterStatus(s.withJoinToken(ctx), &allotv1.ClusterStatusRequest{})
			cancel()
			if err != nil {
				continue
			}
			known := true
			for _, gs := range st.GetGroups() {
				if gs.GetState() == "none" || gs.GetId() == 0 {
					continue // that member hosts no replica of it either
				}
				if l := gs.GetLeaderId(); l != "" && addrs[l] != "" && s.dataGroup(slots.GroupID(gs.GetId())) == nil {
					if s.grp.remote.set(slots.GroupID(gs.GetId()), leaderHint{id: l, addr: addrs[l]}) {
						s.notifyTopology()
					}
				}
			}
			for _, o := range groups {
				known = known && s.grp.remote.get(o.ID).id != ""
			}
			if known {
				return
			}
			break // the next group's members
		}
	}
}

// voterIDs returns the voters of the Raft group r.
func voterIDs(r *raft.Raft) ([]string, error) {
	f := r.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, err
	}
	var out []string
	for _, srv := range f.Configuration().Servers {
		if srv.Suffrage == raft.Voter {
			out = append(out, string(srv.ID))
		}
	}
	return out, nil
}

// liveVoters returns this node and the meta group's voters that can take
// a group's leadership now: their gRPC health service answers within a
// short time, and their own status shows them following this node in the
// meta group over Raft (inRaftContact). A node whose gRPC port answers
// while its Raft traffic is cut (a partition of the Raft port alone)
// must not be handed a leadership: hashicorp/raft refuses every write of
// the group while a transfer is in progress ("leadership transfer in
// progress"), and a transfer to an unreachable node stays in progress up
// to the transport's timeout, again at every spread check.
func (s *Server) liveVoters() []string {
	voters, err := voterIDs(s.node.raft)
	if err != nil {
		return []string{s.cfg.NodeID}
	}
	addrs := map[string]string{}
	for _, m := range s.st.Members() {
		addrs[m.GetId()] = m.GetGrpcAddr()
	}
	live := []string{s.cfg.NodeID}
	for _, id := range voters {
		if id == s.cfg.NodeID || addrs[id] == "" {
			continue
		}
		cc, err := s.fwd.conn(addrs[id])
		if err != nil {
			continue
		}
		ctx, cancel := context.WithTimeout(s.baseCtx, 300*time.Millisecond)
		resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		var st *allotv1.ClusterStatusResponse
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			st, err = allotv1.NewAdminClient(cc).ClusterStatus(s.withJoinToken(ctx), &allotv1.ClusterStatusRequest{})
		}
		cancel()
		if err == nil && inRaftContact(st, s.cfg.NodeID, s.cfg.HeartbeatTimeout) {
			live = append(live, id)
		}
	}
	return live
}

// inRaftContact reports whether a voter's own status st shows it in Raft
// contact with leader, the meta group's leader: it follows leader and
// last heard from it within maxContact. The data groups share the node's
// Raft address with the meta group, so a node cut off from the meta
// group's leader is cut off from the data groups' leaders too.
func inRaftContact(st *allotv1.ClusterStatusResponse, leader string, maxContact time.Duration) bool {
	return st != nil && st.GetState() == "follower" && st.GetLeaderId() == leader &&
		st.GetLastContactMs() <= maxContact.Milliseconds()
}

// transferGroup asks the leader of tr.Group (this node, or another
// through Admin.TransferLeadership) to hand it to tr.To.
func (s *Server) transferGroup(tr meta.Transfer) error {
	ctx, cancel := context.WithTimeout(s.baseCtx, 5*time.Second)
	defer cancel()
	req := &allotv1.TransferLeadershipRequest{Id: tr.To, Group: uint32(tr.Group)}
	return s.onGroup(ctx, tr.Group, false,
		func(ctx context.Context, g *dataGroup) error {
			_, err := s.transferLeadership(ctx, g.node.raft, tr.To)
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := allotv1.NewAdminClient(cc).TransferLeadership(ctx, req)
			return err
		})
}
