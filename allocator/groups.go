package allocator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot/allot/allocator/groupdir"
	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// A cluster with several groups (Config.Groups > 1) runs one Raft group
// per data group besides the meta group 0, every one on the node's one
// Raft listener (raftmux) and served through its one gRPC address. The
// meta group keeps the rules, the member records and the meta state
// (allocator/meta: groups, slot map, moves); it serves no keys. Each data
// group runs the state machine over the keys of its slots, with its own
// batcher and leader duties. The data dir follows allocator/groupdir:
// cluster.json, groups/<id>/ for each group (raft.db, snapshots/,
// raft-watermark.json), and hostedFile, the groups this node hosts.
//
// A cluster of one group (the default) is a single-group cluster: one
// Raft group at the root of the data dir, exactly as before groups
// existed.

// hostedFile, at the data dir's root, lists the groups this node hosts. It
// is written after their directories exist, so a missing one at start is
// an error naming its path.
const hostedFile = "hosted.json"

// joinDiscoverWait bounds how long a new node with Join waits for the
// member it joins through to say whether the cluster has several groups.
const joinDiscoverWait = 60 * time.Second

// groupSet is the runtime of a cluster with several groups.
type groupSet struct {
	layout *groupdir.Layout
	meta   *metaFSM
	// bootstrapData is the number of data groups this node bootstraps the
	// meta state with (Config.Groups on a bootstrapping node), else 0.
	bootstrapData int

	mu   sync.RWMutex // guards data
	data map[slots.GroupID]*dataGroup

	topoMu sync.Mutex    // guards topoCh
	topoCh chan struct{} // closed (and replaced) when the topology may have changed

	observations chan raft.Observation // leader changes of every group

	// joinMu serializes the membership changes a meta leader makes when a
	// node joins or is removed: each reads the members, then records new
	// ones.
	joinMu sync.Mutex

	remote   remoteLeaders          // leaders of the groups this node hosts no replica of
	forwards *prometheus.CounterVec // calls forwarded for those groups, by group
}

// dataGroup is one data group's replica on this node.
type dataGroup struct {
	id      slots.GroupID
	st      *state.State
	fsm     *fsm
	node    *node
	batcher *batcher
	// barrierTerm is the term in which this node, as the group's leader,
	// completed its Barrier.
	barrierTerm atomic.Uint64
}

// multi reports whether the cluster has several groups.
func (s *Server) multi() bool { return s.grp != nil }

type hostedRecord struct {
	Groups []slots.GroupID `json:"groups"`
}

func readHosted(root string) ([]slots.GroupID, bool, error) {
	path := filepath.Join(root, hostedFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("allocator: read %s: %w", path, err)
	}
	var rec hostedRecord
	if err := json.Unmarshal(b, &rec); err != nil || !slices.Contains(rec.Groups, 0) {
		return nil, false, fmt.Errorf("allocator: %s: damaged (want {\"groups\":[0,...]}): %v", path, err)
	}
	return rec.Groups, true, nil
}

func writeHosted(root string, groups []slots.GroupID) error {
	b, err := json.Marshal(hostedRecord{Groups: groups})
	if err != nil {
		return err
	}
	return writeFileSync(filepath.Join(root, hostedFile), append(b, '\n'))
}

// prepareGroups decides the data dir's layout before group 0 opens, and
// returns the configuration group 0 opens with: Config unchanged for a
// single-group node, its DataDir groups/0/ for a node of a cluster with
// several groups (s.grp is then set). A new node bootstrapping with
// Groups > 1 creates the layout; a new node joining asks the member it
// joins through whether the cluster has several groups, and takes its
// id and groups.
func (s *Server) prepareGroups() (Config, error) {
	cfg := s.cfg
	root := cfg.DataDir
	l, err := groupdir.Open(root)
	var clusterID string
	var groups []slots.GroupID
	switch {
	case errors.Is(err, groupdir.ErrLegacy):
		if cfg.Groups > 1 {
			return cfg, fmt.Errorf("allocator: Groups %d: %s holds a single-group node's data; the groups of a cluster are set when it is bootstrapped", cfg.Groups, root)
		}
		return cfg, nil
	case errors.Is(err, groupdir.ErrNotInitialized):
		switch {
		case cfg.Groups > 1:
			clusterID = groupdir.NewClusterID()
			groups = make([]slots.GroupID, cfg.Groups+1)
			for i := range groups {
				groups[i] = slots.GroupID(i)
			}
		case cfg.Join != "":
			st, err := s.discover()
			if err != nil {
				return cfg, err
			}
			if len(st.GetGroups()) == 0 {
				return cfg, nil // a single-group cluster
			}
			// It hosts the meta group from the start, and each data group
			// once the meta state names it a member (hostLoop).
			clusterID = st.GetClusterId()
			groups = []slots.GroupID{0}
		default:
			return cfg, nil
		}
		if l, err = groupdir.Init(root, clusterID, cfg.NodeID); err != nil {
			return cfg, err
		}
	case err != nil:
		return cfg, err
	}
	if err := l.Check("", cfg.NodeID); err != nil {
		return cfg, err
	}
	hosted, ok, err := readHosted(root)
	if err != nil {
		return cfg, err
	}
	if !ok {
		// A new layout (or one whose creation stopped before this file):
		// create the groups' directories, then record them.
		if groups == nil {
			return cfg, fmt.Errorf("allocator: %s has no %s: its creation did not finish; start the node with an empty data dir",
				root, filepath.Join(root, hostedFile))
		}
		for _, id := range groups {
			if _, err := l.OpenGroup(id); errors.Is(err, groupdir.ErrMissingGroup) {
				if _, err := l.CreateGroup(id); err != nil {
					return cfg, err
				}
			} else if err != nil {
				return cfg, err
			}
		}
		if err := writeHosted(root, groups); err != nil {
			return cfg, err
		}
		hosted = groups
	}
	extra, err := l.CheckGroups(hosted)
	if err != nil {
		return cfg, fmt.Errorf("allocator: %w", err)
	}
	if len(extra) > 0 {
		s.log.Warn("group directories of groups this node no longer hosts", "groups", extra)
	}
	s.grp = &groupSet{
		layout:       l,
		data:         make(map[slots.GroupID]*dataGroup),
		topoCh:       make(chan struct{}),
		observations: make(chan raft.Observation, 64),
		forwards:     newGroupForwards(),
	}
	if cfg.Bootstrap && cfg.Groups > 1 {
		s.grp.bootstrapData = cfg.Groups
	}
	s.grp.meta = &metaFSM{inner: s.fsm, onChange: s.notifyTopology}
	s.fsm.outer = s.grp.meta
	g0 := cfg
	g0.DataDir = l.GroupDir(0)
	s.log.Info("groups", "cluster", l.ClusterID, "hosted", hosted)
	return g0, nil
}

// discover asks Config.Join for the cluster's status, retrying for up to
// joinDiscoverWait while it does not answer.
func (s *Server) discover() (*allotv1.ClusterStatusResponse, error) {
	deadline := time.Now().Add(joinDiscoverWait)
	for {
		cc, err := s.fwd.conn(s.cfg.Join)
		if err != nil {
			return nil, err
		}
		ctx, cancel := context.WithTimeout(s.baseCtx, 5*time.Second)
		st, err := allotv1.NewAdminClient(cc).ClusterStatus(s.withJoinToken(ctx), &allotv1.ClusterStatusRequest{})
		cancel()
		if err == nil {
			return st, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("allocator: join %s: no answer to ClusterStatus within %v (a new node learns the cluster's groups from it): %w",
				s.cfg.Join, joinDiscoverWait, err)
		}
		s.log.Info("waiting for the member to join through", "join", s.cfg.Join, "err", err)
		time.Sleep(200 * time.Millisecond)
	}
}

// openDataGroups opens every data group this node hosts (a cluster with
// several groups) and starts their loops.
func (s *Server) openDataGroups() error {
	if !s.multi() {
		return nil
	}
	s.node.raft.RegisterObserver(s.leaderObserver())
	hosted, _, err := readHosted(s.cfg.DataDir)
	if err != nil {
		return err
	}
	for _, id := range hosted {
		if id == 0 {
			continue
		}
		if err := s.openDataGroup(id, s.grp.bootstrapData > 0, nil); err != nil {
			return err
		}
	}
	if err := s.register(&groupCollector{s: s}); err != nil {
		return err
	}
	if err := s.register(s.grp.forwards); err != nil {
		return err
	}
	s.goFunc(s.observeLeaders)
	s.goFunc(s.spreadLoop)
	s.goFunc(s.moveLoop)
	s.goFunc(s.hostLoop)
	return nil
}

// leaderObserver reports a group's leader changes to observeLeaders.
func (s *Server) leaderObserver() *raft.Observer {
	return raft.NewObserver(s.grp.observations, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
}

// observeLeaders wakes topology watchers on every leader change of a group.
func (s *Server) observeLeaders() {
	for {
		select {
		case <-s.done:
			return
		case <-s.grp.observations:
			s.notifyTopology()
		}
	}
}

// openDataGroup opens data group id's replica and starts its batcher and
// leader loop. With boot, a new replica is bootstrapped: with peers as its
// voters (a group added to a running cluster, on each of its founders),
// or with this node as its one voter (peers nil: a bootstrapping node's
// groups). Without, it waits to be added to the group by its leader (a
// node that joins a running group).
func (s *Server) openDataGroup(id slots.GroupID, boot bool, peers []raft.Server) error {
	dir, err := s.grp.layout.OpenGroup(id)
	if err != nil {
		return fmt.Errorf("allocator: %w", err)
	}
	stream, err := s.mux.Group(uint32(id))
	if err != nil {
		return fmt.Errorf("allocator: raft group %d: %w", id, err)
	}
	g := &dataGroup{id: id, st: state.New(s.cfg.stateConfig())}
	log := s.log.With("group", id)
	g.fsm = &fsm{
		st: g.st, onRules: s.notifyTopology, beforeApply: s.cfg.beforeApply,
		onApply: s.metrics.observeApply, onEntry: s.metrics.observeEntry,
		onExpired:  func(n uint64) { s.metrics.expired.Add(float64(n)) },
		onSnapshot: s.observeSnapshot,
	}
	cfg := s.cfg
	cfg.DataDir = dir
	if s.node != nil {
		cfg.newLogStore = s.node.kind // a new group's store is group 0's
	}
	cfg.Bootstrap = boot
	cfg.bootPeers = peers
	if g.node, err = openNode(cfg, g.fsm, newHCLogAdapter(log, "raft"), stream, s.mux.BoundAddr()); err != nil {
		_ = stream.Close()
		return err
	}
	g.node.raft.RegisterObserver(s.leaderObserver())
	g.batcher = s.newGroupBatcher(func(data []byte) (any, error) { return s.proposeOn(g.node.raft, data) })
	s.grp.mu.Lock()
	s.grp.data[id] = g
	s.grp.mu.Unlock()
	s.goFunc(func() { s.runLeaderLoop(g.node.raft, log, func(ctx context.Context) { s.groupDuties(ctx, g) }) })
	return nil
}

// dataGroup returns this node's replica of data group id (nil: not
// hosted).
func (s *Server) dataGroup(id slots.GroupID) *dataGroup {
	s.grp.mu.RLock()
	defer s.grp.mu.RUnlock()
	return s.grp.data[id]
}

// dataGroups returns this node's data group replicas, in id order.
func (s *Server) dataGroups() []*dataGroup {
	s.grp.mu.RLock()
	defer s.grp.mu.RUnlock()
	out := make([]*dataGroup, 0, len(s.grp.data))
	for _, g := range s.grp.data {
		out = append(out, g)
	}
	slices.SortFunc(out, func(a, b *dataGroup) int { return int(a.id) - int(b.id) })
	return out
}

// groupDuties runs while this node leads data group g: a Barrier, then
// the group follows the meta group's rules (installing each new version
// at the meta group's version number) and expires leases as the meta
// group's leader does for a single-group cluster.
func (s *Server) groupDuties(ctx context.Context, g *dataGroup) {
	r := g.node.raft
	term := r.CurrentTerm()
	s.retryWhileLeader(ctx, "barrier", func() error { return r.Barrier(s.cfg.ApplyTimeout).Error() })
	if ctx.Err() != nil {
		return
	}
	g.barrierTerm.Store(term)
	s.advanceStamp(g.st.Stats().LastApplied)
	apply := func(cmd *allotv1.Command) (any, error) { return s.applyOn(r, cmd) }
	t := time.NewTimer(s.cfg.ExpireInterval)
	defer t.Stop()
	var sw sweeper
	for {
		changed := s.rulesChanged()
		if err := s.syncRules(g, apply); err != nil && ctx.Err() == nil {
			s.log.Warn("rules not installed in a data group; retrying", "group", g.id, "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		case now := <-t.C:
			s.expireOnce(ctx, g.st, apply, now, &sw)
			t.Reset(s.expireWait(g.st, &sw, now))
		}
	}
}

// syncRules installs the meta group's rule set in data group g when g's
// is older.
func (s *Server) syncRules(g *dataGroup, apply func(*allotv1.Command) (any, error)) error {
	rs := s.st.RuleSet()
	if rs.GetVersion() <= rulesVersionOf(g.st) {
		return nil
	}
	_, err := apply(&allotv1.Command{Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
		Files: rs.GetFiles(), ReplaceAll: true, Version: rs.GetVersion(),
	}}})
	return err
}

func rulesVersionOf(st *state.State) uint64 {
	if set := st.Rules(); set != nil {
		return set.Version()
	}
	return 0
}

// notifyTopology wakes every topology watcher. It does not block.
func (s *Server) notifyTopology() {
	if s.grp == nil {
		return
	}
	s.grp.topoMu.Lock()
	close(s.grp.topoCh)
	s.grp.topoCh = make(chan struct{})
	s.grp.topoMu.Unlock()
}

// topologyChanged returns a channel closed at the next topology change.
// Take it before reading the topology.
func (s *Server) topologyChanged() <-chan struct{} {
	s.grp.topoMu.Lock()
	defer s.grp.topoMu.Unlock()
	return s.grp.topoCh
}

// groupsNotReady returns why the data groups keep this node from being
// ready ("" when they do not): a hosted data group with no leader known,
// or one this node leads before its Barrier.
func (s *Server) groupsNotReady() string {
	if !s.multi() {
		return ""
	}
	if !s.metaBootstrapped() {
		return "the meta group has not recorded the groups yet"
	}
	for _, g := range s.dataGroups() {
		r := g.node.raft
		_, id := r.LeaderWithID()
		switch {
		case id == "":
			return "group " + strconv.Itoa(int(g.id)) + ": no leader known"
		case string(id) == s.cfg.NodeID && g.barrierTerm.Load() != r.CurrentTerm():
			return "group " + strconv.Itoa(int(g.id)) + ": new leader: applying its log (barrier)"
		}
	}
	return ""
}

// handOverGroups hands the leadership of every group this node leads to
// another voter, all at once, before a graceful shutdown.
func (s *Server) handOverGroups(ctx context.Context) {
	rafts := []*raft.Raft{s.node.raft}
	if s.multi() {
		for _, g := range s.dataGroups() {
			rafts = append(rafts, g.node.raft)
		}
	}
	var wg sync.WaitGroup
	for _, r := range rafts {
		if r.State() == raft.Leader && s.hasOtherVoters(r) {
			wg.Go(func() { s.handOver(ctx, r) })
		}
	}
	wg.Wait()
}

// closeGroups stops every data group: its batcher, its Raft, a last
// watermark, its stores. Safe twice.
func (s *Server) closeGroups() []error {
	if !s.multi() {
		return nil
	}
	var errs []error
	for _, g := range s.dataGroups() {
		g.batcher.close()
		if g.node.closed {
			continue
		}
		if err := g.node.raft.Shutdown().Error(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: group %d: raft shutdown: %w", g.id, err))
		}
		if err := g.node.writeWatermark(g.fsm); err != nil {
			errs = append(errs, err)
		}
		g.node.close()
	}
	return errs
}

// writeGroupWatermarks rewrites every data group's watermark.
func (s *Server) writeGroupWatermarks() {
	if !s.multi() {
		return
	}
	for _, g := range s.dataGroups() {
		if err := g.node.writeWatermark(g.fsm); err != nil {
			s.log.Warn("watermark not written", "group", g.id, "err", err)
		}
	}
}

// groupCollector exports each data group's replica on this node: its
// tracked keys and leases, whether this node leads it, and its applied
// index (label group; at most a few dozen groups).
type groupCollector struct{ s *Server }

var (
	descGroupKeys    = prometheus.NewDesc(metricsNamespace+"_group_keys", "Budget keys tracked by this node's replica of a data group.", []string{"group"}, nil)
	descGroupLeases  = prometheus.NewDesc(metricsNamespace+"_group_leases", "Live leases in this node's replica of a data group.", []string{"group"}, nil)
	descGroupLeader  = prometheus.NewDesc(metricsNamespace+"_group_is_leader", "1 when this node leads the data group.", []string{"group"}, nil)
	descGroupApplied = prometheus.NewDesc(metricsNamespace+"_group_applied_index", "The data group's Raft applied index on this node.", []string{"group"}, nil)
)

func (c *groupCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descGroupKeys, descGroupLeases, descGroupLeader, descGroupApplied} {
		ch <- d
	}
}

func (c *groupCollector) Collect(ch chan<- prometheus.Metric) {
	for _, g := range c.s.dataGroups() {
		id := strconv.FormatUint(uint64(g.id), 10)
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, id)
		}
		stats := g.st.Stats()
		gauge(descGroupKeys, float64(stats.Keys))
		gauge(descGroupLeases, float64(stats.Leases))
		leader := 0.0
		if g.node.raft.State() == raft.Leader {
			leader = 1
		}
		gauge(descGroupLeader, leader)
		gauge(descGroupApplied, float64(g.node.raft.AppliedIndex()))
	}
}
