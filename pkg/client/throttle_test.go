package client

import (
	"testing"
	"time"

	"pgregory.net/rapid"
)

func TestThrottlerSteps(t *testing.T) {
	t0 := time.Unix(1000, 0)
	th := NewThrottler(2, 2*time.Minute, 120)
	if !th.Attempt(t0, 0) {
		t.Fatal("step 0: Attempt(t0) = false, want true (no history)")
	}
	if p := th.RejectProbability(t0); p != 0.5 {
		t.Fatalf("step 1: p = %v, want 0.5", p)
	}
	th.Accepted(t0)
	if p := th.RejectProbability(t0); p != 0 {
		t.Fatalf("step 2: p = %v, want 0", p)
	}
	t1 := t0.Add(time.Second)
	th.Attempt(t1, 0.99)
	th.Attempt(t1, 0.99) // 3 requests, 1 accept: p = (3-2)/4
	if p := th.RejectProbability(t1); p != 0.25 {
		t.Fatalf("step 3: p = %v, want 0.25", p)
	}
	if th.Attempt(t1, 0.2) {
		t.Fatal("step 4: Attempt(t1, u=0.2) = true, want false (0.2 < 0.25)")
	}
	if !th.Attempt(t1, 0.5) { // p is now (4-2)/5 = 0.4
		t.Fatal("step 5: Attempt(t1, u=0.5) = false, want true (0.5 ≥ 0.4)")
	}
	// t0's bucket (1 request, 1 accept) ages out at t0+2m; t1's at t1+2m.
	if r, a := th.Counts(t0.Add(2 * time.Minute)); r != 4 || a != 0 {
		t.Fatalf("step 6: counts at t0+2m = %d/%d, want 4/0", r, a)
	}
	if r, a := th.Counts(t1.Add(2 * time.Minute)); r != 0 || a != 0 {
		t.Fatalf("step 7: counts at t1+2m = %d/%d, want 0/0", r, a)
	}
	// The clock going backwards counts into the newest bucket.
	th.Attempt(t0, 0.99)
	if r, _ := th.Counts(t1.Add(2 * time.Minute)); r != 1 {
		t.Fatalf("step 8: counts after a backwards clock = %d, want 1", r)
	}
}

// TestThrottlerModel checks the bucketed window against a naive model that
// keeps every event and counts those whose bucket lies within the last
// `buckets` buckets.
func TestThrottlerModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		buckets := rapid.IntRange(1, 8).Draw(t, "buckets")
		width := time.Duration(rapid.IntRange(1, 1000).Draw(t, "width_ms")) * time.Millisecond
		th := NewThrottler(2, width*time.Duration(buckets), buckets)
		type ev struct {
			epoch int64
			acc   bool
		}
		var events []ev
		now := time.Unix(0, 0).Add(time.Hour)
		var latest int64
		started := false
		n := rapid.IntRange(1, 200).Draw(t, "ops")
		for i := 0; i < n; i++ {
			now = now.Add(time.Duration(rapid.Int64Range(-int64(width), 3*int64(width)).Draw(t, "dt")))
			epoch := now.UnixNano() / int64(width)
			if !started || epoch > latest {
				started = true
				latest = epoch
			}
			switch rapid.IntRange(0, 2).Draw(t, "op") {
			case 0:
				th.Attempt(now, 0.999999)
				events = append(events, ev{latest, false})
			case 1:
				th.Accepted(now)
				events = append(events, ev{latest, true})
			}
			var wr, wa int64
			for _, e := range events {
				if e.epoch > latest-int64(buckets) {
					if e.acc {
						wa++
					} else {
						wr++
					}
				}
			}
			r, a := th.Counts(now)
			if r != wr || a != wa {
				t.Fatalf("op %d: counts %d/%d, model %d/%d", i, r, a, wr, wa)
			}
			p := th.RejectProbability(now)
			want := (float64(wr) - 2*float64(wa)) / float64(wr+1)
			if want < 0 {
				want = 0
			}
			if p != want || p < 0 || p >= 1 {
				t.Fatalf("op %d: p = %v, want %v in [0,1)", i, p, want)
			}
		}
	})
}

func BenchmarkThrottlerAttempt(b *testing.B) {
	b.ReportAllocs()
	th := NewThrottler(2, 2*time.Minute, 120)
	now := time.Unix(1000, 0)
	for b.Loop() {
		if th.Attempt(now, 0.5) {
			th.Accepted(now)
		}
	}
}

func BenchmarkThrottlerAttemptParallel(b *testing.B) {
	b.ReportAllocs()
	th := NewThrottler(2, 2*time.Minute, 120)
	now := time.Unix(1000, 0)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if th.Attempt(now, 0.5) {
				th.Accepted(now)
			}
		}
	})
}
