package agent

import (
	"math"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// Retry-After is a promise: a client that is denied, waits exactly the
// advertised delay and sends one request is admitted, unless other traffic
// on the key took the token first.
//
// The decision that denied the first request and the one that decides the
// retry may read different states. A burst admitted by the fallback bucket
// is charged to the allocator only at the next Acquire, so the global
// bucket starts refilling later than the fallback bucket did, and the
// allocator's EXHAUSTED answer (deniedUntil, or the paced ask's) ends later
// than the fallback's RetryAfter; the fallback bucket itself is lowered to
// this agent's share of the global remaining at each answer. Either way the
// retry could be denied for a token the first decision counted on.
//
// So each leased key keeps the earliest promise of its latest denial: the
// moment (now + RetryAfter) and the tokens asked for. A request at or after
// that moment that the lease path would deny is admitted instead, once,
// and charged to the allocator like a fallback admission.
//
// It does not admit past the bucket. A promise is kept only if this agent
// admitted nothing on the key since the denial (so the token the denial
// counted on is still there, as far as this agent can see), for at most n
// tokens, once, and within promiseHold of its moment. The denial's
// RetryAfter was the wait until the bucket it read (the allocator's global
// bucket, or this agent's share of it) holds n tokens, with this agent's
// earlier admissions already taken out: the kept request spends that
// token, at the moment the bucket holds it, and the charge debits it from
// the global bucket, so the allocator counts it like every other
// admission. With one agent on the key that is the whole story. With
// several, another agent's traffic in the same interval may have taken the
// token first (the case Retry-After does not promise), which this agent
// cannot see: the request could only be admitted on credit. Every agent on
// a busy key would keep one promise after each denial, admitting about one
// request per agent per Retry-After beyond the budget (9.5 R with 200
// agents on a key of 20/s, in bench/sim's unreachable scenario at full
// scale), and the debt floor of −burst (bucket.Limit.Debit) would forgive
// most of it. So a promise is kept only while the key's latest answer said
// no other agent holds a lease on it (keyState.shared).
//
// Promises are neither made nor kept while the breaker is open, or for keys
// the allocator does not lease: those are decided by the fallback bucket
// alone, whose arithmetic keeps its own promises, and their admissions are
// not charged.
type promise struct {
	at    int64 // Unix nanos the denied request was told to come back; 0 = none
	spent int64 // keyState.spent at the denial: the promise lapses once it moves
	n     int64 // tokens the denied request asked for
}

// Promises are timed with the precise clock (Agent.preciseNow), not the
// coarse one checks use: the coarse clock lags by however long its ticking
// goroutine waits for a CPU, and a client that rounds Retry-After up by
// almost nothing and comes back on time would otherwise arrive "early".
// The moment is the denial's precise time plus its RetryAfter, which the
// coarse clock's lag can only make later than the token's true moment.

// promiseHold is how long after its moment a promise is kept: Retry-After
// is rounded up to whole seconds (under 1 s later), and the client's own
// scheduling and round trip come on top.
const promiseHold = 2 * time.Second

// keepPromise is called for a request of n > 0 tokens on a leased key that
// the lease path denied with retryAfter. It reports whether the key's
// promise admits it (and spends the promise); otherwise it records this
// denial's promise, keeping the earlier one while it is pending.
func (ks *keyState) keepPromise(now, n int64, retryAfter time.Duration) bool {
	spent := ks.spent.Load()
	ks.mu.Lock()
	defer ks.mu.Unlock()
	p := &ks.promise
	valid := p.at != 0 && p.spent == spent && now < p.at+int64(promiseHold)
	if valid && now >= p.at && n <= p.n && !ks.shared {
		*p = promise{}
		return true
	}
	if retryAfter <= 0 || retryAfter == bucket.Never || int64(retryAfter) > math.MaxInt64-now {
		return false
	}
	at := now + int64(retryAfter)
	if valid && now < p.at && p.at <= at && p.n >= n {
		return false // the pending promise is earlier
	}
	*p = promise{at: at, spent: spent, n: n}
	return false
}
