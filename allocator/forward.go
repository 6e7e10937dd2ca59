package allocator

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"

	"github.com/allot/allot/pkg/tlsconfig"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// forwardedKey marks a call one node forwarded to another. A node that
// receives a marked call never forwards it again, so calls cannot loop.
const forwardedKey = "x-allot-forwarded-by"

// forwarder owns the node-to-node client connections, one per address.
type forwarder struct {
	opts []grpc.DialOption

	mu     sync.Mutex // guards conns and closed
	conns  map[string]*grpc.ClientConn
	closed bool
}

// newForwarder dials with l's certificate when l is non-nil, else
// plaintext unless dialOpts bring credentials. With l, the server's
// certificate must carry the allocator role and, when peerNames is
// non-empty (Config.PeerNames, for the connections to this cluster's own
// nodes), one of those names: another allocator certificate from the CA
// (a region's) fails the handshake, so a call is never sent to it, with
// the caller's identity and request, however Raft or a member record
// names its address.
//
// The refused call fails Unavailable, gRPC's code for a failed handshake,
// with the certificate's identity in the message (tlsconfig's error),
// and is passed through toStatus unchanged, as a handshake with a server
// from another CA is. Not PermissionDenied: that code says the caller's
// own credentials are not enough, while here nothing is wrong with them;
// the node it reached will not talk to the leader it knows, which a new
// leader (a listed node) ends, so a caller retrying Unavailable is right
// to.
func newForwarder(dialOpts []grpc.DialOption, l *tlsconfig.Loader, peerNames []string) *forwarder {
	opts := []grpc.DialOption{
		// Find a dead connection to a leader that vanished (the servers
		// allow pings every 10 s).
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		// Reconnect quickly to a node that restarts (gRPC's default backoff
		// starts at 1 s).
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  50 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   time.Second,
			},
			MinConnectTimeout: 2 * time.Second,
		}),
	}
	if l != nil {
		opts = append(opts, grpc.WithTransportCredentials(l.ClientCredentialsNamed("", peerNames, tlsconfig.RoleAllocator)))
	} else {
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	}
	opts = append(opts, dialOpts...)
	return &forwarder{opts: opts, conns: make(map[string]*grpc.ClientConn)}
}

// conn returns the cached connection to addr, creating it (lazily
// connecting) on first use.
func (f *forwarder) conn(addr string) (*grpc.ClientConn, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return nil, errShutdown
	}
	if cc, ok := f.conns[addr]; ok {
		return cc, nil
	}
	cc, err := grpc.NewClient(addr, f.opts...)
	if err != nil {
		return nil, fmt.Errorf("allocator: dial %s: %w", addr, err)
	}
	f.conns[addr] = cc
	return cc, nil
}

// has reports whether a connection to addr is cached.
func (f *forwarder) has(addr string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.conns[addr] != nil
}

// close closes every connection. Safe twice.
func (f *forwarder) close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	for addr, cc := range f.conns {
		cc.Close()
		delete(f.conns, addr)
	}
}

// isForwarded reports whether the incoming call was forwarded by a node.
func isForwarded(ctx context.Context) bool {
	md, ok := metadata.FromIncomingContext(ctx)
	return ok && len(md.Get(forwardedKey)) > 0
}

// onLeader runs local when this node leads, and otherwise forwards the call
// to the leader with remote. While no leader is known (an election), or
// after a failure that allows it (see retryable), it retries with backoff
// for up to Config.ForwardWait, within ctx's deadline. A call that was
// itself forwarded is never forwarded again.
func (s *Server) onLeader(ctx context.Context, idempotent bool,
	local func(ctx context.Context) error,
	remote func(ctx context.Context, cc *grpc.ClientConn) error,
) error {
	return s.onRaftLeader(ctx, s.node.raft, idempotent, local, remote)
}

// onRaftLeader is onLeader for the Raft group r (one of the groups this
// node hosts): local runs when this node leads r, and remote is sent to
// r's leader otherwise.
func (s *Server) onRaftLeader(ctx context.Context, r *raft.Raft, idempotent bool,
	local func(ctx context.Context) error,
	remote func(ctx context.Context, cc *grpc.ClientConn) error,
) error {
	forwarded := isForwarded(ctx)
	deadline := time.Now().Add(s.cfg.ForwardWait)
	wait := 5 * time.Millisecond
	var lastErr error
	for {
		select {
		case <-s.done:
			return errShutdown
		default:
		}
		var err error
		if r.State() == raft.Leader {
			err = local(ctx)
		} else if forwarded {
			// The sender retries elsewhere; a second hop could loop.
			return errForwardedNotLeader
		} else {
			err = s.forward(ctx, s.hintFor(r), remote)
		}
		if err == nil || !retryable(err, idempotent) || ctx.Err() != nil {
			return err
		}
		lastErr = err
		if time.Now().Add(wait).After(deadline) {
			return lastErr
		}
		if err := s.pause(ctx, wait); err != nil {
			return err
		}
		wait = min(wait*2, 100*time.Millisecond)
	}
}

// forward sends the call to the leader h known to this node, marked as
// forwarded. An answer from the leader carries the leader's address in the
// response header allotv1.LeaderAddrHeader.
func (s *Server) forward(ctx context.Context, h leaderHint, remote func(context.Context, *grpc.ClientConn) error) error {
	if h.id == "" || h.addr == "" || h.id == s.cfg.NodeID {
		// No leader, the leader has not registered its address yet, or Raft
		// still names this node after losing leadership.
		return errNoLeader
	}
	cc, err := s.fwd.conn(h.addr)
	if err != nil {
		return err
	}
	s.metrics.forwarded.Inc()
	// Bound the hop: a caller without a deadline must not hold this node's
	// resources on a leader that stopped answering.
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ForwardTimeout)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, forwardMetadata(ctx, s.cfg.NodeID)...)
	start := time.Now()
	err = remote(ctx, cc)
	s.metrics.forwardLatency.Observe(time.Since(start).Seconds())
	if err == nil {
		// Tell the caller where the leader is, so that its next calls
		// skip this hop (allotv1.LeaderAddrHeader). A call that is not a
		// gRPC server stream (a test calling the service directly) has no
		// header to set.
		_ = grpc.SetHeader(ctx, metadata.Pairs(allotv1.LeaderAddrHeader, h.addr))
	}
	return err
}

// pause waits d, or until ctx ends (its error) or the server shuts down
// (errShutdown).
func (s *Server) pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-s.done:
		return errShutdown
	}
}
