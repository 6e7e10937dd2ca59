package breaker

import "testing"

func TestShared(t *testing.T) {
	b := NewShared(Config{Threshold: 3, Cooldown: 100})
	now := int64(1000)
	fail := func() {
		ok, probe := b.Allow(now)
		if !ok {
			t.Fatalf("t=%d: allow = false while closed", now)
		}
		b.Failure(now, probe)
	}
	fail()
	fail()
	if b.State() != Closed {
		t.Fatal("open after 2 of 3 failures")
	}
	b.Success(false) // resets the count
	fail()
	fail()
	if b.State() != Closed {
		t.Fatal("a success did not reset the consecutive count")
	}
	fail()
	if b.State() == Closed {
		t.Fatal("closed after 3 consecutive failures")
	}
	if ok, _ := b.Allow(now + 99); ok {
		t.Fatal("allowed before the cooldown")
	}
	ok, probe := b.Allow(now + 100)
	if !ok || !probe {
		t.Fatalf("after the cooldown: allow = %v, probe = %v; want the probe", ok, probe)
	}
	if ok, _ := b.Allow(now + 100); ok {
		t.Fatal("a second call went through while the probe is in flight")
	}
	b.Failure(now+150, true) // the probe failed: open again from 150
	if ok, _ := b.Allow(now + 200); ok {
		t.Fatal("allowed during the second cooldown")
	}
	ok, probe = b.Allow(now + 250)
	if !ok || !probe {
		t.Fatal("no probe after the second cooldown")
	}
	b.Abandon() // caller cancelled: probe again at once
	ok, probe = b.Allow(now + 251)
	if !ok || !probe {
		t.Fatal("no probe after an abandoned one")
	}
	b.Success(true)
	if b.State() != Closed {
		t.Fatal("a successful probe did not close the breaker")
	}
	if ok, probe := b.Allow(now + 252); !ok || probe {
		t.Fatal("closed breaker refused a call")
	}
}
