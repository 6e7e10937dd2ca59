package agent

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

const redisRules = `
domain: test
descriptors:
  - key: hot
    rate_limit:
      name: hot
      unit: hour
      requests_per_unit: 2
      backend: redis
  - key: hotc
    rate_limit:
      name: hotc
      unit: hour
      requests_per_unit: 2
      backend: redis
      failure_mode: closed
`

// fakeRemote is a RemoteLimiter with one bucket per key, or failing.
type fakeRemote struct {
	mu     sync.Mutex
	fail   bool
	states map[string]*bucket.State
	calls  int
}

func (f *fakeRemote) AllowN(_ context.Context, r *rules.Rule, key []byte, n int64) (bucket.Result, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.fail {
		return bucket.Result{}, errors.New("redis down")
	}
	if f.states == nil {
		f.states = map[string]*bucket.State{}
	}
	st := f.states[string(key)]
	if st == nil {
		st = &bucket.State{}
		f.states[string(key)] = st
	}
	return r.Limit.AllowN(st, time.Unix(0, 0).Add(time.Hour).UnixNano(), n), nil
}

// TestRedisSeam: rules with the redis backend go to Config.Redis; when it
// fails, failure_mode open falls back to the local bucket and closed denies.
func TestRedisSeam(t *testing.T) {
	remote := &fakeRemote{}
	a := newAgent(t, Config{Rules: mustCompile(t, 1, redisRules), Redis: remote})
	d := desc("hot", "k")
	for i := range 2 {
		if got := check(t, a, d); !got.Allowed || got.Source != SourceRedis {
			t.Fatalf("check %d: %+v, want allowed by redis", i, got)
		}
	}
	if got := check(t, a, d); got.Allowed || got.Source != SourceRedis {
		t.Fatalf("third: %+v, want denied by redis", got)
	}
	if _, ok := remote.states["test:hot=k"]; !ok || remote.calls != 3 {
		t.Fatalf("remote saw keys %v in %d calls, want test:hot=k in 3", remote.states, remote.calls)
	}
	remote.mu.Lock()
	remote.fail = true
	remote.mu.Unlock()
	if got := check(t, a, d); !got.Allowed || got.Source != SourceFallback {
		t.Fatalf("redis down, open: %+v, want allowed by the local fallback", got)
	}
	if got := check(t, a, desc("hotc", "k")); got.Allowed {
		t.Fatalf("redis down, closed: %+v, want denied", got)
	}

	// Without Config.Redis the redis backend is a local bucket.
	b := newAgent(t, Config{Rules: mustCompile(t, 1, redisRules)})
	if got := check(t, b, d); !got.Allowed || got.Source != SourceLocal {
		t.Fatalf("no Redis: %+v, want local", got)
	}
}

// TestSecondAllocatorAddress: the first address is dead; the agent rotates
// to the next one and leases from it.
func TestSecondAllocatorAddress(t *testing.T) {
	fake := newFake(t, func() int64 { return time.Now().UnixNano() }, testRules)
	srv := serveFake(t, fake)
	dead := newFake(t, func() int64 { return 0 }, testRules)
	deadSrv := serveFake(t, dead)
	deadSrv.stop()
	cfg := fastConfig(deadSrv.addr, srv.addr)
	cfg.Rules = mustCompile(t, 0, testRules)
	a := newAgent(t, cfg)
	d := desc("tier", "free", "route", "/z", "user", "u")
	waitFor(t, 10*time.Second, "a lease through the second address", func() bool {
		return check(t, a, d).Source == SourceLease
	})
}

// refundingRemote is a fakeRemote that can give tokens back.
type refundingRemote struct{ fakeRemote }

func (f *refundingRemote) GiveBack(_ context.Context, r *rules.Rule, key []byte, n int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if st := f.states[string(key)]; st != nil {
		r.Limit.GiveBack(st, time.Unix(0, 0).Add(time.Hour).UnixNano(), n)
	}
	return nil
}

// TestRedisRefundOnDeny: a request whose Redis-backed descriptor took a
// token but whose other descriptor denied gives the token back when the
// backend is a RemoteRefunder, as leased and local tokens are.
func TestRedisRefundOnDeny(t *testing.T) {
	const yaml = redisRules + `
  - key: blocked
    rate_limit:
      name: blocked
      unit: hour
      requests_per_unit: 0
`
	remote := &refundingRemote{}
	a := newAgent(t, Config{Rules: mustCompile(t, 1, yaml), Redis: remote})
	for i := range 3 {
		if got := check(t, a, desc("hot", "k"), desc("blocked", "x")); got.Allowed || got.Policy != "blocked" {
			t.Fatalf("check %d: %+v, want denied by blocked", i, got)
		}
	}
	// The two tokens of hot=k are all still there.
	for i := range 2 {
		if got := check(t, a, desc("hot", "k")); !got.Allowed {
			t.Fatalf("hot check %d after refunds: %+v, want allowed", i, got)
		}
	}
}

// redisShareRules: 8/hour on the Redis backend, a share of 2 with 4 live
// gateways.
const redisShareRules = `
domain: test
descriptors:
  - key: hot
    rate_limit: {name: hot, unit: hour, requests_per_unit: 8, backend: redis}
`

// TestRedisFailOpenTakesShare: with the Redis backend failing, an agent
// that talks to an allocator decides a failure_mode open rule from its
// share of the limit (R/N, burst ⌈B/N⌉ with N live gateways), as the
// allocator's own fallback does, so the fleet admits no more than the
// limit; a standalone agent, which knows no N, takes the whole limit.
// 8/hour with 4 live gateways: 2 here, then denied for the next token's
// 30 minutes.
func TestRedisFailOpenTakesShare(t *testing.T) {
	remote := &fakeRemote{fail: true}
	s := newSteppedWith(t, func(c *Config) { c.Redis = remote }, redisShareRules)
	s.liveAgents.Store(4)
	d := desc("hot", "k")
	for i := range 2 {
		if got := check(t, s.Agent, d); !got.Allowed || got.Source != SourceFallback {
			t.Fatalf("check %d: %+v, want allowed from this gateway's share", i+1, got)
		}
	}
	if got := check(t, s.Agent, d); got.Allowed || got.Source != SourceFallback || got.RetryAfter != 30*time.Minute {
		t.Fatalf("third: %+v, want denied by the share (2 of 8/hour) for 30m", got)
	}

	alone := newAgent(t, Config{Rules: mustCompile(t, 1, redisShareRules), Redis: &fakeRemote{fail: true}})
	for i := range 8 {
		if got := check(t, alone, d); !got.Allowed || got.Source != SourceFallback {
			t.Fatalf("standalone check %d: %+v, want allowed from the whole limit", i+1, got)
		}
	}
	if got := check(t, alone, d); got.Allowed {
		t.Fatalf("standalone ninth: %+v, want denied", got)
	}
}

// TestRedisOnlyGatewayLearnsLiveAgents: a gateway that talks to an
// allocator but whose traffic is all on Redis rules has no key to lease,
// so no call to make; it sends an empty Acquire every presenceEvery, stays
// counted among the live gateways and learns their number, so failing open
// it decides from its R/N share (8/hour with 4 live gateways: 2).
func TestRedisOnlyGatewayLearnsLiveAgents(t *testing.T) {
	remote := &fakeRemote{}
	s := newSteppedWith(t, func(c *Config) { c.Redis = remote }, redisShareRules)
	s.fake.with(func(f *fakeAllocator) { f.live = 4 })
	d := desc("hot", "k")
	check(t, s.Agent, d)
	s.step()
	if got := s.liveAgents.Load(); got != 4 {
		t.Fatalf("after the first tick: %d live gateways learned, want 4", got)
	}
	calls, _, _ := s.fake.counts()
	s.clock.advance(presenceEvery - time.Second)
	s.step()
	if c, _, _ := s.fake.counts(); c != calls {
		t.Fatalf("%d calls before presenceEvery passed, want none", c-calls)
	}
	s.fake.with(func(f *fakeAllocator) { f.live = 5 })
	s.clock.advance(time.Second)
	s.step()
	if c, _, _ := s.fake.counts(); c != calls+1 || s.liveAgents.Load() != 5 {
		t.Fatalf("after presenceEvery: %d calls, %d live gateways; want one call, 5", c-calls, s.liveAgents.Load())
	}
	s.fake.with(func(f *fakeAllocator) { f.live = 4 })
	s.clock.advance(presenceEvery)
	s.step()
	remote.mu.Lock()
	remote.fail = true
	remote.mu.Unlock()
	for i := range 2 {
		if got := check(t, s.Agent, d); !got.Allowed || got.Source != SourceFallback {
			t.Fatalf("Redis down, check %d: %+v, want allowed from the share", i+1, got)
		}
	}
	if got := check(t, s.Agent, d); got.Allowed {
		t.Fatalf("Redis down, third: %+v, want denied by the share (2 of 8/hour)", got)
	}
}
