package allocator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// fakeRaft answers batches like the state machine would, recording them.
type fakeRaft struct {
	entered atomic.Int32 // propose calls started
	mu      sync.Mutex   // guards batches
	batches [][]*allotv1.AcquireRequest
	gate    chan struct{} // when non-nil, each propose waits for a token
	err     error
}

func (f *fakeRaft) propose(data []byte) (any, error) {
	f.entered.Add(1)
	if f.gate != nil {
		<-f.gate
	}
	var reqs []*allotv1.AcquireRequest
	if state.IsCompactEntry(data) {
		_, rs, err := state.DecodeAcquireEntry(data)
		if err != nil {
			return nil, err
		}
		reqs = rs
	} else {
		cmd := new(allotv1.Command)
		if err := proto.Unmarshal(data, cmd); err != nil {
			return nil, err
		}
		reqs = cmd.GetAcquire().GetRequests()
	}
	f.mu.Lock()
	f.batches = append(f.batches, reqs)
	f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	res := &state.AcquireBatchResult{Responses: make([]*allotv1.AcquireResponse, len(reqs)), Errs: make([]error, len(reqs))}
	for i, r := range reqs {
		if r.GetAgentId() == "bad" {
			res.Errs[i] = state.ErrStaleRequest
			res.Responses[i] = nil
			continue
		}
		res.Responses[i] = &allotv1.AcquireResponse{RulesVersion: r.GetRequestId()}
	}
	return res, nil
}

func (f *fakeRaft) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.batches)
}

func TestBatcherDrainsQueueIntoOneEntry(t *testing.T) {
	fr := &fakeRaft{gate: make(chan struct{})}
	b := newBatcher(fr.propose, func() int64 { return 1 }, 20000, 2<<20, 1)
	b.start()
	defer b.close()

	// The first call blocks in propose; the next 50 queue behind it and
	// must all go in the second entry.
	var wg sync.WaitGroup
	results := make([]*allotv1.AcquireResponse, 51)
	errs := make([]error, 51)
	call := func(i int) {
		defer wg.Done()
		agent := fmt.Sprintf("a%d", i)
		if i == 7 {
			agent = "bad"
		}
		results[i], errs[i] = b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: agent, RequestId: uint64(i + 1)})
	}
	wg.Add(1)
	go call(0)
	waitFor(t, 5*time.Second, "first batch proposed", func() bool { return fr.entered.Load() == 1 })
	for i := 1; i <= 50; i++ {
		wg.Add(1)
		go call(i)
	}
	waitFor(t, 5*time.Second, "50 calls queued", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return len(b.queue) == 50
	})
	fr.gate <- struct{}{}
	fr.gate <- struct{}{}
	wg.Wait()
	if n := fr.count(); n != 2 {
		t.Fatalf("%d entries, want 2", n)
	}
	if len(fr.batches[1]) != 50 {
		t.Errorf("second entry has %d requests, want 50", len(fr.batches[1]))
	}
	for i := range 51 {
		if i == 7 {
			if !errors.Is(errs[i], state.ErrStaleRequest) {
				t.Errorf("call 7 error = %v, want ErrStaleRequest", errs[i])
			}
			continue
		}
		if errs[i] != nil || results[i].GetRulesVersion() != uint64(i+1) {
			t.Errorf("call %d = %v, %v; want its own response", i, results[i], errs[i])
		}
	}
}

func TestBatcherSplitsAtMaxKeys(t *testing.T) {
	fr := &fakeRaft{gate: make(chan struct{})}
	b := newBatcher(fr.propose, func() int64 { return 1 }, 10, 1<<20, 1)
	b.start()
	defer b.close()
	req := func(i, keys int) *allotv1.AcquireRequest {
		r := &allotv1.AcquireRequest{AgentId: fmt.Sprint(i), RequestId: 1}
		for range keys {
			r.Keys = append(r.Keys, key("user", "x", 1))
		}
		return r
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _, _ = b.submit(context.Background(), req(0, 1)) }()
	waitFor(t, 5*time.Second, "first batch proposed", func() bool { return fr.entered.Load() == 1 })
	// 4 calls of 4 keys: 2 per entry (8 ≤ 10 < 12). One of 30 keys goes alone.
	for i := 1; i <= 4; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); _, _ = b.submit(context.Background(), req(i, 4)) }()
	}
	waitFor(t, 5*time.Second, "queued", func() bool { b.mu.Lock(); defer b.mu.Unlock(); return len(b.queue) == 4 })
	wg.Add(1)
	go func() { defer wg.Done(); _, _ = b.submit(context.Background(), req(5, 30)) }()
	waitFor(t, 5*time.Second, "queued", func() bool { b.mu.Lock(); defer b.mu.Unlock(); return len(b.queue) == 5 })
	close(fr.gate)
	wg.Wait()
	var sizes []int
	for _, bt := range fr.batches {
		sizes = append(sizes, len(bt))
	}
	if got := fmt.Sprint(sizes); got != "[1 2 2 1]" {
		t.Errorf("requests per entry = %s, want [1 2 2 1]", got)
	}
}

func TestBatcherCloseFailsQueuedAndErrorsReachEveryone(t *testing.T) {
	fr := &fakeRaft{err: raft.ErrNotLeader}
	b := newBatcher(fr.propose, func() int64 { return 1 }, 100, 1<<20, 2)
	b.start()
	_, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1})
	if !errors.Is(err, raft.ErrNotLeader) {
		t.Errorf("submit error = %v, want ErrNotLeader", err)
	}
	b.close()
	b.close()
	if _, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: "a", RequestId: 2}); !errors.Is(err, errShutdown) {
		t.Errorf("submit after close = %v, want errShutdown", err)
	}
	// A caller whose context ends is told so at once.
	fr2 := &fakeRaft{gate: make(chan struct{})}
	b2 := newBatcher(fr2.propose, func() int64 { return 1 }, 100, 1<<20, 1)
	b2.start()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := b2.submit(ctx, &allotv1.AcquireRequest{AgentId: "a", RequestId: 1}); !errors.Is(err, context.Canceled) {
		t.Errorf("canceled submit = %v", err)
	}
	close(fr2.gate)
	b2.close()
}

// TestBatcherLinger: the first call is proposed at once; calls that come
// within the linger of it wait and share the next entry; close during the
// wait fails them with errShutdown, without proposing.
func TestBatcherLinger(t *testing.T) {
	fr := &fakeRaft{}
	b := newBatcher(fr.propose, func() int64 { return 1 }, 100, 1<<20, 2)
	b.linger = time.Hour
	b.start()
	if _, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1}); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	for i := range 2 {
		go func() {
			_, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: fmt.Sprint("b", i), RequestId: 1})
			errs <- err
		}()
	}
	waitFor(t, 5*time.Second, "2 calls queued", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return len(b.queue) == 2
	})
	b.close()
	for range 2 {
		if err := <-errs; !errors.Is(err, errShutdown) {
			t.Errorf("lingering call = %v, want errShutdown", err)
		}
	}
	if n := fr.count(); n != 1 {
		t.Errorf("%d entries proposed, want 1 (the lingering calls were not)", n)
	}

	fr = &fakeRaft{}
	b = newBatcher(fr.propose, func() int64 { return 1 }, 100, 1<<20, 2)
	b.linger = time.Second
	b.start()
	defer b.close()
	if _, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: fmt.Sprint("c", i), RequestId: 1}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := fr.count(); n != 2 || len(fr.batches[1]) != 3 {
		t.Errorf("%d entries, the second of %d calls; want 2, the second of 3", n, len(fr.batches[n-1]))
	}
}

// TestBatcherFill: a batch short of fillKeys keys waits, under a key rate
// that fills it within fillWait, for the next call and shares its entry
// with it; a call of fillKeys keys goes at once; close during the wait
// fails the call with errShutdown, without proposing.
func TestBatcherFill(t *testing.T) {
	keys := func(n int) []*allotv1.KeyAcquire {
		out := make([]*allotv1.KeyAcquire, n)
		for i := range out {
			out[i] = key("user", fmt.Sprint(i), 1)
		}
		return out
	}
	fr := &fakeRaft{}
	b := newBatcher(fr.propose, func() int64 { return 1 }, 1000, 1<<20, 2)
	b.fillKeys, b.fillWait = 20, time.Hour
	b.start()
	defer b.close()
	// 20 keys: full on its own, so it does not wait the hour.
	if _, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: keys(20)}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := b.submit(context.Background(), &allotv1.AcquireRequest{AgentId: fmt.Sprint("b", i), RequestId: 1, Keys: keys(10)}); err != nil {
				t.Error(err)
			}
		}()
		if i == 0 {
			waitFor(t, 5*time.Second, "first short call queued", func() bool {
				b.mu.Lock()
				defer b.mu.Unlock()
				return len(b.queue) == 1
			})
		}
	}
	wg.Wait()
	if n := fr.count(); n != 2 || len(fr.batches[1]) != 2 {
		t.Errorf("%d entries, the last of %d calls; want 2, the last of 2", n, len(fr.batches[n-1]))
	}

	fr = &fakeRaft{}
	b2 := newBatcher(fr.propose, func() int64 { return 1 }, 1000, 1<<20, 2)
	b2.fillKeys, b2.fillWait = 20, time.Hour
	b2.start()
	errs := make(chan error, 1)
	go func() {
		_, err := b2.submit(context.Background(), &allotv1.AcquireRequest{AgentId: "c", RequestId: 1, Keys: keys(10)})
		errs <- err
	}()
	waitFor(t, 5*time.Second, "short call queued", func() bool {
		b2.mu.Lock()
		defer b2.mu.Unlock()
		return len(b2.queue) == 1
	})
	b2.close()
	if err := <-errs; !errors.Is(err, errShutdown) {
		t.Errorf("waiting call = %v, want errShutdown", err)
	}
	if n := fr.count(); n != 0 {
		t.Errorf("%d entries proposed, want 0", n)
	}
}

// TestKeyRate: the decayed count reads as the recent rate, and fades with
// a time constant of keyRateTau.
func TestKeyRate(t *testing.T) {
	var r keyRate
	t0 := time.Unix(1000, 0)
	for i := range 1000 {
		r.add(t0.Add(time.Duration(i)*time.Millisecond), 200) // 200,000 keys/s for 1 s
	}
	end := t0.Add(999 * time.Millisecond)
	if got := r.perSecond(end); got < 190000 || got > 210000 {
		t.Errorf("rate after 1 s at 200,000 keys/s = %.0f", got)
	}
	if got, want := r.perSecond(end.Add(keyRateTau)), r.perSecond(end)/math.E; math.Abs(got-want) > 1 {
		t.Errorf("rate one time constant later = %.0f, want %.0f", got, want)
	}
}

func TestToStatusMapping(t *testing.T) {
	hint := leaderHint{id: "n1", addr: "127.0.0.1:1"}
	cases := []struct {
		err    error
		code   codes.Code
		reason string
	}{
		{raft.ErrNotLeader, codes.Unavailable, ReasonNotLeader},
		{fmt.Errorf("x: %w", raft.ErrLeadershipLost), codes.Unavailable, ReasonLeadershipLost},
		{raft.ErrRaftShutdown, codes.Unavailable, ReasonLeadershipLost},
		{errShutdown, codes.Unavailable, ReasonShuttingDown},
		{fmt.Errorf("%w: bad", state.ErrInvalid), codes.InvalidArgument, ""},
		{state.ErrStaleRequest, codes.FailedPrecondition, ""},
		{state.ErrFailedPrecondition, codes.FailedPrecondition, ""},
		{context.DeadlineExceeded, codes.DeadlineExceeded, ""},
		{errors.New("boom"), codes.Internal, ""},
	}
	for _, c := range cases {
		err := toStatus(c.err, hint)
		if status.Code(err) != c.code || statusReason(err) != c.reason {
			t.Errorf("toStatus(%v) = %v (reason %q), want %v %q", c.err, err, statusReason(err), c.code, c.reason)
		}
	}
	st, _ := status.FromError(toStatus(raft.ErrNotLeader, hint))
	if !strings.Contains(fmt.Sprint(st.Details()), "127.0.0.1:1") {
		t.Errorf("no leader hint in %v", st.Details())
	}
	if !retryable(toStatus(raft.ErrNotLeader, hint), false) || retryable(toStatus(raft.ErrLeadershipLost, hint), false) ||
		!retryable(toStatus(raft.ErrLeadershipLost, hint), true) {
		t.Error("retryable disagrees with the reasons")
	}
}

func TestFSMPanicsOnUndecodableEntry(t *testing.T) {
	f := &fsm{st: state.New(state.DefaultConfig())}
	mustPanic := func(name string, data []byte) {
		t.Helper()
		defer func() {
			if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "entry 9") {
				t.Errorf("%s: recovered %v, want a panic naming entry 9", name, r)
			}
		}()
		f.Apply(&raft.Log{Index: 9, Term: 2, Type: raft.LogCommand, Data: data})
	}
	mustPanic("garbage", []byte{0xff, 0xff, 0xff})
	unknown, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: 1})
	mustPanic("no command", unknown)
	// Flagged unknown commands are skipped.
	skip, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: 1, IgnoreIfUnknown: true})
	if got := f.Apply(&raft.Log{Index: 10, Type: raft.LogCommand, Data: skip}); got != nil {
		t.Errorf("ignored command returned %v", got)
	}
}

func TestCorruptDataDir(t *testing.T) {
	t.Run("garbage raft.db", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, raftDBFile), []byte(strings.Repeat("garbage!", 2048)), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := New(testNodeConfig(t, dir))
		if err == nil || !strings.Contains(err.Error(), filepath.Join(dir, raftDBFile)) {
			t.Fatalf("New = %v, want an error naming %s", err, raftDBFile)
		}
	})
	t.Run("bad snapshot", func(t *testing.T) {
		dir := t.TempDir()
		s, err := New(testNodeConfig(t, dir))
		if err != nil {
			t.Fatal(err)
		}
		waitReady(t, s)
		if err := s.node.raft.Snapshot().Error(); err != nil {
			t.Fatal(err)
		}
		if err := s.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		snaps, _ := filepath.Glob(filepath.Join(dir, snapshotsDir, "*", "state.bin"))
		if len(snaps) == 0 {
			t.Fatal("no snapshot written")
		}
		if err := os.WriteFile(snaps[0], []byte("not a snapshot"), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err = New(testNodeConfig(t, dir))
		if err == nil || !strings.Contains(err.Error(), filepath.Dir(snaps[0])) {
			t.Fatalf("New = %v, want an error naming %s", err, filepath.Dir(snaps[0]))
		}
	})
	t.Run("snapshot that does not restore", func(t *testing.T) {
		dir := t.TempDir()
		writeSnapshot(t, dir, 5, 1, []byte("valid CRC, invalid state"))
		_, err := New(testNodeConfig(t, dir))
		if err == nil || !strings.Contains(err.Error(), "restore") || !strings.Contains(err.Error(), dir) {
			t.Fatalf("New = %v, want a restore error naming %s", err, dir)
		}
	})
	t.Run("missing snapshot", func(t *testing.T) {
		dir := t.TempDir()
		s, err := New(testNodeConfig(t, dir))
		if err != nil {
			t.Fatal(err)
		}
		waitReady(t, s)
		if err := s.node.raft.Snapshot().Error(); err != nil {
			t.Fatal(err)
		}
		_ = s.Shutdown(context.Background())
		// Compact the log as a snapshot would, then lose the snapshot.
		if err := os.RemoveAll(filepath.Join(dir, snapshotsDir)); err != nil {
			t.Fatal(err)
		}
		st, err := openBolt(filepath.Join(dir, raftDBFile))
		if err != nil {
			t.Fatal(err)
		}
		last, _ := st.LastIndex()
		if err := st.DeleteRange(1, last-1); err != nil {
			t.Fatal(err)
		}
		st.Close()
		_, err = New(testNodeConfig(t, dir))
		if err == nil || !strings.Contains(err.Error(), "no snapshot covers") {
			t.Fatalf("New = %v, want a missing-snapshot error", err)
		}
	})
}

// writeSnapshot writes a snapshot at index and term holding state into
// dir's file snapshot store, and returns the store.
func writeSnapshot(t *testing.T, dir string, index, term uint64, state []byte) *raft.FileSnapshotStore {
	t.Helper()
	store, err := raft.NewFileSnapshotStore(dir, 2, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("solo")
	sink, err := store.Create(raft.SnapshotVersionMax, index, term, raft.Configuration{Servers: []raft.Server{{ID: "solo", Address: "solo"}}}, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = sink.Write(state)
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	return store
}

// testNodeConfig is a one-node bootstrap config over TCP on free ports.
func testNodeConfig(t testing.TB, dir string) Config {
	cfg := DefaultConfig()
	cfg.NodeID = "solo"
	cfg.DataDir = dir
	cfg.GRPCAddr = "127.0.0.1:0"
	cfg.RaftAddr = "127.0.0.1:0"
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.Bootstrap = true
	cfg.InitialRules = testRuleFiles()
	cfg.Logger = testLogger(t, 0)
	return cfg
}

func waitReady(t testing.TB, s *Server) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestHTTPEndpointsAndTCP(t *testing.T) {
	s, err := New(testNodeConfig(t, t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Shutdown(context.Background())
	waitReady(t, s)
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + s.HTTPAddr() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get("/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	code, body := get("/readyz")
	var rd readiness
	if err := json.Unmarshal([]byte(body), &rd); err != nil || code != 200 || !rd.Ready || rd.LeaderID != "solo" || rd.RulesVersion != 1 {
		t.Errorf("/readyz = %d %s", code, body)
	}
	alloc, _ := dial(t, s.GRPCAddr())
	if _, err := alloc.Acquire(ctxT(t), &allotv1.AcquireRequest{AgentId: "h", RequestId: 1, Keys: []*allotv1.KeyAcquire{key("user", "h", 5)}}); err != nil {
		t.Fatal(err)
	}
	_, body = get("/metrics")
	for _, want := range []string{"allot_allocator_raft_state 2", "allot_allocator_tokens_granted_total 5",
		"allot_allocator_rules_version 1", "allot_allocator_batch_keys_count", "allot_allocator_raft_apply_seconds_bucket",
		"allot_allocator_tokens_outstanding 5", "allot_allocator_leases_expired_total 0", "allot_allocator_agents 1"} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// pprof is off without Config.Pprof (TestPprofOffByDefault).
	if code, _ := get("/debug/pprof/"); code != 404 {
		t.Errorf("/debug/pprof/ = %d, want 404", code)
	}
	if !strings.HasPrefix(s.RaftAddr(), "127.0.0.1:") || strings.HasSuffix(s.RaftAddr(), ":0") {
		t.Errorf("RaftAddr = %q, want the bound port", s.RaftAddr())
	}
}

func TestConfigValidate(t *testing.T) {
	good := DefaultConfig()
	good.NodeID, good.DataDir = "a", "/tmp/x"
	if err := good.Validate(); err != nil {
		t.Fatalf("default config invalid: %v", err)
	}
	for _, kind := range []string{LogStoreBolt, LogStoreWAL} {
		c := good
		c.LogStore = kind
		if err := c.Validate(); err != nil {
			t.Fatalf("log store %s: %v", kind, err)
		}
	}
	static := good
	static.StaticSlots = 100
	if err := static.Validate(); err != nil {
		t.Fatalf("static shares on: %v", err)
	}
	for name, mut := range map[string]func(*Config){
		"no node id":         func(c *Config) { c.NodeID = "" },
		"no data dir":        func(c *Config) { c.DataDir = "" },
		"unspecified grpc":   func(c *Config) { c.GRPCAddr = "0.0.0.0:1" },
		"bootstrap and join": func(c *Config) { c.Bootstrap, c.Join = true, "127.0.0.1:1" },
		"lease > heartbeat":  func(c *Config) { c.LeaderLeaseTimeout = time.Second },
		"refresh ≥ ttl":      func(c *Config) { c.RefreshInterval = c.LeaseTTL },
		"negative":           func(c *Config) { c.ExpireInterval = -1 },
		"static slots > max": func(c *Config) { c.StaticSlots = 1 << 16 },
		"static slots < 0":   func(c *Config) { c.StaticSlots = -1 },
		"static ttl ≥ agent": func(c *Config) { c.StaticSlots, c.StaticTTL = 4, c.AgentTTL },
		"static ttl < 0":     func(c *Config) { c.StaticTTL = -time.Second },
		"static ttl in µs":   func(c *Config) { c.StaticTTL = 1500 * time.Microsecond },
		"static groups":      func(c *Config) { c.StaticSlots, c.Groups, c.Bootstrap = 4, 2, true },
		"unknown log store":  func(c *Config) { c.LogStore = "rocksdb" },
	} {
		c := good
		mut(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate() = nil", name)
		}
	}
}

// TestBatcherProperties: whatever the arrivals and sizes, every call is
// proposed exactly once, gets its own answer, and no entry exceeds the key
// bound unless it holds a single call.
func TestBatcherProperties(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		maxKeys := rapid.IntRange(1, 40).Draw(rt, "maxKeys")
		inflight := rapid.IntRange(1, 3).Draw(rt, "inflight")
		sizes := rapid.SliceOfN(rapid.IntRange(0, 30), 1, 60).Draw(rt, "sizes")
		fr := &fakeRaft{}
		b := newBatcher(fr.propose, func() int64 { return 1 }, maxKeys, 1<<20, inflight)
		b.start()
		var wg sync.WaitGroup
		errs := make([]error, len(sizes))
		for i, n := range sizes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req := &allotv1.AcquireRequest{AgentId: fmt.Sprint("a", i), RequestId: uint64(i + 1)}
				for range n {
					req.Keys = append(req.Keys, key("user", "x", 1))
				}
				resp, err := b.submit(context.Background(), req)
				if err == nil && resp.GetRulesVersion() != uint64(i+1) {
					err = fmt.Errorf("call %d got the answer for %d", i, resp.GetRulesVersion())
				}
				errs[i] = err
			}()
		}
		wg.Wait()
		b.close()
		for i, err := range errs {
			if err != nil {
				rt.Fatalf("call %d: %v", i, err)
			}
		}
		seen := map[string]int{}
		for _, batch := range fr.batches {
			keys := 0
			for _, r := range batch {
				seen[r.GetAgentId()]++
				keys += len(r.GetKeys())
			}
			if keys > maxKeys && len(batch) > 1 {
				rt.Fatalf("entry of %d calls has %d keys > %d", len(batch), keys, maxKeys)
			}
		}
		if len(seen) != len(sizes) {
			rt.Fatalf("%d distinct calls proposed, want %d", len(seen), len(sizes))
		}
		for id, n := range seen {
			if n != 1 {
				rt.Fatalf("call %s proposed %d times", id, n)
			}
		}
	})
}
