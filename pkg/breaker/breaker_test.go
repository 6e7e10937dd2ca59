package breaker

import (
	"testing"
	"time"
)

// TestBreakerSteps drives a breaker (threshold 2, cooldown 100 ns doubling
// up to 400 ns) through a fixed script of instants.
func TestBreakerSteps(t *testing.T) {
	b := New(Config{Threshold: 2, Cooldown: 100, MaxCooldown: 400})
	type step struct {
		op       string // allow, fail, ok
		at       int64
		want     bool // Allow's result, or whether the call opened/closed the breaker
		wantOpen bool
		wantNext int64
	}
	steps := []step{
		{"allow", 0, true, false, 0},
		{"fail", 0, false, false, 0},
		{"ok", 1, false, false, 0}, // resets the count
		{"fail", 2, false, false, 0},
		{"fail", 3, true, true, 103}, // the threshold: open, probe at 3+100
		{"allow", 102, false, true, 103},
		{"allow", 103, true, true, 103},
		{"fail", 103, false, true, 303}, // failed probe: wait 200
		{"allow", 302, false, true, 303},
		{"fail", 303, false, true, 703},  // 400
		{"fail", 703, false, true, 1103}, // capped at 400
		{"allow", 50, true, true, 1103},  // the clock went back before the opening: probe
		{"ok", 1103, true, false, 0},     // closed
		{"allow", 1104, true, false, 0},
		{"fail", 1105, false, false, 0},
		{"fail", 1106, true, true, 1206}, // reopens with the first cooldown
	}
	for i, s := range steps {
		var got bool
		switch s.op {
		case "allow":
			got = b.Allow(s.at)
		case "fail":
			got = b.Failure(s.at)
		case "ok":
			got = b.Success()
		}
		if got != s.want || b.Open() != s.wantOpen || b.NextProbe() != s.wantNext {
			t.Fatalf("step %d: %s(t=%d) = %v, open %v, next %d; want %v, open %v, next %d",
				i, s.op, s.at, got, b.Open(), b.NextProbe(), s.want, s.wantOpen, s.wantNext)
		}
	}
}

func TestBreakerJitter(t *testing.T) {
	var waits []time.Duration
	b := New(Config{Threshold: 1, Cooldown: 100, MaxCooldown: 1000, Jitter: func(d time.Duration) time.Duration {
		waits = append(waits, d)
		return d / 2
	}})
	b.Failure(0)
	b.Failure(50)
	if b.NextProbe() != 50+100 || len(waits) != 2 || waits[0] != 100 || waits[1] != 200 {
		t.Fatalf("next %d, waits %v; want 150, [100 200]", b.NextProbe(), waits)
	}
	if b.Failures() != 2 {
		t.Errorf("Failures() = %d, want 2", b.Failures())
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{{Threshold: 0, Cooldown: 1}, {Threshold: 1, Cooldown: 0}} {
		if c.Validate() == nil {
			t.Errorf("Validate(%+v) = nil", c)
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("New with an invalid config did not panic")
		}
	}()
	New(Config{})
}
