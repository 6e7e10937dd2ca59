package allocator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/pkg/tlsconfig"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// advertisedFile, in Config.DataDir, records the addresses the node last
// advertised and the cluster confirmed (or that it started with), so that
// a restart can tell "I moved" from "an operator registered me elsewhere"
// (a proxy, a NAT): the replicated configuration holds the latter too.
const advertisedFile = "advertised.json"

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

// recordedAs reports whether the cluster's view rec of a node holds the
// addresses of m. The Raft address comes from the Raft configuration and
// is always there; an empty gRPC or HTTP address means the answering
// replica has not applied the member record yet (it is catching up),
// which is not a difference.
func recordedAs(rec, m *allotv1.Member) bool {
	same := func(recorded, mine string) bool { return recorded == "" || recorded == mine }
	return rec.GetRaftAddr() == m.GetRaftAddr() && same(rec.GetGrpcAddr(), m.GetGrpcAddr()) &&
		same(rec.GetHttpAddr(), m.GetHttpAddr())
}

// withJoinToken adds the admin token to a node-to-node call that needs a
// join, read or peer permission in a cluster that does not verify client
// certificates (ClientAuth none, with or without TLS): there a node has
// no certificate to prove the allocator role with, and the cluster is
// authenticated by tokens alone. Where client certificates are verified
// the node's certificate proves the role instead.
func (s *Server) withJoinToken(ctx context.Context) context.Context {
	if tok := s.joinToken.Load(); tok != nil && s.cfg.ClientAuth == tlsconfig.ClientAuthNone {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*tok)
	}
	return ctx
}

// advertisedRecord is advertisedFile's content.
type advertisedRecord struct {
	Raft string `json:"raft_addr"`
	GRPC string `json:"grpc_addr"`
	HTTP string `json:"http_addr"`
}

func (r advertisedRecord) member(id string) *allotv1.Member {
	return &allotv1.Member{Id: id, RaftAddr: r.Raft, GrpcAddr: r.GRPC, HttpAddr: r.HTTP}
}

// readAdvertised returns the recorded addresses (ok false when there is no
// record: a data directory from before the record existed).
func readAdvertised(dir string) (rec advertisedRecord, ok bool, err error) {
	path := filepath.Join(dir, advertisedFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return rec, false, nil
	}
	if err != nil {
		return rec, false, fmt.Errorf("allocator: read %s: %w", path, err)
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return rec, false, fmt.Errorf("allocator: %s: %w", path, err)
	}
	return rec, true, nil
}

// writeAdvertised records this node's advertised addresses (write, fsync,
// rename).
func (s *Server) writeAdvertised() error {
	me := s.self()
	b, err := json.Marshal(advertisedRecord{Raft: me.RaftAddr, GRPC: me.GrpcAddr, HTTP: me.HttpAddr})
	if err != nil {
		return err
	}
	return writeFileSync(filepath.Join(s.cfg.DataDir, advertisedFile), append(b, '\n'))
}

// checkAddresses runs at start, once the node is open. A new data
// directory records the addresses the node starts with. A resumed one
// compares them with the record: unchanged, nothing to do; changed (the
// node moved to a new IP or port, or now advertises a name), the
// reregister loop runs. Without a record (a data directory from a version
// that kept none), the node's own replica stands in for it: its entry in
// the Raft configuration and its member record.
func (s *Server) checkAddresses() error {
	if !s.node.existing {
		return s.writeAdvertised()
	}
	rec, ok, err := readAdvertised(s.cfg.DataDir)
	if err != nil {
		return err
	}
	me := s.self()
	var old *allotv1.Member
	if ok {
		old = rec.member(me.Id)
	} else if old = s.localView(); old == nil || recordedAs(old, me) {
		// Not a voter here, or the replica holds these addresses.
		s.setOutcome(outcomeUnchanged)
		return s.writeAdvertised()
	}
	if sameAddrs(old, me) {
		s.setOutcome(outcomeUnchanged)
		return nil
	}
	s.log.Info("this node advertises other addresses than at its last run; it will re-register",
		"was_raft", old.GetRaftAddr(), "was_grpc", old.GetGrpcAddr(), "was_http", old.GetHttpAddr(),
		"raft", me.RaftAddr, "grpc", me.GrpcAddr, "http", me.HttpAddr, "from_record", ok)
	s.goFunc(func() { s.reregisterLoop(old) })
	return nil
}

// localView is this node as its own replica records it: its address in
// the Raft configuration (read from its log and snapshot at start) and
// its member record's (nil when it is not in the configuration).
func (s *Server) localView() *allotv1.Member {
	f := s.node.raft.GetConfiguration()
	if f.Error() != nil {
		return nil
	}
	var m *allotv1.Member
	for _, srv := range f.Configuration().Servers {
		if string(srv.ID) == s.cfg.NodeID {
			m = &allotv1.Member{Id: s.cfg.NodeID, RaftAddr: string(srv.Address)}
		}
	}
	if m == nil {
		return nil
	}
	for _, r := range s.st.Members() {
		if r.GetId() == s.cfg.NodeID {
			m.GrpcAddr, m.HttpAddr = r.GetGrpcAddr(), r.GetHttpAddr()
		}
	}
	return m
}

// Outcomes of the address check (reregisterOutcome).
const (
	outcomeUnchanged    = "unchanged"          // the node advertises what it did at its last run
	outcomeConfirmed    = "confirmed"          // the cluster already holds the new addresses
	outcomeReregistered = "re-registered"      // it held the old ones; now it holds the new ones
	outcomeNotMember    = "not a member"       // removed while down: left alone
	outcomeElsewhere    = "recorded elsewhere" // the cluster holds addresses this node never advertised: left alone
)

func (s *Server) setOutcome(o string) { s.reregistered.Store(&o) }

// reregisterOutcome returns how the address check ended ("" while the
// reregister loop runs).
func (s *Server) reregisterOutcome() string {
	if p := s.reregistered.Load(); p != nil {
		return *p
	}
	return ""
}

// reregisterDecision is what to do given the cluster's view rec of this
// node (nil: not in the configuration), its addresses at its last run
// (old) and now (cur).
func reregisterDecision(rec, old, cur *allotv1.Member) string {
	// ours: each recorded address is unknown (""), the old one or the new
	// one (a mix happens when the node led for a while after it moved: it
	// registered its member record, not its Raft address).
	ours := func(recorded, was, now string, optional bool) bool {
		return (optional && recorded == "") || recorded == was || recorded == now
	}
	switch {
	case rec == nil:
		return outcomeNotMember
	case recordedAs(rec, cur):
		return outcomeConfirmed
	case ours(rec.GetRaftAddr(), old.GetRaftAddr(), cur.GetRaftAddr(), false) &&
		ours(rec.GetGrpcAddr(), old.GetGrpcAddr(), cur.GetGrpcAddr(), true) &&
		ours(rec.GetHttpAddr(), old.GetHttpAddr(), cur.GetHttpAddr(), true):
		return outcomeReregistered
	default:
		// An operator registered it at other addresses (a proxy, a NAT)
		// on purpose: theirs wins.
		return outcomeElsewhere
	}
}

// reregisterLoop runs on a node that resumed its Raft state at other
// advertised addresses than its last run's (old). The cluster still holds
// the old ones, so the leader cannot reach it and it may never hear from
// one. It asks a member for the cluster's view (the leader it knows of,
// Config.Join, then every other member it has a record of) and, when that
// view lists it at its old addresses, re-registers through that member
// (AddVoter under its own id, which the leader applies as an address
// change, as `allotctl cluster join` does by hand); a leader fixes its own
// entry in the Raft configuration. The loop ends with the decision (see
// reregisterDecision: a node removed while down does not add itself back)
// or when the Server stops; the new addresses are recorded once the
// cluster holds them.
func (s *Server) reregisterLoop(old *allotv1.Member) {
	wait := 200 * time.Millisecond
	for attempt := 1; ; attempt++ {
		outcome, err := s.reregisterOnce(old)
		if outcome != "" {
			if outcome == outcomeConfirmed || outcome == outcomeReregistered {
				if err := s.writeAdvertised(); err != nil {
					s.log.Warn("addresses re-registered but not recorded", "err", err)
				}
			}
			s.setOutcome(outcome)
			return
		}
		// A cluster still electing a leader fails a few attempts; say so
		// now and then, not every time.
		if attempt%12 == 3 {
			s.log.Warn("cannot reach the cluster to re-register this node's addresses yet; retrying", "attempt", attempt, "err", err)
		} else {
			s.log.Debug("re-register attempt failed; retrying", "attempt", attempt, "err", err)
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

// reregisterOnce makes one pass over the members. It returns the outcome,
// or "" and why not (try again later).
func (s *Server) reregisterOnce(old *allotv1.Member) (outcome string, err error) {
	if s.IsLeader() {
		return s.reregisterAsLeader(old)
	}
	var errs []error
	for _, addr := range s.reregisterCandidates() {
		outcome, err := s.reregisterVia(addr, old)
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
// node and acts on it (reregisterDecision) through that member.
func (s *Server) reregisterVia(addr string, old *allotv1.Member) (outcome string, err error) {
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
	decision := reregisterDecision(rec, old, me)
	switch decision {
	case outcomeNotMember:
		s.log.Warn("this node is not in the cluster's Raft configuration (removed while down?); not re-registering it",
			"asked", st.GetNodeId())
		return decision, nil
	case outcomeElsewhere:
		s.log.Warn("the cluster holds addresses for this node that it never advertised (registered by hand?); leaving them",
			"asked", st.GetNodeId(), "recorded_raft", rec.GetRaftAddr(), "recorded_grpc", rec.GetGrpcAddr())
		return decision, nil
	case outcomeConfirmed:
		return decision, nil
	}
	s.log.Info("re-registering this node at its new addresses", "via", st.GetNodeId(),
		"recorded_raft", rec.GetRaftAddr(), "recorded_grpc", rec.GetGrpcAddr(), "recorded_http", rec.GetHttpAddr(),
		"raft", me.RaftAddr, "grpc", me.GrpcAddr, "http", me.HttpAddr)
	if _, err := admin.AddVoter(ctx, s.addVoterRequest()); err != nil {
		return "", err
	}
	s.log.Info("re-registered at the advertised addresses")
	return decision, nil
}

// reregisterAsLeader fixes the leader's own entry in the Raft
// configuration (leaderDuties registers its member record).
func (s *Server) reregisterAsLeader(old *allotv1.Member) (outcome string, err error) {
	f := s.node.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return "", err
	}
	me := s.self()
	var rec *allotv1.Member
	for _, srv := range f.Configuration().Servers {
		if string(srv.ID) == me.Id {
			rec = &allotv1.Member{Id: me.Id, RaftAddr: string(srv.Address)} // member records: registerSelf
		}
	}
	decision := reregisterDecision(rec, old, me)
	if decision != outcomeReregistered {
		return decision, nil
	}
	s.log.Info("the Raft configuration holds this node's old address; re-registering",
		"recorded_raft", rec.GetRaftAddr(), "raft", me.RaftAddr)
	if err := s.addVoter(me.Id, me.RaftAddr, me.GrpcAddr, me.HttpAddr); err != nil {
		return "", err
	}
	return decision, nil
}
