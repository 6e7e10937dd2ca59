package allocator

import (
	"context"
	"log/slog"
	"math"
	"math/rand/v2"
	"time"

	"github.com/hashicorp/raft"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// leaderLoop owns the leader's duties: it starts them when this node gains
// leadership and cancels them when it loses it or the Server stops.
func (s *Server) leaderLoop() { s.runLeaderLoop(s.node.raft, s.log, s.leaderDuties) }

// runLeaderLoop runs f while this node leads the Raft group r.
func (s *Server) runLeaderLoop(r *raft.Raft, log *slog.Logger, f func(ctx context.Context)) {
	var cur *duties
	defer func() { cur.stop() }()
	for {
		select {
		case <-s.stopLoops:
			return
		case isLeader := <-r.LeaderCh():
			s.metrics.leaderChanges.Inc()
			// The timeouts first: a node that lost leadership follows
			// with the configured election timer, whatever its duties
			// take to stop.
			if err := raftTimeouts(r, s.cfg, isLeader); err != nil {
				log.Warn("raft timeouts not reloaded", "err", err)
			}
			// true twice in a row means leadership was lost and regained
			// in between: restart the duties either way.
			cur.stop()
			cur = nil
			if isLeader {
				log.Info("became leader")
				cur = s.startDuties(f)
			} else {
				log.Info("lost leadership")
			}
		}
	}
}

// duties is one term's run of leaderDuties.
type duties struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// startDuties runs f (a group's leader duties) in a goroutine owned by
// the group's leader loop, which stops it (and waits for it) with stop.
func (s *Server) startDuties(f func(ctx context.Context)) *duties {
	ctx, cancel := context.WithCancel(s.baseCtx)
	d := &duties{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		f(ctx)
	}()
	return d
}

// stop cancels the duties and waits for them to return. A nil d is a no-op.
func (d *duties) stop() {
	if d == nil {
		return
	}
	d.cancel()
	<-d.done
}

// leaderDuties runs while this node leads: it waits for the FSM to catch up
// (a Barrier), registers this node's addresses, applies the initial rules
// to an empty rule set, commits the static shares settings when they
// differ from Config's, and then commits an ExpireCommand every
// ExpireInterval when a lease or agent is due (with the idle-key sweep,
// when it has keys to drop, at most every SweepInterval).
func (s *Server) leaderDuties(ctx context.Context) {
	// Each step retries until it succeeds or leadership ends. Until the
	// Barrier, this node's FSM may lag its own log: it is not ready and
	// serves no reads or rule watches (ready.go).
	term := s.node.raft.CurrentTerm()
	s.retryWhileLeader(ctx, "barrier", func() error {
		return s.node.raft.Barrier(s.cfg.ApplyTimeout).Error()
	})
	if ctx.Err() != nil {
		return
	}
	s.barrierTerm.Store(term)
	// Stamp no time earlier than the previous leader's last command.
	s.advanceStamp(s.st.Stats().LastApplied)
	s.retryWhileLeader(ctx, "register member", s.registerSelf)
	if len(s.cfg.InitialRules) > 0 {
		s.retryWhileLeader(ctx, "apply initial rules", s.applyInitialRules)
	}
	if !s.multi() {
		s.retryWhileLeader(ctx, "apply static settings", s.applyStaticSettings)
	}
	if s.cfg.RulesXDS.Addr != "" {
		xdsDone := make(chan struct{})
		go func() { // owned by this term: ends with ctx, waited for below
			defer close(xdsDone)
			s.runXDS(ctx)
		}()
		defer func() { <-xdsDone }()
	}
	defer s.runRegion(ctx)()
	t := time.NewTimer(s.cfg.ExpireInterval)
	defer t.Stop()
	var sw sweeper
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.expireOnce(ctx, s.st, s.apply, now, &sw)
			t.Reset(s.expireWait(s.st, &sw, now))
		}
	}
}

// expireWait is how long the leader of st waits before its next look at
// expiry: until a lease or agent falls due or the next sweep segment is to
// be read, and at least ExpireInterval, so that an idle group wakes about
// once a SweepInterval instead of every ExpireInterval. It waits no longer
// than LeaseTTL either (a lease granted meanwhile is due no earlier).
// While the last Expire left a backlog, the next one follows expirePace's
// shorter wait after the look at tick, which the Expire's commit counts
// into.
func (s *Server) expireWait(st *state.State, sw *sweeper, tick time.Time) time.Duration {
	now := time.Now()
	next := sw.last.Add(s.cfg.SweepInterval)
	budget, wait := expirePace(s.cfg.ExpireMaxEntries, s.cfg.ExpireInterval, st.Stats().ExpireBacklog)
	if due := st.NextDue(budget); due < next.UnixNano() {
		next = time.Unix(0, due)
	}
	return min(max(next.Sub(now), tick.Add(wait).Sub(now), 0), s.cfg.LeaseTTL)
}

// sweeper is a group leader's sweep cadence: when it last looked at a
// sweep segment, and how many segments past the replicated cursor it has
// found nothing to drop in since its last committed sweep.
type sweeper struct {
	last time.Time
	skip uint32
}

// expireOnce commits an ExpireCommand through apply when a lease or agent
// of st is due at now, or a sweep is. Every SweepInterval it looks at the
// next sweep segment: only when a sweep there would drop a key (or the
// arena or table wants compacting) does the Expire carry the sweep, so a
// group with no traffic commits nothing however many keys it tracks, and
// reads one segment (1/SweepSegments of its keys) a SweepInterval.
func (s *Server) expireOnce(ctx context.Context, st *state.State, apply func(*allotv1.Command) (any, error), now time.Time, sw *sweeper) {
	sweep := false
	if now.Sub(sw.last) >= s.cfg.SweepInterval {
		sw.last = now
		if sweep = !st.SweepIdle(now.UnixNano(), sw.skip); !sweep {
			sw.skip = (sw.skip + 1) % uint32(st.Config().SweepSegments)
		}
	}
	stats := st.Stats()
	budget, _ := expirePace(s.cfg.ExpireMaxEntries, s.cfg.ExpireInterval, stats.ExpireBacklog)
	cmd := expireCommand(st, now.UnixNano(), budget, sweep)
	if sweep {
		cmd.SweepSkip = sw.skip
	}
	if !sweep && st.ExpireIdle(now.UnixNano(), cmd.MaxEntries) {
		return
	}
	if _, err := apply(&allotv1.Command{Cmd: &allotv1.Command_Expire{Expire: cmd}}); err != nil {
		if ctx.Err() == nil {
			s.log.Warn("expire failed", "err", err)
		}
		return
	}
	if sweep {
		sw.skip = 0
	}
}

// expireDrain is the time over which expirePace spreads a backlog, and
// expireCatchUp the most Expires it commits per ExpireInterval while one
// remains.
const (
	expireDrain   = 500 * time.Millisecond
	expireCatchUp = 10
)

// expirePace returns the MaxEntries of the next ExpireCommand and the
// least wait before it, given the configured budget base, ExpireInterval
// and the backlog the last Expire left.
//
// A second's expiries fall due together when the second ends (the expiry
// wheel is per second), and every Acquire entry waits behind an Expire
// while it runs. So a backlog is not taken in a few large Expires but in
// Expires of base entries that follow each other faster, at a pace that
// works it off in about expireDrain (backlog/expireDrain entries a
// second), from every ExpireInterval up to expireCatchUp times as often.
// Only past that rate does the budget grow, in proportion to the backlog,
// so a sustained expiry rate of any size leaves a bounded backlog. With no
// backlog: base, every ExpireInterval. Negative base: no limit (0), every
// ExpireInterval.
func expirePace(base int, interval time.Duration, backlog uint64) (uint32, time.Duration) {
	if base < 0 {
		return 0, interval
	}
	if backlog == 0 || base == 0 {
		return uint32(min(base, 1<<31)), interval
	}
	// The wait at which Expires of base entries take backlog/expireDrain a
	// second, within [interval/expireCatchUp, interval].
	wait := interval
	if d := float64(expireDrain) * float64(base) / float64(backlog); d < float64(interval) {
		wait = max(time.Duration(d), interval/expireCatchUp)
	}
	per := float64(backlog) * float64(wait) / float64(expireDrain)
	return uint32(min(max(float64(base), math.Ceil(per)), 1<<31)), wait
}

// expireCommand returns the ExpireCommand a leader of st commits at now
// with expirePace's budget of wheel entries: MaxEntries counts the keys
// whose leases end, and LastUnit stops it where this replica's wheel holds
// budget due entries, early and stale ones included (most of a unit's
// entries may end nothing: a renewed key's is early and re-queued, a moved
// one's stale), so an Expire takes about budget entries either way.
func expireCommand(st *state.State, now int64, budget uint32, sweep bool) *allotv1.ExpireCommand {
	return &allotv1.ExpireCommand{MaxEntries: budget, LastUnit: st.ExpireLastUnit(now, budget), SkipSweep: !sweep}
}

func (s *Server) retryWhileLeader(ctx context.Context, what string, f func() error) {
	wait := 10 * time.Millisecond
	for ctx.Err() == nil {
		err := f()
		if err == nil {
			return
		}
		s.log.Warn("leader duty failed; retrying", "duty", what, "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(wait*2, time.Second)
	}
}

// registerSelf commits this node's current addresses unless the replicated
// record already has them.
func (s *Server) registerSelf() error {
	me := s.self()
	for _, m := range s.st.Members() {
		if m.GetId() == me.Id && sameAddrs(m, me) {
			return nil
		}
	}
	return s.registerMember(me)
}

// applyInitialRules puts Config.InitialRules when the rule set is empty.
// expected_version 0 is unconditional, so the emptiness check and the put
// race only with an operator's put in the same instant.
func (s *Server) applyInitialRules() error {
	if s.rulesVersion() != 0 {
		return nil
	}
	req := &allotv1.PutRulesRequest{ReplaceAll: true}
	for _, f := range s.cfg.InitialRules {
		req.Files = append(req.Files, &allotv1.RuleFile{Name: f.Name, Domain: f.Domain, Yaml: f.Source})
	}
	if _, err := s.apply(&allotv1.Command{Cmd: &allotv1.Command_PutRules{PutRules: req}}); err != nil {
		return err
	}
	s.log.Info("initial rules applied", "files", len(req.Files), "version", s.rulesVersion())
	return nil
}

// staticSettings are the static shares' settings of Config.
func (s *Server) staticSettings() state.StaticSettings {
	if s.cfg.StaticSlots <= 0 {
		return state.StaticSettings{}
	}
	return state.StaticSettings{Slots: uint32(s.cfg.StaticSlots), TTL: s.cfg.StaticTTL}
}

// applyStaticSettings commits Config's static shares settings when the
// replicated ones differ (a change revokes every slot for one TTL:
// docs/static-shares.md).
func (s *Server) applyStaticSettings() error {
	want := s.staticSettings()
	if s.st.StaticSettings() == want {
		return nil
	}
	if _, err := s.apply(state.StaticCommand(want)); err != nil {
		return err
	}
	s.log.Info("static shares set", "slots", want.Slots, "ttl", want.TTL)
	return nil
}

// hasJoined reports whether this node already belongs to a cluster (its
// data directory held Raft state).
func (s *Server) hasJoined() bool { return s.node.existing }

// joinLoop asks Config.Join to add this node as a voter, with jittered
// exponential backoff, until it succeeds or the Server stops.
func (s *Server) joinLoop() {
	req := s.addVoterRequest()
	wait := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := s.joinOnce(req)
		if err == nil {
			s.log.Info("joined cluster", "via", s.cfg.Join, "attempts", attempt)
			return
		}
		s.log.Warn("join failed; retrying", "via", s.cfg.Join, "attempt", attempt, "err", err)
		d := wait/2 + rand.N(wait/2+1)
		t := time.NewTimer(d)
		select {
		case <-s.stopLoops:
			t.Stop()
			return
		case <-s.done:
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(wait*2, 5*time.Second)
	}
}

func (s *Server) joinOnce(req *allotv1.AddVoterRequest) error {
	cc, err := s.fwd.conn(s.cfg.Join)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(s.baseCtx, 10*time.Second)
	defer cancel()
	_, err = allotv1.NewAdminClient(cc).AddVoter(s.withJoinToken(ctx), req)
	return err
}
