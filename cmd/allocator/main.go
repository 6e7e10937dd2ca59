// Command allocator runs one node of the allot allocator cluster.
//
// Start the first node with -bootstrap (and -rules for the initial rule
// set), the others with -join pointing at any member's gRPC address.
// Restarting a node with the same -node-id and -data-dir resumes it;
// -bootstrap and -join are then ignored. SIGINT or SIGTERM shuts the node
// down gracefully (handing leadership over if it leads).
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
	"github.com/allot/allot/pkg/rules"
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

func run(args []string) error {
	def := allocator.DefaultConfig()
	fs := flag.NewFlagSet("allocator", flag.ContinueOnError)
	var (
		nodeID        = fs.String("node-id", "", "node id, stable across restarts (default: hostname-<raft port>)")
		dataDir       = fs.String("data-dir", "", "data directory (default: allot-data/<node-id>)")
		grpcAddr      = fs.String("grpc-addr", def.GRPCAddr, "gRPC listen and advertise address")
		raftAddr      = fs.String("raft-addr", def.RaftAddr, "Raft listen and advertise address")
		httpAddr      = fs.String("http-addr", def.HTTPAddr, "HTTP address for /healthz, /readyz, /metrics, /debug/pprof (empty: off)")
		bootstrap     = fs.Bool("bootstrap", false, "bootstrap a new one-node cluster (ignored when the data dir has state)")
		join          = fs.String("join", "", "gRPC address HOST:PORT of any member to join (ignored when the data dir has state)")
		logLevel      = fs.String("log-level", "info", "log level: debug, info, warn, error")
		logFormat     = fs.String("log-format", "text", "log format: json or text")
		heartbeat     = fs.Duration("heartbeat-timeout", def.HeartbeatTimeout, "Raft heartbeat timeout")
		election      = fs.Duration("election-timeout", def.ElectionTimeout, "Raft election timeout")
		leaderLease   = fs.Duration("leader-lease-timeout", def.LeaderLeaseTimeout, "Raft leader lease timeout")
		leaseTTL      = fs.Duration("lease-ttl", def.LeaseTTL, "lease lifetime of a busy key")
		maxLeaseTTL   = fs.Duration("max-lease-ttl", def.MaxLeaseTTL, "lease lifetime bound of a cold key")
		refresh       = fs.Duration("refresh-interval", def.RefreshInterval, "period a grant is sized for")
		agentTTL      = fs.Duration("agent-ttl", def.AgentTTL, "an agent not heard from for this long is forgotten")
		expire        = fs.Duration("expire-interval", def.ExpireInterval, "how often the leader commits lease expiry")
		maxInflight   = fs.Int("max-inflight-batches", def.MaxInflightBatches, "Acquire batches (Raft entries) in flight at once")
		maxBatchKeys  = fs.Int("max-batch-keys", def.MaxBatchKeys, "keys per Acquire batch (Raft entry)")
		shutdownGrace = fs.Duration("shutdown-timeout", 10*time.Second, "graceful shutdown bound")
		ruleFiles     stringList
	)
	fs.Var(&ruleFiles, "rules", "rules YAML file for the initial rule set at bootstrap (repeatable or comma-separated)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}

	logger, err := newLogger(*logLevel, *logFormat)
	if err != nil {
		return err
	}
	if *nodeID == "" {
		*nodeID, err = defaultNodeID(*raftAddr)
		if err != nil {
			return err
		}
	}
	if *dataDir == "" {
		*dataDir = filepath.Join("allot-data", *nodeID)
	}

	cfg := def
	cfg.NodeID = *nodeID
	cfg.DataDir = *dataDir
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = *grpcAddr, *raftAddr, *httpAddr
	cfg.Bootstrap, cfg.Join = *bootstrap, *join
	cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = *heartbeat, *election, *leaderLease
	cfg.LeaseTTL, cfg.MaxLeaseTTL, cfg.RefreshInterval, cfg.AgentTTL = *leaseTTL, *maxLeaseTTL, *refresh, *agentTTL
	cfg.ExpireInterval = *expire
	cfg.MaxInflightBatches, cfg.MaxBatchKeys = *maxInflight, *maxBatchKeys
	cfg.Logger = logger
	for _, path := range ruleFiles {
		src, err := os.ReadFile(path)
		if err != nil {
			return fmt.Errorf("read rules: %w", err)
		}
		cfg.InitialRules = append(cfg.InitialRules, rules.File{Name: path, Source: src})
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	srv, err := allocator.New(cfg)
	if err != nil {
		return err
	}
	logger.Info("allocator listening", "node", cfg.NodeID, "grpc", srv.GRPCAddr(), "raft", srv.RaftAddr(),
		"http", srv.HTTPAddr(), "data_dir", cfg.DataDir)
	<-ctx.Done()
	stop() // a second signal kills the process

	logger.Info("signal received; shutting down", "timeout", *shutdownGrace)
	sctx, cancel := context.WithTimeout(context.Background(), *shutdownGrace)
	defer cancel()
	return srv.Shutdown(sctx)
}

func newLogger(level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("-log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	default:
		return nil, fmt.Errorf("-log-format %q: want json or text", format)
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
