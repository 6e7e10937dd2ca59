package client

import (
	"sync"
	"time"
)

// Throttler is client-side adaptive throttling as described in Google's SRE
// book ("Handling Overload"): over a sliding window it counts the requests
// the application attempted and the requests the backend accepted, and
// rejects a new request locally with probability
//
//	max(0, (requests − K·accepts) / (requests + 1))
//
// so a client whose backend keeps refusing it sends ever fewer requests,
// while a healthy one (accepts ≈ requests) is never throttled: with K = 2 the
// backend has to refuse more than half of the traffic before any request is
// rejected locally.
//
// The window is a ring of time buckets: counts older than the window drop out
// one bucket at a time. Time is passed in, so the Throttler is deterministic;
// a clock going backwards counts into the newest bucket. A Throttler is safe
// for concurrent use; its zero value is not usable, call NewThrottler.
type Throttler struct {
	k     float64
	width int64 // bucket width, nanoseconds
	mu    sync.Mutex
	// guarded by mu:
	reqs, accs []int64 // per bucket
	last       int64   // epoch (now/width) of the newest bucket
	totalReqs  int64
	totalAccs  int64
	started    bool
}

// NewThrottler returns a Throttler with multiplier k over window, counted in
// buckets time buckets. It panics on non-positive arguments, which are
// programming errors (Config.Validate checks them for Transport).
func NewThrottler(k float64, window time.Duration, buckets int) *Throttler {
	if k <= 0 || window <= 0 || buckets <= 0 || window < time.Duration(buckets) {
		panic("client: NewThrottler needs k > 0, window > 0 and 0 < buckets ≤ window in ns")
	}
	return &Throttler{
		k:     k,
		width: int64(window) / int64(buckets),
		reqs:  make([]int64, buckets),
		accs:  make([]int64, buckets),
	}
}

// advance drops the buckets that left the window; mu must be held. It
// returns the ring index of the current bucket.
func (t *Throttler) advance(now time.Time) int {
	n := int64(len(t.reqs))
	epoch := now.UnixNano() / t.width
	if !t.started {
		t.started, t.last = true, epoch
	}
	if epoch > t.last {
		steps := epoch - t.last
		if steps > n {
			steps = n
		}
		for i := int64(1); i <= steps; i++ {
			idx := (t.last + i) % n
			if idx < 0 {
				idx += n
			}
			t.totalReqs -= t.reqs[idx]
			t.totalAccs -= t.accs[idx]
			t.reqs[idx], t.accs[idx] = 0, 0
		}
		t.last = epoch
	}
	idx := t.last % n
	if idx < 0 {
		idx += n
	}
	return int(idx)
}

// RejectProbability returns the current local rejection probability.
func (t *Throttler) RejectProbability(now time.Time) float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.advance(now)
	return t.prob()
}

func (t *Throttler) prob() float64 {
	p := (float64(t.totalReqs) - t.k*float64(t.totalAccs)) / float64(t.totalReqs+1)
	if p < 0 {
		return 0
	}
	return p
}

// Attempt counts one request the application attempts at now and decides
// whether to send it: u is a uniform random number in [0, 1), and the request
// is rejected locally when u < the rejection probability computed before
// counting it. Every attempt counts as a request, sent or not.
func (t *Throttler) Attempt(now time.Time, u float64) (send bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	idx := t.advance(now)
	send = !(u < t.prob())
	t.reqs[idx]++
	t.totalReqs++
	return send
}

// Accepted counts one request the backend accepted at now.
func (t *Throttler) Accepted(now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	idx := t.advance(now)
	t.accs[idx]++
	t.totalAccs++
}

// Counts returns the requests and accepts inside the window at now.
func (t *Throttler) Counts(now time.Time) (requests, accepts int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.advance(now)
	return t.totalReqs, t.totalAccs
}
