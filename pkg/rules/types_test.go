package rules

import "testing"

func TestEnumNames(t *testing.T) {
	for u := UnitSecond; u <= UnitYear; u++ {
		if p, err := ParseUnit(u.String()); err != nil || p != u {
			t.Errorf("ParseUnit(%q) = %v, %v", u.String(), p, err)
		}
	}
	wantSec := map[Unit]int64{UnitUnknown: 0, UnitSecond: 1, UnitMinute: 60, UnitHour: 3600, UnitDay: 86400,
		UnitWeek: 604800, UnitMonth: 2592000, UnitYear: 31536000, Unit(99): 0}
	for u, s := range wantSec {
		if u.Seconds() != s || int64(u.Duration().Seconds()) != s {
			t.Errorf("%v.Seconds() = %d, want %d", u, u.Seconds(), s)
		}
	}
	if _, err := ParseUnit("unknown"); err == nil {
		t.Error(`ParseUnit("unknown") succeeded`)
	}
	if UnitUnknown.String() != "unknown" || Unit(99).String() != "unit(99)" {
		t.Errorf("Unit strings %q %q", UnitUnknown, Unit(99))
	}
	for i, n := range backendNames {
		if b, err := ParseBackend(n); err != nil || b != Backend(i) || b.String() != n {
			t.Errorf("backend %q: %v %v", n, b, err)
		}
	}
	for i, n := range failureModeNames {
		if f, err := ParseFailureMode(n); err != nil || f != FailureMode(i) || f.String() != n {
			t.Errorf("failure_mode %q: %v %v", n, f, err)
		}
	}
	for i, n := range routingNames {
		if r, err := ParseRouting(n); err != nil || r != Routing(i) || r.String() != n {
			t.Errorf("routing %q: %v %v", n, r, err)
		}
	}
	if Backend(9).String() != "backend(9)" || FailureMode(9).String() != "failure_mode(9)" || Routing(9).String() != "routing(9)" {
		t.Error("out-of-range enum strings")
	}
	if _, err := ParseBackend("x"); err == nil {
		t.Error("ParseBackend(x) succeeded")
	}
	if _, err := ParseFailureMode("x"); err == nil {
		t.Error("ParseFailureMode(x) succeeded")
	}
	if _, err := ParseRouting("x"); err == nil {
		t.Error("ParseRouting(x) succeeded")
	}
}
