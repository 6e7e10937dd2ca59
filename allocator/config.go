package allocator

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/allot/allot/allocator/meta"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	"github.com/allot/allot/pkg/tlsconfig"
)

// Config configures a Server. Start from DefaultConfig; New calls Validate.
// Zero durations and sizes mean "the DefaultConfig value".
type Config struct {
	// NodeID names this node in the Raft configuration. It must stay the
	// same across restarts of the same data directory.
	NodeID string
	// DataDir holds the Raft log and stable store (raft.db, or wal/ with
	// LogStore "wal"; fsynced on every commit) and snapshots/ (file
	// snapshots, the two newest kept).
	DataDir string
	// LogStore is the Raft log store of a new data dir: LogStoreBolt
	// (raft-boltdb/v2) or LogStoreWAL (hashicorp/raft-wal: one fsync an
	// append instead of two, and less CPU; docs/operations.md, "Raft log
	// store"). Empty: the store the data dir holds; for a new one bolt (a
	// node's new data group: its group 0's store).
	// A data dir keeps the store it was created with: naming the other is
	// an error.
	LogStore string
	// GRPCAddr, RaftAddr and HTTPAddr are listen addresses. Port 0 picks a
	// free port; the bound addresses are reported by the Server's methods.
	// Without an advertise address (below) the bound address is advertised
	// to the other nodes, so its host must be reachable by them (not
	// 0.0.0.0). HTTPAddr "" runs no HTTP server.
	GRPCAddr, RaftAddr, HTTPAddr string

	// AdvertiseGRPCAddr, AdvertiseRaftAddr and AdvertiseHTTPAddr are the
	// addresses the cluster knows this node by, when they differ from the
	// listen addresses: a stable DNS name (a Kubernetes StatefulSet pod's
	// allot-allocator-1.allot-allocator-peers:7421), a NAT or a proxy in
	// front of the node. AdvertiseRaftAddr goes into the Raft configuration
	// (the other nodes dial it, and its host is the name a Raft TLS
	// certificate must carry); all three go into the replicated member
	// records, which forwarding, leader hints and allotctl status use. The
	// host must be a name or an IP the other nodes reach (not 0.0.0.0),
	// and the port explicit. Empty: the bound address. With an advertise
	// address the listen address may be 0.0.0.0 or :port. A node that
	// resumes at other addresses than at its last run re-registers itself
	// (see Join).
	AdvertiseGRPCAddr, AdvertiseRaftAddr, AdvertiseHTTPAddr string

	// Bootstrap makes this node a one-member cluster when its data directory
	// is empty. Join is the gRPC address of any member of an existing
	// cluster: the node asks it (through Admin.AddVoter, forwarded to the
	// leader) to add it as a voter, retrying until it succeeds or the Server
	// shuts down. A node whose data directory already holds Raft state
	// ignores Bootstrap. It uses Join (or the leader it hears of, or the
	// members it has records of) only when it advertises other addresses
	// than at its last run (recorded in DataDir/advertised.json): it moved
	// to a new IP or port. It then re-registers itself (AddVoter under its
	// id) if the cluster still holds its old addresses; not if it was
	// removed, or registered by hand at addresses it never advertised.
	Bootstrap bool
	Join      string
	// Groups is the number of data groups a bootstrapping node creates
	// (default 1). One is a single-group cluster: one Raft group, in
	// DataDir itself, that holds the rules and serves every key. With more,
	// the node creates the meta group 0 (rules, member records, the slot
	// map) and data groups 1..Groups, which own the key slots evenly, each
	// a Raft group under DataDir/groups/<id>/ (docs/groups.md). Only with
	// Bootstrap: a joining node takes the cluster's groups.
	Groups int
	// GroupReplicas is how many nodes host each data group of a cluster
	// with several groups (0, the default: every node hosts every group).
	// A node that joins becomes a member of the data groups that have
	// fewer members, and a group added later gets that many, on the nodes
	// that host the fewest; the other nodes forward the group's calls to
	// its leader. Recorded in the meta state at bootstrap: only with
	// Groups > 1.
	GroupReplicas int

	// InitialRules are applied by a leader that finds the replicated rule set
	// empty (normally once, right after bootstrap). They are compiled by New,
	// so a bad file fails fast.
	InitialRules []rules.File
	// RulesXDS makes the leader take the rules from an xDS server
	// (XDSConfig; off by default).
	RulesXDS XDSConfig
	// Region makes this cluster a region of a global cluster (RegionConfig;
	// off by default: the cluster owns every budget, scope: global ones
	// included, as the global cluster does).
	Region RegionConfig

	// Raft timeouts. The defaults (500/500/500 ms) halve hashicorp/raft's
	// own (1000/1000/500 ms) and give a failover of about a second
	// (docs/performance.md#summary). Going lower leaves little margin for
	// disk stalls. LeaderLeaseTimeout must not exceed HeartbeatTimeout
	// (default: the smaller of 500 ms and HeartbeatTimeout). A leader sends
	// each follower a heartbeat every fifth of LeaderLeaseTimeout
	// (randomised up to twice that), and at least every tenth of
	// HeartbeatTimeout, raft's own rate: every 100-200 ms by default.
	HeartbeatTimeout, ElectionTimeout, LeaderLeaseTimeout time.Duration

	// Lease policy, passed to the state machine (every node of a cluster
	// must use the same values: they decide grants). A busy key's lease ends
	// LeaseTTL after its last renewal, a cold key's lease may last up to
	// MaxLeaseTTL, grants are sized for RefreshInterval of demand, and an
	// agent not heard from for AgentTTL is forgotten (AgentTTL ≥
	// MaxLeaseTTL ≥ LeaseTTL > RefreshInterval).
	LeaseTTL, MaxLeaseTTL, RefreshInterval, AgentTTL time.Duration

	// Static shares (docs/static-shares.md): StaticSlots is N, the number
	// of shares of each static-eligible rule, one per agent that holds a
	// slot (0, the default: off; at most 65535); StaticTTL is how long an
	// answer lets an agent decide from its shares (default 2s; whole
	// milliseconds, less than AgentTTL). The leader commits them to the
	// replicated state when they differ from it: every node of a cluster
	// should use the same values. A cluster of several groups runs without.
	StaticSlots int
	StaticTTL   time.Duration

	// ExpireInterval is how often the leader commits an ExpireCommand
	// (default 100 ms). Each one takes about ExpireMaxEntries expiry-wheel
	// entries (default 4096; negative: no limit): its MaxEntries counts
	// the keys whose due leases end, and its LastUnit stops it where the
	// leader's wheel holds that many due entries (expireCommand), since
	// early and stale entries end nothing but cost as much; it takes whole
	// wheel units (1/64 of a second's entries each), and leaves the rest
	// for the next, which follows sooner while a backlog remains
	// (expirePace), so no Expire holds the state machine for long: every
	// Acquire entry behind it waits (BenchmarkFSMSecondOfAcquireLoad
	// measures the longest Expire under 20,000 key-grants/s).
	// The idle-key sweep and compaction run with at most one Expire every
	// SweepInterval (default 1 s).
	ExpireInterval   time.Duration
	ExpireMaxEntries int
	SweepInterval    time.Duration
	// ApplyTimeout bounds how long a proposal may wait to be enqueued in Raft
	// (default 5 s).
	ApplyTimeout time.Duration
	// ForwardWait bounds how long a call waits for a leader to be elected
	// (or retries a forward) before failing with Unavailable (default 2 s;
	// the call's own deadline applies too).
	ForwardWait time.Duration
	// MaxBatchKeys and MaxBatchBytes bound one Acquire batch (one Raft
	// entry); the batcher starts a new entry past either (defaults 20,000
	// keys and 2 MiB; a single request larger than that still goes alone).
	MaxBatchKeys, MaxBatchBytes int
	// MaxInflightBatches is how many batch entries may be in Raft at once
	// (default 2). With one, a call that arrives while an entry commits
	// waits for that commit and then its own, and every call that arrives
	// during a slow commit (or while the FSM applies an Expire) pays the
	// stall twice; a second entry in flight starts at once and commits
	// right behind the first (bench/acquire -max-inflight-batches compares
	// the settings).
	MaxInflightBatches int
	// BatchLinger is the least time between two Acquire batches (default
	// 4 ms; negative: none). Calls that arrive within it of the batch
	// before share one entry, whose cost (append, two fsyncs,
	// replication, apply) every node pays per entry; a call after a
	// quieter spell is proposed at once. It adds at most BatchLinger to a
	// call's latency.
	BatchLinger time.Duration
	// FollowerApplyNice is the nice value of the thread a group's FSM
	// applies its entries of 16 KiB or more on while this node does not
	// lead it, at most GOMAXPROCS−1 at once (default 10; negative, or not
	// above the process's own nice value: every apply runs on Raft's own
	// goroutine at the process's priority). A follower's apply is off
	// every client's path, so where nodes share cores the kernel runs the
	// leaders' work first; a node leading applies at the process's
	// priority, and so does a follower more than half of the readiness
	// lag behind. See applythread.go.
	FollowerApplyNice int
	// BatchFillKeys and BatchFillWait join calls into fewer entries under
	// a high key rate (defaults 2,000 keys and 6 ms; either negative: off). A batch short
	// of BatchFillKeys keys waits for more calls, but only when the key
	// rate of the last ~100 ms says they will come before its first call
	// has waited BatchFillWait; at a lower rate, or with calls that hold
	// BatchFillKeys keys on their own, nothing waits. An entry costs the
	// three nodes about as much CPU as a few hundred keys do
	// (docs/performance.md), so an entry below BatchFillKeys keys is mostly
	// that cost. It adds at most BatchFillWait to a call's latency.
	BatchFillKeys int
	BatchFillWait time.Duration
	// LegacyAcquireEntries makes the leader replicate Acquire batches as
	// protobuf AcquireBatch commands instead of compact entries (see
	// allocator/state.IsCompactEntry). Every version applies both kinds it
	// knows; a version older than compact entries stops on one. Upgrading
	// such a cluster: set this on every node, upgrade the nodes one by one,
	// then unset it, one node at a time (default false).
	LegacyAcquireEntries bool
	// MaxRecvMsgSize is the gRPC server's receive limit (default 4 MiB).
	MaxRecvMsgSize int
	// SnapshotInterval and SnapshotThreshold are passed to Raft (defaults
	// 30 s and 8192 entries).
	SnapshotInterval  time.Duration
	SnapshotThreshold uint64

	// Logger receives the service's and Raft's logs (default slog.Default()).
	Logger *slog.Logger
	// Registerer receives the metrics. nil: a private registry, served on
	// /metrics. If Registerer is also a prometheus.Gatherer (a
	// *prometheus.Registry is), /metrics serves it.
	Registerer prometheus.Registerer

	// ServerOptions are added to the gRPC server's options (after the
	// Server's own, so they win). DialOptions are added to node-to-node
	// calls (forwarding, join); without TLS and without transport
	// credentials among them, calls are plaintext.
	ServerOptions []grpc.ServerOption
	DialOptions   []grpc.DialOption

	// TLS names this node's PEM files (docs/security.md). With a
	// certificate and key, gRPC is served over TLS and node-to-node calls
	// present the certificate, which must carry the allocator role
	// (spiffe://allot/allocator or OU=allocator); the other nodes' servers
	// must carry it too. The files are re-read when they change.
	TLS tlsconfig.Options
	// ClientAuth is the gRPC server's client-certificate policy: none
	// (default), optional (verified when presented) or require. Anything
	// but none needs TLS.CAFile.
	ClientAuth tlsconfig.ClientAuth
	// RaftTLS carries Raft over mutual TLS with the TLS files: both ends
	// must present certificates with the allocator role signed by the CA.
	RaftTLS bool
	// PeerNames, when non-empty, are the names (tlsconfig.Identity.Name)
	// of the allocator certificates that are this cluster's nodes, this
	// node's own included: only they may forward calls (with the caller's
	// identity), make the calls nodes make of each other (ApplySlotEntry,
	// joining by AddVoter) and, with RaftTLS, speak Raft. Another
	// certificate with the allocator role (a regional cluster's node,
	// docs/regions.md) keeps what any non-node caller with that role may
	// do. It needs verified client certificates (ClientAuth optional or
	// require). Empty: every allocator-role certificate from the CA is a
	// node.
	PeerNames []string
	// AdminTokens are bearer tokens ("authorization: Bearer <token>") that
	// grant the admin role; SetAdminTokens replaces them at run time.
	AdminTokens []string
	// OpenReads lets any caller use the read-only Admin RPCs (GetRules,
	// ListLeases, InspectKey, ListAgents, TopKeys, ClusterStatus). Without
	// it they need an admin whenever authentication is configured (a
	// ClientAuth other than none, or AdminTokens).
	OpenReads bool

	// Insecure lets the node listen on a non-loopback gRPC or Raft address
	// with no authentication (no client certificates, no admin tokens):
	// anyone who reaches the port can change the rules and the cluster and
	// read leases. Without it such a configuration is an error; with it
	// the node logs a WARN at start and every hour.
	Insecure bool
	// Pprof serves /debug/pprof/ on the HTTP address, to callers with an
	// admin bearer token (it needs AdminTokens). Off by default.
	Pprof bool

	// MaxInflight caps the unary calls this node serves at once (default
	// 1024); a call beyond it is answered ResourceExhausted at once, never
	// queued.
	MaxInflight int
	// MaxQueuedAcquires caps the Acquire calls waiting in the leader's
	// batcher (default 4096); beyond it, ResourceExhausted.
	MaxQueuedAcquires int
	// AgentRate and AgentBurst limit the Acquire and Release calls each
	// agent sends to this node (a token bucket per agent: the certificate's
	// agent id, else the agent_id): default 200 calls/s with a burst of
	// 400. An agent's refill loop sends one call per 1000 keys due per
	// 20 ms tick, so the default admits 200k key refreshes a second.
	// AgentRate < 0 turns the limit off.
	AgentRate, AgentBurst int
	// MaxConcurrentStreams caps the concurrent calls on one client
	// connection (default 256).
	MaxConcurrentStreams uint32
	// ForwardTimeout bounds each forwarded call (follower to leader) when
	// the caller's own deadline is later or absent (default 10 s).
	ForwardTimeout time.Duration
	// Keepalive: a client that pings more often than KeepaliveMinTime is
	// disconnected (default 10 s; pings without calls in flight are
	// allowed); an idle connection is pinged after KeepaliveTime (default
	// 30 s) and closed if the ping is not answered in KeepaliveTimeout
	// (default 10 s).
	KeepaliveMinTime, KeepaliveTime, KeepaliveTimeout time.Duration

	// ReadyMaxLag: a follower that has been behind the commit index the
	// leader sent it, or has not heard from the leader, for longer than
	// this is not ready (/readyz 503; default 5 s, negative: no bound).
	// The leader sends its commit index at least every Raft commit timeout
	// (0.5-1 s, node.go) with or without entries, so a follower in step,
	// idle or not, stays well within it. The lag is bounded by the age of the newest applied
	// entry, which the leader stamps: the clocks of the two hosts must
	// agree to within a fraction of it. The bound in effect is at least
	// three ExpireIntervals.
	ReadyMaxLag time.Duration

	// RecoverFromSnapshot starts a node whose raft log is missing, empty,
	// damaged or older than the node's recorded term and applied index
	// (raft-watermark.json) from its newest snapshot: the file is moved
	// aside, and the node resumes with the snapshot's state and a term past
	// any it may have voted in. Entries committed after that snapshot are
	// lost on this node (the leader sends them again if the cluster still
	// has them). Without it, such a data dir is an error naming the file.
	RecoverFromSnapshot bool

	// trailingLogs, when set (tests), is how many entries Raft keeps
	// after a snapshot (hashicorp/raft's TrailingLogs, default 10240): a
	// follower further behind than that catches up from a snapshot.
	trailingLogs uint64
	// newLogStore is the store of a new data dir when LogStore is empty
	// (a node's new data group takes its group 0's); empty: bolt.
	newLogStore string
	// walSegmentSize, when set (tests), is raft-wal's segment size in
	// bytes (default 64 MiB): small segments rotate, and a compaction
	// then deletes whole ones.
	walSegmentSize int

	// beforeApply, when set (tests), runs before the FSM applies each
	// command entry: a test delays this node's FSM with it.
	beforeApply func(l *raft.Log)

	// bootPeers, when set, are the voters a new Raft group is bootstrapped
	// with (a data group added to a running cluster); otherwise Bootstrap
	// starts it with this node alone.
	bootPeers []raft.Server

	// transport, when set (tests), replaces the TCP Raft transport; RaftAddr
	// is then ignored and the transport's LocalAddr is used.
	transport raft.Transport
}

// DefaultConfig returns a Config with the documented defaults and the
// conventional local addresses (gRPC 7420, Raft 7421, HTTP 7422). NodeID
// and DataDir must still be set.
func DefaultConfig() Config {
	sc := state.DefaultConfig()
	return Config{
		GRPCAddr:           "127.0.0.1:7420",
		RaftAddr:           "127.0.0.1:7421",
		HTTPAddr:           "127.0.0.1:7422",
		HeartbeatTimeout:   500 * time.Millisecond,
		ElectionTimeout:    500 * time.Millisecond,
		LeaderLeaseTimeout: 500 * time.Millisecond,
		LeaseTTL:           sc.LeaseTTL,
		MaxLeaseTTL:        sc.MaxLeaseTTL,
		RefreshInterval:    sc.RefreshInterval,
		AgentTTL:           sc.AgentTTL,
		StaticTTL:          2 * time.Second,
		ExpireInterval:     100 * time.Millisecond,
		ExpireMaxEntries:   4096,
		SweepInterval:      time.Second,
		ApplyTimeout:       5 * time.Second,
		ForwardWait:        2 * time.Second,
		MaxBatchKeys:       20000,
		MaxBatchBytes:      2 << 20,
		MaxInflightBatches: 2,
		BatchLinger:        4 * time.Millisecond,
		FollowerApplyNice:  10,
		BatchFillKeys:      2000,
		BatchFillWait:      6 * time.Millisecond,
		MaxRecvMsgSize:     4 << 20,
		SnapshotInterval:   30 * time.Second,
		SnapshotThreshold:  8192,
		ReadyMaxLag:        5 * time.Second,

		MaxInflight:          1024,
		MaxQueuedAcquires:    4096,
		AgentRate:            200,
		AgentBurst:           400,
		MaxConcurrentStreams: 256,
		ForwardTimeout:       10 * time.Second,
		KeepaliveMinTime:     10 * time.Second,
		KeepaliveTime:        30 * time.Second,
		KeepaliveTimeout:     10 * time.Second,
	}
}

// withDefaults returns c with every zero duration and size replaced by the
// DefaultConfig value.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	setDur := func(v *time.Duration, def time.Duration) {
		if *v == 0 {
			*v = def
		}
	}
	setInt := func(v *int, def int) {
		if *v == 0 {
			*v = def
		}
	}
	setDur(&c.HeartbeatTimeout, d.HeartbeatTimeout)
	setDur(&c.ElectionTimeout, d.ElectionTimeout)
	setDur(&c.LeaderLeaseTimeout, min(d.LeaderLeaseTimeout, c.HeartbeatTimeout))
	setDur(&c.LeaseTTL, d.LeaseTTL)
	if c.MaxLeaseTTL == 0 {
		c.MaxLeaseTTL = max(d.MaxLeaseTTL, c.LeaseTTL)
	}
	if c.AgentTTL == 0 {
		c.AgentTTL = max(d.AgentTTL, c.MaxLeaseTTL)
	}
	setDur(&c.RefreshInterval, d.RefreshInterval)
	setDur(&c.AgentTTL, d.AgentTTL)
	setDur(&c.StaticTTL, d.StaticTTL)
	setDur(&c.ExpireInterval, d.ExpireInterval)
	setDur(&c.SweepInterval, d.SweepInterval)
	setDur(&c.ApplyTimeout, d.ApplyTimeout)
	setDur(&c.ForwardWait, d.ForwardWait)
	setDur(&c.SnapshotInterval, d.SnapshotInterval)
	setDur(&c.ReadyMaxLag, d.ReadyMaxLag)
	setInt(&c.MaxBatchKeys, d.MaxBatchKeys)
	setInt(&c.MaxBatchBytes, d.MaxBatchBytes)
	setInt(&c.MaxInflightBatches, d.MaxInflightBatches)
	setDur(&c.BatchLinger, d.BatchLinger)
	setInt(&c.FollowerApplyNice, d.FollowerApplyNice)
	setInt(&c.BatchFillKeys, d.BatchFillKeys)
	setDur(&c.BatchFillWait, d.BatchFillWait)
	setInt(&c.ExpireMaxEntries, d.ExpireMaxEntries)
	setInt(&c.MaxRecvMsgSize, d.MaxRecvMsgSize)
	setInt(&c.MaxInflight, d.MaxInflight)
	setInt(&c.MaxQueuedAcquires, d.MaxQueuedAcquires)
	setInt(&c.AgentRate, d.AgentRate)
	if c.AgentBurst == 0 {
		c.AgentBurst = max(d.AgentBurst, c.AgentRate)
	}
	if c.MaxConcurrentStreams == 0 {
		c.MaxConcurrentStreams = d.MaxConcurrentStreams
	}
	setDur(&c.ForwardTimeout, d.ForwardTimeout)
	setDur(&c.KeepaliveMinTime, d.KeepaliveMinTime)
	setDur(&c.KeepaliveTime, d.KeepaliveTime)
	setDur(&c.KeepaliveTimeout, d.KeepaliveTimeout)
	if c.SnapshotThreshold == 0 {
		c.SnapshotThreshold = d.SnapshotThreshold
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports every problem with c (after defaults are applied to
// zero fields), joined. Rules files are compiled by New, not here.
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("allocator: "+format, args...))
	}
	if c.NodeID == "" {
		bad("NodeID is required")
	} else if len(c.NodeID) > 256 {
		bad("NodeID is longer than 256 bytes")
	}
	if c.DataDir == "" {
		bad("DataDir is required")
	}
	switch c.LogStore {
	case "", LogStoreBolt, LogStoreWAL:
	default:
		bad("LogStore %q: want %q or %q", c.LogStore, LogStoreBolt, LogStoreWAL)
	}
	if err := checkListenAddr(c.GRPCAddr, c.AdvertiseGRPCAddr); err != nil {
		bad("GRPCAddr: %v", err)
	}
	if err := checkAdvertiseAddr(c.AdvertiseGRPCAddr); err != nil {
		bad("AdvertiseGRPCAddr: %v", err)
	}
	if c.transport == nil {
		if err := checkListenAddr(c.RaftAddr, c.AdvertiseRaftAddr); err != nil {
			bad("RaftAddr: %v", err)
		}
		if err := checkAdvertiseAddr(c.AdvertiseRaftAddr); err != nil {
			bad("AdvertiseRaftAddr: %v", err)
		}
	} else if c.AdvertiseRaftAddr != "" {
		bad("AdvertiseRaftAddr needs the TCP Raft transport")
	}
	if c.HTTPAddr != "" {
		if _, _, err := net.SplitHostPort(c.HTTPAddr); err != nil {
			bad("HTTPAddr: %v", err)
		}
		if err := checkAdvertiseAddr(c.AdvertiseHTTPAddr); err != nil {
			bad("AdvertiseHTTPAddr: %v", err)
		}
	} else if c.AdvertiseHTTPAddr != "" {
		bad("AdvertiseHTTPAddr needs HTTPAddr (there is no HTTP server to advertise)")
	}
	if c.Bootstrap && c.Join != "" {
		bad("Bootstrap and Join are mutually exclusive")
	}
	switch {
	case c.Groups < 0 || c.Groups > slots.Count:
		bad("Groups %d: want 1 to %d", c.Groups, slots.Count)
	case c.Groups > 1 && c.Join != "":
		bad("Groups and Join are mutually exclusive: a joining node takes the cluster's groups")
	case c.Groups > 1 && !c.Bootstrap:
		bad("Groups needs Bootstrap: the groups are set when a cluster is bootstrapped")
	case meta.CheckReplicas(c.GroupReplicas) != nil:
		bad("GroupReplicas %d: want 0 (every node) to 15", c.GroupReplicas)
	case c.GroupReplicas > 0 && c.Groups < 2:
		bad("GroupReplicas needs Groups > 1: a single-group cluster has no data groups")
	case c.Groups > 1 && c.transport != nil:
		bad("Groups needs the TCP Raft transport")
	}
	if c.Join != "" {
		if _, _, err := net.SplitHostPort(c.Join); err != nil {
			bad("Join: %v", err)
		}
	}
	for name, d := range map[string]time.Duration{
		"HeartbeatTimeout": c.HeartbeatTimeout, "ElectionTimeout": c.ElectionTimeout,
		"LeaderLeaseTimeout": c.LeaderLeaseTimeout, "LeaseTTL": c.LeaseTTL, "MaxLeaseTTL": c.MaxLeaseTTL,
		"RefreshInterval": c.RefreshInterval, "AgentTTL": c.AgentTTL,
		"ExpireInterval": c.ExpireInterval, "SweepInterval": c.SweepInterval, "ApplyTimeout": c.ApplyTimeout,
		"ForwardWait": c.ForwardWait, "SnapshotInterval": c.SnapshotInterval,
	} {
		if d < 0 {
			bad("%s must not be negative", name)
		}
	}
	if c.HeartbeatTimeout < 5*time.Millisecond {
		bad("HeartbeatTimeout must be at least 5ms")
	}
	if c.ElectionTimeout < c.HeartbeatTimeout {
		bad("ElectionTimeout (%v) must be at least HeartbeatTimeout (%v)", c.ElectionTimeout, c.HeartbeatTimeout)
	}
	if c.LeaderLeaseTimeout > c.HeartbeatTimeout {
		bad("LeaderLeaseTimeout (%v) must not exceed HeartbeatTimeout (%v)", c.LeaderLeaseTimeout, c.HeartbeatTimeout)
	}
	if c.RefreshInterval >= c.LeaseTTL {
		bad("RefreshInterval (%v) must be shorter than LeaseTTL (%v)", c.RefreshInterval, c.LeaseTTL)
	}
	if err := c.stateConfig().Validate(); err != nil {
		bad("lease policy: %v", err)
	}
	switch {
	case c.StaticSlots < 0 || c.StaticSlots > state.MaxStaticSlots:
		bad("StaticSlots %d: want 0 (off) to %d", c.StaticSlots, state.MaxStaticSlots)
	case c.StaticTTL < time.Millisecond || c.StaticTTL%time.Millisecond != 0:
		bad("StaticTTL %v: want a whole number of milliseconds, at least 1ms", c.StaticTTL)
	case c.StaticSlots > 0 && c.StaticTTL >= c.AgentTTL:
		bad("StaticTTL (%v) must be shorter than AgentTTL (%v): a forgotten agent's static answers must have lapsed", c.StaticTTL, c.AgentTTL)
	case c.StaticSlots > 0 && c.Groups > 1:
		bad("StaticSlots needs a single-group cluster (Groups %d)", c.Groups)
	}
	if c.MaxBatchKeys < 0 || c.MaxBatchBytes < 0 || c.MaxInflightBatches < 0 || c.MaxRecvMsgSize < 0 {
		bad("batch and message sizes must not be negative")
	}
	if c.BatchLinger > time.Second || c.BatchFillWait > time.Second {
		bad("BatchLinger and BatchFillWait must be at most 1s")
	}
	if c.FollowerApplyNice > 19 {
		bad("FollowerApplyNice must be at most 19 (negative: off)")
	}
	if c.MaxInflightBatches > 64 {
		bad("MaxInflightBatches must be at most 64")
	}
	if c.MaxInflight < 0 || c.MaxQueuedAcquires < 0 || c.AgentBurst < 0 {
		bad("MaxInflight, MaxQueuedAcquires and AgentBurst must not be negative")
	}
	for name, d := range map[string]time.Duration{
		"ForwardTimeout": c.ForwardTimeout, "KeepaliveMinTime": c.KeepaliveMinTime,
		"KeepaliveTime": c.KeepaliveTime, "KeepaliveTimeout": c.KeepaliveTimeout,
	} {
		if d < 0 {
			bad("%s must not be negative", name)
		}
	}
	errs = append(errs, c.validateSecurity()...)
	errs = append(errs, c.Region.validate(c)...)
	return errors.Join(errs...)
}

// checkListenAddr accepts host:port. Without an advertise address the
// bound address is given to the other nodes, so its host must be
// advertisable; with one, any listen host (0.0.0.0, or none) will do.
func checkListenAddr(addr, advertise string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if advertise != "" {
		return nil
	}
	if host == "" {
		return errors.New("a host is required (it is advertised to the other nodes; or set an advertise address)")
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		return fmt.Errorf("%s is not an advertisable address (set an advertise address)", host)
	}
	return nil
}

// checkAdvertiseAddr accepts "" (advertise the bound address) or
// host:port with an advertisable host and a port in 1..65535.
func checkAdvertiseAddr(addr string) error {
	if addr == "" {
		return nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if host == "" {
		return errors.New("a host is required")
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		return fmt.Errorf("%s is not an advertisable address", host)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return fmt.Errorf("port %q: want 1..65535", port)
	}
	return nil
}

// stateConfig derives the state machine's configuration.
func (c Config) stateConfig() state.Config {
	sc := state.DefaultConfig()
	sc.LeaseTTL = c.LeaseTTL
	sc.MaxLeaseTTL = c.MaxLeaseTTL
	sc.RefreshInterval = c.RefreshInterval
	sc.AgentTTL = c.AgentTTL
	sc.PackedGrants = true // answers go to agents packed (service.go: answer)
	sc.Regional = c.Region.Name != ""
	return sc
}

// validateSecurity checks the TLS and authentication fields.
func (c Config) validateSecurity() []error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("allocator: "+format, args...))
	}
	if err := c.TLS.Validate(); err != nil {
		bad("TLS: %v", err)
	}
	hasCert := c.TLS.CertFile != "" && c.TLS.KeyFile != ""
	if c.TLS.Enabled() && !hasCert {
		bad("TLS: a certificate and key are required to serve TLS")
	}
	switch c.ClientAuth {
	case tlsconfig.ClientAuthNone:
	case tlsconfig.ClientAuthOptional, tlsconfig.ClientAuthRequire:
		if !hasCert || c.TLS.CAFile == "" {
			bad("ClientAuth %s needs TLS with a certificate, key and CA file", c.ClientAuth)
		}
	default:
		bad("unknown ClientAuth %d", c.ClientAuth)
	}
	if c.RaftTLS {
		if !hasCert || c.TLS.CAFile == "" {
			bad("RaftTLS needs TLS with a certificate, key and CA file")
		}
	}
	if len(c.PeerNames) > 0 {
		if c.ClientAuth == tlsconfig.ClientAuthNone {
			bad("PeerNames (-peer-names) needs verified client certificates (ClientAuth optional or require, with TLS): " +
				"a peer name is the name in a node's allocator certificate; a cluster without client certificates " +
				"authenticates its nodes by admin token")
		}
		for _, n := range c.PeerNames {
			if _, err := tlsconfig.ParseIdentity(string(tlsconfig.RoleAllocator) + "/" + n); err != nil {
				bad("PeerNames (-peer-names) %q: %v", n, err)
			}
		}
	}
	if !c.authEnabled() && !c.Insecure {
		addrs := [][2]string{{"GRPCAddr", c.GRPCAddr}}
		if c.transport == nil {
			addrs = append(addrs, [2]string{"RaftAddr", c.RaftAddr})
		}
		for _, a := range addrs {
			if !isLoopback(a[1]) {
				bad("%s %s is not a loopback address and no authentication is configured (client certificates or "+
					"admin tokens): anyone who reaches it could change the rules and the cluster; configure TLS with "+
					"client certificates or an admin token file, or set Insecure (-insecure) to accept that", a[0], a[1])
			}
		}
	}
	if c.Pprof && len(c.AdminTokens) == 0 {
		bad("Pprof needs AdminTokens: /debug/pprof/ is served only to an admin bearer token")
	}
	for i, tok := range c.AdminTokens {
		if len(tok) < 16 {
			bad("AdminTokens[%d] is shorter than 16 bytes", i)
		}
	}
	return errs
}

// isLoopback reports whether addr's host is a loopback IP or "localhost"
// (an empty or unspecified host listens on every interface).
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// authEnabled reports whether calls are authenticated at all: client
// certificates are verified, or admin tokens are configured.
func (c Config) authEnabled() bool {
	return c.ClientAuth != tlsconfig.ClientAuthNone || len(c.AdminTokens) > 0
}
