package upstream

import (
	"testing"
	"time"
)

const sec = int64(time.Second)

// A region cut off for longer than one retry reports, with the first call
// answered after the cut, every token it minted during it: each failed
// retry's outage_charged is owed again, not dropped.
func TestOutageChargeOwedAgainAfterFailedCalls(t *testing.T) {
	k, err := NewKey(Config{}, Rule{Rate: 100, Burst: 100})
	if err != nil {
		t.Fatal(err)
	}
	now := epoch
	r, _ := k.Tick(now, 50)
	now += sec / 10
	if err := k.Granted(now, Grant{ID: r.ID, Granted: 10, Share: 50, HasShare: true}); err != nil {
		t.Fatal(err)
	}
	if n := k.SubGrant(now, 10); n != 10 {
		t.Fatalf("sub-granted %d of the lease, want 10", n)
	}
	// A 10 s partition: every call fails half a timeout after it is made.
	var minted, failedCalls int64
	var inflight *Request
	for end := now + 10*sec; now < end; now += sec / 10 {
		minted += k.SubGrant(now, 1000)
		if r, ok := k.Tick(now, 50); ok {
			inflight = &r
		}
		if inflight != nil && now-k.sentAt >= int64(k.cfg.CallTimeout)/2 {
			if err := k.Failed(now, inflight.ID); err != nil {
				t.Fatalf("at %v: Failed: %v", time.Duration(now-epoch), err)
			}
			if inflight.OutageCharged > 0 {
				failedCalls++
			}
			inflight = nil
		}
	}
	if failedCalls < 3 || minted < 400 {
		t.Fatalf("the cut made %d failed calls with a charge and minted %d; want several, and about 500", failedCalls, minted)
	}
	// The partition heals: the next call is answered.
	for i := 0; ; i++ {
		if i == 30 {
			t.Fatal("no call in 3 s after the cut")
		}
		now += sec / 10
		if r, ok := k.Tick(now, 50); ok {
			if r.OutageCharged != minted {
				t.Errorf("the first call after the cut reports %d as outage_charged, want all %d minted", r.OutageCharged, minted)
			}
			if err := k.Granted(now+sec/20, Grant{ID: r.ID, Granted: 10, Share: 50, HasShare: true}); err != nil {
				t.Fatal(err)
			}
			break
		}
		minted += k.SubGrant(now, 1000)
	}
	// Answered: reported once.
	now += sec
	if r, ok := k.Tick(now, 50); ok && r.OutageCharged != 0 {
		t.Errorf("the call after the answered one reports %d again", r.OutageCharged)
	}
}

// A key with no demand makes no upstream call, however often it is
// evaluated; a key whose demand stops makes its calls until IdleAfter,
// hands back what it holds, then makes none.
func TestIdleKeyStopsCalling(t *testing.T) {
	never, _ := NewKey(Config{}, Rule{Rate: 100, Burst: 100})
	now := epoch
	for i := 0; i < 100; i++ { // 10 s
		if r, ok := never.Tick(now, 0); ok {
			t.Fatalf("at %v: a key no gateway used called: %+v", time.Duration(now-epoch), r)
		}
		now += sec / 10
	}

	k, _ := NewKey(Config{IdleAfter: 2 * time.Second}, Rule{Rate: 100, Burst: 100})
	now = epoch
	var last Request
	calls := 0
	for i := 0; i < 300; i++ { // 30 s; demand for the first second
		demand := 0.0
		if i < 10 {
			demand = 50
		}
		if r, ok := k.Tick(now, demand); ok {
			calls++
			last = r
			if err := k.Granted(now+sec/100, Grant{ID: r.ID, Granted: r.Want, RefreshAfter: time.Second, Share: 50, HasShare: true}); err != nil {
				t.Fatal(err)
			}
			if at := time.Duration(now - epoch); at > 3*time.Second+time.Millisecond {
				t.Fatalf("at %v, idle since 2.9 s: call %+v", at, r)
			}
		}
		now += sec / 10
	}
	if last.Want != 0 || last.Held != 0 || k.Status().Available != 0 {
		t.Errorf("the last call %+v, then %d held; want it to hand back everything and want nothing", last, k.Status().Available)
	}
	if calls > 5 {
		t.Errorf("%d calls in 30 s for a key used for 1 s", calls)
	}
}

// The region's demand is the sum of its gateways' reports, each at most
// the protocol's bound: the call carries it saturated at MaxWant, which
// the global cluster accepts.
func TestRegionDemandSaturatesAtMaxWant(t *testing.T) {
	k, _ := NewKey(Config{}, Rule{Rate: 100, Burst: 100})
	r, ok := k.Tick(epoch, 2*MaxWant)
	if !ok {
		t.Fatal("no call")
	}
	if r.Demand != MaxWant || r.Want > MaxWant || r.Held > MaxWant {
		t.Errorf("call %+v: demand, want and held must be at most %d", r, int64(MaxWant))
	}
}
