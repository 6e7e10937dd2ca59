package main

import (
	"math"
	"math/rand/v2"
	"slices"
	"strconv"

	"github.com/cespare/xxhash/v2"
)

// router picks the gateway (agent) that receives a request for a key.
type router interface{ pick(key int) int }

// spread: a load balancer that spreads requests uniformly over the agents.
type spread struct {
	rng *rand.Rand
	n   int
}

func (s *spread) pick(int) int { return s.rng.IntN(s.n) }

// skewed: each key has a home agent (key mod n) that receives a share
// `home` of its requests; the rest are spread uniformly. Sticky sessions and
// uneven client placement look like this.
type skewed struct {
	rng  *rand.Rand
	n    int
	home float64
}

func (s *skewed) pick(key int) int {
	if s.rng.Float64() < s.home {
		return key % s.n
	}
	return s.rng.IntN(s.n)
}

// ring is consistent hashing with virtual nodes; members can leave and
// join (routing churn), and the ring can be re-seeded (a full reshuffle).
type ring struct {
	seed    uint64
	members []int
	points  []ringPoint
}

type ringPoint struct {
	h     uint64
	agent int
}

const ringVNodes = 64

func newRing(n int, seed uint64) *ring {
	r := &ring{seed: seed}
	for i := range n {
		r.members = append(r.members, i)
	}
	r.build()
	return r
}

func (r *ring) build() {
	r.points = r.points[:0]
	var buf []byte
	for _, m := range r.members {
		for v := range ringVNodes {
			buf = strconv.AppendUint(strconv.AppendInt(strconv.AppendUint(buf[:0], r.seed, 10), int64(m), 10), uint64(v), 10)
			r.points = append(r.points, ringPoint{xxhash.Sum64(buf), m})
		}
	}
	slices.SortFunc(r.points, func(a, b ringPoint) int {
		switch {
		case a.h < b.h:
			return -1
		case a.h > b.h:
			return 1
		}
		return a.agent - b.agent
	})
}

func (r *ring) remove(agent int) {
	r.members = slices.DeleteFunc(r.members, func(m int) bool { return m == agent })
	r.build()
}

func (r *ring) add(agent int) {
	if !slices.Contains(r.members, agent) {
		r.members = append(r.members, agent)
		slices.Sort(r.members)
		r.build()
	}
}

func (r *ring) reseed(seed uint64) {
	r.seed = seed
	r.build()
}

func (r *ring) pick(key int) int {
	var b [24]byte
	h := xxhash.Sum64(strconv.AppendInt(b[:0], int64(key), 10))
	i, _ := slices.BinarySearchFunc(r.points, h, func(p ringPoint, h uint64) int {
		switch {
		case p.h < h:
			return -1
		case p.h > h:
			return 1
		}
		return 0
	})
	if i == len(r.points) {
		i = 0
	}
	return r.points[i].agent
}

// zipfWeights returns the normalised Zipf(s) popularity of n keys
// (key k has weight (k+1)^-s).
func zipfWeights(n int, s float64) []float64 {
	w := make([]float64, n)
	var sum float64
	for k := range n {
		w[k] = math.Pow(float64(k+1), -s)
		sum += w[k]
	}
	for k := range w {
		w[k] /= sum
	}
	return w
}

// limitForOverLimit finds the per-key rate R such that a share `over` of
// the traffic (total rate lambda, key popularity p) is above its key's
// limit: Σ max(0, λ·p_k − R) = over·λ.
func limitForOverLimit(p []float64, lambda, over float64) float64 {
	f := func(r float64) float64 {
		var x float64
		for _, pk := range p {
			d := lambda * pk
			if d <= r {
				break // p is decreasing
			}
			x += d - r
		}
		return x / lambda
	}
	lo, hi := 0.0, lambda
	for range 100 {
		mid := (lo + hi) / 2
		if f(mid) > over {
			lo = mid
		} else {
			hi = mid
		}
	}
	return hi
}

// profile is a piecewise-linear request rate over time (seconds → req/s).
type profile []struct{ t, rate float64 }

func (p profile) at(t float64) float64 {
	if t <= p[0].t {
		return p[0].rate
	}
	for i := 1; i < len(p); i++ {
		if t <= p[i].t {
			a, b := p[i-1], p[i]
			return a.rate + (b.rate-a.rate)*(t-a.t)/(b.t-a.t)
		}
	}
	return p[len(p)-1].rate
}

func (p profile) max() float64 {
	m := 0.0
	for _, x := range p {
		m = max(m, x.rate)
	}
	return m
}

func (p profile) mean(until float64) float64 {
	const steps = 1000
	var s float64
	for i := range steps {
		s += p.at(until * (float64(i) + 0.5) / steps)
	}
	return s / steps
}

// arrivals is a Poisson request source with a time-varying rate (thinning
// at the profile's peak), picking the key from a sampler and the agent from
// a router. It is one recurring engine event.
type arrivals struct {
	w      *world
	rng    *rand.Rand
	rate   profile
	peak   float64
	key    func() int
	route  router
	onFire func(key, agent int) // default: w.arrive
	until  int64
	n      int64 // arrivals so far
}

func (a *arrivals) start() {
	a.peak = a.rate.max()
	if a.onFire == nil {
		a.onFire = a.w.arrive
	}
	if a.until == 0 {
		a.until = a.w.end
	}
	if a.peak > 0 {
		a.w.eng.at(a.w.eng.now+expInterval(a.rng, a.peak), a, 0)
	}
}

func (a *arrivals) fire(int64) {
	now := a.w.eng.now
	if now >= a.until {
		return
	}
	t := float64(now-epoch) / 1e9
	if r := a.rate.at(t); r >= a.peak || a.rng.Float64()*a.peak < r {
		k := a.key()
		a.n++
		a.onFire(k, a.route.pick(k))
	}
	a.w.eng.at(now+expInterval(a.rng, a.peak), a, 0)
}

// constant is a flat profile.
func constant(rate float64) profile { return profile{{0, rate}} }
