package agent

import (
	"context"
	"log/slog"
	"os"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/allot/allot/internal/testproc"
	"github.com/allot/allot/pkg/rules"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		testproc.RemoveBuilds() // the allocator binary of the integration tests
		os.Exit(code)
	}))
}

// testRules is the rule set most tests use (domain "test").
const testRules = `
domain: test
descriptors:
  - key: api_key
    rate_limit:
      name: per_key
      unit: hour
      requests_per_unit: 50
      burst: 50
  - key: small
    rate_limit:
      name: small
      unit: hour
      requests_per_unit: 3
      burst: 3
  - key: tier
    value: free
    descriptors:
      - key: route
        descriptors:
          - key: user
            rate_limit:
              name: deep
              unit: second
              requests_per_unit: 1000000000
              burst: 1000000000
  - key: shadow
    shadow_mode: true
    rate_limit:
      name: shadowed
      unit: hour
      requests_per_unit: 1
  - key: closed
    rate_limit:
      name: closed
      unit: hour
      requests_per_unit: 10
      failure_mode: closed
  - key: local
    rate_limit:
      name: local
      unit: hour
      requests_per_unit: 5
      backend: local
  - key: ip
    rate_limit:
      name: ip
      unit: hour
      requests_per_unit: 2
  - key: vip
    value: yes
    rate_limit:
      name: vip
      unit: hour
      requests_per_unit: 100
      replaces:
        - name: ip
  - key: free
    rate_limit:
      unlimited: true
  - key: path
    value: /api/*
    share_threshold: true
    rate_limit:
      name: shared
      unit: hour
      requests_per_unit: 3
  - key: rate
    rate_limit:
      name: rate
      unit: second
      requests_per_unit: 100
      burst: 10
`

// fakeClock is a settable Unix-nanosecond clock.
type fakeClock struct{ ns atomic.Int64 }

func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	return c
}

func (c *fakeClock) now() int64              { return c.ns.Load() }
func (c *fakeClock) advance(d time.Duration) { c.ns.Add(int64(d)) }

func mustCompile(t testing.TB, version uint64, yamls ...string) *rules.Set {
	t.Helper()
	files := make([]rules.File, len(yamls))
	for i, y := range yamls {
		files[i] = rules.File{Name: "test.yaml", Source: []byte(y)}
	}
	s, err := rules.Compile(version, files)
	if err != nil {
		t.Fatalf("compile: %v", err)
	}
	return s
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}

// newAgent builds an agent and closes it at the end of the test.
func newAgent(t testing.TB, cfg Config) *Agent {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	a, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = a.Close(ctx)
	})
	return a
}

// steppedAgent is an agent against a fake allocator with a fake clock and
// no refill goroutine: the test calls step to run one refill tick.
type steppedAgent struct {
	*Agent
	clock *fakeClock
	fake  *fakeAllocator
	srv   *fakeServer
}

func newStepped(t testing.TB, yamls ...string) *steppedAgent {
	t.Helper()
	return newSteppedWith(t, nil, yamls...)
}

// newSteppedWith is newStepped with set applied to its configuration.
func newSteppedWith(t testing.TB, set func(*Config), yamls ...string) *steppedAgent {
	t.Helper()
	if len(yamls) == 0 {
		yamls = []string{testRules}
	}
	clock := newFakeClock()
	fake := newFake(t, clock.now, yamls...)
	srv := serveFake(t, fake)
	cfg := DefaultConfig()
	cfg.Allocators = []string{srv.addr}
	cfg.Now = clock.now
	cfg.Rules = mustCompile(t, 0, yamls...)
	cfg.CallTimeout = 5 * time.Second // a slow CI machine must not fail a call
	cfg.manual = true
	if set != nil {
		set(&cfg)
	}
	s := &steppedAgent{Agent: newAgent(t, cfg), clock: clock, fake: fake, srv: srv}
	return s
}

// step runs one refill tick.
func (s *steppedAgent) step() { s.refillOnce(context.Background()) }

func desc(kv ...string) Descriptor {
	d := Descriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, rules.Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

func check(t testing.TB, a *Agent, descs ...Descriptor) Decision {
	t.Helper()
	d, err := a.Check(context.Background(), "test", descs, 0)
	if err != nil {
		t.Fatalf("Check: %v", err)
	}
	return d
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// keyOf is the key state for descriptor d (nil when not tracked).
func keyOf(t testing.TB, a *Agent, d Descriptor) *keyState {
	t.Helper()
	set := a.rules.Load()
	r := set.Match("test", d.Entries)
	if r == nil {
		t.Fatalf("no rule for %v", d.Entries)
	}
	h := a.keys.keyHash(r, "test", d.Entries)
	sh := a.keys.shard(h)
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	return sh.lookupRLocked(h, r, "test", d.Entries)
}

// testutilGauge reads the fallback gauge.
func testutilGauge(m *metrics) float64 {
	var out dto.Metric
	if err := m.fallback.Write(&out); err != nil {
		panic(err)
	}
	return out.GetGauge().GetValue()
}

type dtoCounter struct{}

func (dtoCounter) read(c interface{ Write(*dto.Metric) error }) float64 {
	var out dto.Metric
	if err := c.Write(&out); err != nil {
		panic(err)
	}
	return out.GetCounter().GetValue()
}

// checkUntil checks descs (hits 1) on a until stop is closed, handing each
// decision to seen; it ends early at a check's error (reported) or when
// seen returns false.
func checkUntil(t testing.TB, a *Agent, stop <-chan struct{}, descs []Descriptor, seen func(Decision) bool) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		got, err := a.Check(context.Background(), "test", descs, 1)
		if err != nil {
			t.Error(err)
			return
		}
		if !seen(got) {
			return
		}
	}
}
