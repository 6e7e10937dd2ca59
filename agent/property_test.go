package agent

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// TestPropertyBooksBalance drives one agent against the fake allocator with
// random checks, refill ticks, clock jumps and injected failures (lost
// answers, failed and rejected calls), then closes it. Whatever happened:
//
//   - every token the fallback admitted while the allocator was believed
//     reachable is paid exactly once: charged to the allocator, or settled
//     out of a grant that arrived while it was owed (lost answers are
//     retried with the same request id, rejected calls put their charges
//     back);
//   - leased admissions never exceed what was granted and not returned
//     (the difference is what expired unspent);
//   - no lease balance ever goes negative.
func TestPropertyBooksBalance(t *testing.T) {
	keys := []Descriptor{desc("api_key", "p"), desc("small", "p"), desc("rate", "p")}
	canon := []string{"test:api_key=p", "test:small=p", "test:rate=p"}
	rapid.Check(t, func(rt *rapid.T) {
		s := newStepped(t)
		var leased, charged [3]int64
		rt.Repeat(map[string]func(*rapid.T){
			"check": func(rt *rapid.T) {
				i := rapid.IntRange(0, 2).Draw(rt, "key")
				hits := uint32(rapid.IntRange(1, 3).Draw(rt, "hits"))
				open := s.breakerOpen.Load()
				got, err := s.Check(context.Background(), "test", []Descriptor{keys[i]}, hits)
				if err != nil {
					rt.Fatal(err)
				}
				if !got.Allowed {
					return
				}
				switch got.Source {
				case SourceLease:
					leased[i] += int64(hits)
				case SourceFallback:
					if !open {
						charged[i] += int64(hits)
					}
				default:
					rt.Fatalf("source %v", got.Source)
				}
			},
			"step": func(rt *rapid.T) { s.step() },
			"advance": func(rt *rapid.T) {
				s.clock.advance(rapid.SampledFrom([]time.Duration{
					time.Millisecond, 50 * time.Millisecond, time.Second, 11 * time.Second,
				}).Draw(rt, "by"))
			},
			"fail": func(rt *rapid.T) {
				n := rapid.IntRange(1, 4).Draw(rt, "n")
				s.fake.with(func(f *fakeAllocator) { f.failNext = n })
			},
			"drop":   func(rt *rapid.T) { s.fake.with(func(f *fakeAllocator) { f.dropReplies = 1 }) },
			"reject": func(rt *rapid.T) { s.fake.with(func(f *fakeAllocator) { f.rejectNext = 1 }) },
			"": func(rt *rapid.T) {
				for _, d := range keys {
					if ks := keyOf(t, s.Agent, d); ks != nil && ks.balance.Load() < 0 {
						rt.Fatalf("key %v: negative balance %d", d.Entries, ks.balance.Load())
					}
				}
			},
		})
		s.fake.with(func(f *fakeAllocator) { f.failNext, f.dropReplies, f.rejectNext = 0, 0, 0 })
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.Close(ctx); err != nil {
			rt.Fatalf("Close: %v", err)
		}
		// Payments out of grants are counted agent-wide (a key forgotten
		// after IdleTimeout and seen again starts a new key state), so
		// "paid exactly once" is checked in total, and per key that
		// nothing is charged twice and leases cover leased admissions.
		paid := int64(dtoCounter{}.read(s.met.paid))
		var chargedAll, admittedAll int64
		for i, key := range canon {
			b := s.fake.booksOf(key)
			chargedAll += b.charged
			admittedAll += charged[i]
			if b.charged > charged[i] {
				rt.Fatalf("%s: allocator charged %d, more than the fallback admitted while reachable (%d)", key, b.charged, charged[i])
			}
			if net := b.granted - b.returned - (charged[i] - b.charged); net < leased[i] {
				rt.Fatalf("%s: leased admissions %d > granted %d − returned %d − paid %d", key, leased[i], b.granted, b.returned, charged[i]-b.charged)
			}
		}
		if chargedAll+paid != admittedAll {
			rt.Fatalf("allocator charged %d + paid out of grants %d ≠ fallback admitted %d while reachable", chargedAll, paid, admittedAll)
		}
	})
}

// TestKeyTableCollisions exercises the hash-collision chain: distinct keys
// forced onto one hash are found, kept apart and removed independently.
func TestKeyTableCollisions(t *testing.T) {
	set := mustCompile(t, 1, testRules)
	tab := newKeyTable()
	const h = 42
	sh := tab.shard(h)
	var states []*keyState
	for i := range 3 {
		d := desc("api_key", fmt.Sprint("c", i))
		r := set.Match("test", d.Entries)
		ks, created := sh.insert(h, r, "test", d.Entries, 1, nil)
		if !created {
			t.Fatalf("insert %d: not created", i)
		}
		states = append(states, ks)
	}
	find := func(i int) *keyState {
		d := desc("api_key", fmt.Sprint("c", i))
		return sh.lookupRLocked(h, set.Match("test", d.Entries), "test", d.Entries)
	}
	for i, ks := range states {
		if find(i) != ks {
			t.Fatalf("lookup %d: wrong state", i)
		}
	}
	never := func(*keyState) bool { return false }
	removed := map[int]bool{}
	for _, i := range []int{1, 2, 0} { // middle, head, last of the chain
		if !sh.remove(states[i], never) {
			t.Fatalf("remove %d failed", i)
		}
		removed[i] = true
		for j := range states {
			if got := find(j); removed[j] != (got == nil) || (got != nil && got != states[j]) {
				t.Fatalf("after removing %v: lookup %d = %p, want %p", removed, j, got, states[j])
			}
		}
	}
	if len(sh.m) != 0 {
		t.Fatalf("shard map has %d entries after removing every key", len(sh.m))
	}
	if sh.remove(states[0], never) {
		t.Fatalf("removed a key twice")
	}
	if ks, created := sh.insert(h, set.Match("test", desc("api_key", "c0").Entries), "test", desc("api_key", "c0").Entries, 1, nil); !created || ks == states[0] {
		t.Fatalf("re-insert after removal did not create a fresh state")
	}
}

// TestLongDescriptorKey: descriptors longer than the hash buffer take the
// string-by-string hash and still find their one key state.
func TestLongDescriptorKey(t *testing.T) {
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	long := desc("small", strings.Repeat("v", 3*hashBufLen))
	for i := range 3 {
		if got := check(t, a, long); !got.Allowed || got.Remaining != int64(2-i) {
			t.Fatalf("check %d: %+v", i, got)
		}
	}
	if got := check(t, a, long); got.Allowed {
		t.Fatalf("4th allowed: the long key got more than one state")
	}
	short := desc("small", "v")
	if h1, h2 := a.keys.keyHash(a.Rules().Match("test", long.Entries), "test", long.Entries),
		a.keys.keyHash(a.Rules().Match("test", short.Entries), "test", short.Entries); h1 == h2 {
		t.Fatalf("long and short keys hash alike")
	}
}
