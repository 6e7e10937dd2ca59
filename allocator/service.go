package allocator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// allocatorService implements the agent-facing allot.v1.Allocator service.
type allocatorService struct {
	allotv1.UnimplementedAllocatorServer
	s *Server
}

// Acquire validates the request, then commits it through the batcher on
// the leader (forwarding from a follower). It is idempotent per
// (agent_id, request_id), so it is retried across a leader change.
func (a *allocatorService) Acquire(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	s := a.s
	if err := state.ValidateAcquire(req); err != nil {
		s.metrics.acquireCalls.WithLabelValues("invalid").Inc()
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if s.multi() {
		return a.acquireGroups(ctx, req)
	}
	start := time.Now()
	resp, path, err := s.acquireOn(ctx, s.node.raft, s.batcher, nil, req)
	return s.acquireAnswered(resp, err, path, start)
}

// acquireOn serves req whole on the leader of the Raft group r: through
// b, r's batcher on this node, when this node leads r (once ready, if set,
// allows), else forwarded to r's leader. It returns the answer, its grants
// packed if req asks for that, and the path the last attempt took: local
// or forwarded.
func (s *Server) acquireOn(ctx context.Context, r *raft.Raft, b *batcher, ready func(context.Context) error,
	req *allotv1.AcquireRequest,
) (resp *allotv1.AcquireResponse, path string, err error) {
	err = s.onRaftLeader(ctx, r, true,
		func(ctx context.Context) error {
			path = "local"
			if ready != nil {
				if err := ready(ctx); err != nil {
					return err
				}
			}
			out, err := b.submit(ctx, req)
			if err == nil {
				resp, err = answer(out, s.cfg.NodeID, req.GetPackedGrants())
			}
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) (err error) {
			path = "forwarded"
			resp, err = allotv1.NewAllocatorClient(cc).Acquire(ctx, req)
			return err
		})
	return resp, path, err
}

// acquireAnswered counts an Acquire's outcome (and its latency, by the
// path it took, when it succeeded) and turns an error into its status.
func (s *Server) acquireAnswered(resp *allotv1.AcquireResponse, err error, path string, start time.Time) (*allotv1.AcquireResponse, error) {
	if err != nil {
		if errors.Is(err, errOverloaded) {
			s.metrics.rejected.WithLabelValues("queue_full").Inc()
		}
		s.metrics.acquireCalls.WithLabelValues("error").Inc()
		return nil, s.status(err)
	}
	s.metrics.acquireCalls.WithLabelValues("ok").Inc()
	s.metrics.acquireLatency.WithLabelValues(path).Observe(time.Since(start).Seconds())
	return resp, nil
}

// answer returns the FSM's response r as sent to the caller (or a routed
// answer built from the groups' ones): with LeaderId and ReadsPackedKeys
// set, its topology kept, and its grants packed (packed_grants) if the
// caller asked for that, else as KeyGrant messages. The FSM packs the
// grants it applies (state.Config.PackedGrants); an answer recorded in
// messages (by an older binary, restored from a snapshot) is packed here.
// The FSM may keep r as the recorded answer for retries, so it is copied,
// not modified.
func answer(r *allotv1.AcquireResponse, leader string, packed bool) (*allotv1.AcquireResponse, error) {
	if r == nil {
		return r, nil
	}
	out := &allotv1.AcquireResponse{
		LiveAgents:      r.GetLiveAgents(),
		RulesVersion:    r.GetRulesVersion(),
		LeaderId:        leader,
		NowUnixMs:       r.GetNowUnixMs(),
		Topology:        r.GetTopology(),
		Static:          r.GetStatic(),
		ReadsPackedKeys: true,
	}
	switch inPacked := len(r.GetPackedGrants()) > 0; {
	case packed && inPacked:
		out.PackedGrants, out.Limits = r.GetPackedGrants(), r.GetLimits()
	case packed:
		// About 24 bytes a grant besides its key.
		n := 8
		for _, g := range r.GetGrants() {
			n += 24 + len(g.GetKey())
		}
		out.PackedGrants, out.Limits = allotv1.AppendPackedGrants(make([]byte, 0, n), nil, r.GetGrants())
	case inPacked:
		grants, err := allotv1.UnpackGrants(r.GetPackedGrants(), r.GetLimits())
		if err != nil {
			return nil, fmt.Errorf("allocator: recorded answer: %w", err)
		}
		out.Grants = grants
	default:
		out.Grants = r.GetGrants()
	}
	return out, nil
}

// Release commits the returned tokens and the end of the agent's leases as
// one Raft entry (releases are rare: an agent's shutdown).
func (a *allocatorService) Release(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	s := a.s
	if err := state.ValidateRelease(req); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if s.multi() {
		resp, err := s.releaseRouted(ctx, req)
		return resp, s.status(err)
	}
	resp, err := s.releaseOn(ctx, s.node.raft, req)
	if err != nil {
		return nil, s.status(err)
	}
	return resp, nil
}

// releaseOn applies a Release in the Raft group r, on this node when it
// leads r, else forwarded to r's leader.
func (s *Server) releaseOn(ctx context.Context, r *raft.Raft, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	var resp *allotv1.ReleaseResponse
	err := s.onRaftLeader(ctx, r, true,
		func(ctx context.Context) error {
			out, err := s.applyRelease(r, req)
			resp = out
			return err
		},
		func(ctx context.Context, cc *grpc.ClientConn) error {
			out, err := allotv1.NewAllocatorClient(cc).Release(ctx, req)
			resp = out
			return err
		})
	return resp, err
}

// WatchRules streams the current rule set at once if it is newer than
// known_version (or known_version is 0), then every new version. It is
// served from this node's replica, so a follower streams what it has
// applied, once it has caught up (waitServable). The stream ends when the client leaves or the Server shuts down.
func (a *allocatorService) WatchRules(req *allotv1.WatchRulesRequest, stream grpc.ServerStreamingServer[allotv1.RuleSet]) error {
	s := a.s
	if s.multi() {
		return s.watchRouted(req, stream)
	}
	ctx := stream.Context()
	// A replica that has not applied what was committed when it started
	// would stream rules older than the cluster's.
	if err := s.waitServable(ctx); err != nil {
		return err
	}
	known := req.GetKnownVersion()
	first := true
	for {
		changed := s.rulesChanged()
		rs := s.st.RuleSet()
		if rs.GetVersion() > known || (first && known == 0) {
			if err := stream.Send(rs); err != nil {
				return err
			}
			known = rs.GetVersion()
		}
		first = false
		select {
		case <-changed:
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-s.done:
			return s.status(errShutdown)
		}
	}
}

// ruleFiles converts wire files for rules.Compile.
func ruleFiles(in []*allotv1.RuleFile) []rules.File {
	out := make([]rules.File, len(in))
	for i, f := range in {
		out[i] = rules.File{Name: f.GetName(), Domain: f.GetDomain(), Source: f.GetYaml()}
	}
	return out
}
