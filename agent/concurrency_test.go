package agent

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// hammer runs g goroutines that each make per checks of descs at once and
// returns how many were allowed.
func hammer(t *testing.T, a *Agent, g, per int, descs ...Descriptor) int64 {
	t.Helper()
	var admitted atomic.Int64
	start := make(chan struct{})
	var wg sync.WaitGroup
	for range g {
		wg.Go(func() {
			<-start
			for range per {
				d, err := a.Check(context.Background(), "test", descs, 1)
				if err != nil {
					t.Error(err)
					return
				}
				if d.Allowed {
					admitted.Add(1)
				}
			}
		})
	}
	close(start)
	wg.Wait()
	return admitted.Load()
}

// TestConcurrentExactBurstLocal: 100 goroutines against limit 50 burst 50
// at one instant admit exactly 50 (the per-key mutex loses no update).
func TestConcurrentExactBurstLocal(t *testing.T) {
	clock := newFakeClock()
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules), Now: clock.now})
	if n := hammer(t, a, 100, 1, desc("api_key", "hot")); n != 50 {
		t.Fatalf("admitted %d, want exactly 50", n)
	}
}

// TestConcurrentExactBurstLeased: the same through a lease: one fallback
// admission, then a grant of the other 49; 100 goroutines admit exactly
// the 49 (the CAS loses no update, and the re-based fallback adds none).
func TestConcurrentExactBurstLeased(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "hot")
	check(t, s.Agent, d)
	ks := keyOf(t, s.Agent, d)
	ks.Demand.Rate = 1000
	s.step()
	if b := ks.balance.Load(); b != 49 {
		t.Fatalf("balance %d, want 49", b)
	}
	if n := hammer(t, s.Agent, 100, 1, d); n != 49 {
		t.Fatalf("admitted %d, want exactly 49", n)
	}
}

// TestConcurrentBooksBalance runs checks on many goroutines while the real
// refill loop grants, charges and returns, then closes the agent: every
// admitted token must be on the allocator's books, as granted (and not
// returned) or charged: nothing admitted is lost, nothing counted twice.
func TestConcurrentBooksBalance(t *testing.T) {
	clock := newFakeClock()
	fake := newFake(t, clock.now, testRules)
	srv := serveFake(t, fake)
	cfg := DefaultConfig()
	cfg.Allocators = []string{srv.addr}
	cfg.Rules = mustCompile(t, 0, testRules)
	cfg.RefillInterval = time.Millisecond
	cfg.ScanInterval = time.Millisecond
	cfg.CallTimeout = 5 * time.Second
	cfg.Now = func() int64 { return clock.now() }
	a := newAgent(t, cfg)
	big := desc("tier", "free", "route", "/x", "user", "u")
	var admitted atomic.Int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 8 {
		wg.Go(func() {
			checkUntil(t, a, stop, []Descriptor{big}, func(got Decision) bool {
				if got.Allowed {
					admitted.Add(1)
				}
				return true
			})
		})
	}
	// Let time pass on the fake clock so demand, leases and expiry move.
	waitFor(t, 10*time.Second, "leased decisions", func() bool {
		clock.advance(10 * time.Millisecond)
		return keyOf(t, a, big) != nil && keyOf(t, a, big).balance.Load() > 0 && admitted.Load() > 20000
	})
	close(stop)
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	b := fake.booksOf("test:tier=free,route=/x,user=u")
	if got := b.granted - b.returned + b.charged; got != admitted.Load() {
		t.Fatalf("books: granted %d − returned %d + charged %d = %d, admitted %d",
			b.granted, b.returned, b.charged, got, admitted.Load())
	}
	t.Logf("admitted %d: granted %d, returned %d, charged %d", admitted.Load(), b.granted, b.returned, b.charged)
}

// TestFastPathRacesDrop: checks on the memo's lock-free fast path for a
// leased key race shard.remove dropping that key. Once remove reports the
// key dropped, its counters never change again (a spend that raced the
// drop was either seen by remove, which then kept the key, or given back
// and decided on the key that replaced it), and every admitted token is
// on one of the two keys: none lost, none counted twice.
func TestFastPathRacesDrop(t *testing.T) {
	s := newStepped(t)
	for i := range 8 {
		d := desc("tier", "free", "route", "/x", "user", fmt.Sprint("u", i))
		check(t, s.Agent, d)
		old := keyOf(t, s.Agent, d)
		old.Demand.Rate = 1e9 // a lease no test run spends
		s.step()
		check(t, s.Agent, d) // the memo holds the key, which holds a lease
		if old.balance.Load() < 1e8 || old.expiry.Load() <= s.clock.now() {
			t.Fatalf("key %d: balance %d, want a live lease", i, old.balance.Load())
		}
		balance0, spent0 := old.balance.Load(), old.spent.Load()
		spent := raceDrop(t, s, d, old)
		if balance := old.balance.Load(); balance0-balance != spent-spent0 {
			t.Fatalf("key %d: the balance went down by %d, spent went up by %d", i, balance0-balance, spent-spent0)
		}
	}
}

// TestStaticFastPathRacesDrop is TestFastPathRacesDrop for a key decided
// from its static share (checkStaticHit).
func TestStaticFastPathRacesDrop(t *testing.T) {
	s := newStatic(t)
	for i := range 8 {
		d := desc("big", fmt.Sprint("b", i)) // a share no test run spends
		old := spendStatic(t, s, d, 2)       // the memo holds the key
		raceDrop(t, s, d, old)
		if m := keyOf(t, s.Agent, d).smode.Load(); m != staticOn {
			t.Fatalf("key %d: the new key's mode %d, want static", i, m)
		}
	}
}

// raceDrop checks d from 4 goroutines while the refill loop's
// shard.remove drops old, d's key, and wants old's counters unchanged
// once it is dropped and every admission spent on old or on its
// successor. It returns old's spent.
func raceDrop(t *testing.T, s *steppedAgent, d Descriptor, old *keyState) int64 {
	t.Helper()
	never := func(*keyState) bool { return false }
	spent0 := old.spent.Load()
	const g = 4
	var done [g]atomic.Int64 // checks made by each goroutine
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for j := range g {
		wg.Go(func() {
			checkUntil(t, s.Agent, stop, []Descriptor{d}, func(got Decision) bool {
				if !got.Allowed {
					t.Errorf("check: %+v, want allowed", got)
					return false
				}
				done[j].Add(1)
				return true
			})
		})
	}
	waitFor(t, 10*time.Second, "checks on the fast path", func() bool { return old.spent.Load() > spent0+100 })
	sh := s.keys.shard(old.hash)
	waitFor(t, 10*time.Second, "the key dropped", func() bool {
		if !sh.remove(old, never) {
			return false
		}
		if old.staticable {
			s.ss.remove(old)
		}
		return true
	})
	// Every check in flight at the drop has ended once each goroutine
	// has made two more.
	var atDrop [g]int64
	for j := range done {
		atDrop[j] = done[j].Load()
	}
	waitFor(t, 10*time.Second, "checks after the drop", func() bool {
		for j := range done {
			if done[j].Load() < atDrop[j]+2 {
				return false
			}
		}
		return true
	})
	balance, spent := old.balance.Load(), old.spent.Load()
	waitFor(t, 10*time.Second, "more checks on the new key", func() bool {
		for j := range done {
			if done[j].Load() < atDrop[j]+100 {
				return false
			}
		}
		return true
	})
	close(stop)
	wg.Wait()
	if old.balance.Load() != balance || old.spent.Load() != spent {
		t.Fatalf("%v changed after the drop: balance %d → %d, spent %d → %d",
			d.Entries, balance, old.balance.Load(), spent, old.spent.Load())
	}
	var admitted int64
	for j := range done {
		admitted += done[j].Load()
	}
	nk := keyOf(t, s.Agent, d)
	if got := spent - spent0 + nk.spent.Load(); got != admitted {
		t.Fatalf("%v: spent %d on the dropped key + %d on the new one, admitted %d",
			d.Entries, spent-spent0, nk.spent.Load(), admitted)
	}
	return spent
}

// TestFastPathDropInterleavings runs the memo's fast paths (a leased key's
// and a static key's) inside shard.remove's keep, at the two points where
// they can meet the drop: a spend after remove's first read of the
// counters makes remove keep the key; a spend after the key is marked
// dropped is given back, and the key leaves the table as it was.
func TestFastPathDropInterleavings(t *testing.T) {
	for _, static := range []bool{false, true} {
		t.Run(fmt.Sprint("static=", static), func(t *testing.T) { fastPathDropInterleavings(t, static) })
	}
}

func fastPathDropInterleavings(t *testing.T, static bool) {
	s := newStepped(t)
	fast := s.checkLeasedHit
	if static {
		s = newStatic(t)
		fast = s.checkStaticHit
	}
	hit := func(d Descriptor) bool {
		set := s.rules.Load()
		var iw identWords
		h, ok := identHash(s.memo.seed, "test", []Descriptor{d}, &iw)
		me := s.memo.get(h, set, "test", []Descriptor{d}, &iw)
		if !ok || me == nil {
			t.Fatalf("%v: not in the memo", d.Entries)
		}
		var dec Decision
		return fast(&dec, me, set, &d, 1, 0)
	}
	// level is what the key holds: its lease's balance, or its share.
	level := func(ks *keyState) int64 {
		if !static {
			return ks.balance.Load()
		}
		ks.mu.Lock()
		defer ks.mu.Unlock()
		return ks.fbLimit.Peek(ks.fbState, s.clock.now()).Remaining
	}
	for i, spendAt := range []int{1, 2} { // keep's first call (before dropped is set) or second (after)
		var ks *keyState
		d := desc("tier", "free", "route", "/x", "user", fmt.Sprint("u", i))
		if static {
			d = desc("slow", fmt.Sprint("u", i))
			ks = spendStatic(t, s, d, 1)
			check(t, s.Agent, d) // a memo hit, from the slow path's record
		} else {
			check(t, s.Agent, d)
			ks = keyOf(t, s.Agent, d)
			ks.Demand.Rate = 1e6
			s.step()
			check(t, s.Agent, d)
		}
		if !hit(d) {
			t.Fatalf("spend at %d: the fast path did not decide the key", spendAt)
		}
		lv, spent := level(ks), ks.spent.Load()
		calls, hitOK := 0, false
		removed := s.keys.shard(ks.hash).remove(ks, func(*keyState) bool {
			if calls++; calls == spendAt {
				hitOK = hit(d)
			}
			return false
		})
		switch spendAt {
		case 1:
			if removed || ks.dropped.Load() || !hitOK || keyOf(t, s.Agent, d) != ks {
				t.Fatalf("spend before the drop: removed %v, dropped %v, spent %v: want the key kept", removed, ks.dropped.Load(), hitOK)
			}
			if level(ks) != lv-1 || ks.spent.Load() != spent+1 {
				t.Fatalf("spend before the drop: level %d → %d, spent %d → %d", lv, level(ks), spent, ks.spent.Load())
			}
		case 2:
			if !removed || !ks.dropped.Load() || hitOK || keyOf(t, s.Agent, d) != nil {
				t.Fatalf("spend after the drop: removed %v, dropped %v, spent %v: want the key dropped, the spend refused", removed, ks.dropped.Load(), hitOK)
			}
			if level(ks) != lv || ks.spent.Load() != spent {
				t.Fatalf("spend after the drop: level %d → %d, spent %d → %d", lv, level(ks), spent, ks.spent.Load())
			}
		}
	}
}
