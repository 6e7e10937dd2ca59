package allocator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/tlsconfig"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// identityKey carries, on a call one node forwards to another, the
// identity the forwarding node authenticated (tlsconfig.Identity.String();
// absent for an anonymous caller). The receiving node trusts it only when
// the forwarding node proved with its certificate that it is a node: the
// allocator role, and a name in Config.PeerNames when that is set.
const identityKey = "x-allot-identity"

// methodClass is what a method requires of its caller.
type methodClass uint8

const (
	// classOpen: no authentication (the health service).
	classOpen methodClass = iota
	// classAgent: Acquire and Release, only as the caller's own agent id.
	classAgent
	// classWatch: WatchRules, any caller the transport admitted.
	classWatch
	// classRead: the read-only Admin RPCs (an admin, unless OpenReads).
	classRead
	// classJoin: AddVoter (an admin, or an allocator joining: a node, per
	// Config.PeerNames when that is set).
	classJoin
	// classPeer: calls only allocator nodes make of each other (the move
	// driver's ApplySlotEntry): the immediate caller's certificate has the
	// allocator role (and a name in Config.PeerNames when that is set); an
	// admin may not make them. Where client certificates are not verified
	// (ClientAuth none, with or without TLS) a node has no certificate to
	// prove that with: there (a cluster authenticated by tokens alone) a
	// node presents the admin token every node's file holds, as it does to
	// join, and a token is accepted.
	classPeer
	// classAdmin: every other Admin RPC, and any method not listed.
	classAdmin
)

var methodClasses = map[string]methodClass{
	allotv1.Allocator_Acquire_FullMethodName:    classAgent,
	allotv1.Allocator_Release_FullMethodName:    classAgent,
	allotv1.Allocator_WatchRules_FullMethodName: classWatch,
	allotv1.Admin_GetRules_FullMethodName:       classRead,
	allotv1.Admin_ListLeases_FullMethodName:     classRead,
	allotv1.Admin_InspectKey_FullMethodName:     classRead,
	allotv1.Admin_ListAgents_FullMethodName:     classRead,
	allotv1.Admin_TopKeys_FullMethodName:        classRead,
	allotv1.Admin_ClusterStatus_FullMethodName:  classRead,
	allotv1.Admin_AddVoter_FullMethodName:       classJoin,
	allotv1.Admin_ApplySlotEntry_FullMethodName: classPeer,
	// PutRules, Check, RemoveServer, TransferLeadership: classAdmin.
}

// classify returns a method's class; unknown methods need an admin.
func classify(fullMethod string) methodClass {
	if c, ok := methodClasses[fullMethod]; ok {
		return c
	}
	if strings.HasPrefix(fullMethod, "/grpc.health.v1.Health/") {
		return classOpen
	}
	return classAdmin
}

// principal is who a call comes from.
type principal struct {
	// cert is the identity in the immediate caller's verified certificate
	// (zero without one).
	cert tlsconfig.Identity
	// forwarded: the immediate caller is a node (guard.isPeer of cert)
	// that forwarded the call; via is then the original caller's identity
	// (zero: anonymous).
	forwarded bool
	via       tlsconfig.Identity
	// token: a valid admin bearer token was presented.
	token bool
}

// tokenIdentity is the identity a valid bearer token proves.
var tokenIdentity = tlsconfig.Identity{Role: tlsconfig.RoleAdmin, Name: "token"}

// acting returns the identity the call acts as: the forwarded identity on
// a call from a peer, else an admin token's, else the certificate's.
func (p principal) acting() tlsconfig.Identity {
	switch {
	case p.forwarded:
		return p.via
	case p.token && !p.cert.Is(tlsconfig.RoleAdmin):
		return tokenIdentity
	}
	return p.cert
}

func (p principal) String() string {
	id := p.acting()
	s := "anonymous"
	if !id.IsZero() {
		s = id.String()
	}
	if p.forwarded {
		s += " (forwarded by " + p.cert.String() + ")"
	}
	return s
}

type principalKey struct{}

// withPrincipal records the authenticated principal for the handlers (the
// forwarder passes it on).
func withPrincipal(ctx context.Context, p principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// principalFrom returns the call's principal (ok false when the call was
// not authenticated: authentication is off).
func principalFrom(ctx context.Context) (principal, bool) {
	p, ok := ctx.Value(principalKey{}).(principal)
	return p, ok
}

// authError is a refusal with its metrics reason.
type authError struct {
	reason string // "unauthenticated" or "permission_denied"
	err    error  // a status error
}

func (e *authError) Error() string { return e.err.Error() }

func unauthenticated(format string, args ...any) *authError {
	return &authError{"unauthenticated", status.Errorf(codes.Unauthenticated, "allocator: "+format, args...)}
}

func denied(format string, args ...any) *authError {
	return &authError{"permission_denied", status.Errorf(codes.PermissionDenied, "allocator: "+format, args...)}
}

// authenticate builds the call's principal from the verified peer
// certificate, the forwarding metadata and the bearer token.
func (g *guard) authenticate(ctx context.Context) (principal, *authError) {
	var p principal
	if pr, ok := peer.FromContext(ctx); ok {
		if info, ok := pr.AuthInfo.(credentials.TLSInfo); ok {
			id, err := tlsconfig.PeerIdentity(info.State)
			if err != nil {
				return p, denied("client certificate: %v", err)
			}
			p.cert = id
		}
	}
	md, _ := metadata.FromIncomingContext(ctx)
	if p.cert.Is(tlsconfig.RoleAllocator) && len(md.Get(forwardedKey)) > 0 {
		if !g.isPeer(p.cert) {
			return p, notPeer(p.cert, "forward calls")
		}
		p.forwarded = true
		if v := md.Get(identityKey); len(v) > 0 && v[0] != "" {
			id, err := tlsconfig.ParseIdentity(v[0])
			if err != nil {
				return p, denied("forwarded identity: %v", err)
			}
			p.via = id
		}
		// The forwarding node checked the caller's token; a rotation in
		// progress on this node must not refuse it again.
		return p, nil
	}
	for _, h := range md.Get("authorization") {
		tok, ok := tlsconfig.BearerToken(h)
		if !ok {
			return p, unauthenticated(`malformed authorization metadata: want "Bearer <token>"`)
		}
		if !g.tokens.Load().Valid(tok) {
			return p, unauthenticated("invalid bearer token")
		}
		p.token = true
	}
	return p, nil
}

// isPeer reports whether a certificate identity is one of this cluster's
// nodes: it has the allocator role and, when Config.PeerNames is set, a
// name listed there.
func (g *guard) isPeer(id tlsconfig.Identity) bool {
	return id.Is(tlsconfig.RoleAllocator) && (g.peers == nil || g.peers[id.Name])
}

// notPeer is the refusal for an allocator certificate that is not one of
// the cluster's nodes (Config.PeerNames) doing what only nodes do.
func notPeer(id tlsconfig.Identity, what string) *authError {
	return denied("%s may not %s: it is not one of this cluster's nodes (-peer-names)", id, what)
}

// needAdmin is the refusal for a caller without the admin role.
func needAdmin(p principal, method string) *authError {
	id := p.acting()
	if id.IsZero() {
		return unauthenticated(`%s needs an admin: a client certificate with the admin role, or "authorization: Bearer <token>" metadata`, method)
	}
	return denied("%s may not call %s: it needs the admin role", id, method)
}

// authorize checks that p may call method with req.
func (g *guard) authorize(p principal, class methodClass, method string, req any) *authError {
	id := p.acting()
	switch class {
	case classOpen, classWatch:
		return nil
	case classRead:
		if g.openReads || id.Is(tlsconfig.RoleAdmin, tlsconfig.RoleAllocator) {
			return nil
		}
		return needAdmin(p, method)
	case classJoin:
		// A forwarded identity is a node's when it is one itself, or the
		// nameless nodeIdentity a node adding itself to the data groups
		// forwards (the forwarding node is a node: authenticate). Any other
		// forwarded allocator identity is refused here too, so that a node
		// started without the list does not pass an unlisted one's join on.
		if id.Is(tlsconfig.RoleAdmin) || g.isPeer(id) || (p.forwarded && id == nodeIdentity) {
			return nil
		}
		if id.Is(tlsconfig.RoleAllocator) {
			return notPeer(id, "call "+method)
		}
		return needAdmin(p, method)
	case classPeer:
		if g.isPeer(p.cert) || (g.noCerts && p.token && !p.forwarded) {
			return nil
		}
		if p.cert.Is(tlsconfig.RoleAllocator) {
			return notPeer(p.cert, "call "+method)
		}
		if id.IsZero() {
			return unauthenticated("%s is called by allocator nodes only: a client certificate with the allocator role", method)
		}
		return denied("%s may not call %s: only allocator nodes (a certificate with the allocator role) may", id, method)
	case classAgent:
		agentID := ""
		if r, ok := req.(interface{ GetAgentId() string }); ok {
			agentID = r.GetAgentId()
		}
		switch {
		case id.IsZero():
			if g.requireCerts {
				return unauthenticated("%s needs an agent certificate", method)
			}
			return nil
		case id.Role == tlsconfig.RoleAllocator && isRegionAgent(agentID):
			// A regional cluster's leader leasing global keys (regions.md).
			return nil
		case id.Role != tlsconfig.RoleAgent:
			return denied("%s may not call %s: only agents lease tokens", id, method)
		case !tlsconfig.AgentIDMatches(agentID, id.Name):
			return denied("%s may not act as agent_id %q (want %q or %q)", id, agentID, id.Name, id.Name+"/<suffix>")
		}
		return nil
	default:
		if id.Is(tlsconfig.RoleAdmin) {
			return nil
		}
		return needAdmin(p, method)
	}
}

// forwardMetadata returns the metadata a node adds to a call it forwards:
// the forwarding mark, the caller's identity, and the caller's
// authorization (so a cluster authenticated by tokens alone re-checks the
// token on the leader).
func forwardMetadata(ctx context.Context, nodeID string) []string {
	kv := []string{forwardedKey, nodeID}
	if p, ok := principalFrom(ctx); ok {
		if id := p.acting(); !id.IsZero() {
			kv = append(kv, identityKey, id.String())
		}
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		for _, v := range md.Get("authorization") {
			kv = append(kv, "authorization", v)
		}
	}
	return kv
}

// asCaller returns the context for the calls this node makes of other
// nodes to carry out the call of ctx (the data groups' part of an admin's
// RemoveServer): they present the caller's identity and authorization, as
// a forwarded call does, and the receiving node checks them. It is
// derived from the Server's context, bounded by ForwardTimeout, so that
// the caller going away does not stop a change halfway, and it does not
// carry ctx's forwarding mark: this node forwards these calls itself.
func (s *Server) asCaller(ctx context.Context) (context.Context, context.CancelFunc) {
	out, cancel := context.WithTimeout(s.baseCtx, s.cfg.ForwardTimeout)
	if p, ok := principalFrom(ctx); ok {
		out = withPrincipal(out, p)
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if auth := md.Get("authorization"); len(auth) > 0 {
			out = metadata.NewIncomingContext(out, metadata.MD{"authorization": auth})
		}
	}
	return out, cancel
}

// nodeIdentity is the identity a node's own calls forward: the allocator
// role its certificate proves to the receiving node.
var nodeIdentity = tlsconfig.Identity{Role: tlsconfig.RoleAllocator}

// asNode returns the context for the calls a node makes of others as
// itself (adding a joining node to the data groups): with client
// certificates its certificate proves the allocator role and it forwards
// that identity; without them it presents its admin token (withJoinToken).
// It is bounded by ForwardTimeout.
func (s *Server) asNode() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.ForwardTimeout)
	return s.withJoinToken(withPrincipal(ctx, principal{cert: nodeIdentity})), cancel
}

// errorReason returns the metrics reason of a guard refusal.
func errorReason(err error) string {
	var ae *authError
	if errors.As(err, &ae) {
		return ae.reason
	}
	return fmt.Sprint(status.Code(err))
}

// insecureWarnInterval is how often an Insecure node repeats its warning.
const insecureWarnInterval = time.Hour

// insecureLoop logs that the node runs without authentication, at start
// and every insecureWarnInterval, until the Server stops.
func (s *Server) insecureLoop() {
	t := time.NewTicker(insecureWarnInterval)
	defer t.Stop()
	for {
		s.log.Warn("running with -insecure: no client certificates and no admin tokens; anyone who reaches the gRPC port can change the rules and the cluster and read leases",
			"grpc", s.grpcAddr, "raft", s.node.bound)
		select {
		case <-s.done:
			return
		case <-t.C:
		}
	}
}
