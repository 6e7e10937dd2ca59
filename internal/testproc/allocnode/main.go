// Command allocnode is cmd/allocator for tests that need Raft snapshots on
// a test's time scale: it takes the same flags as cmd/allocator (those the
// fault tests use) plus -snapshot-interval and -snapshot-threshold, which
// cmd/allocator does not expose (allocator.Config.SnapshotInterval and
// SnapshotThreshold; defaults 30 s and 8192 entries). It is wiring only,
// like cmd/allocator: the allocator package does the work.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/allot/allot/allocator"
	"github.com/allot/allot/pkg/rules"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "allocnode:", err)
		os.Exit(1)
	}
}

type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(v string) error {
	*l = append(*l, v)
	return nil
}

func run(args []string) error {
	def := allocator.DefaultConfig()
	fs := flag.NewFlagSet("allocnode", flag.ContinueOnError)
	var (
		nodeID      = fs.String("node-id", "", "node id")
		dataDir     = fs.String("data-dir", "", "data directory")
		grpcAddr    = fs.String("grpc-addr", def.GRPCAddr, "gRPC address")
		raftAddr    = fs.String("raft-addr", def.RaftAddr, "Raft address")
		httpAddr    = fs.String("http-addr", def.HTTPAddr, "HTTP address (empty: off)")
		advRaft     = fs.String("advertise-raft-addr", "", "Raft address in the Raft configuration (default: the bound -raft-addr)")
		bootstrap   = fs.Bool("bootstrap", false, "bootstrap a one-node cluster")
		join        = fs.String("join", "", "gRPC address of a member to join")
		logLevel    = fs.String("log-level", "info", "log level")
		leaseTTL    = fs.Duration("lease-ttl", def.LeaseTTL, "lease lifetime of a busy key")
		maxLeaseTTL = fs.Duration("max-lease-ttl", def.MaxLeaseTTL, "lease lifetime bound of a cold key")
		refresh     = fs.Duration("refresh-interval", def.RefreshInterval, "period a grant is sized for")
		agentTTL    = fs.Duration("agent-ttl", def.AgentTTL, "agent TTL")
		expire      = fs.Duration("expire-interval", def.ExpireInterval, "lease expiry period")
		snapEvery   = fs.Duration("snapshot-interval", def.SnapshotInterval, "how often Raft checks whether to snapshot")
		snapAfter   = fs.Uint64("snapshot-threshold", def.SnapshotThreshold, "log entries since the last snapshot that trigger one")
		ruleFiles   stringList
	)
	fs.Var(&ruleFiles, "rules", "rules YAML file (repeatable)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(*logLevel)); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lv}))

	cfg := def
	cfg.NodeID, cfg.DataDir = *nodeID, *dataDir
	cfg.GRPCAddr, cfg.RaftAddr, cfg.HTTPAddr = *grpcAddr, *raftAddr, *httpAddr
	cfg.AdvertiseRaftAddr = *advRaft
	cfg.Bootstrap, cfg.Join = *bootstrap, *join
	cfg.LeaseTTL, cfg.MaxLeaseTTL, cfg.RefreshInterval, cfg.AgentTTL = *leaseTTL, *maxLeaseTTL, *refresh, *agentTTL
	cfg.ExpireInterval = *expire
	cfg.SnapshotInterval, cfg.SnapshotThreshold = *snapEvery, *snapAfter
	cfg.Logger = logger
	for _, path := range ruleFiles {
		src, err := os.ReadFile(path)
		if err != nil {
			return err
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
		"snapshot_interval", cfg.SnapshotInterval, "snapshot_threshold", cfg.SnapshotThreshold)
	<-ctx.Done()
	stop()
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}
