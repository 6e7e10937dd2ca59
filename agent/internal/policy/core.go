package policy

import (
	"math"
	"slices"
	"time"

	"github.com/allot/allot/pkg/breaker"
)

// NotLeasedRetry is how long a key the allocator does not lease (NO_RULE,
// UNLIMITED, NOT_LEASED: a rules version skew), or a key of a rejected
// call, waits before it is sent again.
const NotLeasedRetry = 5 * time.Second

// RefusedForever in Key.HoldUntil marks a key that is never sent.
const RefusedForever = math.MaxInt64

// Config is what the core needs of the agent's configuration.
type Config struct {
	Tick        time.Duration // the refill interval
	Scan        time.Duration // the scan interval
	IdleTimeout time.Duration
	// MaxOutageKeys bounds the key table against keys kept only for an
	// outage charge they owe (see Forgettable): while the table holds
	// more keys than this, an idle key whose only debt is its outage
	// charge is forgotten, the charge forgiven. 0: no bound.
	MaxOutageKeys int
	// Standalone: no allocator; keys are scanned but never sent.
	Standalone bool
	Breaker    breaker.Config
	// Jitter spreads a wait d over [d/2, d] (the runtime's source of
	// randomness; a test's is deterministic).
	Jitter func(d time.Duration) time.Duration
}

// Core is the refill loop's policy: which keys go to the allocator and
// when, what each asks for and hands back, and what an answer does to
// them. It holds the loop-wide state (the breaker, the round-trip estimate,
// the overload backoff, the request ids, the scan clock) and decides on
// the per-key state in Key. It is single-threaded and deterministic: every
// method takes the time (Unix nanoseconds) and what the check path
// published of the key (Obs) as arguments, and returns what the driver
// must do; it starts no goroutine, reads no clock and touches no atomic.
//
// A tick goes: Tick (is a scan due?); Visit for each key the scan visits
// and Queued for each key a check queued (which are picked); SortPicks and
// BatchLen (which picked keys share a call); NextID and Plan for each key
// of a call (what it asks for and hands back); then, for the answer,
// Answered, and Acked and Grant for each key, or Failed, Throttled or
// Rejected. RestUntil says how long a key the scan left at Rest may sleep.
//
// agent/refill.go is its driver: it reads a key's counters into an Obs,
// feeds the scan, the queued keys and the allocator's answers to the core,
// and carries out what it returns (moves of tokens between the key's
// counters, the Acquire calls). The scripts in testdata/core-* drive it the
// same way, with a few counters standing in for the check path.
//
// The zero Core is not usable; use NewCore.
type Core struct {
	cfg      Config
	br       *breaker.Breaker
	nextID   uint64
	lastScan int64
	// Latency is the EWMA of Acquire round trips, seconds; LatencyMax the
	// largest it has been (sleeping keys wake in time for a renewal
	// whatever the estimate does: see RestUntil).
	Latency, LatencyMax float64
	// The allocator refused the last call as overloaded (ResourceExhausted:
	// refused before any work, so not applied): wait until throttledUntil,
	// then retry the same batch. It is not a failure: the breaker stays
	// closed and leases keep being spent.
	throttledUntil int64
	throttle       time.Duration
	// Keys is the number of keys in the driver's table, set by the driver
	// before each scan (see Config.MaxOutageKeys).
	Keys int
}

// NewCore returns a core with a closed breaker; request ids start at 1.
func NewCore(cfg Config) *Core {
	return &Core{cfg: cfg, br: breaker.New(cfg.Breaker), nextID: 1}
}

// Key is the loop's state of one key: its demand estimate, what it last
// reported, its pacing and holds.
type Key struct {
	Demand     Demand // updated by every scan
	SpentAtAcq int64  // Obs.Spent at the latest Acquire that included the key
	DeniedSent int64  // Obs.Denied at the latest Acquire that included the key
	RefreshAt  int64  // allocator-directed refresh time
	Paid       int64  // fallback-admitted tokens settled out of grants (cumulative)
	RetryAt    int64  // for NotLeased keys: ask again after this
	HoldUntil  int64  // after a rejection: not sent before this; RefusedForever: never sent
	Inflight   bool   // in a batch sent and not yet answered
	Suspect    bool   // was in a batch the allocator rejected: sent alone
	Paced      bool   // the budget was spent at the last grant: asked again only at RefreshAt (see Pace)
}

// Refused reports whether the key is never sent to the allocator.
func (k *Key) Refused() bool { return k.HoldUntil == RefusedForever }

// Obs is what the check path and the earlier answers published of a key:
// the driver reads it from the key's atomics before each decision.
type Obs struct {
	Spent   int64 // cumulative tokens admitted (lease or fallback)
	Denied  int64 // cumulative requests denied
	Charged int64 // fallback-admitted tokens not yet reported
	Outage  int64 // of which admitted while the breaker was open
	Balance int64 // unspent leased tokens
	LastUse int64 // time of the latest check
	// Published by the answers (see Lease).
	Expiry, DeniedUntil, LowWater int64
	Leased, NotLeased             bool
	Local                         bool // decided locally by design: never sent
	Queued                        bool // in the refill queue
	// Static: decided from a static share (static.go): sent only to be
	// promoted. Promote: a check found its share low (StaticLow).
	// StaticRate: the share's rate, tokens/s (0: not known yet).
	// StaticFullAt: when its share's bucket is full again (0: full), for
	// a static key or one that owes its share's level. Such a key is not
	// forgotten before: its share is charged to no one, so a key
	// forgotten and seen again must not start a fresh one early, and the
	// allocator counts a share it is told nothing of as full.
	Static, Promote bool
	StaticRate      float64
	StaticFullAt    int64
}

// live reports whether o's lease has not expired at now.
func (o *Obs) live(now int64) bool { return now < o.Expiry }

func (o *Obs) idle(now int64, timeout time.Duration) bool { return now-o.LastUse >= int64(timeout) }

// active: spent or denied since the latest report.
func (k *Key) active(o *Obs) bool { return o.Spent != k.SpentAtAcq || o.Denied != k.DeniedSent }

// NextID takes the next request id (ids increase strictly per agent).
func (c *Core) NextID() uint64 {
	id := c.nextID
	c.nextID++
	return id
}

// LastScan is the time of the latest scan (0: none yet).
func (c *Core) LastScan() int64 { return c.lastScan }

// Tick starts a refill tick at now. It reports whether the tick scans the
// keys (a scan interval has passed, or the clock went back), and the scan's
// dt (seconds since the previous scan; 0 for the first, or when the clock
// went back: demands are then left alone) and its EWMA weight alpha.
func (c *Core) Tick(now int64) (scan bool, dt, alpha float64) {
	if c.lastScan != 0 && now-c.lastScan < int64(c.cfg.Scan) && now >= c.lastScan {
		return false, 0, 0
	}
	if c.lastScan != 0 && now > c.lastScan {
		dt = float64(now-c.lastScan) / float64(time.Second)
	}
	c.lastScan = now
	return true, dt, Alpha(dt)
}

// Verdict is a scan's decision on a key.
type Verdict uint8

const (
	Stay    Verdict = iota // stays awake: visited again by the next scan
	Pick                   // sent now (it is in flight until answered)
	Forget                 // idle and owing nothing: dropped from the table
	Rest                   // nothing to do until a check or a deadline (see RestUntil)
	Promote                // a static key whose share nears exhaustion: sent now with promote (in flight until answered)
)

// Visit is a scan's visit of k at now (dt, alpha from Tick): it folds the
// scan into k's demand and decides on k.
func (c *Core) Visit(k *Key, o *Obs, now int64, dt, alpha float64) Verdict {
	seen := k.Demand.SpentSeen
	fell := k.Demand.Scan(now, o.Spent, dt, alpha, o.Denied == k.DeniedSent)
	if o.Static {
		// Decided from its static share: no lease to renew, no charge
		// to report; sent only to be promoted.
		switch {
		case !c.cfg.Standalone && !k.Inflight && (o.Promote || StaticBusy(k.Demand.Of(now, o.Spent, c.lastScan), o.StaticRate)):
			k.Inflight = true
			return Promote
		case c.Forgettable(k, o, now):
			return Forget
		case !k.Inflight && o.Spent == seen:
			return Rest
		}
		return Stay
	}
	if o.Local {
		if o.idle(now, c.cfg.IdleTimeout) {
			return Forget
		}
	} else {
		if o.Outage > 0 && c.OverKeys() && c.Forgettable(k, o, now) {
			return Forget // before the outage charge picks it (needsAcquire)
		}
		if !c.cfg.Standalone && !k.Inflight && (fell && c.reportFall(k, o, now) || c.needsAcquire(k, o, now)) {
			k.Inflight = true
			return Pick
		}
		if c.Forgettable(k, o, now) {
			return Forget
		}
	}
	if !k.Inflight && o.Spent == seen {
		return Rest
	}
	return Stay
}

// reportFall decides whether a key whose demand the scan just lowered (see
// Demand.Scan) is sent now rather than at its next refill: when it holds a
// live lease and more than its new target (it would ask for nothing while
// it spends that, up to a second at its old rate, and the allocator would
// weigh its old demand against the others' until then).
func (c *Core) reportFall(k *Key, o *Obs, now int64) bool {
	if now < k.HoldUntil || o.NotLeased || !o.Leased || !o.live(now) {
		return false
	}
	return o.Balance > Want(k.Demand.Rate, c.cfg.Tick, c.Latency)
}

// Forgettable reports whether k is idle for IdleTimeout and owes nothing;
// the driver asks again under the lock that drops the key.
//
// A key that owes an outage charge (fallback admissions while the
// allocator was unreachable, reported on recovery) is kept for it, unless
// the table holds more than Config.MaxOutageKeys keys: then its charge is
// forgiven (the driver counts the tokens) and it is forgotten like a key
// that owes nothing. Otherwise a client sending a fresh key per request
// during an outage would grow the table without bound until the
// allocator is back. The trade is bounded memory against an under-charge
// that is bounded (each forgiven key's charge is at most what its
// fallback bucket admitted) and counted. Such a key is forgotten even
// while a check's hand-over queues it (the driver skips a dropped key it
// dequeues): the queue does not drain while the allocator is unreachable.
// A key in flight (in the one unacknowledged call, retried first) is kept.
func (c *Core) Forgettable(k *Key, o *Obs, now int64) bool {
	forgive := o.Outage > 0 && c.OverKeys()
	if k.Inflight || o.Queued && !forgive || !o.idle(now, c.cfg.IdleTimeout) || now < o.StaticFullAt {
		return false
	}
	if o.Local || k.Refused() {
		return true
	}
	return o.Charged <= 0 && (o.Outage <= 0 || forgive) && (o.Balance == 0 || !o.live(now))
}

// OverKeys reports whether the key table holds more keys than
// Config.MaxOutageKeys (see Forgettable).
func (c *Core) OverKeys() bool {
	return c.cfg.MaxOutageKeys > 0 && c.Keys > c.cfg.MaxOutageKeys
}

// renewMargin is how long before a lease's expiry it is renewed: two
// ticks plus the round trip.
func (c *Core) renewMargin() int64 {
	return int64(2*c.cfg.Tick) + int64(c.Latency*float64(time.Second))
}

// needsAcquire decides whether the scan sends k now.
func (c *Core) needsAcquire(k *Key, o *Obs, now int64) bool {
	if now < k.HoldUntil {
		return false
	}
	if k.Paced && now < k.RefreshAt && now < o.Expiry-c.renewMargin() {
		return false // its share is spent: ask at the paced time, charges included
	}
	if o.Charged > 0 || o.Outage > 0 {
		return true
	}
	active := k.active(o)
	if o.NotLeased {
		return active && now >= k.RetryAt
	}
	if now < o.DeniedUntil && !k.Paced {
		return false
	}
	if !o.Leased || !o.live(now) {
		return active
	}
	switch {
	case o.idle(now, c.cfg.IdleTimeout):
		return o.Balance > 0 // hand it back
	case now >= o.Expiry-c.renewMargin():
		return active || o.Balance > 0 // renew, or hand back before it is lost
	case !active:
		return false
	case o.Balance < o.LowWater, now >= k.RefreshAt:
		return true
	}
	return false
}

// Queued decides whether k, queued by a check (its balance fell below the
// low watermark, or the fallback admitted it), is sent at this tick. A
// picked key is in flight until answered.
func (c *Core) Queued(k *Key, o *Obs, now int64) bool {
	if k.Inflight || o.Local || now < k.HoldUntil || k.Paced && now < k.RefreshAt {
		return false // a paced key is sent by the scan at its time
	}
	if o.Static {
		// Decided from its static share: sent only to be promoted.
		k.Inflight = o.Promote
		return o.Promote
	}
	if o.Charged <= 0 && o.Outage <= 0 && (now < o.DeniedUntil || o.NotLeased && now < k.RetryAt) {
		return false // nothing to report, and asking again is pointless yet
	}
	k.Inflight = true
	return true
}

// RestUntil returns the time until which a scan's verdict Rest on k at now
// holds: its earliest deadline after now (idle timeout, lease expiry,
// renewal, paced refresh, denial, retry and hold times, and the time its
// demand has decayed to nothing; math.MaxInt64: none). ok is false when k
// must stay awake: its renewal is near, and the renewal margin moves with
// the round-trip estimate.
func (c *Core) RestUntil(k *Key, o *Obs, now int64) (until int64, ok bool) {
	until = math.MaxInt64
	at := func(t int64) {
		if t > now && t < until {
			until = t
		}
	}
	at(o.LastUse + int64(c.cfg.IdleTimeout))
	at(k.HoldUntil)
	at(k.RefreshAt)
	at(k.RetryAt)
	at(o.DeniedUntil)
	at(o.StaticFullAt)
	if o.live(now) {
		at(o.Expiry)
		// renewMargin with the largest round-trip estimate seen: never
		// later than the renewal, whatever the estimate does meanwhile.
		renew := o.Expiry - int64(2*c.cfg.Tick) - int64(c.LatencyMax*float64(time.Second))
		if renew <= now {
			return 0, false
		}
		at(renew)
	}
	if k.Demand.Rate > 0 {
		at(now + int64(DecayTime(k.Demand.Rate)))
	}
	return until, true
}

// MaySend reports whether calls may go out at now: the breaker allows it
// and the allocator's overload backoff is over.
func (c *Core) MaySend(now int64) bool { return c.br.Allow(now) && now >= c.throttledUntil }

// Probing reports whether the breaker is open: a tick with nothing to send
// sends an empty Acquire, so that it learns whether the allocator is back.
func (c *Core) Probing() bool { return c.br.Open() }

// SortPicks orders the keys picked for a tick's calls: the keys of a
// rejected batch (Suspect) first. key returns a pick's Key.
func SortPicks[T any](picks []T, key func(T) *Key) {
	slices.SortStableFunc(picks, func(x, y T) int {
		switch sx, sy := key(x).Suspect, key(y).Suspect; {
		case sx == sy:
			return 0
		case sx:
			return -1
		}
		return 1
	})
}

// BatchLen is how many of picks (in SortPicks order) the next call
// carries: a key of a rejected batch alone, so that one key the allocator
// refuses cannot hold back the others, and the others up to max a call.
func BatchLen[T any](picks []T, key func(T) *Key, max int) int {
	if len(picks) == 0 || key(picks[0]).Suspect {
		return min(len(picks), 1)
	}
	return min(len(picks), max)
}

// Entry is what one key asks of the allocator in a batch.
type Entry int8

const (
	Skip     Entry = iota // idle: reports its charges only
	HandBack              // idle, or its lease ends unused: returns its whole balance
	Lend                  // a thin share's first use: wants nothing (see FirstUse)
	Refill                // returns its excess over Plan.Target and asks for the rest
)

// Plan is a key's part of a batch (see Core.Plan).
type Plan struct {
	Entry    Entry
	Demand   float64 // tokens/s, reported to the allocator
	Target   int64   // Refill: what the key aims to hold
	LowWater int64   // Refill: the new low watermark, published to the check path
}

// Plan decides k's part of a batch built at now. o.Charged is the charge
// this batch reports (already taken out of the key), o.Balance what it
// holds (0 once its lease has expired); thin reports whether its fallback
// bucket is a thin share (ThinShare), asked only when it matters.
func (c *Core) Plan(k *Key, o *Obs, now int64, thin func() bool) Plan {
	idle := o.idle(now, c.cfg.IdleTimeout)
	p := Plan{Demand: k.Demand.Of(now, o.Spent, c.lastScan)}
	switch {
	case o.live(now) && (idle || (!k.active(o) && now >= o.Expiry-c.renewMargin())):
		// Idle, or the lease is ending unused: hand it back rather than
		// let it expire (expired tokens are not credited).
		p.Entry = HandBack
	case !idle && FirstUse(p.Demand, o.Charged, o.Spent, o.Balance) && thin():
		p.Entry = Lend
	case !idle:
		p.Entry = Refill
		p.LowWater = LowWater(p.Demand, c.cfg.Tick, c.Latency)
		p.Target = max(Want(p.Demand, c.cfg.Tick, c.Latency), 1)
	}
	return p
}

// WantOf is what a key asks for: up to target, given what it holds once
// its excess is returned.
func WantOf(target, balance int64) int64 { return min(max(target-balance, 0), MaxWant) }

// Answered records a call's round trip (sent and recv, Unix nanos) that
// the allocator answered: the round-trip estimate, and the breaker closes.
// It reports whether the breaker was open.
func (c *Core) Answered(sent, recv int64) (closed bool) {
	rtt := float64(recv-sent) / float64(time.Second)
	if c.Latency == 0 {
		c.Latency = rtt
	} else {
		c.Latency += 0.2 * (rtt - c.Latency)
	}
	c.LatencyMax = max(c.LatencyMax, c.Latency)
	return c.Reachable()
}

// Reachable records that the allocator answered a call (even with an
// error): the overload backoff ends, the breaker closes. It reports whether
// the breaker was open.
func (c *Core) Reachable() (closed bool) {
	c.throttle, c.throttledUntil = 0, 0
	return c.br.Success()
}

// Failed records a transport failure at now. opened: the breaker opened;
// open: it is open (the driver zeroes the unacknowledged batch's wants:
// when the allocator is back, their refill must come after the outage's
// charges).
func (c *Core) Failed(now int64) (opened, open bool) {
	wasOpen := c.br.Open()
	opened = c.br.Failure(now) // opens it, or doubles the wait while open
	return opened, opened || wasOpen
}

// Failures is the count of consecutive failed calls.
func (c *Core) Failures() int { return c.br.Failures() }

// NextProbe is when the open breaker lets the next call through.
func (c *Core) NextProbe() int64 { return c.br.NextProbe() }

const (
	minThrottle = 20 * time.Millisecond
	maxThrottle = time.Second
)

// Throttled records an overload refusal at now: the batch stays
// unacknowledged and is retried, with the same request id, after hint (the
// allocator's RetryInfo; 0: none), or after a doubling backoff from 20 ms
// up to 1 s, jittered. It returns the wait before jitter.
func (c *Core) Throttled(now int64, hint time.Duration) time.Duration {
	c.throttle = min(max(2*c.throttle, minThrottle), maxThrottle)
	wait := c.throttle
	if hint > 0 {
		wait = min(max(hint, minThrottle), maxThrottle)
	}
	c.throttledUntil = now + int64(c.cfg.Jitter(wait))
	return wait
}

// Rejected records that the allocator (or the encoder) refused a batch
// holding k at now: nothing of it was applied. k waits NotLeasedRetry,
// then is sent alone.
func (c *Core) Rejected(k *Key, now int64) {
	k.Inflight = false
	k.Suspect = true
	k.HoldUntil = now + int64(NotLeasedRetry)
}

// Status is the allocator's answer status for a key, as the core sees it.
type Status uint8

const (
	Unknown   Status = iota // try again at the next scan
	OK                      // granted (perhaps less than asked)
	Exhausted               // the budget is spent
	NotLeased               // NO_RULE, UNLIMITED, NOT_LEASED: decided locally, uncharged
)

// Answer is the allocator's answer for one key.
type Answer struct {
	Status    Status
	Granted   int64
	Remaining int64
	TTL       time.Duration
	// Times after the call's first attempt.
	RefreshAfter, RetryAfter, ResetAfter time.Duration
	// The key's limit and the agents on it (see Pace).
	RequestsPerUnit uint32
	WindowSeconds   int64
	Burst           int64
	Agents          uint32
}

// Lease is what an answer publishes to the check path.
type Lease struct {
	Expiry      int64 // the lease's end; 0: unchanged
	DeniedUntil int64 // a dry lease denies until this
	Remaining   int64 // global remaining
	ResetAt     int64 // the global bucket is full again at
	// Rebase: the fallback bucket starts again from this agent's share of
	// Remaining at RebaseAt and refills from then (OK and EXHAUSTED
	// answers). RebaseAt is the answer's arrival, or for a paced key the
	// end of its dry lease's denial (DeniedUntil): the refill of the paced
	// time is the paced ask's grant, and a fallback refilled since the
	// answer admitted the whole pace and grace at R/N at once whenever
	// that ask's answer came after the grace.
	Rebase    bool
	RebaseAt  int64
	NotLeased bool
}

// Acked records that the allocator answered a batch holding k, built when
// the key had spent and denied so much: what it reported is settled.
func (c *Core) Acked(k *Key, spent, denied int64) {
	k.Inflight = false
	k.Suspect = false
	k.SpentAtAcq = spent
	k.DeniedSent = denied
}

// Grant applies the allocator's answer a for k, which asked for want, in a
// call first sent at sent and answered at recv, and returns what the check
// path must see.
func (c *Core) Grant(k *Key, a Answer, want, sent, recv int64) Lease {
	switch a.Status {
	case OK, Exhausted:
	case NotLeased:
		// A rules version skew (or a backend change): decide locally,
		// uncharged, and ask again later.
		k.RetryAt = recv + int64(NotLeasedRetry)
		return Lease{NotLeased: true}
	default:
		return Lease{}
	}
	l := Lease{
		Remaining: a.Remaining,
		ResetAt:   sent + int64(a.ResetAfter),
		Rebase:    true,
		RebaseAt:  recv,
	}
	if a.Granted > 0 || a.TTL > 0 {
		l.Expiry = sent + int64(a.TTL) - int64(LeaseMargin(a.TTL))
	}
	k.RefreshAt = sent + int64(a.RefreshAfter)
	// Short: less than asked. The bucket is empty, or this agent was
	// granted its allowance for the refresh window (grant pacing,
	// docs/leases.md): either way asking again before the paced time gets
	// nothing more.
	short := want > 0 && a.Granted < want
	p, paced := Pace(Grant{
		Exhausted: a.Status == Exhausted, Short: short,
		RequestsPerUnit: a.RequestsPerUnit, WindowSeconds: a.WindowSeconds, Burst: a.Burst,
		Agents: a.Agents, RefreshAfter: a.RefreshAfter, RetryAfter: a.RetryAfter,
	}, c.cfg.Scan)
	k.Paced = paced
	switch {
	case paced:
		// The budget, or this agent's share of it, is spent: what this
		// agent holds is what it may spend until it asks again, at the
		// paced time. Meanwhile a dry lease denies (the lease says no)
		// instead of admitting from the fallback bucket and owing a
		// charge every tick. Jittered (p/2 … p): agents that found the
		// budget spent together must not all come back together, or the
		// refill waits in the bucket between their waves. Never before
		// retry_after: no token exists before it.
		k.RefreshAt = sent + int64(max(c.cfg.Jitter(p), a.RetryAfter))
		l.DeniedUntil = k.RefreshAt + c.paceGrace()
		l.RebaseAt = max(recv, l.DeniedUntil)
	case a.Status == Exhausted:
		l.DeniedUntil = sent + int64(a.RetryAfter)
	}
	return l
}

// paceGrace is how long past a paced key's ask its dry lease keeps
// denying: the ask goes at the first scan after RefreshAt and its answer
// takes a round trip. An answer that is later than that (a slow or
// unreachable allocator) leaves the key to its fallback bucket.
func (c *Core) paceGrace() int64 {
	return int64(c.cfg.Scan+c.cfg.Tick) + int64(2*c.Latency*float64(time.Second))
}
