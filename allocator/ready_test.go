package allocator

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// putRulesV2 commits a second rule set and waits until node i applied it.
func putRulesV2(t *testing.T, tc *testCluster, i int) {
	t.Helper()
	_, admin := tc.clients(tc.leader())
	newRules := strings.Replace(testRules, "burst: 50", "burst: 60", 1)
	if _, err := admin.PutRules(ctxT(t), &allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(newRules)}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "rules version 2 applied", func() bool { return tc.node(i).rulesVersion() == 2 })
}

// followerNotBootstrap returns a follower other than node 0 (node 0
// carries InitialRules, which would keep it unready for another reason).
func followerNotBootstrap(tc *testCluster) int {
	l := tc.leader()
	for i := 1; i < len(tc.nodes); i++ {
		if i != l {
			return i
		}
	}
	panic("no follower")
}

// gate blocks a node's FSM until opened.
type gate struct {
	ch   chan struct{}
	once sync.Once
}

func newGate(t *testing.T) *gate {
	g := &gate{ch: make(chan struct{})}
	t.Cleanup(g.open)
	return g
}

func (g *gate) open()            { g.once.Do(func() { close(g.ch) }) }
func (g *gate) wait(_ *raft.Log) { <-g.ch }

// applyHold holds, behind a gate, the FSM of the node whose index is in
// node (−1: none) at each entry that match accepts (nil: every entry),
// and closes held at the first one.
type applyHold struct {
	*gate
	node  atomic.Int64
	held  chan struct{}
	once  sync.Once
	match func(*raft.Log) bool
}

func newApplyHold(t *testing.T, match func(*raft.Log) bool) *applyHold {
	h := &applyHold{gate: newGate(t), held: make(chan struct{}), match: match}
	h.node.Store(-1)
	return h
}

// hook is node i's Config.beforeApply.
func (h *applyHold) hook(i int) func(*raft.Log) {
	return func(l *raft.Log) {
		if h.node.Load() == int64(i) && (h.match == nil || h.match(l)) {
			h.once.Do(func() { close(h.held) })
			h.wait(l)
		}
	}
}

// TestRestartReadyMeansCaughtUp pins a restarted follower that reported
// ready, and streamed rules to watchers, before its FSM had applied what
// was committed when it started ("rules version after full restart = 1,
// want 2"). The restarted node's FSM is held by a gate, so the race is
// deterministic.
func TestRestartReadyMeansCaughtUp(t *testing.T) {
	tc := newTestCluster(t, 3)
	f := followerNotBootstrap(tc)
	putRulesV2(t, tc, f)

	tc.stop(f, false)
	g := newGate(t)
	tc.cfgs[f].beforeApply = g.wait
	tc.cfgs[f].Join = ""
	tc.restart(f)
	s := tc.node(f)
	waitFor(t, 5*time.Second, "the restarted follower hears the leader", func() bool {
		id, _ := s.Leader()
		return id != "" && s.node.raft.CommitIndex() > 0
	})
	if rd := s.readiness(); rd.Ready {
		t.Fatalf("restarted follower ready with its FSM held (rules version %d, fsm index %d, commit %d)",
			rd.RulesVersion, rd.FSMIndex, rd.CommitIndex)
	}
	alloc, admin := tc.clients(f)
	ctx, cancel := context.WithTimeout(ctxT(t), 300*time.Millisecond)
	defer cancel()
	if stream, err := alloc.WatchRules(ctx, &allotv1.WatchRulesRequest{}); err == nil {
		if rs, err := stream.Recv(); err == nil {
			t.Fatalf("watch on a follower that has not caught up streamed rules version %d", rs.GetVersion())
		} else if c := status.Code(err); c != codes.DeadlineExceeded && c != codes.Unavailable {
			t.Fatalf("watch before catch-up: %v", err)
		}
	}
	if rs, err := admin.GetRules(ctx, &allotv1.GetRulesRequest{}); err == nil {
		t.Fatalf("GetRules on a follower that has not caught up answered version %d", rs.GetVersion())
	}

	g.open()
	tc.waitReady(f)
	if v := s.rulesVersion(); v != 2 {
		t.Fatalf("ready follower has rules version %d, want 2", v)
	}
	stream, err := alloc.WatchRules(ctxT(t), &allotv1.WatchRulesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if rs, err := stream.Recv(); err != nil || rs.GetVersion() != 2 {
		t.Fatalf("watch after catch-up = %v, %v; want version 2", rs.GetVersion(), err)
	}
}

// TestReadyzFollowerLag: a follower whose FSM stops applying goes unready
// once it has been behind the leader's commit index for longer than
// ReadyMaxLag, and ready again once it catches up.
func TestReadyzFollowerLag(t *testing.T) {
	h := newApplyHold(t, nil)
	tc := newTestCluster(t, 3, func(i int, c *Config) {
		c.ReadyMaxLag = 400 * time.Millisecond
		c.beforeApply = h.hook(i)
	})
	f := followerNotBootstrap(tc)
	tc.waitReady(f)
	h.node.Store(int64(f))
	// An idle group commits nothing: an Acquire gives the follower an
	// entry to hold.
	commitOne(t, tc, "lag")
	<-h.held
	waitFor(t, 5*time.Second, "the lagging follower unready", func() bool {
		rd := tc.node(f).readiness()
		return !rd.Ready && strings.Contains(rd.Reason, "lagging")
	})
	h.node.Store(-1)
	h.open()
	tc.waitReady(f)
}

// TestReadyzCannotAppend: appends that fail on a real raft.db (opened
// read-only here, as a full or read-only disk would refuse them) are
// recorded, and a follower with such a failure is unready, naming it,
// until an append succeeds.
func TestReadyzCannotAppend(t *testing.T) {
	path := filepath.Join(t.TempDir(), raftDBFile)
	rw, err := openBolt(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := rw.Close(); err != nil {
		t.Fatal(err)
	}
	ro, err := raftboltdb.New(raftboltdb.Options{Path: path, BoltOptions: &bbolt.Options{ReadOnly: true, Timeout: time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	var failed atomic.Pointer[appendFailure]
	w := &watchedLog{LogStore: ro, failed: &failed}
	if err := w.StoreLogs([]*raft.Log{{Index: 1, Term: 1, Type: raft.LogCommand}}); err == nil {
		t.Fatal("append to a read-only raft.db succeeded")
	}
	e := failed.Load()
	if e == nil {
		t.Fatal("failed append not recorded")
	}
	ro.Close()

	tc := newTestCluster(t, 3)
	f := followerNotBootstrap(tc)
	tc.waitReady(f)
	tc.node(f).node.appendErr.Store(e)
	if rd := tc.node(f).readiness(); rd.Ready || !strings.Contains(rd.Reason, "cannot append") {
		t.Fatalf("readiness with failing appends = %+v", rd)
	}
	// The next successful append clears it.
	commitOne(t, tc, "append")
	tc.waitReady(f)
}

// commitOne commits one Acquire (of a new agent, named by id) through the
// leader.
func commitOne(t *testing.T, tc *testCluster, id string) {
	t.Helper()
	alloc, _ := tc.clients(tc.leader())
	if _, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: id, RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", id, 1)}}); err != nil {
		t.Fatal(err)
	}
}

// TestReadyzIdle: a group with nothing due commits no entry, and its
// followers stay ready however long ago their newest entry was appended
// (readiness needs no periodic entries: see followerLag).
func TestReadyzIdle(t *testing.T) {
	tc := newTestCluster(t, 3, func(i int, c *Config) { c.ReadyMaxLag = 500 * time.Millisecond })
	// The leader's duties (registration, initial rules) are done once
	// every node is a member.
	tc.waitMembers(3)
	inStableTerm(t, tc, func(l int) string {
		f := 1
		if l == 1 {
			f = 2
		}
		last := tc.node(l).node.raft.LastIndex()
		if !until(5*time.Second, func() bool {
			n := tc.node(l).node.raft.LastIndex()
			settled := n == last
			last = n
			// Raft's applied index: a new term's first entry is a no-op
			// the state machine never sees.
			return settled && tc.node(f).readiness().AppliedIndex == n
		}) {
			return fmt.Sprintf("the leader's log did not settle in 5 s (last index %d)", last)
		}
		for end := time.Now().Add(4 * tc.node(f).maxLag()); time.Now().Before(end); {
			if rd := tc.node(f).readiness(); !rd.Ready {
				return fmt.Sprintf("idle follower unready: %+v", rd)
			}
			time.Sleep(20 * time.Millisecond) // sampling a condition that must hold throughout
		}
		if n := tc.node(l).node.raft.LastIndex(); n != last {
			return fmt.Sprintf("idle leader appended entries %d..%d", last+1, n)
		}
		return ""
	})
}

// inStableTerm runs check(leader) until it runs through in a term no
// election ended: the idle properties the readiness tests assert are
// about a group whose leadership stays put, and on a starved machine a
// missed heartbeat deadline starts an election, which appends entries and
// leaves followers without a leader for a moment for reasons of its own.
// check returns "" when the property held, else what failed. A failure in
// a term that held, with every node's leader unchanged throughout, fails
// the test; otherwise the check runs again, for up to 45 s.
func inStableTerm(t *testing.T, tc *testCluster, check func(l int) string) {
	t.Helper()
	deadline := time.Now().Add(45 * time.Second)
	for {
		l := tc.leader()
		term := tc.node(l).node.raft.CurrentTerm()
		// Every node follows l (one that lost its leader may still be
		// asking for votes).
		until(5*time.Second, func() bool {
			for i := range tc.nodes {
				if s := tc.node(i); s != nil {
					if _, id := s.node.raft.LeaderWithID(); string(id) != tc.cfgs[l].NodeID {
						return false
					}
				}
			}
			return true
		})
		// A follower whose heartbeat deadline passes forgets its leader
		// and asks for votes; refused, it keeps the term. Its leader
		// observations tell.
		var changes atomic.Int64
		var obs []func()
		for i := range tc.nodes {
			if s := tc.node(i); s != nil {
				o := raft.NewObserver(nil, false, func(o *raft.Observation) bool {
					if _, ok := o.Data.(raft.LeaderObservation); ok {
						changes.Add(1)
					}
					return false
				})
				s.node.raft.RegisterObserver(o)
				obs = append(obs, func() { s.node.raft.DeregisterObserver(o) })
			}
		}
		msg := check(l)
		for _, deregister := range obs {
			deregister()
		}
		moved := !tc.node(l).IsLeader() || changes.Load() != 0
		for i := range tc.nodes {
			if s := tc.node(i); s != nil && s.node.raft.CurrentTerm() != term {
				moved = true
			}
		}
		switch {
		case !moved && msg != "":
			t.Fatal(msg)
		case !moved:
			return
		case time.Now().After(deadline):
			t.Fatalf("an election in every attempt for 45 s; the last attempt (term %d): %q", term, msg)
		}
		t.Logf("an election ended term %d during the check (%q); again", term, msg)
	}
}

// blockedLog is a log store whose appends wait for release.
type blockedLog struct {
	raft.LogStore
	release chan struct{}
}

func (b *blockedLog) StoreLogs([]*raft.Log) error { <-b.release; return nil }

// TestReadyzAppendHung: an append that hangs (a stalled disk) is recorded
// while it runs, and a follower whose append has run longer than the lag
// bound is unready (it still answers heartbeats, so its leader contact
// looks fresh), and ready again once the append returns.
func TestReadyzAppendHung(t *testing.T) {
	var failed atomic.Pointer[appendFailure]
	var running atomic.Int64
	w := &watchedLog{LogStore: &blockedLog{release: make(chan struct{})}, failed: &failed, running: &running}
	done := make(chan error, 1)
	go func() { done <- w.StoreLogs([]*raft.Log{{Index: 1, Term: 1, Type: raft.LogCommand}}) }()
	waitFor(t, 5*time.Second, "the running append recorded", func() bool { return running.Load() != 0 })
	close(w.LogStore.(*blockedLog).release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if running.Load() != 0 {
		t.Fatal("finished append still recorded as running")
	}

	tc := newTestCluster(t, 3, func(i int, c *Config) { c.ReadyMaxLag = 300 * time.Millisecond })
	f := followerNotBootstrap(tc)
	tc.waitReady(f)
	n := tc.node(f)
	n.node.appendStart.Store(time.Now().Add(-time.Second).UnixNano())
	if rd := n.readiness(); rd.Ready || !strings.Contains(rd.Reason, "append has been running") {
		t.Fatalf("readiness with an append running for 1 s = %+v", rd)
	}
	n.node.appendStart.Store(0)
	tc.waitReady(f)
}

// TestReadyzIdleAfterBarrier: raft commits barrier and no-op entries
// without handing them to the state machine. A follower whose newest
// committed entry is one of them, in a group with nothing more to append,
// is caught up and stays ready: after a Barrier on the leader, and after a
// leadership transfer (the new leader's no-op and barrier).
func TestReadyzIdleAfterBarrier(t *testing.T) {
	tc := newTestCluster(t, 3, func(i int, c *Config) { c.ReadyMaxLag = 300 * time.Millisecond })
	tc.waitMembers(3)
	// stayReady: once every follower is ready, each stays ready for three
	// lag bounds.
	stayReady := func(l int) string {
		for i := range tc.nodes {
			if i != l {
				tc.waitReady(i)
			}
		}
		for end := time.Now().Add(3 * tc.node(l).maxLag()); time.Now().Before(end); {
			for i := range tc.nodes {
				if rd := tc.node(i).readiness(); i != l && !rd.Ready {
					return fmt.Sprintf("idle follower %d unready: %+v", i, rd)
				}
			}
			time.Sleep(20 * time.Millisecond) // sampling a condition that must hold throughout
		}
		return ""
	}
	inStableTerm(t, tc, func(l int) string {
		if err := tc.node(l).node.raft.Barrier(5 * time.Second).Error(); err != nil {
			return fmt.Sprintf("barrier: %v", err)
		}
		if msg := stayReady(l); msg != "" {
			return "after a barrier: " + msg
		}
		return ""
	})
	l := tc.leader()
	if err := tc.node(l).node.raft.LeadershipTransfer().Error(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "a new leader", func() bool { return !tc.node(l).IsLeader() && tc.leader() != l })
	inStableTerm(t, tc, func(l int) string {
		if msg := stayReady(l); msg != "" {
			return "after a leadership transfer: " + msg
		}
		return ""
	})
}
