package main

import (
	"testing"
	"time"
)

// TestHistQuantile pins the histogram_quantile arithmetic the harness
// reports: linear inside the bucket, 0 as the first bucket's lower bound,
// the highest finite bound for ranks in +Inf, and differences of readings.
func TestHistQuantile(t *testing.T) {
	h := hist{bounds: []float64{1e-6, 2e-6, 4e-6}, cum: []uint64{50, 90, 100}, total: 100}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{
		{0.25, 500 * time.Nanosecond},  // rank 25 of 50 in [0, 1µs]
		{0.5, 1000 * time.Nanosecond},  // rank 50: the bucket's top
		{0.7, 1500 * time.Nanosecond},  // rank 70: half of [1µs, 2µs]
		{0.95, 3000 * time.Nanosecond}, // rank 95: half of [2µs, 4µs]
	} {
		if got := h.quantile(c.q); got != c.want {
			t.Errorf("quantile(%v) = %v, want %v", c.q, got, c.want)
		}
	}
	inf := hist{bounds: []float64{1e-6, 2e-6}, cum: []uint64{1, 2}, total: 10}
	if got := inf.quantile(0.99); got != 2*time.Microsecond {
		t.Errorf("rank in +Inf: quantile = %v, want the highest finite bound 2µs", got)
	}
	if got := (hist{}).quantile(0.5); got != 0 {
		t.Errorf("empty: %v, want 0", got)
	}
	before := hist{bounds: h.bounds, cum: []uint64{40, 80, 90}, total: 90}
	d := h.plus(before, -1)
	if d.total != 10 || d.cum[0] != 10 || d.cum[2] != 10 {
		t.Fatalf("difference = %+v", d)
	}
	if got := d.quantile(0.5); got != 500*time.Nanosecond {
		t.Errorf("difference: quantile(0.5) = %v, want 500ns", got)
	}
	sum := (hist{}).plus(d, 1).plus(d, 1)
	if sum.total != 20 || sum.cum[0] != 20 {
		t.Errorf("sum = %+v", sum)
	}
}
