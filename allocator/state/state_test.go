package state

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func TestAcquireDesignCard(t *testing.T) {
	// quota 30/minute, burst 10: one agent asking for 20 gets the burst (10),
	// then nothing until a token refills (2 s).
	s := newTestState(t)
	r := mustAcquire(t, s, at(0), "a", 1, ka("slow", "k1", 20, 0, 0, 0))
	g := r.Grants[0]
	if g.Status != allotv1.KeyStatus_KEY_STATUS_OK || g.Granted != 10 || g.Held != 10 || g.Remaining != 0 {
		t.Fatalf("step 1: grant = %v, want OK granted 10 held 10 remaining 0", g)
	}
	if g.Key != "test:slow=k1" || g.Limit.GetName() != "slow" || g.Agents != 1 {
		t.Fatalf("step 1: key %q limit %q agents %d", g.Key, g.Limit.GetName(), g.Agents)
	}
	r = mustAcquire(t, s, at(time.Second), "a", 2, ka("slow", "k1", 5, 0, 0, 0))
	g = r.Grants[0]
	if g.Status != allotv1.KeyStatus_KEY_STATUS_EXHAUSTED || g.Granted != 0 || g.RetryAfterMs != 1000 {
		t.Fatalf("step 2: grant = %v, want EXHAUSTED retry 1000ms", g)
	}
	r = mustAcquire(t, s, at(3*time.Second), "a", 3, ka("slow", "k1", 5, 0, 0, 0))
	if g = r.Grants[0]; g.Granted != 1 {
		t.Fatalf("step 3: granted %d, want 1 (one token refilled in 2s)", g.Granted)
	}
}

func TestAcquireStatuses(t *testing.T) {
	s := newTestState(t)
	r := mustAcquire(t, s, at(0), "a", 1,
		ka("nope", "x", 5, 0, 0, 0), ka("free", "x", 5, 0, 0, 0), ka("redis", "x", 5, 0, 0, 0), ka("tb", "x", 5, 0, 0, 0))
	want := []allotv1.KeyStatus{allotv1.KeyStatus_KEY_STATUS_NO_RULE, allotv1.KeyStatus_KEY_STATUS_UNLIMITED,
		allotv1.KeyStatus_KEY_STATUS_NOT_LEASED, allotv1.KeyStatus_KEY_STATUS_OK}
	for i, g := range r.Grants {
		if g.Status != want[i] {
			t.Errorf("key %d: status %v, want %v", i, g.Status, want[i])
		}
	}
	if r.Grants[0].Key != "test:nope=x" || r.Grants[2].Limit.GetBackend() != "redis" {
		t.Errorf("grants = %v", r.Grants)
	}
	if st := s.Stats(); st.Keys != 1 || st.Leases != 1 || st.Agents != 1 || st.RulesVersion != 1 {
		t.Errorf("stats = %+v, want 1 key, 1 lease, 1 agent, rules v1", st)
	}
}

func TestSnapshotRoundTrip(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 5, 0, 0, 0), ka("gcra", "y", 3, 0, 0, 0))
	mustAcquire(t, s, at(time.Millisecond), "b", 1, ka("tb", "x", 5, 0, 0, 0), ka("slow", "z", 0, 0, 0, 4))
	b1 := persist(t, s)
	s2 := New(testConfig())
	if err := s2.Restore(bytes.NewReader(b1)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if b2 := persist(t, s2); !bytes.Equal(b1, b2) {
		t.Fatalf("re-persisted snapshot differs (%d vs %d bytes)", len(b1), len(b2))
	}
	for n := range len(b1) {
		if err := s2.Restore(bytes.NewReader(b1[:n])); !errors.Is(err, ErrCorruptSnapshot) {
			t.Fatalf("Restore(truncated to %d) = %v, want ErrCorruptSnapshot", n, err)
		}
	}
}

func TestPutRulesErrors(t *testing.T) {
	s := newTestState(t)
	res := s.Apply(&allotv1.Command{NowUnixNanos: at(0), Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
		Files: []*allotv1.RuleFile{{Name: "bad.yaml", Yaml: []byte("domain: test\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n")}}}}})
	err, _ := res.(error)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "bad.yaml:4") {
		t.Fatalf("PutRules(bad) = %v, want ErrInvalid naming bad.yaml:4", err)
	}
	if v := s.Rules().Version(); v != 1 {
		t.Fatalf("rules version %d after a bad put, want 1", v)
	}
}
