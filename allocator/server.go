package allocator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/raftmux"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/tlsconfig"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Server is one allocator node: Raft, the replicated state, the gRPC
// services and the HTTP endpoints. Create it with New and stop it with
// Shutdown. Its methods are safe for concurrent use.
type Server struct {
	cfg Config
	log *slog.Logger

	st      *state.State
	fsm     *fsm
	node    *node
	mux     *raftmux.Mux // the Raft listener (nil with a test transport)
	batcher *batcher
	// grp is the runtime of a cluster with several groups (groups.go);
	// nil in a single-group cluster.
	grp *groupSet
	// fwd dials this cluster's nodes (with Config.PeerNames, only
	// certificates with a listed name); up dials the global allocators
	// (-global-allocators), any allocator certificate.
	fwd      *forwarder
	up       *forwarder
	guard    *guard
	pprofLog logGate           // refused /debug/pprof/ requests logged
	tls      *tlsconfig.Loader // nil without TLS
	metrics  *metrics
	gather   prometheus.Gatherer
	// registries and registered: where the metrics went, for unregistering.
	registries []prometheus.Registerer
	registered []prometheus.Collector

	grpcSrv  *grpc.Server
	grpcLn   net.Listener
	health   *health.Server
	httpSrv  *http.Server
	httpLn   net.Listener
	grpcAddr string // bound
	httpAddr string // bound ("" without HTTP)
	// advGRPC and advHTTP are the advertised addresses (the bound ones
	// unless Config.Advertise* says otherwise).
	advGRPC string
	advHTTP string

	rulesMu sync.Mutex    // guards rulesCh
	rulesCh chan struct{} // closed (and replaced) when the rule set may have changed

	lastStamp atomic.Int64 // the latest time stamped into a command

	region *regional // a regional cluster's link to its global cluster (nil otherwise)

	// Readiness (ready.go): catchUpTarget is the commit index this node
	// must apply before it first serves (0: not learned yet); caughtUp
	// latches once it has; barrierTerm is the term in which this node, as
	// leader, completed its Barrier; behindSince is when a readiness check
	// first saw this follower's FSM behind its commit index (Unix nanos;
	// 0: caught up at the last check).
	catchUpTarget atomic.Uint64
	caughtUp      atomic.Bool
	barrierTerm   atomic.Uint64
	behindSince   atomic.Int64

	// joinToken is the admin token presented when joining without a
	// certificate (nil: none).
	joinToken atomic.Pointer[string]
	// reregistered is how the address check ended (nil: the reregister
	// loop runs).
	reregistered atomic.Pointer[string]

	// done is closed when Shutdown starts: waits, watchers and loops end.
	done chan struct{}
	// baseCtx is canceled when done is closed; the Server's own outgoing
	// calls derive from it.
	baseCtx    context.Context
	cancelBase context.CancelFunc
	// stopLoops is closed once the gRPC server has drained: the leader and
	// join loops end.
	stopLoops chan struct{}
	// wg tracks the Server's loops (goFunc): Shutdown waits for them
	// before it shuts any Raft group down, because they propose, and
	// hashicorp/raft may drop the future of an entry it committed but had
	// not applied when it shuts down, leaving its waiter blocked for good.
	wg sync.WaitGroup
	// serving tracks the gRPC and HTTP Serve goroutines; each ends when
	// its server is stopped.
	serving sync.WaitGroup

	shutdownOnce sync.Once
	shutdownErr  error
}

// New opens the stores in cfg.DataDir, starts Raft, and starts the gRPC and
// HTTP servers. A node with existing Raft state ignores Bootstrap and Join.
// A damaged data directory is an error naming the path; it is never reset.
func New(cfg Config) (*Server, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if len(cfg.InitialRules) > 0 {
		if _, err := rules.Compile(1, cfg.InitialRules); err != nil {
			return nil, fmt.Errorf("allocator: initial rules: %w", err)
		}
	}
	s := &Server{
		cfg:       cfg,
		log:       cfg.Logger.With("node", cfg.NodeID),
		st:        state.New(cfg.stateConfig()),
		rulesCh:   make(chan struct{}),
		done:      make(chan struct{}),
		stopLoops: make(chan struct{}),
	}
	s.baseCtx, s.cancelBase = context.WithCancel(context.Background())
	if cfg.TLS.Enabled() {
		opts := cfg.TLS
		opts.OnReloadError = func(err error) {
			s.log.Warn("TLS files changed but did not load; keeping the previous ones", "err", err)
		}
		l, err := tlsconfig.Load(opts)
		if err != nil {
			return nil, fmt.Errorf("allocator: %w", err)
		}
		s.tls = l
		id, err := l.Identity()
		if err != nil || id.Role != tlsconfig.RoleAllocator {
			// The other nodes refuse its forwarded calls and Raft traffic.
			s.log.Warn("this node's certificate does not carry the allocator role; peers will refuse it",
				"identity", id.String(), "err", err)
		}
		if len(cfg.PeerNames) > 0 && (err != nil || id.Role != tlsconfig.RoleAllocator || !slices.Contains(cfg.PeerNames, id.Name)) {
			return nil, fmt.Errorf("allocator: this node's certificate (%s) is not one of PeerNames (-peer-names %s): "+
				"its peers would refuse it", id, strings.Join(cfg.PeerNames, ","))
		}
	}
	s.setJoinToken(cfg.AdminTokens)
	s.guard = newGuard(cfg, s.log)
	s.fwd = newForwarder(cfg.DialOptions, s.tls, cfg.PeerNames)
	// The global allocators are another cluster: their names are not
	// this cluster's PeerNames (docs/regions.md).
	s.up = newForwarder(cfg.DialOptions, s.tls, nil)
	s.fsm = &fsm{st: s.st, onRules: s.notifyRules, beforeApply: cfg.beforeApply}

	var err error
	defer func() {
		if err != nil {
			s.abortStart()
		}
	}()

	if err = s.setupMetrics(); err != nil {
		return nil, err
	}
	s.guard.rejected = func(reason string) { s.metrics.rejected.WithLabelValues(reason).Inc() }
	s.fsm.onApply = s.metrics.observeApply
	s.fsm.onEntry = s.metrics.observeEntry
	s.fsm.onExpired = func(n uint64) { s.metrics.expired.Add(float64(n)) }
	s.fsm.onSnapshot = s.observeSnapshot

	// Listeners first: without an advertise address, the bound gRPC
	// address is advertised in MemberCommand.
	if s.grpcLn, err = net.Listen("tcp", cfg.GRPCAddr); err != nil {
		err = fmt.Errorf("allocator: listen grpc %s: %w", cfg.GRPCAddr, err)
		return nil, err
	}
	s.grpcAddr = s.grpcLn.Addr().String()
	s.advGRPC = cmp.Or(cfg.AdvertiseGRPCAddr, s.grpcAddr)
	if cfg.HTTPAddr != "" {
		if s.httpLn, err = net.Listen("tcp", cfg.HTTPAddr); err != nil {
			err = fmt.Errorf("allocator: listen http %s: %w", cfg.HTTPAddr, err)
			return nil, err
		}
		s.httpAddr = s.httpLn.Addr().String()
		s.advHTTP = cmp.Or(cfg.AdvertiseHTTPAddr, s.httpAddr)
	}

	var stream raft.StreamLayer
	var bound net.Addr
	if cfg.transport == nil {
		var raftTLS *tlsconfig.Loader
		if cfg.RaftTLS {
			raftTLS = s.tls
		}
		var g0 *raftmux.Stream
		if s.mux, g0, err = listenRaft(cfg, raftTLS, s.log); err != nil {
			return nil, err
		}
		stream, bound = g0, s.mux.BoundAddr()
	}
	g0, err := s.prepareGroups()
	if err != nil {
		return nil, err
	}
	if cfg.Region.Name != "" && s.multi() {
		err = errRegionGroups
		return nil, err
	}
	if s.node, err = openNode(g0, s.fsm, newHCLogAdapter(s.log, "raft"), stream, bound); err != nil {
		return nil, err
	}
	if err = s.register(&stateCollector{s: s}); err != nil {
		return nil, err
	}
	s.batcher = s.newGroupBatcher(s.proposeData)
	if err = s.openDataGroups(); err != nil {
		return nil, err
	}

	if err = s.setupRegion(); err != nil {
		return nil, err
	}
	if err = s.startGRPC(); err != nil {
		return nil, err
	}
	if s.httpLn != nil {
		s.startHTTP()
	}
	s.goFunc(s.leaderLoop)
	s.goFunc(s.watermarkLoop)
	if cfg.Insecure && !cfg.authEnabled() {
		s.goFunc(s.insecureLoop)
	}
	if cfg.Join != "" && !s.hasJoined() {
		s.goFunc(s.joinLoop)
	}
	if err = s.checkAddresses(); err != nil {
		return nil, err
	}
	s.log.Info("allocator started", "grpc", s.grpcAddr, "raft", s.node.bound, "http", s.httpAddr,
		"advertise_grpc", s.advGRPC, "advertise_raft", string(s.node.addr), "advertise_http", s.advHTTP,
		"data_dir", cfg.DataDir, "tls", s.tls != nil, "client_auth", cfg.ClientAuth.String(), "raft_tls", cfg.RaftTLS,
		"admin_tokens", len(cfg.AdminTokens))
	return s, nil
}

// abortStart releases whatever New had set up before failing.
func (s *Server) abortStart() {
	close(s.done)
	s.cancelBase()
	close(s.stopLoops)
	if s.grpcSrv != nil {
		s.grpcSrv.Stop()
	} else if s.grpcLn != nil {
		s.grpcLn.Close()
	}
	if s.httpSrv != nil {
		s.httpSrv.Close()
	} else if s.httpLn != nil {
		s.httpLn.Close()
	}
	if s.batcher != nil {
		s.batcher.close()
	}
	s.wg.Wait()
	s.serving.Wait()
	s.closeGroups()
	s.node.close()
	s.closeRaftListener()
	s.fwd.close()
	s.up.close()
	s.unregisterMetrics()
}

// goFunc runs f in a goroutine tracked by the Server's WaitGroup; f must
// return once s.done or s.stopLoops is closed, and may wait on Raft
// futures meanwhile (Raft still runs until f has returned).
func (s *Server) goFunc(f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
}

// startGRPC starts the gRPC server: TLS when configured, the guard's
// interceptors (authentication, per-agent rate, in-flight cap), keepalive
// enforcement and the per-connection stream cap.
func (s *Server) startGRPC() error {
	c := s.cfg
	opts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(c.MaxRecvMsgSize),
		grpc.MaxSendMsgSize(c.MaxRecvMsgSize * 4),
		grpc.MaxConcurrentStreams(c.MaxConcurrentStreams),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: c.KeepaliveMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: c.KeepaliveTime, Timeout: c.KeepaliveTimeout}),
		// A connection that has not finished its handshake in this time is
		// closed (gRPC's default is 120 s).
		grpc.ConnectionTimeout(10 * time.Second),
		// Stop (the hard stop when a graceful drain runs out of time)
		// cancels every call in flight and waits for its handler to
		// return, so that no handler still runs when the loops and Raft
		// shut down after it.
		grpc.WaitForHandlers(true),
		grpc.ChainUnaryInterceptor(s.guard.unary),
		grpc.ChainStreamInterceptor(s.guard.stream),
	}
	if s.tls != nil {
		tc, err := s.tls.Server(c.ClientAuth)
		if err != nil {
			return fmt.Errorf("allocator: %w", err)
		}
		opts = append(opts, grpc.Creds(credentials.NewTLS(tc)))
	}
	opts = append(opts, c.ServerOptions...)
	s.grpcSrv = grpc.NewServer(opts...)
	allotv1.RegisterAllocatorServer(s.grpcSrv, &allocatorService{s: s})
	allotv1.RegisterAdminServer(s.grpcSrv, &adminService{s: s})
	s.health = health.NewServer()
	healthpb.RegisterHealthServer(s.grpcSrv, s.health)
	s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	ln := s.grpcLn
	s.serving.Go(func() {
		if err := s.grpcSrv.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			s.log.Error("grpc server stopped", "err", err)
		}
	})
	return nil
}

// SetAdminTokens replaces the admin bearer tokens (a rotation: callers with
// an old token are refused from now on). It fails when authentication was
// not configured at New (no ClientAuth and no AdminTokens), or a token is
// shorter than 16 bytes.
func (s *Server) SetAdminTokens(tokens []string) error {
	if !s.guard.authOn {
		return errors.New("allocator: authentication is off (no ClientAuth and no AdminTokens at start); tokens not set")
	}
	for i, tok := range tokens {
		if len(tok) < 16 {
			return fmt.Errorf("allocator: admin token %d is shorter than 16 bytes", i)
		}
	}
	s.guard.setTokens(tokens)
	s.setJoinToken(tokens)
	s.log.Info("admin tokens replaced", "count", len(tokens))
	return nil
}

// ReloadAdminTokens re-reads the admin token file at path
// (tlsconfig.ReadTokens) and replaces the tokens with its content. On
// error (the file does not read, a line is bad, no token is left, or
// SetAdminTokens refuses them) every previous token stays valid, a
// token being revoked included, and
// allot_allocator_admin_token_reload_failures_total counts the failure.
func (s *Server) ReloadAdminTokens(path string) error {
	tokens, err := tlsconfig.ReadTokens(path)
	if err == nil {
		err = s.SetAdminTokens(tokens)
	}
	if err != nil {
		s.metrics.tokenReloadFailures.Inc()
	}
	return err
}

func (s *Server) setJoinToken(tokens []string) {
	if len(tokens) == 0 {
		s.joinToken.Store(nil)
		return
	}
	tok := tokens[0]
	s.joinToken.Store(&tok)
}

// ReloadTLS re-reads the TLS files now (they are also re-read when they
// change, within tlsconfig.Options.ReloadInterval). On error the previous
// certificates stay in use. Without TLS it does nothing.
func (s *Server) ReloadTLS() error {
	if s.tls == nil {
		return nil
	}
	if err := s.tls.Reload(); err != nil {
		return fmt.Errorf("allocator: %w", err)
	}
	s.log.Info("TLS files reloaded")
	return nil
}

// GRPCAddr returns the bound gRPC address.
func (s *Server) GRPCAddr() string { return s.grpcAddr }

// HTTPAddr returns the bound HTTP address ("" when HTTP is off).
func (s *Server) HTTPAddr() string { return s.httpAddr }

// RaftAddr returns the bound Raft address.
func (s *Server) RaftAddr() string { return s.node.bound }

// AdvertiseGRPCAddr returns the gRPC address the cluster knows this node
// by: Config.AdvertiseGRPCAddr, or the bound address.
func (s *Server) AdvertiseGRPCAddr() string { return s.advGRPC }

// AdvertiseRaftAddr returns the Raft address in the Raft configuration:
// Config.AdvertiseRaftAddr, or the bound address.
func (s *Server) AdvertiseRaftAddr() string { return string(s.node.addr) }

// AdvertiseHTTPAddr returns the advertised HTTP address ("" when HTTP is
// off).
func (s *Server) AdvertiseHTTPAddr() string { return s.advHTTP }

// NodeID returns the node's Raft server id.
func (s *Server) NodeID() string { return s.cfg.NodeID }

// IsLeader reports whether this node is the Raft leader now.
func (s *Server) IsLeader() bool { return s.node.raft.State() == raft.Leader }

// Leader returns the current leader's node id and gRPC address, as known to
// this node ("" when unknown).
func (s *Server) Leader() (id, grpcAddr string) {
	h := s.leaderHint()
	return h.id, h.addr
}

// leaderHint returns the leader's id and, if registered, gRPC address.
func (s *Server) leaderHint() leaderHint { return s.hintFor(s.node.raft) }

// hintFor returns the leader of the Raft group r (one this node hosts):
// its id and, if registered, gRPC address.
func (s *Server) hintFor(r *raft.Raft) leaderHint {
	_, id := r.LeaderWithID()
	if id == "" {
		return leaderHint{}
	}
	if string(id) == s.cfg.NodeID {
		return leaderHint{id: string(id), addr: s.advGRPC}
	}
	for _, m := range s.st.Members() {
		if m.GetId() == string(id) {
			return leaderHint{id: string(id), addr: m.GetGrpcAddr()}
		}
	}
	return leaderHint{id: string(id)}
}

// status maps err for a gRPC reply (see toStatus).
func (s *Server) status(err error) error {
	if err == nil {
		return nil
	}
	return toStatus(err, s.leaderHint())
}

func (s *Server) rulesVersion() uint64 {
	if set := s.st.Rules(); set != nil {
		return set.Version()
	}
	return 0
}

// notifyRules wakes every rule watcher. Called by the FSM; does not block.
func (s *Server) notifyRules() {
	s.rulesMu.Lock()
	close(s.rulesCh)
	s.rulesCh = make(chan struct{})
	s.rulesMu.Unlock()
	s.metrics.rulesVersion.Set(float64(s.rulesVersion()))
}

// rulesChanged returns a channel closed at the next rule set change. Take
// it before reading the rules, so that no change is missed.
func (s *Server) rulesChanged() <-chan struct{} {
	s.rulesMu.Lock()
	defer s.rulesMu.Unlock()
	return s.rulesCh
}

// stamp returns the time to stamp into a command: the leader's clock,
// never earlier than a previous stamp from this node.
func (s *Server) stamp() int64 {
	now := time.Now().UnixNano()
	for {
		last := s.lastStamp.Load()
		if now <= last {
			return last
		}
		if s.lastStamp.CompareAndSwap(last, now) {
			return now
		}
	}
}

// advanceStamp makes later stamps at least t.
func (s *Server) advanceStamp(t int64) {
	for {
		last := s.lastStamp.Load()
		if t <= last || s.lastStamp.CompareAndSwap(last, t) {
			return
		}
	}
}

// propose commits cmd through Raft and returns the FSM's result; an error
// result from the FSM is returned as the error. Both ApplyFuture.Error()
// and Response() are checked.
func (s *Server) propose(cmd *allotv1.Command) (any, error) { return s.proposeCmd(s.node.raft, cmd) }

// proposeCmd is propose in the Raft group r.
func (s *Server) proposeCmd(r *raft.Raft, cmd *allotv1.Command) (any, error) {
	data, err := proto.Marshal(cmd)
	if err != nil {
		return nil, fmt.Errorf("allocator: encode command: %w", err)
	}
	return s.proposeOn(r, data)
}

// proposeData commits an encoded log entry, as propose does.
func (s *Server) proposeData(data []byte) (any, error) { return s.proposeOn(s.node.raft, data) }

// proposeOn commits an encoded log entry in the Raft group r.
func (s *Server) proposeOn(r *raft.Raft, data []byte) (any, error) {
	start := time.Now()
	f := r.Apply(data, s.cfg.ApplyTimeout)
	if err := f.Error(); err != nil {
		return nil, err
	}
	s.metrics.applyLatency.Observe(time.Since(start).Seconds())
	resp := f.Response()
	if err, ok := resp.(error); ok {
		return nil, err
	}
	return resp, nil
}

// apply stamps and proposes a command that is not batched.
func (s *Server) apply(cmd *allotv1.Command) (any, error) { return s.applyOn(s.node.raft, cmd) }

// applyOn is apply in the Raft group r.
func (s *Server) applyOn(r *raft.Raft, cmd *allotv1.Command) (any, error) {
	cmd.NowUnixNanos = s.stamp()
	return s.proposeCmd(r, cmd)
}

// newGroupBatcher starts a batcher of Acquire calls that commits its
// entries with propose (a group's Raft).
func (s *Server) newGroupBatcher(propose func([]byte) (any, error)) *batcher {
	cfg := s.cfg
	b := newBatcher(propose, s.stamp, cfg.MaxBatchKeys, cfg.MaxBatchBytes, cfg.MaxInflightBatches)
	b.legacy = cfg.LegacyAcquireEntries
	b.linger = max(cfg.BatchLinger, 0)
	b.fillKeys, b.fillWait = max(cfg.BatchFillKeys, 0), max(cfg.BatchFillWait, 0)
	b.maxQueue = cfg.MaxQueuedAcquires
	b.observe = s.metrics.observeBatch
	b.queued = func(d time.Duration) { s.metrics.batchQueue.Observe(d.Seconds()) }
	b.start()
	return b
}

// Shutdown stops the node gracefully: it stops accepting calls, hands
// leadership to another voter if it leads (bounded), drains the gRPC server
// (falling back to a hard stop when ctx ends), stops its loops, shuts Raft
// down and closes the stores and the HTTP server. It is safe to call twice;
// later calls return the first call's result.
func (s *Server) Shutdown(ctx context.Context) error {
	s.shutdownOnce.Do(func() { s.shutdownErr = s.shutdown(ctx, true) })
	return s.shutdownErr
}

// kill stops the node abruptly (tests): no leadership transfer, no drain.
func (s *Server) kill() {
	s.shutdownOnce.Do(func() { s.shutdownErr = s.shutdown(context.Background(), false) })
}

func (s *Server) shutdown(ctx context.Context, graceful bool) error {
	s.log.Info("allocator shutting down", "graceful", graceful)
	var errs []error
	s.health.Shutdown()
	if graceful {
		s.handOverGroups(ctx)
	}
	close(s.done)
	s.cancelBase()

	if graceful {
		stopped := make(chan struct{})
		go func() {
			s.grpcSrv.GracefulStop()
			close(stopped)
		}()
		select {
		case <-stopped:
		case <-ctx.Done():
			s.grpcSrv.Stop()
			<-stopped
		}
	} else {
		s.grpcSrv.Stop()
	}
	close(s.stopLoops)
	// The loops end before any Raft group shuts down: a loop may be
	// waiting on an ApplyFuture, which a running Raft always resolves
	// (committed, or ErrLeadershipLost when it steps down), but which one
	// shutting down may never resolve (its FSM goroutine can exit with
	// the committed entry still queued; see hashicorp/raft#498).
	s.wg.Wait()
	s.batcher.close()
	errs = append(errs, s.closeGroups()...)

	if err := s.node.raft.Shutdown().Error(); err != nil {
		errs = append(errs, fmt.Errorf("allocator: raft shutdown: %w", err))
	}
	if err := s.node.writeWatermark(s.fsm); err != nil {
		errs = append(errs, err)
	}
	s.node.close()
	s.closeRaftListener()
	if s.httpSrv != nil {
		if err := s.httpSrv.Shutdown(ctx); err != nil {
			s.httpSrv.Close()
		}
	}
	s.serving.Wait()
	s.fwd.close()
	s.up.close()
	s.unregisterMetrics()
	s.log.Info("allocator stopped")
	return errors.Join(errs...)
}

// handOver transfers leadership before shutting down, bounded by ctx and
// raft's own transfer timeout. It first checks that a quorum still answers
// (VerifyLeader): a transfer to voters that are all gone would only wait.
func (s *Server) handOver(ctx context.Context, r *raft.Raft) {
	errc := make(chan error, 1)
	go func() { // ends with raft's lease timeout, the transfer timeout or raft.Shutdown
		if err := r.VerifyLeader().Error(); err != nil {
			errc <- fmt.Errorf("no quorum: %w", err)
			return
		}
		s.followerTimeouts(r)
		errc <- r.LeadershipTransfer().Error()
	}()
	select {
	case err := <-errc:
		if err != nil {
			s.log.Warn("leadership not handed over", "err", err)
		} else {
			s.log.Info("leadership handed over")
		}
	case <-ctx.Done():
		s.log.Warn("leadership hand-over abandoned", "err", ctx.Err())
	}
}

// hasOtherVoters reports whether the configuration of the Raft group r
// has a voter besides this node (a leadership transfer needs one).
func (s *Server) hasOtherVoters(r *raft.Raft) bool {
	f := r.GetConfiguration()
	if f.Error() != nil {
		return false
	}
	for _, srv := range f.Configuration().Servers {
		if srv.Suffrage == raft.Voter && string(srv.ID) != s.cfg.NodeID {
			return true
		}
	}
	return false
}

// observeSnapshot records a snapshot stage in the metrics, and logs a
// failure (Raft logs it too, without the stage).
func (s *Server) observeSnapshot(ev snapshotEvent) {
	s.metrics.observeSnapshot(ev)
	if ev.err != nil {
		s.log.Warn("snapshot failed", "stage", ev.stage, "after", ev.took, "err", ev.err)
	}
}
