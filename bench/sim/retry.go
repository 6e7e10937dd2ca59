package main

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/client"
)

// retryMode is how clients retry a 429.
type retryMode struct {
	name     string
	throttle bool // pkg/client's adaptive throttling (the real Throttler)
	delay    func(rng *rand.Rand, attempt int, retryAfter time.Duration) time.Duration
}

// pkg/client's defaults (client.DefaultConfig).
const (
	clientMaxRetries = 3
	clientBaseDelay  = 100 * time.Millisecond
	clientMaxDelay   = 10 * time.Second
)

// fullJitter is pkg/client's backoff: uniform(0, min(MaxDelay, BaseDelay·2^n)).
func fullJitter(rng *rand.Rand, n int, base time.Duration) time.Duration {
	expo := clientMaxDelay
	if d := base << n; n < 30 && d > 0 && d < expo {
		expo = d
	}
	return time.Duration(rng.Float64() * float64(expo))
}

var retryModes = []retryMode{
	{name: "lockstep: retry exactly at Retry-After", delay: func(_ *rand.Rand, _ int, ra time.Duration) time.Duration { return ra }},
	{name: "pkg/client: full jitter floored at Retry-After, adaptive throttling", throttle: true,
		delay: func(rng *rand.Rand, n int, ra time.Duration) time.Duration {
			return max(fullJitter(rng, n, clientBaseDelay), ra)
		}},
	{name: "proposal: Retry-After + full jitter (base Retry-After), adaptive throttling", throttle: true,
		delay: func(rng *rand.Rand, n int, ra time.Duration) time.Duration {
			return ra + fullJitter(rng, n, ra)
		}},
}

// storm is one run of the retry storm for one client mode.
type storm struct {
	w    *world
	mode retryMode
	rng  *rand.Rand
	thr  []*client.Throttler
	key  int

	attempts, served, gaveUp, shed int64
	attemptBins                    []int32
}

// request is one logical client request and its attempts.
type request struct {
	s       *storm
	client  int
	attempt int
}

func (r *request) fire(int64) { r.s.try(r) }

func (s *storm) try(r *request) {
	w := s.w
	now := w.eng.now
	var thr *client.Throttler
	if s.mode.throttle {
		thr = s.thr[r.client]
		if !thr.Attempt(time.Unix(0, now), s.rng.Float64()) {
			s.shed++ // throttled locally: the caller gets ErrThrottled, or the last 429
			return
		}
	}
	s.attempts++
	s.attemptBins[int((now-epoch)/int64(w.cfg.bin))]++
	ag := s.rng.IntN(w.cfg.agents)
	allowed, ra := w.decide(s.key, ag)
	if allowed {
		if thr != nil {
			thr.Accepted(time.Unix(0, now))
		}
		s.served++
		return
	}
	if r.attempt >= clientMaxRetries {
		s.gaveUp++
		return
	}
	// The gateway's header: whole seconds, at least 1 (agent/httplimit).
	header := time.Duration(httplimit.RetryAfterSeconds(agent.Decision{RetryAfter: ra})) * time.Second
	d := s.mode.delay(s.rng, r.attempt, header)
	r.attempt++
	w.eng.at(now+int64(d), r, 0)
}

// runRetryStorm: chaos scenario 5. Clients of one key send 0.8 R in steady
// state; at one instant every client sends a burst (a synchronized retry of
// an upstream incident, a cron job): three requests each. Each 429 carries
// Retry-After; clients retry per their mode, at most 3 times.
func runRetryStorm(sc scale, seed uint64) (*result, error) {
	c := sc.clients
	quota := int64(c / 2) // clients × 0.4/s = 0.8 R
	const perClient, herd = 0.4, 3
	herdAt := 5 * time.Second
	res := &result{name: "retry-storm", title: "retry storm: lockstep clients vs jittered clients with adaptive throttling"}
	res.what = []string{
		fmt.Sprintf("%d agents; one key at %d/s burst %d; %d clients each sending %.1f requests/s (0.8 R, Poisson); at t=%s every client sends %d requests at once (%s);",
			sc.agents, quota, quota, c, perClient, herdAt, herd, count(int64(c*herd))),
		fmt.Sprintf("a 429 carries Retry-After (agent/httplimit: whole seconds, at least 1); clients retry at most %d times (pkg/client defaults: backoff from %s, throttling K=2 over 2 min, the real client.Throttler).",
			clientMaxRetries, clientBaseDelay),
	}
	t := table{title: "Per client behaviour (the limiter is allot's lease system in every row)",
		header: []string{"clients", "attempts at the limiter", "retry waves: peak attempts / 100 ms", "admitted", "served (of requests)", "gave up after retries", "shed by the throttle", "over-admission / 10 s"}}
	var plotLines []plotLine
	var bounds []bound
	for i, mode := range retryModes {
		g := &group{name: "storm", quota: quota, unit: time.Second, burst: quota}
		cfg := worldConfig{name: "retry-storm", seed: seed, agents: sc.agents, keys: 1, groups: []*group{g},
			lease: true, warmup: 2 * time.Second, duration: sc.chaos - 2*time.Second, bin: 100 * time.Millisecond, track: []int{0}}
		w, err := newWorld(cfg)
		if err != nil {
			return nil, err
		}
		s := &storm{w: w, mode: mode, rng: newRand(seed, fmt.Sprintf("storm-%d", i)), attemptBins: make([]int32, w.bins)}
		for range c {
			s.thr = append(s.thr, client.NewThrottler(2, 2*time.Minute, 120))
		}
		base := &arrivals{w: w, rng: newRand(seed, "storm-arrivals"), rate: constant(perClient * float64(c)),
			key: func() int { return 0 }, route: &spread{rng: newRand(seed, "storm-route"), n: sc.agents},
			onFire: func(_, _ int) { s.try(&request{s: s, client: s.rng.IntN(c)}) }}
		base.start()
		var requests int64
		w.eng.atFunc(epoch+int64(herdAt), func() {
			for cl := range c {
				for range herd {
					requests++
					s.try(&request{s: s, client: cl})
				}
			}
		})
		if err := w.run(); err != nil {
			w.shutdown()
			return nil, err
		}
		w.shutdown()
		requests += base.n
		rec := w.systems[0].rec
		// The herd itself is one instant; the waves are what follows.
		peak := int32(0)
		for _, v := range s.attemptBins[int((herdAt+w.cfg.bin)/w.cfg.bin):] {
			peak = max(peak, v)
		}
		t.add(mode.name, count(s.attempts), count(int64(peak)), count(rec.admitted), pct(ratio(s.served, requests)),
			count(s.gaveUp), count(s.shed), pct(max(rec.maxOver, 0)))
		bounds = append(bounds, bound{system: "allot leases", what: mode.name + ": over-admission per 10 s window", promise: "the limit holds under any client behaviour (≤ 1%)",
			measured: max(rec.maxOver, 0), limit: 0.01, unit: "%"})
		l := w.seriesLine(mode.name, s.attemptBins, 1)
		plotLines = append(plotLines, l)
	}
	res.tables = append(res.tables, t)
	res.bounds = bounds
	res.notes = append(res.notes,
		"pkg/client's retry loop is modelled from pkg/client/client.go (attempt, throttle check, Retry-After floor, MaxRetries); its Throttler and agent/httplimit's Retry-After rounding are the real code. With Retry-After ≥ 1 s and a 100 ms base, the full-jitter delay of the first retries (≤ 800 ms) is always below the Retry-After floor, so pkg/client's retries land exactly Retry-After later, in lockstep, unless the throttle sheds them; adding the jitter on top of Retry-After (the proposal row) spreads them.")
	plot := plotSpec{file: "sim-" + sc.name + "-retry-storm.png", title: fmt.Sprintf("retry storm (%s): attempts reaching the limiter per second (limit %d/s)", sc.name, quota),
		ylabel: "attempts (per second)", lines: plotLines, marks: []float64{herdAt.Seconds()}}
	plot.lines = append(plot.lines, flatLine("limit R", 0, sc.chaos.Seconds(), float64(quota)))
	res.plots = append(res.plots, plot)
	return res, nil
}

// decide runs the first system on one request, recorded like an arrival.
func (w *world) decide(key, ag int) (bool, time.Duration) {
	now := w.eng.now
	g := w.group(key)
	inQuota := g.limit.AllowN(&w.truth[key], now, 1).Allowed
	s := w.systems[0]
	ok, ra := s.check(ag, key, w.desc(key))
	s.rec.observe(key, g, now, ok, inQuota)
	return ok, ra
}
