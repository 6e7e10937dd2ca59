package bucket

import (
	"testing"
	"time"
)

func TestDenyAll(t *testing.T) {
	if _, err := DenyAll(0); err == nil {
		t.Fatal("DenyAll(0): no error")
	}
	l, err := DenyAll(time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if l.IsZero() || !l.DeniesAll() || l.Quota() != 0 || l.Burst() != 0 {
		t.Fatalf("DenyAll: IsZero %v DeniesAll %v Quota %d Burst %d", l.IsZero(), l.DeniesAll(), l.Quota(), l.Burst())
	}
	// Rebuilt from its accessors (as allocator snapshots store limits), it
	// is itself: the regression FuzzFSMApply found.
	if r, err := NewLimit(l.Algorithm(), l.Quota(), l.Window(), l.Burst()); err != nil || r != l {
		t.Fatalf("NewLimit(accessors) = %v, %v; want %v", r, err, l)
	}
	var s State
	t0 := int64(10*time.Minute + 15*time.Second)
	steps := []struct {
		name string
		got  Result
		want Result
	}{
		{"AllowN(t0, 1)", l.AllowN(&s, t0, 1), Result{RetryAfter: 45 * time.Second}},
		{"AllowN(t0, 0)", l.AllowN(&s, t0, 0), Result{Allowed: true}},
		{"Peek(t0)", l.Peek(s, t0), Result{RetryAfter: 45 * time.Second}},
		{"AllowN(t0+59s, 5)", l.AllowN(&s, t0+int64(59*time.Second), 5), Result{RetryAfter: 46 * time.Second}},
	}
	for i, st := range steps {
		if st.got != st.want {
			t.Errorf("step %d: %s = %+v, want %+v", i, st.name, st.got, st.want)
		}
	}
	if got := l.TakeUpTo(&s, t0, 100); got != 0 {
		t.Errorf("TakeUpTo = %d, want 0", got)
	}
	l.GiveBack(&s, t0, 5)
	l.Debit(&s, t0, 5)
	if s != (State{}) {
		t.Errorf("GiveBack/Debit changed the state: %+v", s)
	}
	if got := l.AllowN(&s, t0, 1); got.Allowed {
		t.Errorf("allowed after GiveBack")
	}
}
