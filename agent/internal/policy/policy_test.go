package policy

import (
	"math/rand/v2"
	"testing"
)

// TestDemandFellIgnoresNoise: a steady Poisson key never reads as a fall,
// whatever its rate, over many scans (the demand would flap and every flap
// costs a call).
func TestDemandFellIgnoresNoise(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	const dt = 0.1 // one scan
	for _, rate := range []float64{1, 10, 100, 400, 1000, 4000} {
		for scan := range 3000 {
			// Count a Poisson process's arrivals over dt.
			n, at := int64(0), rng.ExpFloat64()/rate
			for at < dt {
				n++
				at += rng.ExpFloat64() / rate
			}
			if Fell(rate, n, dt) {
				t.Fatalf("rate %v/s, scan %d: %d tokens in %v s read as a fall", rate, scan, n, dt)
			}
		}
	}
}
