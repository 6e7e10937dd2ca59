package upstream

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/allot/allot/pkg/rules"
)

// MaxWant bounds want, held, returned, outage_charged and demand, as the
// allocator bounds them in an Acquire (allotv1.MaxAmount): a region's
// demand, the sum of its gateways' reports, may exceed it, and is sent
// as MaxWant then.
const MaxWant = 1_000_000_000_000

// maxReports bounds the demand reports remembered for the fall reading
// (FallWindow of Ticks; a longer ring only reads falls over a shorter span).
const maxReports = 64

// Demand falls: as the agent does for one key at one gateway, a region
// whose demand clearly fell takes the fallen rate at once rather than
// waiting for the gateways' EWMAs to decay. Right after the hot spot of a
// key moves to another region, the region it left still reports about a
// second of its old rate, claims that much of the global refill and holds
// a lease sized for it; the region the traffic moved to meanwhile falls
// short (bench/sim -scenarios regions).
const (
	// FallFactor: the rate read over FallWindow must be at most the
	// reported demand divided by this.
	FallFactor = 2
	// FallMinTokens: the reported demand over FallWindow must be at least
	// this many tokens, so that noise never reads as a fall.
	FallMinTokens = 40
)

// OverdueFactor: a call in flight for this many measured round trips (and
// at least Config.OverdueMin) is overdue. Answers vary with the global
// cluster's commit latency by well under a round trip; a call three round
// trips old is waiting on something else: a global leader that is gone,
// whose follower retries for the next one, or a link that is down.
const OverdueFactor = 3

// maxGrants bounds the grants remembered for the estimated share
// (ShareWindow of refills at most every Tick; older ones fall out first,
// which only lowers the estimate).
const maxGrants = 128

// Config sets the policy for every global key of one regional cluster. The
// zero value of a field means its default; DefaultConfig lists them.
type Config struct {
	// RTT is the round trip to the global cluster. It is part of the low
	// watermark: a refill starts while the key still holds what its
	// region spends during RTT + Tick. Default 150 ms.
	RTT time.Duration
	// Tick is how often the regional leader evaluates each global key.
	// Default 100 ms.
	Tick time.Duration
	// Horizon is the period of demand a refill aims to hold beyond the low
	// watermark. Default 1 s (bench/sim regions: shorter horizons left the
	// region too little to absorb its gateways' refills, of a second of
	// their demand each).
	Horizon time.Duration
	// CallTimeout: an upstream call unanswered after this has failed and
	// the region counts as cut off. Default 1 s.
	CallTimeout time.Duration
	// OverdueMin is the least time after which a call in flight counts as
	// overdue (see Key.OverdueAfter). Default 250 ms: an answer takes the
	// round trip plus a Raft commit at the global cluster (two fsyncs,
	// tens of ms at p99 on a busy disk) and, from a global follower, a
	// forward to its leader, so a call a few short round trips old (a
	// region next to its global cluster) is no sign of trouble yet.
	OverdueMin time.Duration
	// RetryBackoff is the wait after a failed call before the next one.
	// Default 1 s.
	RetryBackoff time.Duration
	// ShareWindow is the window of grants the fair share is estimated
	// over when the global cluster sends none with its grant (one that
	// predates Grant.Share; see Key.Granted). Default 4 s.
	ShareWindow time.Duration
	// DemandTau is the time constant of the demand EWMA each gateway
	// reports (the agent's, 1 s by default). A fall of the region's demand
	// is read from how fast the sum of those EWMAs falls (see Tick).
	DemandTau time.Duration
	// FallWindow is the span over which a fall of demand is read. Default
	// 500 ms.
	FallWindow time.Duration
	// IdleAfter: a key none of whose gateways reported demand, had a want
	// cut or was sub-granted anything for this long is idle (see
	// Key.Idle). Default 10 s.
	IdleAfter time.Duration
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		RTT:          150 * time.Millisecond,
		Tick:         100 * time.Millisecond,
		Horizon:      time.Second,
		CallTimeout:  time.Second,
		OverdueMin:   250 * time.Millisecond,
		RetryBackoff: time.Second,
		ShareWindow:  4 * time.Second,
		DemandTau:    time.Second,
		FallWindow:   500 * time.Millisecond,
		IdleAfter:    10 * time.Second,
	}
}

// Validate reports a negative or over-long setting.
func (c Config) Validate() error {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"RTT", c.RTT}, {"Tick", c.Tick}, {"Horizon", c.Horizon}, {"CallTimeout", c.CallTimeout},
		{"OverdueMin", c.OverdueMin}, {"RetryBackoff", c.RetryBackoff}, {"ShareWindow", c.ShareWindow}, {"DemandTau", c.DemandTau}, {"FallWindow", c.FallWindow},
		{"IdleAfter", c.IdleAfter}} {
		if f.d < 0 || f.d > time.Hour {
			return fmt.Errorf("upstream: %s must be between 0 and 1h, got %v", f.name, f.d)
		}
	}
	return nil
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	for _, p := range []struct{ v, def *time.Duration }{{&c.RTT, &d.RTT}, {&c.Tick, &d.Tick}, {&c.Horizon, &d.Horizon},
		{&c.CallTimeout, &d.CallTimeout}, {&c.OverdueMin, &d.OverdueMin}, {&c.RetryBackoff, &d.RetryBackoff}, {&c.ShareWindow, &d.ShareWindow},
		{&c.DemandTau, &d.DemandTau}, {&c.FallWindow, &d.FallWindow}, {&c.IdleAfter, &d.IdleAfter}} {
		if *p.v == 0 {
			*p.v = *p.def
		}
	}
	return c
}

// Rule is what the policy needs of a scope: global rule, for one region.
type Rule struct {
	Rate     float64              // the rule's rate, tokens/s
	Burst    int64                // the rule's burst
	Fallback rules.GlobalFallback // what the region falls to when cut off
	Fraction float64              // with FallbackStatic: this region's fraction of Rate, in [0, 1]
}

// RuleOf returns region's view of a compiled rule.
func RuleOf(r *rules.Rule, region string) Rule {
	out := Rule{Fallback: r.GlobalFallback, Fraction: r.StaticFraction(region)}
	if !r.Unlimited && !r.DenyAll && r.Window > 0 {
		out.Rate = float64(r.RequestsPerUnit) / r.Window.Seconds()
		out.Burst = r.Burst
	}
	return out
}

// Validate reports a rule the policy cannot follow.
func (r Rule) Validate() error {
	switch {
	case !(r.Rate >= 0) || math.IsInf(r.Rate, 0):
		return fmt.Errorf("upstream: rate must be ≥ 0, got %v", r.Rate)
	case r.Burst < 0:
		return fmt.Errorf("upstream: burst must be ≥ 0, got %d", r.Burst)
	case !(r.Fraction >= 0 && r.Fraction <= 1):
		return fmt.Errorf("upstream: fraction must be in [0, 1], got %v", r.Fraction)
	case r.Fallback > rules.FallbackStatic:
		return fmt.Errorf("upstream: unknown fallback %v", r.Fallback)
	}
	return nil
}

// Request is an upstream call the region makes for the key: an Acquire of
// the global key with the region as the agent.
type Request struct {
	ID   uint64 // strictly increasing per key
	Want int64  // tokens wanted for the next Horizon
	// Held is the lease balance the region keeps after this call. What
	// its gateways hold is theirs, sub-leased, and bounded by the regional
	// cluster's own grant policy: counting it here too would make the
	// global cluster's hold caps bind on a region twice.
	Held     int64
	Returned int64   // tokens handed back now (no longer the region's once sent)
	Demand   float64 // the region's demand, tokens/s
	// OutageCharged: tokens the region admitted from its fallback share
	// while cut off, reported once for the global bucket to pay for what
	// it can.
	OutageCharged int64
	Final         bool // a Release: the region gives the key up
}

// Grant is the global cluster's answer to a Request.
type Grant struct {
	ID           uint64        // the Request's ID
	Granted      int64         // new tokens for the region
	RefreshAfter time.Duration // come back after this (0: after Horizon)
	// Share is the region's max-min fair share of the rule's rate by the
	// regions' reported demands, as the global cluster computed it for
	// this answer, tokens/s (KeyGrant.share). HasShare is false when the
	// global cluster sent none (one that predates the field).
	Share    float64
	HasShare bool
}

// Key is the policy of one global key at one regional leader. Create it
// with NewKey; the zero value is not usable.
type Key struct {
	cfg  Config
	rule Rule

	avail int64 // lease tokens held and not sub-granted
	out   int64 // lease tokens sub-granted, neither returned nor reported spent

	nextID    uint64
	inflight  bool
	sent      Request // the call in flight
	sentAt    int64
	refreshAt int64 // the server-directed refresh (0: none yet)
	srtt      int64 // the smoothed round trip of answered calls, ns (0: none measured yet)
	retryAt   int64 // when cut off: no call before this

	connected bool  // the last call was answered (false before the first)
	cutAt     int64 // when the last failure cut the region off (valid when cut)
	cut       bool

	grants [maxGrants]struct{ at, n int64 } // ring of recent grants
	gHead  int                              // next slot
	gLen   int
	share  float64 // tokens/s: the fair share at the last grant (see Granted)

	fb      float64 // fallback tokens available to sub-grant
	fbAt    int64   // the last fallback mint (valid when minting)
	minting bool
	fbOwed  int64 // fallback tokens sub-granted, to report as outage_charged
	// minted: Mint handed fallback tokens to the regional state since the
	// region was cut off; the share then accrues continuously (the lease
	// balance holds what was minted and not yet spent, not lease tokens).
	minted bool

	demand float64 // the demand the last Tick used (after a fall, the fallen rate)
	// reports is a ring of the demand reported and the tokens sub-granted,
	// per Tick.
	reports [maxReports]struct {
		at      int64
		d, flow float64
	}
	rHead   int
	rLen    int
	flowNow int64 // tokens sub-granted since the last Tick
	shortAt int64 // the last time Cap cut a want (0: never)
	usedAt  int64 // the last demand reported or token sub-granted (0: none since NewKey)
	now     int64 // the latest time seen (time never runs backwards here)

	c Counters
}

// Counters are a key's totals since NewKey.
type Counters struct {
	Received    int64 // tokens granted by the global cluster and accepted
	Returned    int64 // tokens handed back upstream
	SubGranted  int64 // lease tokens sub-granted to gateways
	SubReturned int64 // lease tokens gateways handed back
	Minted      int64 // fallback tokens sub-granted while cut off
	Dropped     int64 // tokens gateways handed back beyond what they owed the lease (fallback tokens)
	Calls       int64 // upstream calls made
	Failures    int64 // upstream calls failed or timed out
	Stale       int64 // replies ignored: not the call in flight
}

// ErrStale is returned for a reply that does not answer the call in flight
// (a repeated, late or unknown reply); it changes nothing.
var ErrStale = errors.New("upstream: reply to a call not in flight")

// NewKey returns the policy of a key under rule, holding nothing.
func NewKey(cfg Config, rule Rule) (*Key, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := rule.Validate(); err != nil {
		return nil, err
	}
	return &Key{cfg: cfg.withDefaults(), rule: rule}, nil
}

// SetRule applies a changed rule; what the key holds stays.
func (k *Key) SetRule(rule Rule) error {
	if err := rule.Validate(); err != nil {
		return err
	}
	k.rule = rule
	if k.share > rule.Rate {
		k.share = rule.Rate
	}
	return nil
}

// advance moves the key's clock to now (never backwards) and mints the
// fallback share for the time since the last mint.
func (k *Key) advance(now int64) {
	if now < k.now {
		now = k.now
	}
	k.now = now
	minting := k.fallingBack(now) && (k.avail == 0 || k.minted)
	if minting && k.minting {
		if dt := float64(now-k.fbAt) / 1e9; dt > 0 {
			k.fb = min(k.fb+k.fallbackRate()*dt, k.fallbackCap())
		}
	}
	if minting {
		k.fbAt = now
	}
	k.minting = minting
}

// fallingBack reports whether the key serves from its fallback share once
// its lease is spent: the region is cut off, or its call in flight is
// overdue. A region whose call is overdue is as good as cut off for what
// it admits meanwhile: it holds nothing ahead, and the answer, if it comes,
// comes late. What it mints meanwhile is reported upstream as
// outage_charged, as a cut-off region's is, once a call is answered again.
func (k *Key) fallingBack(now int64) bool {
	return k.cut || k.overdue(now)
}

// overdue reports whether the call in flight is past OverdueAfter at now.
func (k *Key) overdue(now int64) bool {
	return k.inflight && now-k.sentAt >= int64(k.OverdueAfter())
}

// OverdueAfter is how long a call may be in flight before it is overdue:
// OverdueFactor round trips, measured (a smoothed mean of the answered
// calls, weight 1/8 to the newest) or, before the first answer, the
// configured RTT; at least OverdueMin and at most CallTimeout.
func (k *Key) OverdueAfter() time.Duration {
	rtt := time.Duration(k.srtt)
	if rtt == 0 {
		rtt = k.cfg.RTT
	}
	return min(max(OverdueFactor*rtt, k.cfg.OverdueMin), k.cfg.CallTimeout)
}

// fallbackRate is the share the region falls to when cut off, tokens/s.
func (k *Key) fallbackRate() float64 {
	if k.rule.Fallback == rules.FallbackStatic {
		return k.rule.Fraction * k.rule.Rate
	}
	return k.share
}

// fallbackCap bounds the fallback tokens that may accumulate: one Tick of
// the share, at least one token, so that a cut-off region admits its share
// as a rate, not in bursts.
func (k *Key) fallbackCap() float64 {
	return max(k.fallbackRate()*k.cfg.Tick.Seconds(), min(1, k.fallbackRate()))
}

// LowWater is the lease balance below which the key is refilled: what
// demand d (tokens/s) spends while a refill is collected (one Tick) and
// answered (RTT), at least one token.
func (k *Key) LowWater(d float64) int64 {
	return ceilTokens(d*(k.cfg.RTT.Seconds()+k.cfg.Tick.Seconds()), 1)
}

// Target is the lease balance a refill aims for: one Horizon of demand on
// top of the low watermark.
func (k *Key) Target(d float64) int64 {
	return min(ceilTokens(d*k.cfg.Horizon.Seconds(), 0)+k.LowWater(d), MaxWant)
}

func ceilTokens(x float64, floor int64) int64 {
	switch {
	case !(x > 0):
		return floor
	case x >= MaxWant:
		return MaxWant
	}
	return max(int64(math.Ceil(x)), floor)
}

// Tick evaluates the key at now, with its region's demand (tokens/s, the
// sum its gateways report). It returns the
// upstream call to make, if one is due: when the lease is below the low
// watermark, at the server-directed refresh, when there is an excess to
// hand back, or, when cut off, once the retry backoff has passed. A call
// in flight past CallTimeout has failed. An idle key (see Idle) makes a
// call only to hand back all it holds and to report what it minted; it
// wants nothing.
func (k *Key) Tick(now int64, demand float64) (Request, bool) {
	k.advance(now)
	if !(demand >= 0) || math.IsInf(demand, 0) {
		demand = 0
	}
	if demand > 0 {
		k.usedAt = now
	}
	demand = k.fallen(now, demand)
	k.demand = demand
	if k.inflight {
		if now-k.sentAt < int64(k.cfg.CallTimeout) {
			return Request{}, false
		}
		k.fail(now)
	}
	if k.cut && now < k.retryAt {
		return Request{}, false
	}
	idle := k.Idle(now)
	low, target := k.LowWater(demand), k.Target(demand)
	excess := int64(0)
	switch {
	case idle:
		excess = k.avail
	case !k.cut && k.avail > 2*target:
		excess = k.avail - target
	}
	excess = min(excess, MaxWant)
	due := excess > 0 || k.fbOwed > 0 ||
		!idle && (!k.connected || k.cut || k.avail < low || (k.refreshAt != 0 && now >= k.refreshAt))
	if !due {
		return Request{}, false
	}
	k.avail -= excess
	k.c.Returned += excess
	r := Request{
		ID:            k.nextID + 1,
		Want:          max(0, min(target-k.avail, MaxWant)),
		Held:          min(k.avail, MaxWant),
		Returned:      excess,
		Demand:        min(demand, MaxWant),
		OutageCharged: min(k.fbOwed, MaxWant),
	}
	if k.rule.Rate == 0 || idle {
		r.Want = 0 // a deny-all or unlimited rule, or an idle key: nothing to lease
	}
	k.fbOwed -= r.OutageCharged
	k.send(now, r)
	return r, true
}

// fallen records the reported demand and returns the demand to act on:
// the report, or, when it clearly fell, the rate it fell to. Two readings,
// each over the last FallWindow or more, count as a fall when the rate
// they read is at most the report over FallFactor and the report stands
// for at least FallMinTokens over the span:
//
//   - the report is a sum of EWMAs with time constant τ = DemandTau, so a
//     rate x held since a report d₀ taken dt ago gives
//     d = d₀ + (x − d₀)(1 − e^(−dt/τ)); x is the rate read;
//   - what the region sub-granted over the last two FallWindows, per
//     second, unless a want was cut for want of tokens in that span (a
//     region short of tokens sub-grants less than it needs). Gateways
//     report their demand only when they call, and those that hold a
//     second of a rate that has since fallen do not call: the tokens they
//     stop asking for show the fall first.
//
// A rise is left to the reports.
func (k *Key) fallen(now int64, d float64) float64 {
	k.reports[k.rHead] = struct {
		at      int64
		d, flow float64
	}{now, d, float64(k.flowNow)}
	k.flowNow = 0
	k.rHead = (k.rHead + 1) % maxReports
	k.rLen = min(k.rLen+1, maxReports)
	fell := func(x float64, dt int64) bool { return d*float64(dt)/1e9 >= FallMinTokens && x*FallFactor <= d }
	// The flow over the last 2·FallWindow, from the Ticks in that span.
	span := 2 * int64(k.cfg.FallWindow)
	flow, covered := 0.0, false
	for i := 1; i <= k.rLen; i++ {
		r := k.reports[(k.rHead-i+maxReports)%maxReports]
		if now-r.at >= span {
			covered = true
			break
		}
		flow += r.flow
	}
	if rate := flow / (float64(span) / 1e9); covered && now-k.shortAt > span && fell(rate, span) {
		return rate
	}
	// The newest report at least FallWindow old.
	for i := 2; i <= k.rLen; i++ {
		r := k.reports[(k.rHead-i+maxReports)%maxReports]
		dt := now - r.at
		if dt < int64(k.cfg.FallWindow) {
			continue
		}
		a := -math.Expm1(-float64(dt) / float64(k.cfg.DemandTau))
		if x := max(r.d+(d-r.d)/a, 0); fell(x, dt) {
			return x
		}
		break
	}
	return d
}

// Idle reports whether the key is idle at now: for IdleAfter, or since
// NewKey, its region reported no demand for it, cut no gateway's want
// (Cap, Short) and sub-granted none of its tokens. An idle key wants
// nothing upstream, hands back what it holds, mints nothing and is not
// refreshed, so that its lease at the global cluster runs out; a key
// that is idle, holds nothing and owes no report has nothing left at the
// global cluster, and the regional leader forgets its pool. A gateway's
// want cut for want of tokens ends it at once.
func (k *Key) Idle(now int64) bool {
	last := max(k.usedAt, k.shortAt)
	return last == 0 || now-last >= int64(k.cfg.IdleAfter)
}

func (k *Key) send(now int64, r Request) {
	k.nextID = r.ID
	k.inflight, k.sent, k.sentAt = true, r, now
	k.c.Calls++
}

// Release returns the call that gives the key up: everything the lease
// holds is handed back (MaxWant at most). The key holds nothing
// afterwards; its gateways' leases run out on their own.
func (k *Key) Release(now int64) Request {
	k.advance(now)
	r := Request{ID: k.nextID + 1, Returned: min(k.avail, MaxWant), Final: true, OutageCharged: min(k.fbOwed, MaxWant)}
	k.c.Returned += r.Returned
	k.avail, k.fb, k.fbOwed = 0, 0, k.fbOwed-r.OutageCharged
	k.send(now, r)
	return r
}

// Granted applies the global cluster's answer to the call in flight. A
// reply to any other call is ignored with ErrStale: each grant counts
// once. The share the answer carries, at most the rule's rate, is the
// fair share the key falls to when cut off (with FallbackFairShare); an
// answer without one (from a global cluster that predates Grant.Share)
// leaves the key to estimate it from its grants (see remember). A share
// that is negative, NaN or infinite counts as none.
func (k *Key) Granted(now int64, g Grant) error {
	k.advance(now)
	if !k.inflight || g.ID != k.sent.ID || g.Granted < 0 {
		k.c.Stale++
		return ErrStale
	}
	k.inflight = false
	if rtt := now - k.sentAt; rtt > 0 {
		if k.srtt == 0 {
			k.srtt = rtt
		} else {
			k.srtt += (rtt - k.srtt) / 8
		}
	}
	k.avail += g.Granted
	k.c.Received += g.Granted
	k.connected, k.cut, k.minting, k.fb, k.minted = true, false, false, 0, false
	refresh := g.RefreshAfter
	if refresh <= 0 {
		refresh = k.cfg.Horizon
	}
	k.refreshAt = now + int64(refresh)
	k.remember(now, g.Granted)
	if g.HasShare && g.Share >= 0 && !math.IsInf(g.Share, 0) {
		k.share = min(g.Share, k.rule.Rate)
	}
	k.advance(now)
	return nil
}

// remember records a grant and estimates the fair share from the grants:
// what the global cluster granted in the ShareWindow up to now, per second
// of the time those grants cover (from the first of them to one Horizon
// after the last), at most the rule's rate. In a steady state it is about
// the rate the global cluster's max-min fair share grants the region, but
// the regions' estimates, each of lumps of up to a Horizon of demand taken
// at its own last grant, may sum to more than the rate: Granted replaces
// it with the share the global cluster computed whenever one came.
func (k *Key) remember(now, n int64) {
	k.grants[k.gHead] = struct{ at, n int64 }{now, n}
	k.gHead = (k.gHead + 1) % maxGrants
	k.gLen = min(k.gLen+1, maxGrants)
	from := now - int64(k.cfg.ShareWindow)
	sum, first := int64(0), now
	for i := 1; i <= k.gLen; i++ {
		g := k.grants[(k.gHead-i+maxGrants)%maxGrants]
		if g.at <= from {
			break
		}
		sum, first = sum+g.n, g.at
	}
	// The grants in the window last from the first of them until one
	// Horizon after the last.
	span := float64(now-first+int64(k.cfg.Horizon)) / 1e9
	k.share = min(float64(sum)/span, k.rule.Rate)
}

// Failed reports that the call in flight failed (an error, or no answer).
// The region is cut off until a call is answered. A failure of any other
// call is ignored with ErrStale.
func (k *Key) Failed(now int64, id uint64) error {
	k.advance(now)
	if !k.inflight || id != k.sent.ID {
		k.c.Stale++
		return ErrStale
	}
	k.fail(now)
	return nil
}

// fail ends the call in flight as failed. The tokens it returned stay
// returned (the global cluster may have applied the call: handing them
// back twice would credit the global bucket twice). Its outage charge is
// owed again and goes with the next call: when the global cluster did
// apply the failed call and only its answer was lost, those tokens are
// charged twice, which only makes the global bucket admit less.
func (k *Key) fail(now int64) {
	k.inflight = false
	k.fbOwed += k.sent.OutageCharged
	k.c.Failures++
	if !k.cut {
		k.cut, k.cutAt = true, now
	}
	k.retryAt = now + int64(k.cfg.RetryBackoff)
	k.advance(now)
}

// Cap returns what a gateway asking for want may be granted at now: want,
// at most the lease balance and, when the region is cut off or its call
// is overdue, the fallback tokens accrued. The regional leader caps each gateway's want with it
// before the gateway's Acquire is committed, so that its regional grant
// policy sizes grants from what the region holds. A want it cuts marks the
// region as short of tokens (a region short of tokens sub-grants less than
// it needs, which is no sign of a fall; see Tick).
func (k *Key) Cap(now, want int64) int64 {
	k.advance(now)
	n := k.avail
	if k.fallingBack(now) {
		n += int64(k.fb)
	}
	if want > n {
		k.shortAt = now
		return max(n, 0)
	}
	return max(want, 0)
}

// Short records that the region cut a gateway's want for want of tokens
// at at (Unix ns; a regional state that caps wants itself records when it
// last did, and the leader passes it on before each Tick). Like a want Cap
// cuts, it marks the region as short of tokens, so that what it
// sub-grants meanwhile is not read as a fall of demand (see Tick).
func (k *Key) Short(at int64) {
	k.shortAt = max(k.shortAt, at)
}

// SubGrant hands up to want tokens to a gateway of the region and returns
// how many: from the lease while it holds any, then, when the region is
// cut off or its call is overdue and its lease is spent, from its fallback
// share. Never more than
// the key holds.
func (k *Key) SubGrant(now, want int64) int64 {
	k.advance(now)
	if want <= 0 {
		return 0
	}
	k.usedAt = now
	n := min(want, k.avail)
	k.avail -= n
	k.out += n
	k.c.SubGranted += n
	k.flowNow += n
	if n < want && k.fallingBack(now) {
		k.advance(now) // the lease may have just run dry: start minting
		f := min(want-n, int64(k.fb))
		k.fb -= float64(f)
		k.fbOwed += f
		k.c.Minted += f
		k.flowNow += f
		n += f
	}
	return n
}

// SubReturn credits n tokens a gateway handed back. What the gateways owe
// the lease goes back to it; anything beyond (fallback tokens) is dropped,
// so returns never grow the lease beyond what the global cluster granted.
func (k *Key) SubReturn(now, n int64) {
	k.advance(now)
	if n <= 0 {
		return
	}
	back := min(n, k.out)
	k.out -= back
	k.avail += back
	k.c.SubReturned += back
	k.c.Dropped += n - back
	k.advance(now)
}

// SubSpent records that gateways spent n of the lease tokens sub-granted to
// them (they reported it): those tokens no longer count as owed.
func (k *Key) SubSpent(n int64) {
	k.out -= min(max(n, 0), k.out)
}

// Status is a key's state, for inspection.
type Status struct {
	Available  int64   // lease tokens held and not sub-granted
	Owed       int64   // lease tokens sub-granted and not yet spent or returned
	Fallback   int64   // fallback tokens available while cut off
	Share      float64 // the fair share at the last grant, tokens/s (see Granted)
	FallbackRt float64 // the rate the region falls to when cut off, tokens/s
	Demand     float64 // the demand of the last Tick
	Connected  bool    // the last call was answered
	CutOff     bool    // the last call failed; no call answered since
	CutSince   int64   // when the region was cut off (when CutOff)
	InFlight   bool
	// Overdue: the call in flight is past OverdueAfter; the key falls
	// back as when cut off.
	Overdue bool
	// RTT: the smoothed round trip of answered calls (0: none yet).
	RTT time.Duration
	Counters
}

// Status returns the key's state at the latest time it saw.
func (k *Key) Status() Status {
	return Status{
		Available: k.avail, Owed: k.out, Fallback: int64(k.fb), Share: k.share, FallbackRt: k.fallbackRate(),
		Demand: k.demand, Connected: k.connected && !k.cut, CutOff: k.cut, CutSince: k.cutAt,
		InFlight: k.inflight, Overdue: k.overdue(k.now), RTT: time.Duration(k.srtt), Counters: k.c,
	}
}

// Resume sets what a key built by a new regional leader starts from: the
// lease balance the regional state records (avail), the fair share it
// recorded at the last grant (share, tokens/s) and the fallback tokens
// minted and not yet reported upstream (owed). The key is not connected:
// its first Tick makes a call.
func (k *Key) Resume(avail int64, share float64, owed int64) {
	k.avail = max(avail, 0)
	if share >= 0 && !math.IsInf(share, 0) {
		k.share = min(share, k.rule.Rate)
	}
	k.fbOwed = max(owed, 0)
}

// Sync sets the lease balance to avail, what the regional state records
// as held and not sub-granted. The regional state machine sub-grants to
// gateways and takes their returns itself; the regional leader reads the
// balance back before each Tick. A drop counts as sub-granted (and in the
// flow a fall of demand is read from), a rise as returned.
func (k *Key) Sync(now, avail int64) {
	k.advance(now)
	avail = max(avail, 0)
	switch d := k.avail - avail; {
	case d > 0:
		k.out += d
		k.c.SubGranted += d
		k.flowNow += d
		k.usedAt = now
	case d < 0:
		back := min(-d, k.out)
		k.out -= back
		k.c.SubReturned += back
	}
	k.avail = avail
	k.advance(now)
}

// Keep is how many of minted fallback tokens, minted at now, a region
// holds for its gateways while its pool owes debt (what its gateways'
// fallback buckets admitted beyond what it held): while it is cut off or
// its call is overdue, half of them, rounded up; the rest pays the debt,
// and what is left of the debt is paid out of the next grants. A region
// that paid its debt with the whole share would admit nothing for
// debt/share seconds at the moment it is already short (the global leader
// failing over, say). What the region admits stays within its bound, its
// share over the time plus what its gateways' fallback buckets admitted:
// the order of repayment moves no token. While its mints keep, the
// regional ledger has its gateways come back after 50 ms, not 500, so
// that what is kept for them is spent.
func (k *Key) Keep(now, minted, debt int64) int64 {
	if minted <= 0 || debt <= 0 || !k.fallingBack(max(now, k.now)) {
		return 0
	}
	return (minted + 1) / 2
}

// Mint takes the fallback tokens accrued while the region is cut off, or
// its call in flight is overdue (see OverdueAfter), and its lease is
// spent, for the regional state to sub-grant; they are reported upstream
// as outage_charged: each call carries what is owed, and a call that
// fails owes it again (see Failed), so the first call answered reports
// all. It returns 0 unless the key is cut off or overdue and holds
// nothing, and 0 for an idle key (see Idle): no gateway asks for it.
//
// Once it has minted, the share accrues continuously until a call is
// answered again, and what it hands out keeps the minted tokens the
// regional state holds unspent within one Tick of the share: the region
// admits its share as a rate, however its gateways' asks fall between
// Ticks.
func (k *Key) Mint(now int64) int64 {
	k.advance(now)
	if !k.fallingBack(now) || (k.avail > 0 && !k.minted) || k.Idle(now) {
		return 0
	}
	n := min(int64(k.fb), int64(k.fallbackCap())-k.avail)
	if n <= 0 {
		return 0
	}
	k.minted = true
	k.fb -= float64(n)
	k.fbOwed += n
	k.c.Minted += n
	k.avail += n // the regional state holds them now; Sync counts them as they go
	k.advance(now)
	return n
}
