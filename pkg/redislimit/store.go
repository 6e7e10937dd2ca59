package redislimit

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/allot/allot/pkg/bucket"
	"github.com/redis/go-redis/v9"
)

// A store runs one script operation on one key. redisStore is the real one;
// memStore is its in-memory twin (pkg/bucket on a map), used by NewInmem and
// by the tests that need many deterministic runs.
type store interface {
	do(ctx context.Context, c *call) (outcome, error)
	close() error
}

// call is one operation.
type call struct {
	key    string
	lim    bucket.Limit
	p      params
	op     op
	now    int64 // Unix ns; < 0: Redis's clock
	pinned bool  // run at now even with Config.ServerTime
	n      int64
	shards int64 // op promote
	ttl    int64 // op promote: promoted until now + ttl (ns)
}

// outcome is an operation's result. code is the script's reply code; taken
// the tokens op take took; now is the instant (Unix ns, whole ms) the
// operation ran at; state is the key's state after it (not for
// codePromoted/codeExtended, which report shards and until instead).
type outcome struct {
	code   int64
	taken  int64
	now    int64
	state  bucket.State
	shards int64
	until  int64
}

// msFloor truncates a Unix ns instant to the millisecond.
func msFloor(ns int64) int64 { return ns - ns%nsPerMs }

// redisStore runs the Lua script with EVALSHA, and with EVAL (which also
// loads it) on NOSCRIPT.
type redisStore struct {
	client   redis.UniversalClient
	script   *redis.Script
	slackMs  int64
	useTIME  bool
	ownClose bool
}

func (s *redisStore) do(ctx context.Context, c *call) (outcome, error) {
	nowMs := int64(-1)
	if !s.useTIME || c.pinned {
		nowMs = max(c.now, 0) / nsPerMs
	}
	args := []any{c.key, int64(c.op), c.p.fam, nowMs, c.n, c.p.p1, c.p.p2, c.p.p3, s.slackMs, c.shards, c.ttl / nsPerMs}
	cmd := s.eval(ctx, "evalsha", s.script.Hash(), args)
	if err := cmd.Err(); errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT") {
		cmd = s.eval(ctx, "eval", scriptSource, args)
	}
	v, err := cmd.Int64Slice()
	if err != nil {
		return outcome{}, err
	}
	if len(v) < 4 {
		return outcome{}, fmt.Errorf("%w: %v", errShortReply, v)
	}
	o := outcome{code: v[0], now: v[1] * nsPerMs, taken: v[2]}
	switch o.code {
	case codePromoted, codeExtended:
		if len(v) < 5 {
			return outcome{}, fmt.Errorf("%w: %v", errShortReply, v)
		}
		o.shards, o.until = v[3], v[4]*nsPerMs
		return o, nil
	}
	o.state, err = c.p.stateFrom(c.lim, o.now, v[3:])
	return o, err
}

// eval sends EVAL or EVALSHA (name) of payload for one key (args[0]) as a
// scriptCmd.
func (s *redisStore) eval(ctx context.Context, name, payload string, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx, append([]any{name, payload, 1}, args...)...)
	cmd.SetFirstKeyPos(3)
	_ = s.client.Process(ctx, scriptCmd{cmd})
	return cmd
}

// scriptCmd is a script call that go-redis never sends again once it may
// have reached Redis. ClusterClient re-sends a command after a network
// error, a timeout, LOADING or CLUSTERDOWN (up to MaxRedirects times); a
// script that ran but whose reply was lost would run twice (a GiveBack
// given twice over-admits). Redirects (MOVED, ASK), which Redis answers
// without running the script, are still followed.
type scriptCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to re-send the command after an error.
func (scriptCmd) NoRetry() bool { return true }

func (s *redisStore) close() error {
	if s.ownClose {
		return s.client.Close()
	}
	return nil
}

// memStore is the in-memory twin of redisStore: the same operations, the
// same millisecond time and promotion markers, computed by pkg/bucket on a
// map. Keys never expire (the tests it serves are short).
type memStore struct {
	mu   sync.Mutex // guards keys
	keys map[string]*memKey
}

type memKey struct {
	st     bucket.State
	shards int64 // promoted to shards sub-keys until until (Unix ns)
	until  int64
}

func newMemStore() *memStore { return &memStore{keys: make(map[string]*memKey)} }

func (s *memStore) do(_ context.Context, c *call) (outcome, error) {
	now := msFloor(max(c.now, 0))
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.keys[c.key]
	if k == nil {
		k = &memKey{}
		s.keys[c.key] = k
	}
	if k.shards > 0 {
		if k.until > now {
			if c.op != opPromote && c.op != opExtend {
				return outcome{code: codePromoted, now: now, shards: k.shards, until: k.until}, nil
			}
			k.until = max(k.until, now+msFloor(c.ttl))
			return outcome{code: codeExtended, now: now, shards: k.shards, until: k.until}, nil
		}
		// Demoted: the key restarts empty at until.
		k.st = bucket.State{}
		c.lim.TakeUpTo(&k.st, k.until, max(c.lim.Burst(), c.lim.Quota()))
		k.shards = 0
	}
	l := c.lim
	o := outcome{code: codeOK, now: now}
	switch c.op {
	case opAllow:
		if !l.AllowN(&k.st, now, c.n).Allowed {
			o.code = codeDenied
		}
	case opTake:
		o.taken = l.TakeUpTo(&k.st, now, c.n)
	case opGive:
		l.GiveBack(&k.st, now, c.n)
	case opDebit:
		l.Debit(&k.st, now, c.n)
	case opDrain:
		l.Drain(&k.st, now)
	case opPromote:
		o.code = codeMarked
		o.state = k.st
		k.shards, k.until = c.shards, now+msFloor(c.ttl)
		return o, nil
	}
	o.state = k.st
	return o, nil
}

func (s *memStore) close() error { return nil }
