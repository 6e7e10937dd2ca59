// Package policy is the agent's refill policy. Core (core.go) is the
// refill loop's pure core: it holds the loop-wide state (the breaker, the
// round-trip estimate, the overload backoff, the request ids) and each
// key's Key (its demand estimate, what it last reported, its pacing and
// holds), takes the time and what the check path published of a key (Obs),
// and returns what to send and what an answer changes. The functions here
// are its arithmetic: a key's demand estimate, the want and low watermark
// sized from it, the excess a key hands back, when a demand reads as a
// fall, and when a key whose grant fell short is paced.
//
// Everything is single-threaded and deterministic: every method and
// function takes the time and the counts as arguments, starts no
// goroutine, reads no clock and touches no atomic, so the refill loop
// (agent/refill.go), the simulator (through agent/agentsim) and the
// scripts in testdata drive it the same way.
//
// The scripts in testdata are the policy's specification, readable without
// the code: each block is a command with its arguments, then "----", then
// what the policy answers (TestArithmetic, TestDemand and TestCore list
// the commands). `go test ./agent/internal/policy -rewrite` rewrites the
// answers after a deliberate change (review the diff).
package policy

import (
	"math"
	"time"
)

const (
	// DemandTau is the time constant of the per-key demand EWMA.
	DemandTau = time.Second
	// LeaseHorizon is the period a want is sized for: one refresh interval
	// of demand, the allocator's default RefreshInterval (docs/leases.md:
	// want = demand × F, plus the low watermark, minus what is held).
	LeaseHorizon = time.Second
	// MinRateWindow keeps a fresh key's demand estimate from overshooting:
	// tokens seen since the previous scan are spread over at least this.
	MinRateWindow = 250 * time.Millisecond
	// SparseTokens: a key expected to spend fewer tokens than this in a
	// lease horizon is sparse (see Demand.Of).
	SparseTokens = 2
	// MaxWant is the allocator's bound on want (and on returned and charged).
	MaxWant = 1_000_000_000_000
	// MaxLeaseMargin caps the safety margin taken off each lease's TTL.
	MaxLeaseMargin = 250 * time.Millisecond
)

// Demand falls. A load balancer that moves a key's traffic from one
// gateway to another leaves the first holding about a second of its old
// rate, and an EWMA with a 1 s time constant takes 0.7 s to halve.
// Meanwhile the gateway asks for nothing, and the allocator weighs its old
// demand against the gateway the traffic went to, whose allowance then
// falls short of its new rate (bench/load -workload skew: the false
// rejects were the first second after each switch). So a scan whose count
// leaves no doubt that the rate fell by more than ShiftFactor sets the
// demand to the scan's rate, and the key is reported at once, its excess
// holding returned (Excess). A rise is left to the EWMA and the recent
// rate (Demand.Of): a key whose grants come in bursts (paced, or over its
// limit) admits at its full offered rate right after each grant, and
// taking such a scan's rate as its demand overstated it (bench/sim
// hot-key: 0% → 0.78% false rejects).
const (
	// ShiftFactor: the rate over one scan must be this many times below
	// the EWMA.
	ShiftFactor = 4
	// ShiftMinTokens: the EWMA's expected count over the scan must be at
	// least this, so that a Poisson key's noise never reads as a fall:
	// P(X ≤ 10 | mean 40) ≈ 2·10⁻⁸.
	ShiftMinTokens = 40
)

// Demand is one key's demand estimate, updated by every scan of the key.
type Demand struct {
	Rate      float64 // EWMA of tokens/s
	SpentSeen int64   // the key's cumulative admissions at the latest scan
	ActiveAt  int64   // the latest scan that saw tokens spent; 0 = none yet
	Gap       float64 // smoothed seconds per token between such scans (see Of)
}

// Alpha is the EWMA's weight for a scan dt seconds after the previous one.
func Alpha(dt float64) float64 {
	if dt <= 0 {
		return 0
	}
	return 1 - math.Exp(-dt/DemandTau.Seconds())
}

// Scan folds a scan at now into the estimate: spent is the key's
// cumulative admissions, dt the seconds since the previous scan (0: the
// first scan, or the clock went back; the rate is left alone), alpha =
// Alpha(dt), and quiet whether the key has denied nothing since its latest
// report. It reports whether the rate fell (Fell; never while the key
// denies: a fall in what a scan admits is then the limiter's doing, not
// the traffic's), in which case the demand is now the scan's rate.
func (d *Demand) Scan(now, spent int64, dt, alpha float64, quiet bool) (fell bool) {
	if dt > 0 {
		delta := max(spent-d.SpentSeen, 0)
		fell = quiet && Fell(d.Rate, delta, dt)
		if fell {
			d.Rate = float64(delta) / dt
		} else {
			d.Rate += alpha * (float64(delta)/dt - d.Rate)
		}
		if d.Rate < 1e-3 {
			d.Rate = 0
		}
		if delta > 0 {
			if d.ActiveAt != 0 && now > d.ActiveAt {
				d.Gap = GapAvg(d.Gap, now-d.ActiveAt, delta)
			}
			d.ActiveAt = now
		}
	}
	d.SpentSeen = spent
	return fell
}

// Decay is Scan for a scan that saw nothing spent and could not read a
// fall: the rate decays by alpha.
func (d *Demand) Decay(alpha float64) {
	d.Rate += alpha * (0 - d.Rate)
	if d.Rate < 1e-3 {
		d.Rate = 0
	}
}

// DecayTime bounds how long a rate of r tokens/s takes to decay below the
// 1e-3 tokens/s at which a scan sets it to zero when nothing is spent: one
// time constant more than ln(r/1e-3) of them.
func DecayTime(r float64) time.Duration {
	if r <= 1e-3 {
		return 0
	}
	return time.Duration((math.Log(r*1e3) + 1) * float64(DemandTau))
}

// Of estimates the key's tokens/s at now, with spent its cumulative
// admissions and lastScan the time of the latest scan: the EWMA, or the
// rate since the last scan when that is higher (a key that just woke up).
//
// A sparse key (under SparseTokens per lease horizon) that has been used
// before reports at most its rate from the smoothed gaps between uses: one
// token every 4 s is 0.25/s, where one token since the last scan read as
// 4/s, and the EWMA (time constant 1 s) jumps to about 1/s just after a use
// (it has decayed to about 0.02/s just before the next; the lower of the
// two is reported, because the allocator rounds each agent's claim up to a
// whole token per interval). The demand is what the allocator weighs
// against the other agents' on the key; overstating it at every lightly
// used agent of a low-rate key starved the busy one (bench/sim
// unreachable, skewed keys). A sparse key used only once reports 0. A
// recent rate above the EWMA (a key that wakes up) counts only from
// SparseTokens tokens since the last scan, spread over the time since the
// key's previous use (at least MinRateWindow).
func (d *Demand) Of(now, spent, lastScan int64) float64 {
	r := d.Rate
	pending := max(spent-d.SpentSeen, 0)
	// A key that was used before spreads its new tokens over the time since
	// that use: two requests of a 0.25/s key landing in one scan are not a
	// key waking up at 8/s (they claimed 9 tokens of a 20/s key).
	since := lastScan
	if d.ActiveAt != 0 {
		since = d.ActiveAt // a scan time: ≤ lastScan, equal for a busy key
	}
	elapsed := max(now-since, int64(MinRateWindow))
	if recent := float64(pending) / (float64(elapsed) / float64(time.Second)); recent > r && pending >= SparseTokens {
		r = recent
	}
	if d.ActiveAt == 0 || r*LeaseHorizon.Seconds() >= SparseTokens {
		return r
	}
	g := d.Gap
	if pending > 0 && now > d.ActiveAt {
		g = GapAvg(g, now-d.ActiveAt, pending) // the gap ending now counts too
	}
	if g == 0 {
		// Used once so far: no gap to measure a rate from. Just after the
		// use the EWMA reads about 1/s whatever the key's rate, which asked
		// for two tokens and made each of 199 gateways that saw a 20/s key
		// once weigh 2 tokens in the busy agent's share (bench/sim
		// unreachable, full scale). Report no demand: the agent still
		// wants its one token, and the allocator weighs a one-token lease
		// without demand at almost nothing for the others.
		return 0
	}
	return min(r, 1/g)
}

// GapAvg folds a gap of span nanoseconds over tokens uses into avg, the
// smoothed seconds per token (0: none yet). One gap is a poor estimate of
// a Poisson rate (1/gap has no mean), so gaps are averaged, weight 1/4.
func GapAvg(avg float64, span, tokens int64) float64 {
	g := float64(span) / float64(time.Second) / float64(tokens)
	if avg == 0 {
		return g
	}
	return avg + 0.25*(g-avg)
}

// Fell reports whether a scan that counted delta tokens over dt seconds,
// for a key whose demand EWMA is d, shows the key's rate fell: the scan's
// count is at most 1/ShiftFactor of the expected d·dt, and that is at
// least ShiftMinTokens.
func Fell(d float64, delta int64, dt float64) bool {
	expected := d * dt
	return expected >= ShiftMinTokens && float64(delta)*ShiftFactor <= expected
}

// Excess returns what a key holding bal tokens against a target of target
// hands back: the holding beyond twice its target, down to the target,
// when that is at least ShiftMinTokens (a few tokens beyond are not worth
// the churn). A gateway whose load balancer moved the key's traffic away
// holds up to a second of its old rate; that holding counts in the other
// agents' hold caps on the key and would take ten seconds or more to spend
// at its new rate.
func Excess(bal, target int64) int64 {
	if bal <= 2*target || bal-target < ShiftMinTokens {
		return 0
	}
	return bal - target
}

// Want is what a key with demand d (tokens/s) aims to hold after a
// refill: one lease horizon of demand plus what it spends while the next
// refill is collected (two ticks) and answered (latency, seconds), rounded
// up once (the refill asks for at least one token). Rounding the two up
// separately, the low watermark to at least one token, made every lightly
// used agent ask for two, and on a low-rate key spread over many gateways
// those needs added up past the key's capacity: the water-filling then
// starved the busy agent.
func Want(d float64, tick time.Duration, latency float64) int64 {
	w := d * (LeaseHorizon.Seconds() + 2*tick.Seconds() + latency)
	if w > MaxWant {
		return MaxWant
	}
	return int64(math.Ceil(w))
}

// LowWater is the balance below which a key is refilled: what demand d
// (tokens/s) spends while a refill is collected (two ticks) and answered
// (latency, seconds), at least one token.
func LowWater(d float64, tick time.Duration, latency float64) int64 {
	w := d * (2*tick.Seconds() + latency)
	if w < 1 {
		return 1
	}
	if w > MaxWant {
		return MaxWant
	}
	return int64(math.Ceil(w))
}

// FirstUse reports whether a key is reported for the first time after a
// single use that its fallback bucket admitted: it has no demand d (a key
// used once reports none, see Demand.Of), holds nothing (balance), and
// every token it ever admitted (spent) is in this report's charge. Such a
// key of a thin share asks for no token. Asking for one cost the key two
// tokens for each gateway's first use, the charge and the prefetched
// token, and the token is often handed back unused after the idle timeout:
// with 199 gateways each using a 20/s key once every 41 s, 20.8/s against
// the key's 20/s refill for the first seconds, and the gateway carrying
// most of its traffic came up short (bench/sim unreachable, full scale).
// Instead the token the fallback bucket lent for the use is given back to
// it once the allocator has debited the charge, so a second use is
// admitted as the first was, and charged.
func FirstUse(d float64, charged, spent, balance int64) bool {
	return d == 0 && charged > 0 && spent == charged && balance <= 0
}

// ThinShare reports whether an agent's fallback share of a key, quota
// tokens per window shared by n agents, is under one token per lease
// horizon (R/N·F_h < 1): then one prefetched token at each gateway's first
// use is more than that gateway's share of the key, and N of them a
// sizeable part of its refill. A key alone at this agent (n < 2, or a
// consistent-hash rule) keeps prefetching.
func ThinShare(quota int64, window time.Duration, n uint32) bool {
	if n < 2 || window <= 0 {
		return false
	}
	return float64(quota)*LeaseHorizon.Seconds() < window.Seconds()
}

// LeaseMargin is taken off a lease's TTL: clocks drift and the allocator's
// expiry command runs on its own schedule.
func LeaseMargin(ttl time.Duration) time.Duration {
	return min(ttl/10, MaxLeaseMargin)
}
