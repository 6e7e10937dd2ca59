package policy

import (
	"testing"
	"time"

	"github.com/allot/allot/pkg/breaker"
)

// TestForgettableOutageOverKeys: an idle key whose only debt is an outage
// charge is kept while the table is within Config.MaxOutageKeys, and
// forgotten (by Forgettable and by a scan's Visit, even while queued) once
// the table holds more; a key owing a charge, or in flight, is kept.
func TestForgettableOutageOverKeys(t *testing.T) {
	c := NewCore(Config{Tick: 50 * time.Millisecond, Scan: 100 * time.Millisecond, IdleTimeout: 10 * time.Second, MaxOutageKeys: 10,
		Breaker: breaker.Config{Threshold: 3, Cooldown: time.Second, MaxCooldown: time.Second, Jitter: func(d time.Duration) time.Duration { return d }}})
	now := int64(100 * time.Second)
	o := Obs{Outage: 3, LastUse: now - int64(11*time.Second)}
	var k Key
	c.Keys = 10
	if c.Forgettable(&k, &o, now) {
		t.Fatal("forgettable within the bound")
	}
	c.Keys = 11
	if !c.Forgettable(&k, &o, now) {
		t.Fatal("not forgettable over the bound")
	}
	q := o
	q.Queued = true
	if v := c.Visit(&k, &q, now, 0.1, Alpha(0.1)); v != Forget {
		t.Fatalf("Visit of a queued idle outage key over the bound: %v, want Forget", v)
	}
	for name, mod := range map[string]func(*Key, *Obs){
		"charged":  func(_ *Key, o *Obs) { o.Charged = 1 },
		"inflight": func(k *Key, _ *Obs) { k.Inflight = true },
		"active":   func(_ *Key, o *Obs) { o.LastUse = now - int64(time.Second) },
	} {
		k2, o2 := Key{}, o
		mod(&k2, &o2)
		if c.Forgettable(&k2, &o2, now) {
			t.Errorf("%s: forgettable over the bound", name)
		}
	}
}
