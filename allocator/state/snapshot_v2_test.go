package state

import (
	"bytes"
	"testing"
	"time"

	"github.com/allot/allot/pkg/rules"
)

// TestRestoreV2 restores a format-2 snapshot (testdata/snapshot-v2.bin,
// written by the binary before grant pacing: agent a leases big=x wanting
// 30 with demand 0.1; b leases big=x wanting 20 with demand 123.456 and
// tb=y wanting 5): its leases come back with nothing granted in the
// current window and their demand truncated as a lease stores it, and the
// state persists as format 3 and restores from that unchanged.
func TestRestoreV2(t *testing.T) {
	v2, s := restoreFixture(t, "snapshot-v2.bin")
	c := s.st
	big := []rules.Entry{{Key: "big", Value: "x"}}
	e, ok := c.leasedEntry(keyHash(c.rules, "test", big))
	if !ok {
		t.Fatalf("big=x is not leased after restore")
	}
	if len(e.leases) != 2 {
		t.Fatalf("big=x has %d leases, want 2", len(e.leases))
	}
	for j, want := range []struct {
		held   int64
		demand float64
	}{{30, 0.1}, {20, 123.456}} {
		l := e.leases[j]
		if l.held != want.held || l.win != 0 || l.demand != roundDemand(want.demand) {
			t.Errorf("lease %d: held %d win %d demand %v, want %d, 0, %v", j, l.held, l.win, l.demand, want.held, roundDemand(want.demand))
		}
	}
	v3 := persist(t, s)
	if bytes.Equal(v3, v2) {
		t.Fatalf("re-persisted snapshot is still format 2")
	}
	s2 := New(testConfig())
	if err := s2.Restore(bytes.NewReader(v3)); err != nil {
		t.Fatalf("Restore(v3): %v", err)
	}
	if !bytes.Equal(persist(t, s2), v3) {
		t.Errorf("format 3 does not round-trip")
	}
	// The restored lease paces: a's grants in the current window start at 0.
	if g := mustAcquire(t, s2, at(2*time.Second), "a", 2, ka("big", "x", 10, 30, 0, 0)).Grants[0]; g.Status.String() != "KEY_STATUS_OK" {
		t.Errorf("acquire after restore: %v", g)
	}
}
