package allocator

import (
	"fmt"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const metricsNamespace = "allot_allocator"

// latencyBuckets are the latency histograms' buckets: 50 µs to ~2.8 s,
// each 25% wider than the last, fine enough to read a p99 between two
// bounds 25% apart.
var latencyBuckets = prometheus.ExponentialBuckets(0.00005, 1.25, 50)

// metrics are the Server's Prometheus metrics. None has a per-key label.
type metrics struct {
	applyLatency prometheus.Histogram
	// The Acquire latency breakdown (bench/acquire prints it; see
	// docs/performance.md#reading-the-figures): handler time by path, time
	// queued in the batcher, Raft's commit (the leader's append to the FSM
	// seeing the entry), the FSM's apply, and the follower's forwarding hop.
	acquireLatency *prometheus.HistogramVec
	batchQueue     prometheus.Histogram
	raftCommit     prometheus.Histogram
	fsmApply       *prometheus.HistogramVec
	forwardLatency prometheus.Histogram
	batchRequests  prometheus.Histogram
	batchKeys      prometheus.Histogram
	acquireCalls   *prometheus.CounterVec
	forwarded      prometheus.Counter
	leaderChanges  prometheus.Counter
	// tokenReloadFailures counts admin token reloads that failed and kept
	// the previous tokens.
	tokenReloadFailures prometheus.Counter
	xdsUpdates          *prometheus.CounterVec
	granted             prometheus.Counter
	returned            prometheus.Counter
	charged             prometheus.Counter
	commands            *prometheus.CounterVec
	expired             prometheus.Counter
	rulesVersion        prometheus.Gauge
	rejected            *prometheus.CounterVec
	inflight            prometheus.GaugeFunc

	snapCapture   prometheus.Histogram
	snapPersist   prometheus.Histogram
	snapBytes     prometheus.Histogram
	snapRestore   prometheus.Histogram
	snapFailures  *prometheus.CounterVec
	snapLastIndex prometheus.Gauge
	snapLastTime  prometheus.Gauge
}

// Label values exposed at 0 from the start, so that alerts on increase()
// see the first event and dashboards show 0 rather than no data.
var (
	rejectReasons  = []string{"unauthenticated", "permission_denied", "agent_rate", "inflight", "queue_full"}
	snapshotStages = []string{stageCapture, stagePersist, stageRestore}
	acquireResults = []string{"ok", "invalid", "error"}
	acquirePaths   = []string{"local", "forwarded"}
	commandTypes   = []string{"acquire", "release", "put_rules", "expire", "member", "check"}
)

func newMetrics(inflight func() float64) *metrics {
	m := newMetricsVecs(inflight)
	for _, r := range rejectReasons {
		m.rejected.WithLabelValues(r)
	}
	for _, st := range snapshotStages {
		m.snapFailures.WithLabelValues(st)
	}
	for _, r := range acquireResults {
		m.acquireCalls.WithLabelValues(r)
	}
	for _, p := range acquirePaths {
		m.acquireLatency.WithLabelValues(p)
	}
	for _, c := range commandTypes {
		m.commands.WithLabelValues(c)
		m.fsmApply.WithLabelValues(c)
	}
	return m
}

func newMetricsVecs(inflight func() float64) *metrics {
	return &metrics{
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "rejected_calls_total",
			Help: "Calls refused before any work, by reason: unauthenticated, permission_denied, agent_rate, inflight, queue_full.",
		}, []string{"reason"}),
		inflight: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "inflight_calls",
			Help: "Unary calls being served by this node (capped by MaxInflight).",
		}, inflight),
		applyLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "raft_apply_seconds",
			Help:    "Time from raft.Apply to the entry being applied on the leader.",
			Buckets: latencyBuckets,
		}),
		acquireLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "acquire_seconds",
			Help:    "Time this node spent serving an Acquire call (validated to answered), by path: local (this node leads) or forwarded (sent on to the leader).",
			Buckets: latencyBuckets,
		}, []string{"path"}),
		batchQueue: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "batch_queue_seconds",
			Help:    "Time an Acquire call waited in the leader's batcher before its batch was proposed to Raft.",
			Buckets: latencyBuckets,
		}),
		raftCommit: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "raft_commit_seconds",
			Help:    "Time from the leader appending an entry to its log to this replica's FSM starting to apply it (on the leader: its own fsync, a follower's append and fsync, the wait for the FSM). On a follower the leader's clock is compared with its own, so the figure includes their offset. Entries replayed at start count with their age.",
			Buckets: latencyBuckets,
		}),
		fsmApply: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "fsm_apply_seconds",
			Help:    "Time this replica's FSM took to decode and apply one Raft entry, by command type.",
			Buckets: latencyBuckets,
		}, []string{"type"}),
		forwardLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "forward_seconds",
			Help:    "Round trip of a call this node forwarded to the leader.",
			Buckets: latencyBuckets,
		}),
		batchRequests: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "batch_requests",
			Help:    "Acquire calls per committed batch (one Raft entry).",
			Buckets: prometheus.ExponentialBuckets(1, 2, 14),
		}),
		batchKeys: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "batch_keys",
			Help:    "Keys per committed batch (one Raft entry).",
			Buckets: prometheus.ExponentialBuckets(1, 2, 16),
		}),
		acquireCalls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "acquire_calls_total",
			Help: "Acquire RPCs answered by this node, by result (ok, invalid, error).",
		}, []string{"result"}),
		forwarded: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "forwarded_calls_total",
			Help: "Calls this node forwarded to the leader.",
		}),
		leaderChanges: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "leadership_changes_total",
			Help: "Times this node gained or lost leadership.",
		}),
		tokenReloadFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "admin_token_reload_failures_total",
			Help: "Admin token reloads that failed (unreadable file, a bad line, no token left); each kept the previous tokens.",
		}),
		xdsUpdates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "xds_updates_total",
			Help: "Rule updates from the xDS server answered by this node as leader, by result (ack, nack).",
		}, []string{"result"}),
		granted: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "tokens_granted_total",
			Help: "Tokens granted in leases (applied entries on this replica).",
		}),
		returned: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "tokens_returned_total",
			Help: "Tokens agents reported returning (applied entries on this replica).",
		}),
		charged: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "tokens_charged_total",
			Help: "Tokens agents admitted without a lease and were charged for.",
		}),
		commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "commands_applied_total",
			Help: "Raft commands applied on this replica, by type.",
		}, []string{"type"}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "leases_expired_total",
			Help: "Leases ended by expiry (applied entries on this replica).",
		}),
		rulesVersion: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "rules_version",
			Help: "Version of the rule set applied on this replica.",
		}),
		snapCapture: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "snapshot_capture_seconds",
			Help:    "Time to capture the state for a Raft snapshot (FSM.Snapshot, under the state's lock: applies wait for it).",
			Buckets: prometheus.ExponentialBuckets(0.00001, 4, 10), // 10 µs .. 2.6 s
		}),
		snapPersist: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "snapshot_persist_seconds",
			Help:    "Time to write a captured snapshot to the snapshot store, fsync and rename included (outside the lock).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16), // 1 ms .. 33 s
		}),
		snapBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "snapshot_bytes",
			Help:    "Size of each snapshot this node persisted.",
			Buckets: prometheus.ExponentialBuckets(1024, 4, 12), // 1 KiB .. 4 GiB
		}),
		snapRestore: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "snapshot_restore_seconds",
			Help:    "Time to restore the state from a snapshot (at start, or one installed by the leader).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		snapFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "snapshot_failures_total",
			Help: "Snapshot stages that failed, by stage: capture, persist, restore.",
		}, []string{"stage"}),
		snapLastIndex: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "snapshot_last_index",
			Help: "Raft index covered by the newest snapshot in this node's store (0: none yet).",
		}),
		snapLastTime: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "snapshot_last_timestamp_seconds",
			Help: "Unix time the newest snapshot in this node's store was written (0: none yet).",
		}),
	}
}

// observeSnapshot records a snapshot stage; a failed stage only counts
// as a failure.
func (m *metrics) observeSnapshot(ev snapshotEvent) {
	if ev.err != nil {
		m.snapFailures.WithLabelValues(ev.stage).Inc()
		return
	}
	switch ev.stage {
	case stageCapture:
		m.snapCapture.Observe(ev.took.Seconds())
	case stagePersist:
		m.snapPersist.Observe(ev.took.Seconds())
		m.snapBytes.Observe(float64(ev.bytes))
	case stageRestore:
		m.snapRestore.Observe(ev.took.Seconds())
	}
	if ev.newest != nil {
		m.snapLastIndex.Set(float64(ev.newest.index))
		m.snapLastTime.Set(float64(ev.newest.at.UnixNano()) / 1e9)
	}
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{
		m.applyLatency, m.acquireLatency, m.batchQueue, m.raftCommit, m.fsmApply, m.forwardLatency, m.batchRequests, m.batchKeys, m.acquireCalls, m.forwarded,
		m.leaderChanges, m.tokenReloadFailures, m.xdsUpdates, m.granted, m.returned, m.charged, m.commands, m.expired, m.rulesVersion,
		m.rejected, m.inflight,
		m.snapCapture, m.snapPersist, m.snapBytes, m.snapRestore, m.snapFailures, m.snapLastIndex, m.snapLastTime,
	}
}

// setupMetrics creates the metrics and registers them with the
// Registerer (and a private registry served on /metrics when the Registerer
// cannot be gathered).
func (s *Server) setupMetrics() error {
	s.metrics = newMetrics(func() float64 { return float64(s.guard.inflight.Load()) })
	reg := s.cfg.Registerer
	switch g, ok := reg.(prometheus.Gatherer); {
	case reg == nil:
		// The node's own registry: also the Go runtime and process
		// metrics (memory per key is read from them, bench/load).
		r := prometheus.NewRegistry()
		r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		s.registries, s.gather = []prometheus.Registerer{r}, r
	case ok:
		s.registries, s.gather = []prometheus.Registerer{reg}, g
	default:
		r := prometheus.NewRegistry()
		s.registries, s.gather = []prometheus.Registerer{reg, r}, r
	}
	return s.register(s.metrics.collectors()...)
}

// register registers cs with every registry, remembering them for
// unregisterMetrics.
func (s *Server) register(cs ...prometheus.Collector) error {
	for _, reg := range s.registries {
		for _, c := range cs {
			if err := reg.Register(c); err != nil {
				return fmt.Errorf("allocator: register metrics: %w", err)
			}
		}
	}
	s.registered = append(s.registered, cs...)
	return nil
}

// unregisterMetrics removes the Server's collectors, so that a caller's
// Registerer can be reused by a later Server.
func (s *Server) unregisterMetrics() {
	for _, reg := range s.registries {
		for _, c := range s.registered {
			reg.Unregister(c)
		}
	}
}

// observeApply counts an applied command (called by the FSM on every
// replica).
func (m *metrics) observeApply(cmd *allotv1.Command, result any) {
	switch cmd.Cmd.(type) {
	case *allotv1.Command_Acquire:
		m.commands.WithLabelValues("acquire").Inc()
		if br, ok := result.(*state.AcquireBatchResult); ok {
			m.granted.Add(float64(br.Granted))
			m.returned.Add(float64(br.Returned))
			m.charged.Add(float64(br.Charged))
		}
	case *allotv1.Command_Release:
		m.commands.WithLabelValues("release").Inc()
		if r, ok := result.(*allotv1.ReleaseResponse); ok {
			m.returned.Add(float64(r.GetReturned()))
		}
	case *allotv1.Command_PutRules:
		m.commands.WithLabelValues("put_rules").Inc()
	case *allotv1.Command_Expire:
		m.commands.WithLabelValues("expire").Inc()
	case *allotv1.Command_Member:
		m.commands.WithLabelValues("member").Inc()
	case *allotv1.Command_Check:
		m.commands.WithLabelValues("check").Inc()
	case *allotv1.Command_Static:
		m.commands.WithLabelValues("static").Inc()
	}
}

// observeEntry records one applied entry's commit wait and apply time
// (every replica; the commit wait only when the entry carries the
// leader's append time).
func (m *metrics) observeEntry(cmd *allotv1.Command, commit, apply time.Duration) {
	if commit >= 0 {
		m.raftCommit.Observe(commit.Seconds())
	}
	m.fsmApply.WithLabelValues(commandType(cmd)).Observe(apply.Seconds())
}

// commandType names a command for the metrics' type label.
func commandType(cmd *allotv1.Command) string {
	switch cmd.GetCmd().(type) {
	case *allotv1.Command_Acquire:
		return "acquire"
	case *allotv1.Command_Release:
		return "release"
	case *allotv1.Command_PutRules:
		return "put_rules"
	case *allotv1.Command_Expire:
		return "expire"
	case *allotv1.Command_Member:
		return "member"
	case *allotv1.Command_Check:
		return "check"
	case *allotv1.Command_Static:
		return "static"
	}
	return "unknown"
}

// observeBatch records the size of a committed batch (leader only).
func (m *metrics) observeBatch(calls, keys int) {
	m.batchRequests.Observe(float64(calls))
	m.batchKeys.Observe(float64(keys))
}

// stateCollector reads Raft's and the state's statistics at scrape time.
// It is registered once the node is open.
type stateCollector struct{ s *Server }

var (
	descRaftState = prometheus.NewDesc(metricsNamespace+"_raft_state",
		"Raft state of this node: 0 follower, 1 candidate, 2 leader, 3 shutdown.", nil, nil)
	descRaftTerm = prometheus.NewDesc(metricsNamespace+"_raft_term",
		"Current Raft term.", nil, nil)
	descRaftCommit = prometheus.NewDesc(metricsNamespace+"_raft_commit_index",
		"Latest committed Raft index known to this node.", nil, nil)
	descRaftApplied = prometheus.NewDesc(metricsNamespace+"_raft_applied_index",
		"Latest Raft index applied to this node's state.", nil, nil)
	descRaftLastContact = prometheus.NewDesc(metricsNamespace+"_raft_last_contact_seconds",
		"Seconds since this follower last heard from the leader (0 on the leader).", nil, nil)
	descIsLeader = prometheus.NewDesc(metricsNamespace+"_is_leader",
		"1 if this node is the Raft leader.", nil, nil)
	descKeys = prometheus.NewDesc(metricsNamespace+"_keys",
		"Budget keys tracked by this replica.", nil, nil)
	descLeases = prometheus.NewDesc(metricsNamespace+"_leases",
		"Live leases in this replica.", nil, nil)
	descAgents = prometheus.NewDesc(metricsNamespace+"_agents",
		"Live agents in this replica.", nil, nil)
	descExpireBacklog = prometheus.NewDesc(metricsNamespace+"_expire_backlog",
		"Leased keys with a lease due that the last Expire left for the next one (its -expire-max-entries budget ran out); growing means expiry falls behind.", nil, nil)
	descOutstanding = prometheus.NewDesc(metricsNamespace+"_tokens_outstanding",
		"Tokens held by agents in live leases, as recorded by this replica.", nil, nil)
	descHotKeys = prometheus.NewDesc(metricsNamespace+"_static_hot_keys",
		"Keys in the static shares' hot-key set: coordinated, decided by no agent from a static share (0 with static shares off).", nil, nil)
	descStaticSlots = prometheus.NewDesc(metricsNamespace+"_static_slots_held",
		"Static slots held by agents (at most -static-slots).", nil, nil)
	descStaticTransitions = prometheus.NewDesc(metricsNamespace+"_static_transitions",
		"Keys that turned hot less than -static-ttl ago: in transition, their limit a part of the rule's until the other slot holders acknowledge.", nil, nil)
)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descRaftState, descRaftTerm, descRaftCommit, descRaftApplied,
		descRaftLastContact, descIsLeader, descKeys, descLeases, descAgents, descExpireBacklog, descOutstanding,
		descHotKeys, descStaticSlots, descStaticTransitions} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	r := s.node.raft
	gauge := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v)
	}
	st := r.State()
	gauge(descRaftState, float64(st))
	gauge(descRaftTerm, float64(r.CurrentTerm()))
	gauge(descRaftCommit, float64(r.CommitIndex()))
	gauge(descRaftApplied, float64(r.AppliedIndex()))
	lc := 0.0
	if st != raft.Leader {
		if t := r.LastContact(); !t.IsZero() {
			lc = time.Since(t).Seconds()
		}
	}
	gauge(descRaftLastContact, lc)
	leader := 0.0
	if st == raft.Leader {
		leader = 1
	}
	gauge(descIsLeader, leader)
	stats := s.st.Stats()
	gauge(descKeys, float64(stats.Keys))
	gauge(descLeases, float64(stats.Leases))
	gauge(descAgents, float64(stats.Agents))
	gauge(descExpireBacklog, float64(stats.ExpireBacklog))
	gauge(descHotKeys, float64(stats.HotKeys))
	gauge(descStaticSlots, float64(stats.StaticSlotsHeld))
	gauge(descStaticTransitions, float64(stats.StaticTransitions))
	var held int64
	for _, a := range s.st.ListAgents(time.Now().UnixNano()).GetAgents() {
		held += a.GetTokensHeld()
	}
	gauge(descOutstanding, float64(held))
}
