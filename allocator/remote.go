package allocator

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/pkg/slots"
)

// Data groups this node hosts no replica of (a cluster bootstrapped with
// GroupReplicas, whose groups live on some of the nodes). Such a node
// never serves a group's calls from its own state, since it has none: it
// forwards each one to the group's leader, as a follower does, and reads
// (InspectKey, ListLeases, TopKeys, ListAgents) go to the leader too. It
// learns the leader from the group's members (the meta state names them):
// a member that does not lead the group answers NOT_LEADER with the
// leader's id and address, and the node keeps the last leader that
// answered, per group, for the next calls and for the topology it
// reports.

// remoteLeaders is the last known leader of each data group this node
// hosts no replica of.
type remoteLeaders struct {
	mu    sync.Mutex // guards hints
	hints map[slots.GroupID]leaderHint
}

func (r *remoteLeaders) get(id slots.GroupID) leaderHint {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.hints[id]
}

// set records h as group id's leader, and reports whether that changed.
func (r *remoteLeaders) set(id slots.GroupID, h leaderHint) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.hints == nil {
		r.hints = map[slots.GroupID]leaderHint{}
	}
	if r.hints[id] == h {
		return false
	}
	r.hints[id] = h
	return true
}

// forget drops group id's leader if it is still h.
func (r *remoteLeaders) forget(id slots.GroupID, h leaderHint) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.hints[id] == h {
		delete(r.hints, id)
	}
}

// newGroupForwards is the counter of calls forwarded for groups this
// node hosts no replica of, by group (at most a few dozen groups).
func newGroupForwards() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricsNamespace,
		Name:      "group_forwards_total",
		Help:      "Calls of a data group this node hosts no replica of, forwarded to the group's leader.",
	}, []string{"group"})
}

// groupMembers returns the members of data group id in the meta state,
// with their gRPC addresses (this node excluded).
func (s *Server) groupMembers(id slots.GroupID) []leaderHint {
	var g meta.Group
	s.grp.meta.view(func(st *meta.State) { g, _ = st.Group(id) })
	addrs := map[string]string{}
	for _, m := range s.st.Members() {
		addrs[m.GetId()] = m.GetGrpcAddr()
	}
	var out []leaderHint
	for _, m := range g.Members {
		if m != s.cfg.NodeID && addrs[m] != "" {
			out = append(out, leaderHint{id: m, addr: addrs[m]})
		}
	}
	return out
}

// groupHint returns the leader of data group id known to this node: its
// replica's leader when it hosts one, else the last one that answered.
func (s *Server) groupHint(id slots.GroupID) leaderHint {
	if g := s.dataGroup(id); g != nil {
		return s.hintFor(g.node.raft)
	}
	return s.grp.remote.get(id)
}

// onGroup runs a call of data group id: on this node's replica when it
// hosts one (onRaftLeader: local when it leads the group, else remote
// on the leader), else remote on the group's leader (onRemoteGroup). An
// error that names no leader carries the group's leader hint.
func (s *Server) onGroup(ctx context.Context, id slots.GroupID, idempotent bool,
	local func(ctx context.Context, g *dataGroup) error,
	remote func(ctx context.Context, cc *grpc.ClientConn) error,
) error {
	g := s.dataGroup(id)
	if g == nil {
		return s.onRemoteGroup(ctx, id, idempotent, remote)
	}
	err := s.onRaftLeader(ctx, g.node.raft, idempotent, func(ctx context.Context) error { return local(ctx, g) }, remote)
	return s.groupLeaderErr(err, g)
}

// groupLeaderErr gives an error that names no leader (this node does not
// lead data group g) the group's leader hint, so that a node that
// forwarded the call here, or an agent, tries that leader next (the
// service's own mapping would name the meta group's leader).
func (s *Server) groupLeaderErr(err error, g *dataGroup) error {
	if errors.Is(err, errForwardedNotLeader) || errors.Is(err, errNoLeader) {
		return toStatus(err, s.hintFor(g.node.raft))
	}
	return err
}

// readGroup runs a read of data group id: local on this node's replica
// when it hosts one, else remote on the group's leader.
func (s *Server) readGroup(ctx context.Context, id slots.GroupID,
	local func(g *dataGroup) error,
	remote func(ctx context.Context, cc *grpc.ClientConn) error,
) error {
	if g := s.dataGroup(id); g != nil {
		return local(g)
	}
	return s.onRemoteGroup(ctx, id, true, remote)
}

// onRemoteGroup sends a call of data group id, which this node hosts no
// replica of, to the group's leader: the last one known, else its
// members in turn, following the leader hint of a member's NOT_LEADER
// answer. It retries as onRaftLeader does, for up to ForwardWait. A call
// forwarded to this node is not forwarded again.
func (s *Server) onRemoteGroup(ctx context.Context, id slots.GroupID, idempotent bool,
	remote func(ctx context.Context, cc *grpc.ClientConn) error,
) error {
	if isForwarded(ctx) {
		return toStatus(errForwardedNotLeader, s.grp.remote.get(id))
	}
	exists := false
	s.grp.meta.view(func(st *meta.State) { _, exists = st.Group(id) })
	if !exists {
		return status.Errorf(codes.NotFound, "allocator: group %d does not exist", id)
	}
	deadline := time.Now().Add(s.cfg.ForwardWait)
	wait := 5 * time.Millisecond
	tried := map[string]bool{}
	for {
		select {
		case <-s.done:
			return errShutdown
		default:
		}
		h := s.grp.remote.get(id)
		if h.addr == "" || tried[h.id] {
			h = leaderHint{}
			for _, m := range s.groupMembers(id) {
				if !tried[m.id] {
					h = m
					break
				}
			}
		}
		err := errNoLeader
		if h.addr != "" {
			tried[h.id] = true
			s.grp.forwards.WithLabelValues(strconv.FormatUint(uint64(id), 10)).Inc()
			err = s.forward(ctx, h, remote)
			if err == nil {
				if s.grp.remote.set(id, h) {
					s.notifyTopology()
				}
				return nil
			}
			s.grp.remote.forget(id, h)
			if next := hintOf(err); next.addr != "" && next.id != s.cfg.NodeID && !tried[next.id] {
				// A member named the leader: call it at once.
				s.grp.remote.set(id, next)
				if retryable(err, idempotent) && ctx.Err() == nil {
					continue
				}
			}
		}
		if !retryable(err, idempotent) || ctx.Err() != nil {
			return err
		}
		if h.addr != "" && slices.ContainsFunc(s.groupMembers(id), func(m leaderHint) bool { return !tried[m.id] }) {
			continue // another member may know the leader
		}
		clear(tried)
		if time.Now().Add(wait).After(deadline) {
			return err
		}
		if err := s.pause(ctx, wait); err != nil {
			return err
		}
		wait = min(wait*2, 100*time.Millisecond)
	}
}

// hintOf returns the leader hint an Unavailable answer carries in its
// ErrorInfo (zero when none).
func hintOf(err error) leaderHint {
	st, ok := status.FromError(err)
	if !ok {
		return leaderHint{}
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == errorDomain {
			return leaderHint{id: info.GetMetadata()[MetaLeaderID], addr: info.GetMetadata()[MetaLeaderAddr]}
		}
	}
	return leaderHint{}
}
