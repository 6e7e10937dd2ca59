package allocator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"regexp"
	"strings"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"

	"github.com/allot/allot/allocator/upstream"
)

// RegionConfig makes a cluster a region of a global cluster: the cluster's
// leader leases the keys of scope: global rules from the global cluster
// (an ordinary Acquire, with the region as the agent) and sub-grants them
// to its gateways, never more than it holds (docs/regions.md). Every node
// of a regional cluster must carry the same Name.
type RegionConfig struct {
	// Name names the region (1-64 of [a-z0-9._-]); "" for a global or
	// standalone cluster. static_fraction maps are keyed by it.
	Name string
	// GlobalAllocators are gRPC addresses (host:port) of the global
	// cluster's nodes. Empty with a Name: the region has no upstream, and
	// each global key is served from its fallback share (the rule's
	// static fraction, or with fair_share its whole rate), with a log
	// line and a metric.
	GlobalAllocators []string
	// Upstream tunes the per-key policy (upstream.DefaultConfig for the
	// zero value); set Upstream.RTT to the round trip to the global
	// cluster.
	Upstream upstream.Config
	// SkipCycleCheck skips the startup check that the global allocators
	// are not a region nor this cluster (tests that start the global
	// cluster after the region).
	SkipCycleCheck bool
}

var regionName = regexp.MustCompile(`^[a-z0-9._-]{1,64}$`)

// regionAgentPrefix starts the agent id a regional leader leases with.
const regionAgentPrefix = "region:"

// isRegionAgent reports whether agentID is a region's (region:NAME).
func isRegionAgent(agentID string) bool {
	return strings.HasPrefix(agentID, regionAgentPrefix) && regionName.MatchString(agentID[len(regionAgentPrefix):])
}

func (r RegionConfig) validate(c Config) []error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("allocator: "+format, args...))
	}
	if r.Name != "" && !regionName.MatchString(r.Name) {
		bad("-region %q: want 1-64 characters of a-z, 0-9, '.', '_' and '-'", r.Name)
	}
	if len(r.GlobalAllocators) > 0 && r.Name == "" {
		bad("-global-allocators needs -region: only a regional cluster leases from a global one")
	}
	if r.Name != "" && c.Groups > 1 {
		bad("-region with -groups %d: a regional cluster runs a single group (docs/regions.md)", c.Groups)
	}
	seen := map[string]bool{}
	for _, a := range r.GlobalAllocators {
		if _, _, err := net.SplitHostPort(a); err != nil {
			bad("-global-allocators %q: %v", a, err)
		}
		if seen[a] {
			bad("-global-allocators names %s twice", a)
		}
		seen[a] = true
		for _, own := range []string{c.GRPCAddr, c.AdvertiseGRPCAddr} {
			if own != "" && sameHostPort(own, a) {
				bad("-global-allocators %s is this node's own gRPC address: a cluster cannot be its own global cluster", a)
			}
		}
	}
	if err := r.Upstream.Validate(); err != nil {
		bad("%v", err)
	}
	return errs
}

// sameHostPort reports whether two host:port addresses name the same
// endpoint literally (a wildcard listen host matches any host).
func sameHostPort(a, b string) bool {
	ha, pa, err1 := net.SplitHostPort(a)
	hb, pb, err2 := net.SplitHostPort(b)
	if err1 != nil || err2 != nil || pa != pb || pa == "0" {
		return false
	}
	wild := func(h string) bool { return h == "" || h == "0.0.0.0" || h == "::" }
	return ha == hb || wild(ha) || wild(hb)
}

// errCycle: the global allocators are a region, or this cluster.
var errCycle = errors.New("allocator: cycle in the allocator chain")

// checkUpstream refuses a cycle at startup: each reachable global
// allocator must be a global cluster (no -region) and must not count this
// node among its members (by advertised gRPC or Raft address: node ids are
// only unique within a cluster). An allocator that does not answer within a
// second is checked by the leader's runner before its calls, until one
// answers.
func (s *Server) checkUpstream() error {
	r := s.cfg.Region
	if len(r.GlobalAllocators) == 0 || r.SkipCycleCheck {
		return nil
	}
	for _, addr := range r.GlobalAllocators {
		ctx, cancel := context.WithTimeout(s.baseCtx, time.Second)
		st, err := s.upstreamStatus(ctx, addr)
		cancel()
		if err != nil {
			s.log.Warn("global allocator not reachable at startup; the cycle check runs when it answers", "addr", addr, "err", err)
			continue
		}
		if err := s.cycleError(addr, st); err != nil {
			return err
		}
	}
	return nil
}

// upstreamStatus asks a global allocator for its ClusterStatus.
func (s *Server) upstreamStatus(ctx context.Context, addr string) (*allotv1.ClusterStatusResponse, error) {
	cc, err := s.up.conn(addr)
	if err != nil {
		return nil, err
	}
	st, err := allotv1.NewAdminClient(cc).ClusterStatus(s.withJoinToken(ctx), &allotv1.ClusterStatusRequest{})
	if err != nil {
		return nil, s.explainRefusal(s.baseCtx, addr, err)
	}
	return st, nil
}

// cycleError reports a global allocator that is a region or this cluster.
func (s *Server) cycleError(addr string, st *allotv1.ClusterStatusResponse) error {
	if st.GetRegion() != "" {
		return fmt.Errorf("%w: -global-allocators %s is a regional cluster (region %q); a global cluster runs without -region",
			errCycle, addr, st.GetRegion())
	}
	for _, m := range st.GetMembers() {
		if m.GetGrpcAddr() == s.advGRPC || m.GetRaftAddr() == string(s.node.addr) {
			return fmt.Errorf("%w: -global-allocators %s is this cluster (member %s)", errCycle, addr, m.GetId())
		}
	}
	return nil
}

// errRegionGroups: a regional node in a cluster with several data groups
// (one that joined such a cluster, or whose data dir holds one). A
// region's pools live with its keys, in the data groups, while its
// upstream runner reads and commits to the meta group's ledger only, so
// such a region would never be granted a global key. Config.Validate
// refuses -region with -groups N up front.
var errRegionGroups = errors.New("allocator: -region needs a single-group cluster, and this node's cluster has several data groups (-groups); a regional cluster runs a single group (docs/regions.md)")

// setupRegion creates the region's link (none unless Config.Region names
// one) and refuses a cycle in the allocator chain.
func (s *Server) setupRegion() error {
	var err error
	if s.region, err = s.newRegional(); err != nil {
		return err
	}
	return s.checkUpstream()
}

// runRegion runs the region's upstream runner for one term of leadership,
// in a goroutine owned by the term; the returned function waits for it
// to end (after ctx is canceled).
func (s *Server) runRegion(ctx context.Context) (wait func()) {
	if s.region == nil {
		return func() {}
	}
	done := make(chan struct{})
	go func() { // owned by this term: ends with ctx
		defer close(done)
		s.region.run(ctx)
	}()
	return func() { <-done }
}
