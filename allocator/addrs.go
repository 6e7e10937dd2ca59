package allocator

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/metadata"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// self returns this node's member record: its id and advertised addresses.
func (s *Server) self() *allotv1.Member {
	return &allotv1.Member{
		Id:       s.cfg.NodeID,
		RaftAddr: string(s.node.addr),
		GrpcAddr: s.advGRPC,
		HttpAddr: s.advHTTP,
		Suffrage: "voter",
	}
}

// addVoterRequest asks the cluster to add (or re-address) this node.
func (s *Server) addVoterRequest() *allotv1.AddVoterRequest {
	me := s.self()
	return &allotv1.AddVoterRequest{Id: me.Id, RaftAddr: me.RaftAddr, GrpcAddr: me.GrpcAddr, HttpAddr: me.HttpAddr}
}

// sameAddrs reports whether two member records hold the same addresses.
func sameAddrs(a, b *allotv1.Member) bool {
	return a.GetRaftAddr() == b.GetRaftAddr() && a.GetGrpcAddr() == b.GetGrpcAddr() && a.GetHttpAddr() == b.GetHttpAddr()
}

// recordedAs reports whether the cluster's view rec of this node holds
// me's addresses. The Raft address comes from the Raft configuration and
// is always there; an empty gRPC or HTTP address means the answering
// replica has not applied the member record yet (it is catching up), which
// is not a difference.
func recordedAs(rec, me *allotv1.Member) bool {
	same := func(recorded, mine string) bool { return recorded == "" || recorded == mine }
	return rec.GetRaftAddr() == me.GetRaftAddr() && same(rec.GetGrpcAddr(), me.GetGrpcAddr()) &&
		same(rec.GetHttpAddr(), me.GetHttpAddr())
}

// withJoinToken adds the admin token to a node-to-node call that needs a
// join or read permission: with a certificate the node proves the
// allocator role instead; without one, a cluster authenticated by tokens
// needs an admin token.
func (s *Server) withJoinToken(ctx context.Context) context.Context {
	if tok := s.joinToken.Load(); tok != nil && s.tls == nil {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*tok)
	}
	return ctx
}

// reregisterLoop runs on a node that resumed its Raft state. The cluster
// may hold other addresses for it than it advertises now: it moved to a
// new IP or port, or it now advertises a DNS name where it used to
// advertise an IP. Then the leader cannot reach it, and it may never hear
// from one. So it asks a member for the cluster's view (the leader it
// knows of, Config.Join, then every other member it has a record of) and,
// when that view lists it at other addresses, re-registers through that
// member (AddVoter under its own id, which the leader applies as an
// address change, as `allotctl cluster join` does by hand). A leader
// checks its own entry in the Raft configuration instead. The loop ends
// once a member confirms the addresses, once it has re-registered, once a
// member's view no longer lists the node (it was removed while down: it
// must not add itself back), or when the Server stops.
func (s *Server) reregisterLoop() {
	wait := 200 * time.Millisecond
	for attempt := 1; ; attempt++ {
		outcome, err := s.reregisterOnce()
		if outcome != "" {
			s.reregistered.Store(&outcome)
			return
		}
		// A cluster still electing a leader fails a few attempts; say so
		// now and then, not every time.
		if attempt%12 == 3 {
			s.log.Warn("cannot confirm this node's addresses with the cluster yet; retrying", "attempt", attempt, "err", err)
		} else {
			s.log.Debug("address check failed; retrying", "attempt", attempt, "err", err)
		}
		t := time.NewTimer(wait/2 + rand.N(wait/2+1))
		select {
		case <-s.stopLoops:
			t.Stop()
			return
		case <-s.done:
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(wait*2, 5*time.Second)
	}
}

// Outcomes of reregisterLoop.
const (
	outcomeConfirmed    = "confirmed"     // the cluster holds the advertised addresses
	outcomeReregistered = "re-registered" // it held others; now it holds these
	outcomeNotMember    = "not a member"  // removed: left alone
)

// reregisterOutcome returns how reregisterLoop ended ("" while it runs,
// or when it did not run).
func (s *Server) reregisterOutcome() string {
	if p := s.reregistered.Load(); p != nil {
		return *p
	}
	return ""
}

// reregisterOnce makes one pass over the members. It returns the outcome,
// or "" and why not (try again later).
func (s *Server) reregisterOnce() (outcome string, err error) {
	if s.IsLeader() {
		return s.reregisterAsLeader()
	}
	var errs []error
	for _, addr := range s.reregisterCandidates() {
		outcome, err := s.reregisterVia(addr)
		if outcome != "" {
			return outcome, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", addr, err))
	}
	if len(errs) == 0 {
		return "", errors.New("allocator: no other member's address known (no Join, no leader, no member records yet)")
	}
	return "", errors.Join(errs...)
}

// reregisterCandidates lists the gRPC addresses to ask, without
// duplicates or this node's own.
func (s *Server) reregisterCandidates() []string {
	seen := map[string]bool{"": true, s.advGRPC: true, s.grpcAddr: true}
	var out []string
	add := func(a string) {
		if !seen[a] {
			seen[a] = true
			out = append(out, a)
		}
	}
	if h := s.leaderHint(); h.id != s.cfg.NodeID {
		add(h.addr)
	}
	add(s.cfg.Join)
	for _, m := range s.st.Members() {
		if m.GetId() != s.cfg.NodeID {
			add(m.GetGrpcAddr())
		}
	}
	return out
}

// reregisterVia asks the member at addr for the cluster's view of this
// node and, if it lists other addresses, re-registers through it.
func (s *Server) reregisterVia(addr string) (outcome string, err error) {
	cc, err := s.fwd.conn(addr)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(s.baseCtx, 5*time.Second)
	defer cancel()
	ctx = s.withJoinToken(ctx)
	admin := allotv1.NewAdminClient(cc)
	st, err := admin.ClusterStatus(ctx, &allotv1.ClusterStatusRequest{})
	if err != nil {
		return "", err
	}
	if st.GetNodeId() == s.cfg.NodeID {
		return "", errors.New("allocator: that address is this node's")
	}
	me := s.self()
	var rec *allotv1.Member
	for _, m := range st.GetMembers() {
		if m.GetId() == me.Id {
			rec = m
		}
	}
	switch {
	case rec == nil:
		s.log.Warn("this node is not in the cluster's Raft configuration (removed while down?); not re-registering it",
			"asked", st.GetNodeId())
		return outcomeNotMember, nil
	case recordedAs(rec, me):
		s.log.Debug("the cluster holds this node's advertised addresses", "asked", st.GetNodeId())
		return outcomeConfirmed, nil
	}
	s.log.Info("the cluster holds other addresses for this node; re-registering", "via", st.GetNodeId(),
		"recorded_raft", rec.GetRaftAddr(), "recorded_grpc", rec.GetGrpcAddr(), "recorded_http", rec.GetHttpAddr(),
		"raft", me.RaftAddr, "grpc", me.GrpcAddr, "http", me.HttpAddr)
	if _, err := admin.AddVoter(ctx, s.addVoterRequest()); err != nil {
		return "", err
	}
	s.log.Info("re-registered at the advertised addresses")
	return outcomeReregistered, nil
}

// reregisterAsLeader fixes the leader's own entry in the Raft
// configuration (leaderDuties registers its member record).
func (s *Server) reregisterAsLeader() (outcome string, err error) {
	f := s.node.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return "", err
	}
	for _, srv := range f.Configuration().Servers {
		if string(srv.ID) != s.cfg.NodeID {
			continue
		}
		if srv.Address == s.node.addr {
			return outcomeConfirmed, nil
		}
		s.log.Info("the Raft configuration holds another address for this node; re-registering",
			"recorded_raft", string(srv.Address), "raft", string(s.node.addr))
		me := s.self()
		if err := s.addVoter(me.Id, me.RaftAddr, me.GrpcAddr, me.HttpAddr); err != nil {
			return "", err
		}
		return outcomeReregistered, nil
	}
	return outcomeNotMember, nil
}
