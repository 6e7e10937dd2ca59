package main

import (
	"context"
	"errors"
	"maps"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

// redisModel is the canonical Redis design, modelled: one atomic
// store operation (a Lua token bucket, here pkg/bucket's, the same maths as
// pkg/redislimit's script) per request, on the primary of the key's shard.
//
//   - Each shard is one core: operations queue FIFO and take 1/opsPerShard
//     each (~100k un-pipelined script calls/s per shard); a hot
//     key is one shard whatever the shard count.
//   - A client call has a deadline (pkg/redislimit: 5 ms); an operation
//     that misses it has usually still executed (its tokens are counted),
//     and the agent fails open for it anyway.
//   - Each agent's client has pkg/redislimit's circuit breaker: open after
//     3 consecutive failures, one probe per 250 ms cooldown, fail fast
//     while open.
//   - Primary failover: the primary dies at failAt; for rto every call times
//     out; then a replica is promoted holding the state as of failAt − rpo
//     (asynchronous replication; AOF everysec loses up to 1 s), so the
//     tokens spent in that last stretch are handed out again.
type redisModel struct {
	w       *world
	shards  int
	svc     int64   // ns per operation on one shard
	free    []int64 // per shard: when its core is next free
	oneWay  logNormal
	timeout int64
	state   map[uint64]bucket.State

	failAt, upAt, rpo int64 // failover (failAt == 0: none)
	snaps             []redisSnap

	calls, ops, timeouts, fastFails, downCalls int64
	lat                                        *histogram // added latency per check (ns)
}

type redisSnap struct {
	at int64
	st map[uint64]bucket.State
}

var errRedis = errors.New("sim: redis unavailable")

func newRedisModel(w *world, shards int, opsPerShard float64) *redisModel {
	return &redisModel{
		w:       w,
		shards:  shards,
		svc:     int64(1e9 / opsPerShard),
		free:    make([]int64, shards),
		oneWay:  newLogNormal(250*time.Microsecond, 1*time.Millisecond),
		timeout: int64(5 * time.Millisecond),
		state:   make(map[uint64]bucket.State),
		lat:     newHistogram(),
	}
}

// failover schedules a primary failure at failAt with the given recovery
// time and replication loss window, and starts the replication snapshots
// it needs (every 50 ms).
func (m *redisModel) failover(failAt int64, rto, rpo time.Duration) {
	m.failAt, m.upAt, m.rpo = failAt, failAt+int64(rto), int64(rpo)
	var snap func()
	snap = func() {
		now := m.w.eng.now
		if now < m.failAt {
			m.snaps = append(m.snaps, redisSnap{at: now, st: maps.Clone(m.state)})
			for len(m.snaps) > 0 && m.snaps[0].at < now-m.rpo-int64(time.Second) {
				m.snaps = m.snaps[1:]
			}
			m.w.eng.after(50*time.Millisecond, snap)
		}
	}
	m.w.eng.after(0, snap)
	m.w.eng.atFunc(m.upAt, func() {
		// Promote: the replica has what was replicated up to failAt − rpo.
		m.state = make(map[uint64]bucket.State)
		for i := len(m.snaps) - 1; i >= 0; i-- {
			if m.snaps[i].at <= m.failAt-m.rpo {
				m.state = maps.Clone(m.snaps[i].st)
				break
			}
		}
		m.snaps = nil
		clear(m.free)
	})
}

func (m *redisModel) down(now int64) bool { return m.failAt != 0 && now >= m.failAt && now < m.upAt }

// op runs one script call issued at now: its latency as the client sees it
// and its result; err when the client's deadline passed first.
func (m *redisModel) op(r *rules.Rule, key []byte, n, now int64) (bucket.Result, int64, error) {
	if m.down(now) {
		m.downCalls++
		return bucket.Result{}, m.timeout, errRedis
	}
	h := xxhash.Sum64(key)
	s := int(h % uint64(m.shards))
	rng := m.w.rng
	start := max(now+m.oneWay.sample(rng), m.free[s])
	m.free[s] = start + m.svc
	done := start + m.svc + m.oneWay.sample(rng)
	st := m.state[h]
	res := r.Limit.AllowN(&st, start, n)
	m.state[h] = st
	m.ops++
	if lat := done - now; lat > m.timeout {
		m.timeouts++
		return bucket.Result{}, m.timeout, errRedis
	}
	return res, done - now, nil
}

// redisClient is one agent's connection (agent.Config.Redis) with its
// circuit breaker.
type redisClient struct {
	m         *redisModel
	fails     int
	open      bool
	openUntil int64
}

const (
	redisBreakerFailures = 3
	redisBreakerCooldown = 250 * time.Millisecond
)

func (c *redisClient) AllowN(_ context.Context, r *rules.Rule, key []byte, n int64) (bucket.Result, error) {
	m := c.m
	now := m.w.eng.now
	m.calls++
	if c.open && now < c.openUntil {
		m.fastFails++
		m.lat.record(0)
		return bucket.Result{}, errRedis
	}
	res, lat, err := m.op(r, key, n, now)
	m.lat.record(lat)
	if err != nil {
		c.fails++
		if c.open || c.fails >= redisBreakerFailures {
			c.open = true
			c.openUntil = now + int64(redisBreakerCooldown)
		}
		return bucket.Result{}, err
	}
	c.fails, c.open = 0, false
	return res, nil
}
