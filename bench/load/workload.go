package main

import (
	"context"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// domain is the rules domain the harness owns: PutRules replaces only it.
const domain = "load"

// maxEvents bounds the decisions one run records (12 bytes each).
const maxEvents = 20_000_000

// Latency histograms record nanoseconds from 1 ns to 10 s with two
// significant digits (1% resolution): small enough to keep one set per
// worker.
const (
	histMax     = int64(10 * time.Second)
	histSigFigs = 2
)

// event is one check as the harness saw it.
type event struct {
	us      uint32 // start of the check, µs since the run started
	key     uint32 // key index (rank: 0 is the most frequent)
	agent   uint16
	allowed bool
	source  agent.Source
}

// workload is the request stream: which key, which agent, when.
type workload struct {
	o     options
	descs []agent.Descriptor // one per key, each with one entry user=u<i>
}

func newWorkload(o options) *workload {
	w := &workload{o: o, descs: make([]agent.Descriptor, o.keys)}
	entries := make([]rules.Entry, o.keys)
	for i := range entries {
		entries[i] = rules.Entry{Key: "user", Value: "u" + strconv.Itoa(i)}
		w.descs[i].Entries = entries[i : i+1 : i+1]
	}
	return w
}

// keyPicker draws key indexes: Zipf(s) over [0, keys) (rank^-s), or uniform.
type keyPicker struct {
	r    *rand.Rand
	zipf *rand.Zipf
	n    uint64
}

func (w *workload) picker(seed uint64) *keyPicker {
	r := rand.New(rand.NewPCG(w.o.seed, seed))
	p := &keyPicker{r: r, n: uint64(w.o.keys)}
	if w.o.zipfS > 1 && w.o.keys > 1 {
		p.zipf = rand.NewZipf(r, w.o.zipfS, 1, uint64(w.o.keys-1))
	}
	return p
}

func (p *keyPicker) next() uint32 {
	if p.zipf != nil {
		return uint32(p.zipf.Uint64())
	}
	return uint32(p.r.Uint64N(p.n))
}

// agentFor routes a request made at elapsed time t: with probability skew
// to the favored agent, otherwise uniformly over all agents.
func (w *workload) agentFor(r *rand.Rand, t time.Duration) int {
	k := w.o.agents
	if w.o.skew > 0 && r.Float64() < w.o.skew {
		if w.o.skewRotate > 0 {
			return int(int64(t/w.o.skewRotate) % int64(k))
		}
		return 0
	}
	return r.IntN(k)
}

// zipfShare returns the probability of each key (rank^-s normalised, or
// uniform), as the picker draws them.
func zipfShare(keys int, s float64) []float64 {
	p := make([]float64, keys)
	var sum float64
	for i := range p {
		if s > 1 {
			p[i] = math.Pow(float64(i+1), -s)
		} else {
			p[i] = 1
		}
		sum += p[i]
	}
	for i := range p {
		p[i] /= sum
	}
	return p
}

// coldShareExpected is the share of requests that go to keys whose expected
// rate is under 1 req/s.
func coldShareExpected(keys int, s, rate float64) float64 {
	var cold float64
	for _, p := range zipfShare(keys, s) {
		if p*rate < 1 {
			cold += p
		}
	}
	return cold
}

// checker is the part of agent.Agent the load uses.
type checker interface {
	Check(ctx context.Context, domain string, descs []agent.Descriptor, hits uint32) (agent.Decision, error)
}

// workerResult is what one load goroutine measured; merged after the run.
type workerResult struct {
	all, lease, fallback, remote *hdrhistogram.Histogram
	bySource                     [int(agent.SourceStatic) + 1][2]int64 // [source][allowed]
	events                       []event
	scheduled, issued, dropped   int64
	errs                         int64
	unrecorded                   int64 // checks beyond the log's capacity (a harness bug if not 0)
}

func newWorkerResult(capacity int) *workerResult {
	h := func() *hdrhistogram.Histogram { return hdrhistogram.New(1, histMax, histSigFigs) }
	return &workerResult{all: h(), lease: h(), fallback: h(), remote: h(), events: make([]event, 0, capacity)}
}

// drive runs the workload against agents for o.duration and returns what the
// workers measured. The schedule is open loop: worker i issues its j-th
// request at offset + j·interval (interval = workers/rate); a worker that
// wakes up late issues every request that is due, back to back, and drops
// (counts) those more than o.maxLag late. The same seed gives every run the
// same keys and agents in the same order.
func (w *workload) drive(ctx context.Context, agents []checker) []*workerResult {
	o := w.o
	results := make([]*workerResult, o.workers)
	interval := float64(o.workers) / o.rate * float64(time.Second) // ns between a worker's requests
	perWorker := int(o.rate*o.duration.Seconds()/float64(o.workers)) + 2
	var wg sync.WaitGroup
	start := time.Now()
	for i := range o.workers {
		res := newWorkerResult(perWorker)
		results[i] = res
		offset := interval * float64(i) / float64(o.workers)
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.worker(ctx, uint64(i), agents, start, offset, interval, res)
		}()
	}
	wg.Wait()
	return results
}

func (w *workload) worker(ctx context.Context, id uint64, agents []checker, start time.Time, offset, interval float64, res *workerResult) {
	o := w.o
	keys := w.picker(2*id + 1)
	route := rand.New(rand.NewPCG(o.seed, 2*id+2))
	end := o.duration
	var j int64 // next request of this worker's schedule
	at := func(j int64) time.Duration { return time.Duration(offset + float64(j)*interval) }
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	defer func() {
		// Requests the run ended before issuing count as dropped.
		for ; at(j) < end; j++ {
			res.scheduled++
			res.dropped++
		}
	}()
	for ctx.Err() == nil {
		now := time.Since(start)
		if now >= end {
			break
		}
		for at(j) <= now && at(j) < end {
			sched := at(j)
			j++
			res.scheduled++
			// Draw the key and agent whether or not the request is issued,
			// so that drops do not shift the rest of the stream.
			k := keys.next()
			a := w.agentFor(route, sched)
			if now-sched > o.maxLag {
				res.dropped++
				continue
			}
			t0 := time.Since(start)
			d, err := agents[a].Check(ctx, domain, w.descs[k:k+1], 1)
			t1 := time.Since(start)
			el := int64(t1 - t0)
			if err != nil {
				res.errs++
				continue
			}
			res.issued++
			rec(res.all, el)
			switch {
			case d.Source == agent.SourceLease && d.Allowed:
				rec(res.lease, el)
			case d.Source == agent.SourceFallback:
				rec(res.fallback, el)
			case d.Source == agent.SourceRedis:
				rec(res.remote, el)
			}
			if int(d.Source) < len(res.bySource) {
				res.bySource[d.Source][b2i(d.Allowed)]++
			}
			if len(res.events) < cap(res.events) {
				res.events = append(res.events, event{us: uint32(t0 / time.Microsecond), key: k, agent: uint16(a), allowed: d.Allowed, source: d.Source})
			} else {
				res.unrecorded++
			}
			now = t1
		}
		if at(j) >= end {
			// Nothing more is scheduled for this worker.
			break
		}
		timer.Reset(max(at(j)-time.Since(start), o.tick))
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
	}
}

func rec(h *hdrhistogram.Histogram, v int64) {
	_ = h.RecordValue(min(max(v, 1), histMax))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// timerOverhead measures what the harness's timing adds to each recorded
// check: two time.Since calls back to back (the median and p99 of n pairs).
func timerOverhead(n int) (p50, p99 time.Duration) {
	h := hdrhistogram.New(1, histMax, 3)
	start := time.Now()
	for range n {
		t0 := time.Since(start)
		t1 := time.Since(start)
		_ = h.RecordValue(max(int64(t1-t0), 1))
	}
	return time.Duration(h.ValueAtQuantile(50)), time.Duration(h.ValueAtQuantile(99))
}
