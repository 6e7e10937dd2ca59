package main

import (
	"math"
	"time"

	"github.com/HdrHistogram/hdrhistogram-go"
)

// recorder measures one system against the exact limiter on the same
// arrivals, after the warm-up:
//
//   - false rejects: per key and per aligned window of length W, how many
//     fewer requests the system admitted than the exact limiter (one token
//     bucket per key fed every arrival) admitted, max(0, in-quota −
//     admitted), summed over keys and windows, over the in-quota total.
//     Counting per window rather than per request keeps a key at its limit
//     from scoring noise: two correct limiters at saturation admit about R
//     each, not the same requests;
//   - over-admission: per key and per aligned window of length W (10 s),
//     admitted − (B + R·W), the most any correct limiter can admit in W,
//     as a fraction of R·W; the maximum over keys and windows is reported;
//   - excess over the exact limiter: Σ_keys max(0, admitted − in-quota),
//     over the in-quota total;
//   - per-bin series for plots (every system's admitted total; tracked keys).
type recorder struct {
	w    *world
	keys []keyRec

	offered, admitted, inQuota int64
	falseRej                   int64 // Σ over (key, window) of max(0, in-quota − admitted)

	maxOver     float64 // max over keys and windows, fraction of R·W
	maxOverKey  int
	overWindows int64 // (key, window) pairs over the bound by more than 1% of R·W

	series  []int32         // admitted per bin, all keys
	tracked map[int][]int32 // admitted per bin, tracked keys
	offer   map[int][]int32 // offered per bin, tracked keys
}

type keyRec struct {
	offered, admitted, inQuota int32
	wi, wc, wq                 int32 // current window index, its admitted and in-quota counts
}

func newRecorder(w *world) *recorder {
	r := &recorder{
		w:       w,
		keys:    make([]keyRec, w.cfg.keys),
		series:  make([]int32, w.bins),
		tracked: make(map[int][]int32),
		offer:   make(map[int][]int32),
	}
	for _, k := range w.cfg.track {
		r.tracked[k] = make([]int32, w.bins)
		r.offer[k] = make([]int32, w.bins)
	}
	for i := range r.keys {
		r.keys[i].wi = -1
	}
	return r
}

func (r *recorder) observe(key int, g *group, now int64, allowed, inQuota bool) {
	bin := int((now - epoch) / int64(r.w.cfg.bin))
	if allowed {
		r.series[bin]++
	}
	if s := r.tracked[key]; s != nil {
		r.offer[key][bin]++
		if allowed {
			s[bin]++
		}
	}
	if now < r.w.measureFrom {
		return
	}
	k := &r.keys[key]
	k.offered++
	r.offered++
	if inQuota {
		k.inQuota++
		r.inQuota++
	}
	if allowed {
		k.admitted++
		r.admitted++
	}
	wi := int32((now - r.w.measureFrom) / int64(r.w.cfg.window))
	if wi != k.wi {
		if k.wi >= 0 {
			r.closeWindow(key, g, k.wc, k.wq, r.w.cfg.window)
		}
		k.wi, k.wc, k.wq = wi, 0, 0
	}
	if allowed {
		k.wc++
	}
	if inQuota {
		k.wq++
	}
}

// closeWindow scores one (key, window): admitted beyond B + R·length, and
// admitted short of the exact limiter.
func (r *recorder) closeWindow(key int, g *group, admitted, inQuota int32, length time.Duration) {
	if inQuota > admitted {
		r.falseRej += int64(inQuota - admitted)
	}
	rw := g.rate() * length.Seconds()
	over := (float64(admitted) - float64(g.burst) - rw) / (g.rate() * r.w.cfg.window.Seconds())
	if over > r.maxOver {
		r.maxOver, r.maxOverKey = over, key
	}
	if over > 0.01 {
		r.overWindows++
	}
}

// finish scores every key's last (possibly partial) window.
func (r *recorder) finish() {
	last := time.Duration((r.w.end - r.w.measureFrom) % int64(r.w.cfg.window))
	if last == 0 {
		last = r.w.cfg.window
	}
	lastWi := int32((r.w.end - 1 - r.w.measureFrom) / int64(r.w.cfg.window))
	for i := range r.keys {
		k := &r.keys[i]
		if k.wi < 0 {
			continue
		}
		length := r.w.cfg.window
		if k.wi == lastWi {
			length = last
		}
		r.closeWindow(i, r.w.group(i), k.wc, k.wq, length)
		k.wi = -1
	}
}

// falseRejectRate is false rejects over in-quota requests.
func (r *recorder) falseRejectRate() float64 { return ratio(r.falseRej, r.inQuota) }

// excessOverExact is Σ max(0, admitted − in-quota) over Σ in-quota.
func (r *recorder) excessOverExact() float64 {
	var ex int64
	for i := range r.keys {
		if d := int64(r.keys[i].admitted) - int64(r.keys[i].inQuota); d > 0 {
			ex += d
		}
	}
	return ratio(ex, r.inQuota)
}

// overRun is, for one key, admitted over the measured period beyond
// B + R·T, as a fraction of R·T.
func (r *recorder) overRun(key int) float64 {
	g := r.w.group(key)
	t := time.Duration(r.w.end - r.w.measureFrom).Seconds()
	return (float64(r.keys[key].admitted) - float64(g.burst) - g.rate()*t) / (g.rate() * t)
}

func ratio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// rate per second of a bin count.
func (w *world) perSecond(count int32) float64 { return float64(count) / w.cfg.bin.Seconds() }

// binRange returns the bins covering [from, to) (offsets from epoch).
func (w *world) binRange(from, to time.Duration) (int, int) {
	a := int(from / w.cfg.bin)
	b := int(to / w.cfg.bin)
	return max(a, 0), min(b, w.bins)
}

// sumBins sums s over [from, to).
func (w *world) sumBins(s []int32, from, to time.Duration) int64 {
	a, b := w.binRange(from, to)
	var n int64
	for i := a; i < b; i++ {
		n += int64(s[i])
	}
	return n
}

// maxWindow is the largest sum of s over any window of the given length
// (in whole bins) starting in [from, to).
func (w *world) maxWindow(s []int32, length, from, to time.Duration) int64 {
	a, b := w.binRange(from, to)
	n := int(length / w.cfg.bin)
	var best int64
	for i := a; i < b && i+n <= len(s); i++ {
		var sum int64
		for j := i; j < i+n; j++ {
			sum += int64(s[j])
		}
		best = max(best, sum)
	}
	return best
}

// histogram is an HDR histogram of nanoseconds.
type histogram struct{ h *hdrhistogram.Histogram }

func newHistogram() *histogram { return &histogram{h: hdrhistogram.New(0, int64(time.Minute), 3)} }

func (h *histogram) record(ns int64) { _ = h.h.RecordValue(min(max(ns, 0), int64(time.Minute))) }

func (h *histogram) quantile(q float64) time.Duration {
	if h.h.TotalCount() == 0 {
		return 0
	}
	return time.Duration(h.h.ValueAtQuantile(q))
}

func (h *histogram) mean() time.Duration {
	if h.h.TotalCount() == 0 {
		return 0
	}
	return time.Duration(math.Round(h.h.Mean()))
}
