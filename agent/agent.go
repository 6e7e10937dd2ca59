package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot/allot/agent/internal/drive"
	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/breaker"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// pendingCap bounds the queue of keys the check path hands to the refill
// loop; when it is full the loop's periodic scan finds the keys instead.
const pendingCap = 4096

// Agent decides rate limits in-process. Create it with New, call Check (or
// CheckStatuses) per request from any goroutine, and Close it at shutdown.
type Agent struct {
	cfg        Config
	log        *slog.Logger
	logs       logLimiter
	met        *metrics
	standalone bool
	redis      RemoteLimiter

	nowHook func() int64
	clock   *coarseClock

	rules atomic.Pointer[rules.Set]
	keys  *keyTable
	memo  *memo // request → matched rules and keys (see memo)

	// pending carries keys from checks to the refill loop.
	pending chan *keyState
	// woken are dormant keys checks handed back to the refill loop (see
	// due.go); guarded by wakeMu.
	wakeMu sync.Mutex
	woken  []*keyState

	liveAgents  atomic.Uint32 // live agents the allocator last reported (N)
	breakerOpen atomic.Bool   // the allocator is unreachable: do not charge, fail closed rules deny
	nextProbe   atomic.Int64  // Unix nanos of the breaker's next probe while open
	talked      atomic.Bool   // an allocator has answered at least once

	conns    []*grpc.ClientConn
	clients  []allotv1.AllocatorClient
	names    []string // one per client: its address (Allocators), for logs and leader hints
	dialOpts []grpc.DialOption
	rt       router // leader routing (route.go), owned like rf

	rngMu sync.Mutex // guards rng
	rng   *rand.Rand // Config.Rand; nil: the global source

	rf refiller     // owned by the refill goroutine, then by Close
	ss staticShares // static shares (static.go)
	fw fileWatch

	// rulesFromAllocator: the current set came from WatchRules (so its
	// version is comparable with the stream's).
	rulesFromAllocator atomic.Bool
	// staleSince is when an Acquire answer first carried a rules version
	// newer than the current set's (agent clock; 0: not stale), and
	// watchCancel ends the current rule watch stream (rulewatch.go).
	staleSince  atomic.Int64
	watchCancel atomic.Pointer[context.CancelFunc]

	ctx    context.Context // canceled by Close: stops the loops and their calls
	cancel context.CancelFunc
	stop   chan struct{}
	wg     sync.WaitGroup

	closeOnce sync.Once
	closeErr  error
}

// New validates cfg, loads the initial rules (standalone RulesFiles must
// compile) and starts the agent's goroutines: the coarse clock, the refill
// loop and, with Allocators, the rule watch or, standalone with RulesFiles,
// the file watch. Allocator connections are made lazily: New does not wait
// for an allocator.
func New(cfg Config) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	a := &Agent{
		cfg:        cfg,
		log:        cfg.Logger,
		met:        met,
		standalone: len(cfg.Allocators) == 0 && len(cfg.Clients) == 0,
		redis:      cfg.Redis,
		nowHook:    cfg.Now,
		keys:       newKeyTable(),
		memo:       newMemo(),
		pending:    make(chan *keyState, pendingCap),
		stop:       make(chan struct{}),
		rng:        cfg.Rand,
	}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	a.log = a.log.With("agent", cfg.ID)
	a.liveAgents.Store(1)
	a.rf.core = policy.NewCore(policy.Config{
		Tick: cfg.RefillInterval, Scan: cfg.ScanInterval, IdleTimeout: cfg.IdleTimeout, Standalone: a.standalone,
		MaxOutageKeys: cfg.MaxOutageKeys,
		Breaker: breaker.Config{Threshold: cfg.FailureThreshold, Cooldown: cfg.ProbeBackoff,
			MaxCooldown: cfg.MaxProbeBackoff, Jitter: a.jitter},
		Jitter: a.jitter,
	})
	if a.nowHook == nil {
		a.clock = newCoarseClock()
	}
	if cfg.Rules != nil {
		a.setRules(cfg.Rules, false)
	}
	if len(cfg.RulesFiles) > 0 {
		a.fw.init(cfg.Rules)
		set, err := a.fw.load(cfg.RulesFiles, true)
		if err != nil {
			met.unregister()
			return nil, err
		}
		a.setRules(set, false)
	}

	if len(cfg.Clients) > 0 {
		a.clients = append(a.clients, cfg.Clients...)
		for i := range cfg.Clients {
			if len(cfg.Allocators) == len(cfg.Clients) {
				a.names = append(a.names, cfg.Allocators[i])
			} else {
				a.names = append(a.names, fmt.Sprintf("client-%d", i))
			}
		}
	}
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, cfg.DialOptions...)
	a.dialOpts = dial
	for _, addr := range cfg.Allocators {
		if len(cfg.Clients) > 0 {
			break // the clients replace the connections
		}
		cc, err := grpc.NewClient(addr, dial...)
		if err != nil {
			for _, c := range a.conns {
				_ = c.Close()
			}
			met.unregister()
			return nil, fmt.Errorf("agent: allocator %q: %w", addr, err)
		}
		a.conns = append(a.conns, cc)
		a.clients = append(a.clients, allotv1.NewAllocatorClient(cc))
		a.names = append(a.names, addr)
	}

	a.ctx, a.cancel = context.WithCancel(context.Background())
	if cfg.driven {
		return a, nil // agentsim drives Refill and ApplyRuleSet
	}
	if a.clock != nil {
		a.goLoop(func() { a.clock.run(a.stop) })
	}
	if !cfg.manual {
		a.goLoop(a.refillLoop)
	}
	if !a.standalone {
		a.goLoop(a.watchRules)
	}
	if len(cfg.RulesFiles) > 0 {
		a.goLoop(a.watchFiles)
	}
	return a, nil
}

// goLoop starts an owned goroutine; Close waits for it.
func (a *Agent) goLoop(f func()) {
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		f()
	}()
}

// preciseNow is now without the coarse clock's lag: the test hook, else
// the coarse clock read precisely. For decisions off the fast path.
func (a *Agent) preciseNow() int64 {
	if a.nowHook != nil {
		return a.nowHook()
	}
	return a.clock.precise()
}

// now is the decision clock: the test hook, else the coarse clock.
func (a *Agent) now() int64 {
	if a.nowHook != nil {
		return a.nowHook()
	}
	return a.clock.load()
}

// nowFast is now in its commonest case, inlined: the ticking coarse
// clock, once its reads are counted (coarseClock.load). ok is false in
// any other case, and the caller calls now.
func (a *Agent) nowFast() (t int64, ok bool) {
	c := a.clock
	if a.nowHook != nil || c.reads.Load() < clockCount || c.parked.Load() {
		return 0, false
	}
	return c.now.Load(), true
}

// loopNow is the refill loop's clock: the test hook, else the coarse clock
// read without keeping it awake (see coarseClock).
func (a *Agent) loopNow() int64 {
	if a.nowHook != nil {
		return a.nowHook()
	}
	return a.clock.fresh()
}

// refill runs one tick of the refill loop for a driven agent (see
// package agentsim).
func (a *Agent) refill(ctx context.Context) error {
	if !a.cfg.driven {
		return errors.New("agent: Refill is for agents made by agentsim.New; this agent runs its own refill loop")
	}
	a.refillOnce(ctx)
	return nil
}

func init() {
	drive.New = func(cfg any) (any, error) {
		c := cfg.(Config)
		c.driven = true
		return New(c)
	}
	drive.Refill = func(a any, ctx context.Context) error { return a.(*Agent).refill(ctx) }
	drive.ApplyRuleSet = func(a any, rs *allotv1.RuleSet) error { return a.(*Agent).applyRuleSet(rs) }
}

// Rules returns the rule set in use (nil: none yet).
func (a *Agent) Rules() *rules.Set { return a.rules.Load() }

// Ready reports whether the agent has rules and, with Allocators, has had an
// answer from one (a rule set or an Acquire).
func (a *Agent) Ready() bool {
	return a.rules.Load() != nil && (a.standalone || a.talked.Load())
}

func (a *Agent) setRules(s *rules.Set, fromAllocator bool) {
	a.met.setRules(s) // before the set: checks count against the index of their own set
	a.rules.Store(s)
	a.rulesFromAllocator.Store(fromAllocator)
	a.met.rulesVersion.Set(float64(s.Version()))
}

// Close stops the agent's goroutines, then hands every unspent lease
// balance back to the allocator and reports the tokens still owed, in one
// Release (bounded by ctx; without a deadline, by 2 × CallTimeout), and
// closes the connections. Checks made after Close are still answered, from
// the local buckets only. Close is safe to call more than once; later calls
// return the first call's result.
func (a *Agent) Close(ctx context.Context) error {
	a.closeOnce.Do(func() {
		// Checks after Close decide from the fallback buckets: the slot
		// is the allocator's again once it forgets this agent.
		a.ss.closed.Store(true)
		a.ss.validUntil.Store(0)
		close(a.stop)
		a.cancel()
		a.wg.Wait()
		var errs []error
		if !a.standalone {
			if _, ok := ctx.Deadline(); !ok {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, 2*a.cfg.CallTimeout)
				defer cancel()
			}
			if err := a.release(ctx); err != nil {
				errs = append(errs, err)
			}
		}
		a.rt.close()
		for _, c := range a.conns {
			if err := c.Close(); err != nil {
				errs = append(errs, fmt.Errorf("agent: closing connection: %w", err))
			}
		}
		a.met.unregister()
		a.closeErr = errors.Join(errs...)
	})
	return a.closeErr
}

// jitter is "equal jitter": d/2 + uniform(0, d/2), drawn from Config.Rand
// when set.
func (a *Agent) jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	if a.rng == nil {
		return d/2 + rand.N(d/2)
	}
	a.rngMu.Lock()
	defer a.rngMu.Unlock()
	return d/2 + time.Duration(a.rng.Int64N(int64(d/2)))
}
