package allocator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// adminService implements the operator-facing allot.v1.Admin service.
// Writes (PutRules, Check, membership, leadership) run on the leader, and
// are forwarded there from a follower. Reads (GetRules, ListLeases,
// InspectKey, ListAgents, TopKeys, ClusterStatus) are served from the
// answering node's replica, which may lag the leader by a few milliseconds.
type adminService struct {
	allotv1.UnimplementedAdminServer
	s *Server
}

// PutRules compiles the files first: a bad set is rejected with
// InvalidArgument (the file:line message) and nothing changes.
func (a *adminService) PutRules(ctx context.Context, req *allotv1.PutRulesRequest) (*allotv1.PutRulesResponse, error) {
	s := a.s
	if len(req.GetFiles()) == 0 && !req.GetReplaceAll() {
		return nil, status.Error(codes.InvalidArgument, "allocator: put rules: no files")
	}
	if req.GetVersion() != 0 {
		return nil, status.Error(codes.InvalidArgument, "allocator: put rules: version is set only inside the replicated log")
	}
	compiled, err := rules.Compile(1, ruleFiles(req.GetFiles()))
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if req.GetDryRun() {
		return a.dryRun(req, compiled)
	}
	var resp *allotv1.PutRulesResponse
	err = s.onLeader(ctx, false,
		func(ctx context.Context) error {
			res, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_PutRules{PutRules: req}})
			if err != nil {
				return err
			}
			r, ok := res.(*allotv1.PutRulesResponse)
			if !ok {
				return fmt.Errorf("allocator: put rules applied with unexpected result %T", res)
			}
			resp = r
			// Every data group follows the meta group's rules: answer once
			// this node's replicas of them have the new version.
			return s.waitGroupRules(ctx, r.GetVersion())
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			r, err := allotv1.NewAdminClient(cc).PutRules(ctx, req)
			resp = r
			return err
		})
	if err != nil {
		return nil, s.status(err)
	}
	return resp, nil
}

// dryRun reports what a put would produce, from this node's replica.
func (a *adminService) dryRun(req *allotv1.PutRulesRequest, compiled *rules.Set) (*allotv1.PutRulesResponse, error) {
	cur := a.s.st.Rules()
	var version uint64
	var domains []string
	if cur != nil {
		version = cur.Version()
		if !req.GetReplaceAll() {
			domains = append(domains, cur.Domains()...)
		}
	}
	if ev := req.GetExpectedVersion(); ev != 0 && ev != version {
		return nil, status.Errorf(codes.FailedPrecondition, "allocator: put rules: expected version %d, current is %d", ev, version)
	}
	for _, d := range compiled.Domains() {
		if !slices.Contains(domains, d) {
			domains = append(domains, d)
		}
	}
	slices.Sort(domains)
	return &allotv1.PutRulesResponse{Version: version, Domains: domains}, nil
}

// GetRules returns the rule set: this node's, or with linearizable the
// leader's after it confirmed its leadership with a quorum, so the answer
// holds every PutRules that returned before the call (read-your-writes
// through any node). Either way the answering replica has caught up
// (waitServable): a new leader has completed its Barrier.
func (a *adminService) GetRules(ctx context.Context, req *allotv1.GetRulesRequest) (*allotv1.RuleSet, error) {
	s := a.s
	if !req.GetLinearizable() {
		if err := s.waitServable(ctx); err != nil {
			return nil, err
		}
		return s.st.RuleSet(), nil
	}
	var rs *allotv1.RuleSet
	err := s.onLeader(ctx, true,
		func(ctx context.Context) error {
			// PutRules answers once the leader has applied the entry, so
			// the leader's state after its Barrier and VerifyLeader holds
			// it.
			if err := s.waitServable(ctx); err != nil {
				return err
			}
			if err := s.node.raft.VerifyLeader().Error(); err != nil {
				return err
			}
			rs = s.st.RuleSet()
			return nil
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			r, err := allotv1.NewAdminClient(cc).GetRules(ctx, req)
			rs = r
			return err
		})
	if err != nil {
		return nil, s.status(err)
	}
	return rs, nil
}

func (a *adminService) ListLeases(ctx context.Context, req *allotv1.ListLeasesRequest) (*allotv1.ListLeasesResponse, error) {
	if err := a.s.waitServable(ctx); err != nil {
		return nil, err
	}
	resp, err := a.s.listLeases(ctx, req, time.Now().UnixNano())
	if err != nil {
		return nil, a.s.status(err)
	}
	if redactAnswer(ctx, a.s.guard.authOn) {
		redactLeases(resp.GetLeases())
	}
	return resp, nil
}

func (a *adminService) InspectKey(ctx context.Context, req *allotv1.InspectKeyRequest) (*allotv1.InspectKeyResponse, error) {
	if err := a.s.waitServable(ctx); err != nil {
		return nil, err
	}
	resp, err := a.s.inspectKey(ctx, req, time.Now().UnixNano())
	if err != nil {
		return nil, a.s.status(err)
	}
	a.s.region.inspect(ctx, req, resp)
	if redactAnswer(ctx, a.s.guard.authOn) {
		resp.Key = redactKey(resp.GetKey())
		redactLeases(resp.GetLeases())
		if resp.Pool != nil {
			resp.Pool.Key = redactKey(resp.Pool.GetKey())
		}
	}
	return resp, nil
}

func (a *adminService) ListAgents(ctx context.Context, req *allotv1.ListAgentsRequest) (*allotv1.ListAgentsResponse, error) {
	if err := a.s.waitServable(ctx); err != nil {
		return nil, err
	}
	resp, err := a.s.listAgents(ctx, req, time.Now().UnixNano())
	if err != nil {
		return nil, a.s.status(err)
	}
	return resp, nil
}

func (a *adminService) TopKeys(ctx context.Context, req *allotv1.TopKeysRequest) (*allotv1.TopKeysResponse, error) {
	if err := a.s.waitServable(ctx); err != nil {
		return nil, err
	}
	resp, err := a.s.topKeys(ctx, req, time.Now().UnixNano())
	if err != nil {
		return nil, a.s.status(err)
	}
	if redactAnswer(ctx, a.s.guard.authOn) {
		for _, k := range resp.GetKeys() {
			k.Key = redactKey(k.GetKey())
		}
	}
	return resp, nil
}

// Check runs one authoritative check-and-take, committed through Raft.
func (a *adminService) Check(ctx context.Context, req *allotv1.CheckRequest) (*allotv1.CheckResponse, error) {
	s := a.s
	if err := ValidateCheck(req); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	var resp *allotv1.CheckResponse
	check := func(r *raft.Raft) error {
		res, err := s.applyOn(r, &allotv1.Command{Cmd: &allotv1.Command_Check{Check: req}})
		if err != nil {
			return err
		}
		out, ok := res.(*allotv1.CheckResponse)
		if !ok {
			return fmt.Errorf("allocator: check applied with unexpected result %T", res)
		}
		resp = out
		return nil
	}
	remote := func(ctx context.Context, cc *grpc.ClientConn) error {
		r, err := allotv1.NewAdminClient(cc).Check(ctx, req)
		resp = r
		return err
	}
	var err error
	if s.multi() {
		// Served by the data group that owns the keys, on its leader.
		id, gerr := s.checkGroup(req)
		if gerr != nil {
			return nil, gerr
		}
		req = proto.CloneOf(req)
		req.Group = uint32(id)
		err = s.onGroup(ctx, id, false, func(ctx context.Context, g *dataGroup) error { return check(g.node.raft) }, remote)
	} else {
		r, rerr := s.groupRaft(req.GetGroup())
		if rerr != nil {
			return nil, rerr
		}
		err = s.onRaftLeader(ctx, r, false, func(ctx context.Context) error { return check(r) }, remote)
	}
	if err != nil {
		return nil, s.status(err)
	}
	return resp, nil
}

// Limits on a Check: the protocol's, which the state machine applies to
// Acquire keys.
const (
	maxCheckDescriptors = allotv1.MaxKeysPerCall
	maxKeyBytes         = allotv1.MaxKeyBytes
)

// ValidateCheck checks a CheckRequest against the bounds the state machine
// applies (it checks them again when applying): a domain, 1..1000
// descriptors, none empty, each key (domain and entries) at most 4 KiB. It
// needs no state, so a client (allotctl) or a fuzz target can call it.
func ValidateCheck(req *allotv1.CheckRequest) error {
	if req.GetDomain() == "" {
		return errors.New("allocator: check: domain is required")
	}
	if n := len(req.GetDescriptors()); n == 0 || n > maxCheckDescriptors {
		return fmt.Errorf("allocator: check: %d descriptors (want 1..%d)", n, maxCheckDescriptors)
	}
	for i, d := range req.GetDescriptors() {
		if d == nil {
			return fmt.Errorf("allocator: check: descriptor %d is empty", i)
		}
		size := len(req.GetDomain())
		for _, e := range d.GetEntries() {
			size += len(e.GetKey()) + len(e.GetValue()) + 2
		}
		if size > maxKeyBytes {
			return fmt.Errorf("allocator: check: descriptor %d is longer than %d bytes", i, maxKeyBytes)
		}
	}
	return nil
}

// ClusterStatus reports the answering node's view of Raft and the state.
func (a *adminService) ClusterStatus(ctx context.Context, _ *allotv1.ClusterStatusRequest) (*allotv1.ClusterStatusResponse, error) {
	s := a.s
	r := s.node.raft
	stats := r.Stats()
	_, leaderID := r.LeaderWithID()
	st := s.st.Stats()
	resp := &allotv1.ClusterStatusResponse{
		LeaderId:          string(leaderID),
		NodeId:            s.cfg.NodeID,
		State:             roleName(r.State()),
		Term:              r.CurrentTerm(),
		CommitIndex:       r.CommitIndex(),
		AppliedIndex:      r.AppliedIndex(),
		RulesVersion:      st.RulesVersion,
		Agents:            st.Agents,
		Keys:              st.Keys,
		Leases:            st.Leases,
		LastSnapshotIndex: parseUint(stats["last_snapshot_index"]),
		Static:            s.st.StaticStatus(time.Now().UnixNano()),
	}
	if r.State() != raft.Leader {
		if lc := r.LastContact(); !lc.IsZero() {
			resp.LastContactMs = time.Since(lc).Milliseconds()
		}
	}
	members, err := s.members()
	if err != nil {
		return nil, s.status(err)
	}
	resp.Members = members
	s.groupsStatus(resp)
	s.region.status(resp, !showKeys(ctx, s.guard.authOn))
	return resp, nil
}

// members merges the Raft configuration (who votes) with the replicated
// member records (their gRPC and HTTP addresses).
func (s *Server) members() ([]*allotv1.Member, error) {
	f := s.node.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, err
	}
	_, leaderID := s.node.raft.LeaderWithID()
	recs := make(map[string]*allotv1.Member)
	for _, m := range s.st.Members() {
		recs[m.GetId()] = m
	}
	var out []*allotv1.Member
	for _, srv := range f.Configuration().Servers {
		m := &allotv1.Member{
			Id:       string(srv.ID),
			RaftAddr: string(srv.Address),
			Role:     "follower",
			Suffrage: "voter",
		}
		if srv.Suffrage != raft.Voter {
			m.Suffrage = "nonvoter"
		}
		switch {
		case leaderID == "":
			m.Role = "unknown"
		case srv.ID == leaderID:
			m.Role = "leader"
		}
		if string(srv.ID) == s.cfg.NodeID {
			m.Role = roleName(s.node.raft.State())
			m.GrpcAddr, m.HttpAddr = s.advGRPC, s.advHTTP
		} else if rec := recs[m.Id]; rec != nil {
			m.GrpcAddr, m.HttpAddr = rec.GetGrpcAddr(), rec.GetHttpAddr()
		}
		out = append(out, m)
	}
	return out, nil
}

func roleName(st raft.RaftState) string {
	switch st {
	case raft.Leader:
		return "leader"
	case raft.Follower:
		return "follower"
	case raft.Candidate:
		return "candidate"
	default:
		return "unknown"
	}
}

func parseUint(s string) uint64 {
	v, _ := strconv.ParseUint(s, 10, 64)
	return v
}

// AddVoter adds a node to the Raft configuration and records its addresses.
// It is idempotent: adding a voter again with the same address is a no-op.
func (a *adminService) AddVoter(ctx context.Context, req *allotv1.AddVoterRequest) (*allotv1.AddVoterResponse, error) {
	s := a.s
	if req.GetId() == "" || req.GetRaftAddr() == "" || len(req.GetId()) > allotv1.MaxIDBytes {
		return nil, status.Error(codes.InvalidArgument, "allocator: add voter: id (at most 256 bytes) and raft_addr are required")
	}
	if err := s.checkVoterAddrs(req); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "allocator: add voter %s: %v", req.GetId(), err)
	}
	if s.multi() && req.GetGroup() != 0 {
		return s.addGroupVoter(ctx, req)
	}
	err := s.onLeader(ctx, true,
		func(ctx context.Context) error {
			if err := s.addVoter(req.GetId(), req.GetRaftAddr(), req.GetGrpcAddr(), req.GetHttpAddr()); err != nil {
				return err
			}
			return s.addVoterToGroups(req)
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := allotv1.NewAdminClient(cc).AddVoter(ctx, req)
			return err
		})
	if err != nil {
		return nil, s.status(err)
	}
	return &allotv1.AddVoterResponse{}, nil
}

// checkVoterAddrs checks a new voter's addresses before anything is
// committed (a voter no node can reach would cost the group its quorum for
// good): each is host:port with a host and a port in 1..65535, the gRPC
// and HTTP addresses when given. The Raft address is the transport's: an
// injected transport (Config.transport) names its own.
func (s *Server) checkVoterAddrs(req *allotv1.AddVoterRequest) error {
	for _, a := range []struct{ name, addr string }{
		{"raft_addr", req.GetRaftAddr()}, {"grpc_addr", req.GetGrpcAddr()}, {"http_addr", req.GetHttpAddr()},
	} {
		if a.name == "raft_addr" && s.cfg.transport != nil {
			continue
		}
		if err := checkAdvertiseAddr(a.addr); err != nil {
			return fmt.Errorf("%s %q: %w", a.name, a.addr, err)
		}
	}
	return nil
}

// addVoter runs on the leader.
func (s *Server) addVoter(id, raftAddr, grpcAddr, httpAddr string) error {
	f := s.node.raft.AddVoter(raft.ServerID(id), raft.ServerAddress(raftAddr), 0, s.cfg.ApplyTimeout)
	if err := f.Error(); err != nil {
		return err
	}
	s.log.Info("voter added", "id", id, "raft", raftAddr, "grpc", grpcAddr)
	return s.registerMember(&allotv1.Member{
		Id: id, RaftAddr: raftAddr, GrpcAddr: grpcAddr, HttpAddr: httpAddr, Suffrage: "voter",
	})
}

// registerMember commits a node's advertised addresses.
func (s *Server) registerMember(m *allotv1.Member) error {
	_, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Member{Member: &allotv1.MemberCommand{Member: m}}})
	return err
}

// RemoveServer removes a node from the Raft configuration and forgets its
// addresses. Removing the leader makes it step down.
func (a *adminService) RemoveServer(ctx context.Context, req *allotv1.RemoveServerRequest) (*allotv1.RemoveServerResponse, error) {
	s := a.s
	if req.GetId() == "" {
		return nil, status.Error(codes.InvalidArgument, "allocator: remove server: id is required")
	}
	if s.multi() && req.GetGroup() != 0 {
		return s.removeGroupServer(ctx, req)
	}
	err := s.onLeader(ctx, true,
		func(ctx context.Context) error {
			id := req.GetId()
			inConfig, err := s.inConfiguration(id)
			if err != nil {
				return err
			}
			if !inConfig && !s.hasMemberRecord(id) {
				return status.Errorf(codes.NotFound, "allocator: remove server: %q is not a member", id)
			}
			// The data groups first, while the member records still name
			// their leaders' addresses.
			if err := s.removeFromGroups(ctx, id); err != nil {
				return err
			}
			// Forget the addresses first: after removing itself the leader
			// could not commit anything more.
			if err := s.forgetMember(id); err != nil {
				return err
			}
			if !inConfig {
				s.log.Info("stale member record removed", "id", id)
				return nil
			}
			f := s.node.raft.RemoveServer(raft.ServerID(id), 0, s.cfg.ApplyTimeout)
			if err := f.Error(); err != nil {
				return err
			}
			s.log.Info("server removed", "id", id)
			return nil
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			_, err := allotv1.NewAdminClient(cc).RemoveServer(ctx, req)
			return err
		})
	if err != nil {
		return nil, s.status(err)
	}
	return &allotv1.RemoveServerResponse{}, nil
}

// inConfiguration reports whether id is in the Raft configuration.
func (s *Server) inConfiguration(id string) (bool, error) {
	f := s.node.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return false, err
	}
	for _, srv := range f.Configuration().Servers {
		if string(srv.ID) == id {
			return true, nil
		}
	}
	return false, nil
}

// hasMemberRecord reports whether the replicated member records hold id.
func (s *Server) hasMemberRecord(id string) bool {
	for _, m := range s.st.Members() {
		if m.GetId() == id {
			return true
		}
	}
	return false
}

func (s *Server) forgetMember(id string) error {
	_, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_Member{Member: &allotv1.MemberCommand{
		Member: &allotv1.Member{Id: id}, Remove: true,
	}}})
	return err
}

// TransferLeadership hands leadership to the named voter (or any suitable
// one) and waits, within the call's deadline, until a new leader is known.
func (a *adminService) TransferLeadership(ctx context.Context, req *allotv1.TransferLeadershipRequest) (*allotv1.TransferLeadershipResponse, error) {
	s := a.s
	var resp *allotv1.TransferLeadershipResponse
	local := func(ctx context.Context, r *raft.Raft) error {
		id, err := s.transferLeadership(ctx, r, req.GetId())
		if err == nil {
			resp = &allotv1.TransferLeadershipResponse{LeaderId: id}
		}
		return err
	}
	remote := func(ctx context.Context, cc *grpc.ClientConn) error {
		r, err := allotv1.NewAdminClient(cc).TransferLeadership(ctx, req)
		resp = r
		return err
	}
	var err error
	if s.multi() && req.GetGroup() != 0 {
		// A data group: on its leader, forwarded by a node that hosts no
		// replica of it.
		err = s.onGroup(ctx, slots.GroupID(req.GetGroup()), false,
			func(ctx context.Context, g *dataGroup) error { return local(ctx, g.node.raft) }, remote)
	} else {
		r, rerr := s.groupRaft(req.GetGroup())
		if rerr != nil {
			return nil, rerr
		}
		err = s.onRaftLeader(ctx, r, false, func(ctx context.Context) error { return local(ctx, r) }, remote)
	}
	if err != nil {
		return nil, s.status(err)
	}
	return resp, nil
}

// transferLeadership runs on the leader of the Raft group r.
func (s *Server) transferLeadership(ctx context.Context, r *raft.Raft, target string) (string, error) {
	if target == s.cfg.NodeID {
		return target, nil
	}
	s.followerTimeouts(r)
	var f raft.Future
	if target == "" {
		f = r.LeadershipTransfer()
	} else {
		cf := r.GetConfiguration()
		if err := cf.Error(); err != nil {
			return "", err
		}
		var addr raft.ServerAddress
		for _, srv := range cf.Configuration().Servers {
			if string(srv.ID) == target && srv.Suffrage == raft.Voter {
				addr = srv.Address
			}
		}
		if addr == "" {
			return "", status.Errorf(codes.NotFound, "allocator: transfer leadership: %q is not a voter", target)
		}
		f = r.LeadershipTransferToServer(raft.ServerID(target), addr)
	}
	if err := f.Error(); err != nil {
		// The transfer did not complete (the target did not catch up or
		// win its election within an election timeout, or another
		// transfer runs): this node still leads, and the call may be
		// tried again.
		return "", status.Errorf(codes.Unavailable, "allocator: transfer leadership: %v", err)
	}
	// Wait until the new leader is known here.
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		if _, id := r.LeaderWithID(); id != "" && string(id) != s.cfg.NodeID {
			return string(id), nil
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-s.done:
			return "", errShutdown
		case <-t.C:
		}
	}
}
