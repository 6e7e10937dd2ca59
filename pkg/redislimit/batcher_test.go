package redislimit

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// gatedStore holds the next call of op at a gate, once armed: it signals
// entered and waits for release.
type gatedStore struct {
	store
	op      op
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func gate(b *Backend, o op) *gatedStore {
	g := &gatedStore{store: b.st, op: o, entered: make(chan struct{}, 1), release: make(chan struct{})}
	b.st = g
	return g
}

func (s *gatedStore) do(ctx context.Context, c *call) (outcome, error) {
	if c.op == s.op && s.armed.CompareAndSwap(true, false) {
		s.entered <- struct{}{}
		<-s.release
	}
	return s.store.do(ctx, c)
}

// takeLog records the tokens each take on a store gave, and when.
type takeLog struct {
	store
	mu    sync.Mutex // guards takes
	takes []struct{ at, n int64 }
}

func (s *takeLog) do(ctx context.Context, c *call) (outcome, error) {
	o, err := s.store.do(ctx, c)
	if err == nil && c.op == opTake {
		s.mu.Lock()
		s.takes = append(s.takes, struct{ at, n int64 }{c.now, o.taken})
		s.mu.Unlock()
	}
	return o, err
}

// since returns the tokens taken at instants in (from, to].
func (s *takeLog) since(from, to int64) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	for _, tk := range s.takes {
		if tk.at > from && tk.at <= to {
			n += tk.n
		}
	}
	return n
}

// holdingOf returns bt's holding of key (nil if none).
func holdingOf(bt *Batcher, key string) *holding {
	sh := &bt.shards[xxh64(key)%batchShards]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.m[key]
}

// batcherBackends runs test against two backends that share one store
// (two agents): in memory, and on a redis-server.
func batcherBackends(t *testing.T, test func(t *testing.T, mk func(mutate func(*Config)) *Backend)) {
	t.Run("inmem", func(t *testing.T) {
		st := newMemStore()
		test(t, func(mutate func(*Config)) *Backend {
			b := newInmem(t, mutate)
			b.st = st
			return b
		})
	})
	t.Run("redis", func(t *testing.T) {
		srv := startRedis(t)
		test(t, func(mutate func(*Config)) *Backend { return newTestBackend(t, mutate, srv.addr()) })
	})
}

// manualBatcher returns a Batcher on b with default settings and no
// background sweep (the tests drive time), closed at cleanup.
func manualBatcher(t *testing.T, b *Backend) (*Batcher, BatchConfig) {
	t.Helper()
	cfg := DefaultBatchConfig()
	cfg.Sweep = time.Hour
	bt, err := NewBatcher(b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = bt.Close(bg) })
	return bt, cfg
}

// TestRedisBatcherPromotionEnd: a holding that moved to a sub-key when the
// key was promoted goes back to the key when the promotion ends, so the key
// has one budget at every instant, and every interval admits at most the
// documented B + R·(T + hold) across the promotion's start and end. Agents
// 0–7 check the key from the start; it is promoted at 0.5 s for 1 s; agent 8
// first checks it at 1.5 s.
func TestRedisBatcherPromotionEnd(t *testing.T) {
	batcherBackends(t, func(t *testing.T, mk func(func(*Config)) *Backend) {
		var clock atomic.Int64
		clock.Store(base)
		lim := mustLimit(t, bucket.TokenBucket, 100, time.Second, 100)
		var bts []*Batcher
		var cfg BatchConfig
		for range 9 {
			// TTLSlack: Redis expires keys in real time, which this test's
			// clock outruns.
			var bt *Batcher
			bt, cfg = manualBatcher(t, mk(func(c *Config) { c.Now, c.TTLSlack = clock.Load, time.Minute }))
			bts = append(bts, bt)
		}
		const step = 250 * time.Microsecond
		const steps = 12000 // 3 s; each agent offers 1 per step
		promoteAt, joinAt := 2000, 6000
		admitted := make([]int64, steps+1) // admitted[i]: in steps before i
		for i := range steps {
			now := base + int64(i)*int64(step)
			clock.Store(now)
			if i == promoteAt {
				if _, _, err := bts[0].b.Promote(bg, "hot", lim, 8, now, time.Second); err != nil {
					t.Fatal(err)
				}
			}
			admitted[i+1] = admitted[i]
			for j, bt := range bts {
				if j == 8 && i < joinAt {
					continue
				}
				r, err := bt.AllowNAt(bg, "hot", lim, 1, now, 1)
				if err != nil {
					t.Fatal(err)
				}
				if r.Allowed {
					admitted[i+1]++
				}
			}
		}
		// Every interval between multiples of 250 ms.
		const grid = 1000 // steps
		for a := 0; a < steps; a += grid {
			for e := a + grid; e <= steps; e += grid {
				T := time.Duration(e-a) * step
				bound := lim.Burst() + int64(100*(T+cfg.Hold).Seconds())
				if got := admitted[e] - admitted[a]; got > bound {
					t.Errorf("[%v, %v): admitted %d > B + R·(T + hold) = %d", time.Duration(a)*step, time.Duration(e)*step, got, bound)
				}
			}
		}
		var per []int64
		for a := 0; a < steps; a += grid {
			per = append(per, admitted[a+grid]-admitted[a])
		}
		t.Logf("admitted %d in 3 s (B + R·(T + hold) = %d), per 250 ms %v", admitted[steps], 100+int64(100*(3*time.Second+cfg.Hold).Seconds()), per)
	})
}

// TestRedisBatcherRuleChangeDuringRefill: a rule change (shards 1 → 4)
// while a refill under the old rule waits on Redis. The refill's batch is not
// added to the reset holding: the old-rule request is decided from it and
// the rest goes back to the key; the holding then serves the new rule from
// the sub-keys, and the key's count is exactly what the old rule admitted.
func TestRedisBatcherRuleChangeDuringRefill(t *testing.T) {
	batcherBackends(t, func(t *testing.T, mk func(func(*Config)) *Backend) {
		b := mk(nil)
		g := gate(b, opTake)
		bt, bcfg := manualBatcher(t, b)
		lim := mustLimit(t, bucket.TokenBucket, 8, time.Hour, 800) // no refill to speak of
		now := base
		for range 40 { // demand: the next refill takes a batch of several tokens
			if r, err := bt.AllowNAt(bg, "k", lim, 1, now, 1); err != nil || !r.Allowed {
				t.Fatalf("%+v %v", r, err)
			}
		}
		now += int64(2 * bcfg.Hold) // what is held is past its hold
		g.armed.Store(true)
		oldDone := make(chan bucket.Result, 1)
		go func() {
			r, err := bt.AllowNAt(bg, "k", lim, 1, now, 1) // old rule: unsharded
			if err != nil {
				t.Error(err)
			}
			oldDone <- r
		}()
		<-g.entered
		newDone := make(chan bucket.Result, 1)
		go func() {
			r, err := bt.AllowNAt(bg, "k", lim, 4, now, 1) // new rule: 4 shards
			if err != nil {
				t.Error(err)
			}
			newDone <- r
		}()
		h := holdingOf(bt, "k")
		waitFor(t, 5*time.Second, "the new rule to reset the holding", func() bool {
			h.mu.Lock()
			defer h.mu.Unlock()
			return h.ruleShards == 4
		})
		close(g.release)
		if r := <-oldDone; !r.Allowed {
			t.Fatalf("old-rule request: %+v, want allowed from the refill's batch", r)
		}
		if r := <-newDone; !r.Allowed {
			t.Fatalf("new-rule request: %+v", r)
		}
		for range 20 {
			if _, err := bt.AllowNAt(bg, "k", lim, 4, now, 1); err != nil {
				t.Fatal(err)
			}
		}
		h.mu.Lock()
		shards := h.shards
		h.mu.Unlock()
		if err := bt.Close(bg); err != nil {
			t.Fatal(err)
		}
		r, err := b.AllowNAt(bg, "k", lim, 1, now, 0)
		if err != nil {
			t.Fatal(err)
		}
		if want := lim.Burst() - 41; r.Remaining != want || shards != 4 {
			t.Fatalf("after the new rule's checks and Close: the key has %d left, want %d (41 admitted under the old rule); holding on %d shards, want 4", r.Remaining, want, shards)
		}
	})
}

// TestRedisBatcherHoldFromOldestToken: tokens a refill keeps without
// serving its request (another agent took what the key had) are still
// spent or given back within Hold of when they were taken: a later refill
// does not restart their hold. Agent A asks for 3 tokens every 20 ms while
// agent B empties the key just before each ask.
func TestRedisBatcherHoldFromOldestToken(t *testing.T) {
	batcherBackends(t, func(t *testing.T, mk func(func(*Config)) *Backend) {
		a, other := mk(nil), mk(nil)
		log := &takeLog{store: a.st}
		a.st = log
		bt, cfg := manualBatcher(t, a)
		lim := mustLimit(t, bucket.TokenBucket, 100, time.Second, 100)
		hold := int64(cfg.Hold)
		if _, err := other.TakeUpTo(bg, "k", lim, 1, 0, base, 100); err != nil {
			t.Fatal(err)
		}
		now := base + int64(10*time.Millisecond) // the key has 1 token
		for i := 0; now <= base+3*hold; i++ {
			if i > 0 {
				if _, err := other.TakeUpTo(bg, "k", lim, 1, 0, now, 100); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := bt.AllowNAt(bg, "k", lim, 1, now, 3); err != nil {
				t.Fatal(err)
			}
			h := holdingOf(bt, "k")
			h.mu.Lock()
			spendable := h.tokens
			if now >= h.expiry(hold) {
				spendable = 0
			}
			h.mu.Unlock()
			if recent := log.since(now-hold, now); spendable > recent {
				t.Fatalf("at +%v: %d tokens spendable, but only %d were taken within the last hold", time.Duration(now-base), spendable, recent)
			}
			now += int64(20 * time.Millisecond)
		}
	})
}

// TestRedisBatcherDemandOncePerRequest: a request that waits for another
// caller's refill counts once in the key's demand.
func TestRedisBatcherDemandOncePerRequest(t *testing.T) {
	batcherBackends(t, func(t *testing.T, mk func(func(*Config)) *Backend) {
		b := mk(nil)
		g := gate(b, opTake)
		bt, cfg := manualBatcher(t, b)
		lim := mustLimit(t, bucket.TokenBucket, 100, time.Second, 100)
		g.armed.Store(true)
		var wg sync.WaitGroup
		check := func() {
			defer wg.Done()
			if r, err := bt.AllowNAt(bg, "k", lim, 1, base, 1); err != nil || !r.Allowed {
				t.Errorf("%+v %v", r, err)
			}
		}
		wg.Add(2)
		go check()
		<-g.entered
		go check()
		perRequest := float64(time.Second) / float64(cfg.Hold) // one token's weight in the EWMA
		h := holdingOf(bt, "k")
		waitFor(t, 5*time.Second, "the second request to wait for the refill", func() bool {
			h.mu.Lock()
			defer h.mu.Unlock()
			return h.demand >= 2*perRequest
		})
		close(g.release)
		wg.Wait()
		h.mu.Lock()
		demand := h.demand
		h.mu.Unlock()
		if math.Abs(demand-2*perRequest) > 1e-9 {
			t.Fatalf("demand %.1f tokens/s after 2 requests at one instant, want %.1f", demand, 2*perRequest)
		}
	})
}
