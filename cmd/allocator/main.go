// Command allocator runs one node of the allot allocator cluster.
//
// Start the first node with -bootstrap (and -rules for the initial rule
// set), the others with -join pointing at any member's gRPC address.
// -bootstrap -groups N starts a cluster whose key slots are spread over N
// Raft groups (docs/groups.md); the nodes that join take its groups, each
// hosted by every node or, with -group-replicas R, by R of them.
// Restarting a node with the same -node-id and -data-dir resumes it;
// -bootstrap is then ignored, and -join only serves to re-register the
// node if it comes back at other addresses. A node whose IP may change
// (a Kubernetes pod) binds 0.0.0.0 and advertises a stable name with
// -advertise-grpc-addr, -advertise-raft-addr and -advertise-http-addr:
//
//	allocator -node-id allot-allocator-1 -grpc-addr 0.0.0.0:7420 -raft-addr 0.0.0.0:7421 \
//	    -advertise-grpc-addr allot-allocator-1.allot-allocator-peers:7420 \
//	    -advertise-raft-addr allot-allocator-1.allot-allocator-peers:7421 -join allot-allocator:7420
//
// The garbage collector's heap goal is kept at 64 MiB or more while the
// live heap is smaller (fewer collections, hence fewer stop-the-world
// pauses, on a small node); setting GOGC in the environment turns this
// off, and GOMEMLIMIT bounds memory as usual.
//
// SIGINT or SIGTERM shuts the node
// down gracefully (handing leadership over if it leads). SIGHUP re-reads
// the TLS files and the admin token file.
//
// Security (docs/security.md): -tls-cert/-tls-key/-tls-ca serve gRPC over
// TLS and require client certificates (-tls-client-auth), -raft-tls
// carries Raft over mutual TLS with the same files, -peer-names names the
// allocator certificates that are the cluster's nodes, and
// -admin-token-file adds bearer tokens for admin calls:
//
//	allocator -node-id a -data-dir /var/lib/allot/a -bootstrap -rules rules/api.yaml \
//	    -tls-cert certs/allocator.crt -tls-key certs/allocator.key -tls-ca certs/ca.crt \
//	    -raft-tls -peer-names a,b,c -admin-token-file /etc/allot/admin-tokens
//
//	allocator -node-id a -data-dir /var/lib/allot/a -bootstrap -rules rules/api.yaml
//	allocator -node-id b -data-dir /var/lib/allot/b -grpc-addr 127.0.0.1:7430 \
//	    -raft-addr 127.0.0.1:7431 -http-addr 127.0.0.1:7432 -join 127.0.0.1:7420
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/allot/allot/allocator"
	"github.com/allot/allot/internal/cliflags"
	"github.com/allot/allot/internal/tracing"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/tlsconfig"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "allocator:", err)
		os.Exit(1)
	}
}

// stringList is a repeatable, comma-separated flag.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(v string) error {
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			*l = append(*l, p)
		}
	}
	return nil
}

// options is the parsed command line.
type options struct {
	cfg           allocator.Config
	logger        *slog.Logger
	shutdownGrace time.Duration
	tokenFile     string
	otel          bool // OpenTelemetry tracing (internal/tracing)
}

func parse(args []string) (*options, error) {
	def := allocator.DefaultConfig()
	fs := flag.NewFlagSet("allocator", flag.ContinueOnError)
	var (
		nodeID        = fs.String("node-id", "", "node id, stable across restarts (default: hostname-<raft port>)")
		dataDir       = fs.String("data-dir", "", "data directory (default: allot-data/<node-id>)")
		logStore      = fs.String("log-store", "", "Raft log store of a new data dir: bolt (raft.db) or wal (hashicorp/raft-wal, wal/: one fsync an append, less CPU); empty: the one the data dir holds, bolt for a new one (a new data group: its group 0's)")
		grpcAddr      = fs.String("grpc-addr", def.GRPCAddr, "gRPC listen address (also advertised unless -advertise-grpc-addr)")
		raftAddr      = fs.String("raft-addr", def.RaftAddr, "Raft listen address (also advertised unless -advertise-raft-addr)")
		httpAddr      = fs.String("http-addr", def.HTTPAddr, "HTTP address for /healthz, /readyz, /metrics, /debug/pprof (empty: off)")
		advGRPC       = fs.String("advertise-grpc-addr", "", "gRPC address HOST:PORT the other nodes and clients reach this node at, e.g. a stable DNS name (default: the bound -grpc-addr)")
		advRaft       = fs.String("advertise-raft-addr", "", "Raft address HOST:PORT in the Raft configuration, e.g. a stable DNS name (default: the bound -raft-addr)")
		advHTTP       = fs.String("advertise-http-addr", "", "HTTP address HOST:PORT recorded for this node (default: the bound -http-addr)")
		bootstrap     = fs.Bool("bootstrap", false, "bootstrap a new one-node cluster (ignored when the data dir has state)")
		join          = fs.String("join", "", "gRPC address HOST:PORT of any member to join (ignored when the data dir has state)")
		groups        = fs.Int("groups", 1, "with -bootstrap: the number of data groups (Raft groups that share the key slots); 1 is a single-group cluster (docs/groups.md)")
		groupReplicas = fs.Int("group-replicas", 0, "with -bootstrap -groups N: how many nodes host each data group; 0 is every node (docs/groups.md)")
		heartbeat     = fs.Duration("heartbeat-timeout", def.HeartbeatTimeout, "Raft heartbeat timeout")
		election      = fs.Duration("election-timeout", def.ElectionTimeout, "Raft election timeout")
		leaderLease   = fs.Duration("leader-lease-timeout", 0, fmt.Sprintf("Raft leader lease timeout (0: the smaller of %v and -heartbeat-timeout); the leader heartbeats every fifth of it", def.LeaderLeaseTimeout))
		leaseTTL      = fs.Duration("lease-ttl", def.LeaseTTL, "lease lifetime of a busy key")
		maxLeaseTTL   = fs.Duration("max-lease-ttl", def.MaxLeaseTTL, "lease lifetime bound of a cold key")
		refresh       = fs.Duration("refresh-interval", def.RefreshInterval, "period a grant is sized for")
		agentTTL      = fs.Duration("agent-ttl", def.AgentTTL, "an agent not heard from for this long is forgotten")
		staticSlots   = fs.Int("static-slots", 0, "static shares: the number of shares of each static-eligible rule, one per gateway that holds a slot; at least the number of gateways (0: off; docs/static-shares.md)")
		staticTTL     = fs.Duration("static-ttl", def.StaticTTL, "static shares: how long an answer lets an agent decide from its shares; less than -agent-ttl")
		expire        = fs.Duration("expire-interval", def.ExpireInterval, "how often the leader commits lease expiry")
		expireMax     = fs.Int("expire-max-entries", def.ExpireMaxEntries, "expiry-wheel entries one expiry takes, about (whole units of 1/64 of a second's entries, up to the unit where the leader's wheel holds this many due entries); the rest wait for the next (negative: no limit)")
		sweepEvery    = fs.Duration("sweep-interval", def.SweepInterval, "how often an expiry also sweeps idle keys and compacts")
		snapEvery     = fs.Duration("snapshot-interval", def.SnapshotInterval, "how often Raft checks whether to take a snapshot")
		snapAfter     = fs.Uint64("snapshot-threshold", def.SnapshotThreshold, "log entries since the last snapshot that trigger one")
		maxInflight   = fs.Int("max-inflight-batches", def.MaxInflightBatches, "Acquire batches (Raft entries) in flight at once")
		legacyEntries = fs.Bool("legacy-acquire-entries", false, "replicate Acquire batches as protobuf commands, which allocators older than compact entries apply (set on every node while upgrading from such a version)")
		batchLinger   = fs.Duration("batch-linger", def.BatchLinger, "least time between two Acquire batches, so that calls close together share a Raft entry (negative: none)")
		maxBatchKeys  = fs.Int("max-batch-keys", def.MaxBatchKeys, "keys per Acquire batch (Raft entry)")
		fillKeys      = fs.Int("batch-fill-keys", def.BatchFillKeys, "an Acquire batch short of this many keys waits for more calls when the recent key rate says they come within -batch-fill-wait (negative: never)")
		fillWait      = fs.Duration("batch-fill-wait", def.BatchFillWait, "longest an Acquire call waits for its batch to fill to -batch-fill-keys (negative: never)")
		applyNice     = fs.Int("follower-apply-nice", def.FollowerApplyNice, "nice value of the thread a group's entries of 16 KiB or more are applied on while this node does not lead it, so that on shared cores the leaders' work runs first (negative: off)")
		shutdownGrace = fs.Duration("shutdown-timeout", 10*time.Second, "graceful shutdown bound")

		tlsClientAuth = fs.String("tls-client-auth", "", "client certificates: require, optional or none (default: require with -tls-ca, else none)")
		raftTLS       = fs.Bool("raft-tls", false, "carry Raft over mutual TLS with the -tls-* files (peers need allocator-role certificates)")
		tokenFile     = fs.String("admin-token-file", "", "file of admin bearer tokens, one a line (re-read on SIGHUP)")
		openReads     = fs.Bool("open-reads", false, "let any caller use the read-only Admin RPCs (default: admins only when authentication is on)")
		callCap       = fs.Int("max-inflight-calls", def.MaxInflight, "unary calls served at once; beyond, ResourceExhausted at once")
		queueCap      = fs.Int("max-queued-acquires", def.MaxQueuedAcquires, "Acquire calls waiting in the leader's batcher; beyond, ResourceExhausted")
		agentRate     = fs.Int("agent-rate", def.AgentRate, "Acquire and Release calls per second per agent (negative: no limit)")
		agentBurst    = fs.Int("agent-burst", def.AgentBurst, "burst of -agent-rate")
		streams       = fs.Uint("max-concurrent-streams", uint(def.MaxConcurrentStreams), "concurrent calls per client connection")
		fwdTimeout    = fs.Duration("forward-timeout", def.ForwardTimeout, "bound of one call forwarded to the leader")
		burnCPU       = fs.Int("debug-burn-cpu", 0, "deprecated, no effect: the CPU burner left the production binary (bench/gateway -burn)")
		insecure      = fs.Bool("insecure", false, "allow a non-loopback -grpc-addr or -raft-addr without client certificates or an admin token (logs a WARN at start and every hour)")
		pprofOn       = fs.Bool("pprof", false, "serve /debug/pprof/ on -http-addr, to an admin bearer token only (needs -admin-token-file)")
		recoverSnap   = fs.Bool("recover-from-snapshot", false, "start a node whose raft log (raft.db or wal/) is missing, empty, damaged or rolled back from its newest snapshot (it is moved aside; entries after the snapshot are lost on this node)")
		readyMaxLag   = fs.Duration("ready-max-lag", def.ReadyMaxLag, "a follower behind the leader's commit index, or out of contact with the leader, for longer than this answers /readyz 503 (negative: no bound)")
		otelOn        = fs.Bool("otel", false, "OpenTelemetry tracing: export spans of Acquire, admin and forwarded calls over OTLP, configured by the OTEL_* environment variables (docs/operations.md#tracing)")
		ruleFiles     stringList
		rulesXDS      = fs.String("rules-xds", "", "xDS server HOST:PORT: the leader subscribes (ADS, state of the world) to RateLimitConfig resources and commits each update as the rule set (docs/rules.md)")
		rulesXDSNode  = fs.String("rules-xds-node-id", "", "node id sent to the -rules-xds server (default: allot)")
		rulesXDSEvery = fs.Duration("rules-xds-min-interval", time.Second, "least time between two rule versions committed from the -rules-xds server; a newer update that arrives meanwhile replaces the waiting one (0: none)")
		logFlags      cliflags.Log
		tlsFlags      cliflags.TLS
		region        = fs.String("region", "", "make this cluster the region NAME of a global cluster: scope: global keys are leased from -global-allocators and sub-granted from what the region holds (docs/regions.md)")
		globalAllocs  stringList
		upstreamRTT   = fs.Duration("upstream-rtt", 0, "round trip to the global cluster, part of a regional leader's low watermark (default 150ms)")
	)
	var peerNames stringList
	fs.Var(&peerNames, "peer-names", "names in the allocator certificates of this cluster's nodes, this node's included (comma-separated or repeatable): only they forward calls, join and, with -raft-tls, speak Raft, and only they are dialed as nodes (not the -global-allocators); another allocator-role certificate from the CA is not a node (empty: any is; needs client certificates)")
	fs.Var(&globalAllocs, "global-allocators", "gRPC addresses HOST:PORT,... of the global cluster's allocators (with -region; repeatable)")
	logFlags.Register(fs)
	tlsFlags.Register(fs, cliflags.TLSUsage{
		Cert: "PEM certificate of this node (with -tls-key): serve gRPC over TLS",
		CA:   "PEM CA bundle that verifies client certificates and the other nodes",
	})
	fs.Var(&ruleFiles, "rules", "rules YAML file for the initial rule set at bootstrap (repeatable or comma-separated)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}

	logger, err := logFlags.Logger(os.Stderr)
	if err != nil {
		return nil, err
	}
	if *nodeID == "" {
		*nodeID, err = defaultNodeID(*raftAddr)
		if err != nil {
			return nil, err
		}
	}
	if *dataDir == "" {
		*dataDir = filepath.Join("allot-data", *nodeID)
	}

	cfg := def
	cfg.NodeID = *nodeID
	cfg.DataDir = *dataDir
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = *grpcAddr, *raftAddr, *httpAddr
	cfg.AdvertiseGRPCAddr, cfg.AdvertiseRaftAddr, cfg.AdvertiseHTTPAddr = *advGRPC, *advRaft, *advHTTP
	cfg.Bootstrap, cfg.Join = *bootstrap, *join
	if *groups < 1 {
		return nil, fmt.Errorf("-groups %d: want at least 1 (1 is a single-group cluster)", *groups)
	}
	groupsSet, replicasSet := false, false
	fs.Visit(func(f *flag.Flag) {
		groupsSet = groupsSet || f.Name == "groups"
		replicasSet = replicasSet || f.Name == "group-replicas"
	})
	if groupsSet && *join != "" {
		return nil, errors.New("-groups with -join: a joining node takes the cluster's groups; give -groups only with -bootstrap")
	}
	if replicasSet && (*groups < 2 || !*bootstrap) {
		return nil, errors.New("-group-replicas needs -bootstrap -groups N (N > 1): it is recorded when a cluster with several groups is bootstrapped")
	}
	if *groupReplicas < 0 {
		return nil, fmt.Errorf("-group-replicas %d: want 0 (every node) or more", *groupReplicas)
	}
	cfg.Groups, cfg.GroupReplicas = *groups, *groupReplicas
	cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = *heartbeat, *election, *leaderLease
	cfg.LeaseTTL, cfg.MaxLeaseTTL, cfg.RefreshInterval, cfg.AgentTTL = *leaseTTL, *maxLeaseTTL, *refresh, *agentTTL
	cfg.StaticSlots, cfg.StaticTTL = *staticSlots, *staticTTL
	cfg.ExpireInterval, cfg.ExpireMaxEntries, cfg.SweepInterval = *expire, *expireMax, *sweepEvery
	cfg.SnapshotInterval, cfg.SnapshotThreshold = *snapEvery, *snapAfter
	cfg.MaxInflightBatches, cfg.MaxBatchKeys, cfg.BatchLinger = *maxInflight, *maxBatchKeys, *batchLinger
	cfg.BatchFillKeys, cfg.BatchFillWait = *fillKeys, *fillWait
	cfg.FollowerApplyNice = *applyNice
	cfg.LegacyAcquireEntries = *legacyEntries
	cfg.Logger = logger
	cfg.RulesXDS = allocator.XDSConfig{Addr: *rulesXDS, NodeID: *rulesXDSNode, MinInterval: *rulesXDSEvery}
	if cfg.RulesXDS.MinInterval == 0 {
		cfg.RulesXDS.MinInterval = -1 // 0 on the command line: none
	}
	cfg.Region = allocator.RegionConfig{Name: *region, GlobalAllocators: globalAllocs}
	cfg.Region.Upstream.RTT = *upstreamRTT
	for _, path := range ruleFiles {
		src, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("read rules: %w", err)
		}
		cfg.InitialRules = append(cfg.InitialRules, rules.File{Name: path, Source: src})
	}

	// Security.
	if cfg.TLS, err = tlsFlags.Options(); err != nil {
		return nil, err
	}
	tlsCA, tlsCert := &tlsFlags.CA, &tlsFlags.Cert
	if *tlsCA != "" && *tlsCert == "" {
		return nil, errors.New("-tls-ca needs -tls-cert and -tls-key (the allocator serves TLS)")
	}
	switch {
	case *tlsClientAuth != "":
		if cfg.ClientAuth, err = tlsconfig.ParseClientAuth(*tlsClientAuth); err != nil {
			return nil, fmt.Errorf("-tls-client-auth: %w", err)
		}
		if cfg.ClientAuth != tlsconfig.ClientAuthNone && *tlsCA == "" {
			return nil, fmt.Errorf("-tls-client-auth %s needs -tls-ca", cfg.ClientAuth)
		}
	case *tlsCA != "":
		cfg.ClientAuth = tlsconfig.ClientAuthRequire
	}
	if *raftTLS && (*tlsCert == "" || *tlsCA == "") {
		return nil, errors.New("-raft-tls needs -tls-cert, -tls-key and -tls-ca")
	}
	cfg.RaftTLS = *raftTLS
	cfg.PeerNames = peerNames
	if *tokenFile != "" {
		if cfg.AdminTokens, err = tlsconfig.ReadTokens(*tokenFile); err != nil {
			return nil, fmt.Errorf("-admin-token-file: %w", err)
		}
	}
	cfg.OpenReads = *openReads
	cfg.Insecure, cfg.Pprof = *insecure, *pprofOn
	cfg.RecoverFromSnapshot, cfg.ReadyMaxLag = *recoverSnap, *readyMaxLag
	cfg.LogStore = *logStore

	// Overload.
	cfg.MaxInflight, cfg.MaxQueuedAcquires = *callCap, *queueCap
	cfg.AgentRate, cfg.AgentBurst = *agentRate, *agentBurst
	if *streams == 0 || *streams > 1<<20 {
		return nil, errors.New("-max-concurrent-streams must be in [1, 1048576]")
	}
	cfg.MaxConcurrentStreams = uint32(*streams)
	cfg.ForwardTimeout = *fwdTimeout
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if *burnCPU != 0 {
		logger.Warn("-debug-burn-cpu is deprecated and has no effect; burn CPU with bench/gateway -burn (docs/configuration.md, deprecated flags)")
	}
	return &options{cfg: cfg, logger: logger, shutdownGrace: *shutdownGrace, tokenFile: *tokenFile, otel: *otelOn}, nil
}

func run(args []string) error {
	o, err := parse(args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	logger, cfg := o.logger, o.cfg

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	// A GOGC set in the environment is the operator's choice; otherwise
	// the heap goal stays at least gcMinHeap (see gcFloor).
	if os.Getenv("GOGC") == "" {
		gcf := startGCFloor(gcMinHeap, time.Second)
		defer gcf.Stop()
	}

	if o.otel {
		if tracing.Disabled() {
			logger.Warn("-otel is ignored: OTEL_SDK_DISABLED=true")
		} else {
			tr, err := tracing.Start(ctx, "allot-allocator", logger)
			if err != nil {
				return err
			}
			// Deferred first, so it runs last: after the server's drain,
			// whose calls' spans it exports.
			defer func() {
				sctx, cancel := context.WithTimeout(context.Background(), o.shutdownGrace)
				defer cancel()
				if err := tr.Shutdown(sctx); err != nil {
					logger.Warn("tracing: spans not flushed", "err", err)
				}
			}()
			cfg.ServerOptions = append(cfg.ServerOptions, tr.ServerOption())
			cfg.DialOptions = append(cfg.DialOptions, tr.DialOption())
		}
	}

	srv, err := allocator.New(cfg)
	if err != nil {
		return err
	}
	logger.Info("allocator listening", "node", cfg.NodeID, "grpc", srv.GRPCAddr(), "raft", srv.RaftAddr(),
		"http", srv.HTTPAddr(), "advertise_grpc", srv.AdvertiseGRPCAddr(), "advertise_raft", srv.AdvertiseRaftAddr(),
		"advertise_http", srv.AdvertiseHTTPAddr(), "data_dir", cfg.DataDir)

	for {
		select {
		case <-hup:
			reload(logger, srv, o.tokenFile)
			continue
		case <-ctx.Done():
		}
		break
	}
	stop() // a second signal kills the process

	logger.Info("signal received; shutting down", "timeout", o.shutdownGrace)
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownGrace)
	defer cancel()
	return srv.Shutdown(sctx)
}

// reload re-reads the TLS files and the admin token file (SIGHUP). A file
// that fails to load keeps the previous material in use.
func reload(logger *slog.Logger, srv *allocator.Server, tokenFile string) {
	if err := srv.ReloadTLS(); err != nil {
		logger.Error("SIGHUP: TLS files not reloaded; keeping the previous ones", "err", err)
	}
	if tokenFile == "" {
		return
	}
	if err := srv.ReloadAdminTokens(tokenFile); err != nil {
		logger.Error("SIGHUP: admin tokens not reloaded; keeping the previous ones, revoked ones included", "err", err)
	}
}

// defaultNodeID is hostname-<raft port>: stable across restarts with the
// same flags, and distinct for several nodes on one host.
func defaultNodeID(raftAddr string) (string, error) {
	host, err := os.Hostname()
	if err != nil {
		return "", fmt.Errorf("-node-id not set and hostname unknown: %w", err)
	}
	_, port, err := net.SplitHostPort(raftAddr)
	if err != nil {
		return "", fmt.Errorf("-raft-addr: %w", err)
	}
	return host + "-" + port, nil
}
