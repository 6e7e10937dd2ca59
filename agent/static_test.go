package agent

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// staticRules: "k" is static-eligible; with 4 slots its share is 100/s
// with a burst of 10.
const staticRules = `
domain: test
descriptors:
  - key: k
    rate_limit:
      name: k
      unit: second
      requests_per_unit: 400
      burst: 40
  - key: slow
    rate_limit:
      name: slow
      unit: hour
      requests_per_unit: 40
      burst: 40
  - key: window
    rate_limit:
      name: window
      unit: second
      requests_per_unit: 100
      algorithm: sliding_window
  - key: warm
    rate_limit:
      name: warm
      unit: minute
      requests_per_unit: 600
      burst: 40
  - key: big
    rate_limit:
      name: big
      unit: second
      requests_per_unit: 1000000000
      burst: 1000000000
`

// newStatic is a stepped agent whose allocator gives it one of 4 slots
// for 2 s, for rules whose shares refill within 2 hours (slow's does): its
// first call (for the key "warm") has been answered.
func newStatic(t *testing.T) *steppedAgent { return newStaticSlots(t, 4) }

// newStaticSlots is newStatic with slots slots (0: none).
func newStaticSlots(t *testing.T, slots uint32) *steppedAgent {
	t.Helper()
	s := newSteppedWith(t, nil, staticRules)
	s.fake.with(func(f *fakeAllocator) {
		f.static = &allotv1.StaticShares{Slots: slots, ValidMs: 2000, HotVersion: 1, MaxRefillMs: 7_200_000}
	})
	check(t, s.Agent, desc("warm", "w"))
	s.step()
	if s.ss.held.Load() != (slots > 0) || s.ss.slots.Load() != slots {
		t.Fatalf("slots %d after the first answer, want %d", s.ss.slots.Load(), slots)
	}
	return s
}

// newStaticPacked is newStatic whose allocator reads packed keys, and has
// said so in an answer: the agent's calls are packed.
func newStaticPacked(t *testing.T) *steppedAgent {
	t.Helper()
	s := newStatic(t)
	s.fake.with(func(f *fakeAllocator) { f.readsPacked = true })
	check(t, s.Agent, desc("warm", "w"))
	s.clock.advance(100 * time.Millisecond)
	s.step()
	return s
}

func staticHash(t *testing.T, s *steppedAgent, d Descriptor) uint64 {
	t.Helper()
	r := s.rules.Load().Match("test", d.Entries)
	return rules.KeyHash(r, "test", d.Entries)
}

// keyCalls returns the keys of the requests after the first n whose
// domain and entries are d's.
func keyCalls(s *steppedAgent, n int, d Descriptor) (out []*allotv1.KeyAcquire, hot []uint64) {
	s.fake.with(func(f *fakeAllocator) {
		for _, req := range f.acquires[n:] {
			hot = append(hot, req.HotVersion)
			for _, k := range req.Keys {
				if k.Domain == "test" && entriesEqual(fromProto(k.Entries), d.Entries) {
					out = append(out, k)
				}
			}
		}
	})
	return out, hot
}

func wantSource(t *testing.T, s *steppedAgent, d Descriptor, src Source) Decision {
	t.Helper()
	got := check(t, s.Agent, d)
	if !got.Allowed || got.Source != src {
		t.Fatalf("check %v: allowed %v from %v, want allowed from %v", d.Entries, got.Allowed, got.Source, src)
	}
	return got
}

// spendStatic decides d n times from its static share and returns its key.
func spendStatic(t *testing.T, s *steppedAgent, d Descriptor, n int) *keyState {
	t.Helper()
	for range n {
		wantSource(t, s, d, SourceStatic)
	}
	return keyOf(t, s.Agent, d)
}

// wantMode fails unless ks's static mode is m.
func wantMode(t *testing.T, ks *keyState, m uint32, when string) {
	t.Helper()
	if got := ks.smode.Load(); got != m {
		t.Fatalf("mode %d %s, want %d", got, when, m)
	}
}

// TestStaticMaxRefill: a rule whose share takes longer than the answer's
// max_refill_ms to refill its burst is not decided from a share; a rule
// whose share refills within it is.
func TestStaticMaxRefill(t *testing.T) {
	s := newSteppedWith(t, nil, staticRules)
	s.fake.with(func(f *fakeAllocator) {
		// slow's share (10 an hour, burst 10) refills in an hour; k's in
		// 100 ms.
		f.static = &allotv1.StaticShares{Slots: 4, ValidMs: 2000, HotVersion: 1, MaxRefillMs: 118_000}
	})
	check(t, s.Agent, desc("warm", "w"))
	s.step()
	wantSource(t, s, desc("k", "a"), SourceStatic)
	wantSource(t, s, desc("slow", "a"), SourceFallback)
}

// TestStaticDecision: a slot holder decides an eligible key from its share
// without any call for it, and counts the decisions.
func TestStaticDecision(t *testing.T) {
	s := newStatic(t)
	if req := s.fake.lastAcquire(); !req.StaticShares || req.HotVersion != 0 {
		t.Fatalf("first call: static_shares %v hot_version %d, want true 0", req.StaticShares, req.HotVersion)
	}
	a := desc("k", "a")
	for i := range 3 {
		if got := wantSource(t, s, a, SourceStatic); got.Remaining != int64(9-i) {
			t.Fatalf("check %d: remaining %d, want %d (share burst 10)", i, got.Remaining, 9-i)
		}
	}
	n0, _, _ := s.fake.counts()
	for range 5 {
		s.clock.advance(100 * time.Millisecond)
		s.step()
	}
	if ks, _ := keyCalls(s, n0, a); len(ks) != 0 {
		t.Fatalf("static key sent: %v", ks)
	}
	if got := s.met.decisions(SourceStatic, true); got != 3 {
		t.Fatalf("static decisions %d, want 3", got)
	}
	if got := s.ss.keys.Load(); got != 1 {
		t.Fatalf("static keys %d, want 1", got)
	}
	// The share denies once spent (and the key is handed over for
	// promotion: TestStaticPromotion).
	b := desc("k", "b")
	for range 10 {
		wantSource(t, s, b, SourceStatic)
	}
	if got := check(t, s.Agent, b); got.Allowed || got.Source != SourceStatic {
		t.Fatalf("11th check of a share of 10: %+v, want denied from the share", got)
	}
}

// TestStaticPromotion: a key whose share falls below half is sent with
// promote and static_left (through packed keys); what it admits from its
// share after the call is built is charged; from the answer it is leased.
func TestStaticPromotion(t *testing.T) {
	s := newStaticPacked(t)
	a := desc("k", "a")
	ks := spendStatic(t, s, a, 5)
	wantMode(t, ks, staticOn, "after 5 of 10")
	wantSource(t, s, a, SourceStatic) // 4 left: below half
	wantMode(t, ks, staticPromote, "after 6 of 10")
	n0, _, _ := s.fake.counts()
	block, entered := make(chan struct{}), make(chan struct{}, 1)
	s.fake.with(func(f *fakeAllocator) { f.block, f.entered = block, entered })
	done := make(chan struct{})
	go func() { s.step(); close(done) }()
	<-entered
	// Built and sent: the share still decides, and what it admits is charged.
	wantSource(t, s, a, SourceStatic)
	wantSource(t, s, a, SourceStatic)
	if got := ks.charged.Load(); got != 2 {
		t.Fatalf("charged %d during the promotion, want 2", got)
	}
	s.fake.with(func(f *fakeAllocator) { f.block = nil })
	close(block)
	<-done
	kas, _ := keyCalls(s, n0, a)
	if len(kas) != 1 || !kas[0].Promote || kas[0].StaticLeft != 4 || kas[0].Charged != 0 || kas[0].Want < 1 {
		t.Fatalf("promotion sent %v, want one promote with static_left 4, no charge, a want", kas)
	}
	if s.fake.packedCalls == 0 {
		t.Fatalf("no packed call")
	}
	if m := ks.smode.Load(); m != staticOff {
		t.Fatalf("mode %d after the answer, want off", m)
	}
	wantSource(t, s, a, SourceLease)
	for range 3 {
		s.clock.advance(100 * time.Millisecond)
		s.step()
	}
	key := ks.key
	if got := ks.Paid + s.fake.booksOf(key).charged; got != 2 {
		t.Fatalf("paid %d + charged %d, want the 2 admitted after the build", ks.Paid, s.fake.booksOf(key).charged)
	}
	if got := s.met.staticPromotions; (dtoCounter{}).read(got) != 1 {
		t.Fatalf("promotions %v, want 1", (dtoCounter{}).read(got))
	}
}

// TestStaticPromotionCharged: while a promotion is in flight, what the
// share admits is charged, on the memo's fast path too: a key handed over
// for promotion with its share well above half (its demand passed half
// the share's rate) is decided by decideStatic, not checkStaticHit.
func TestStaticPromotionCharged(t *testing.T) {
	s := newStatic(t)
	waitFor(t, 10*time.Second, "the allocator's rules", func() bool { return s.rules.Load().Version() == 1 })
	d := desc("big", "x")
	ks := spendStatic(t, s, d, 2) // the memo holds it
	s.handOver(ks)
	s.enqueue(ks)
	block, entered := make(chan struct{}), make(chan struct{}, 1)
	s.fake.with(func(f *fakeAllocator) { f.block, f.entered = block, entered })
	done := make(chan struct{})
	go func() { s.step(); close(done) }()
	<-entered
	wantMode(t, ks, staticSent, "with the promotion in flight")
	wantSource(t, s, d, SourceStatic)
	if got := ks.charged.Load(); got != 1 {
		t.Fatalf("charged %d during the promotion, want 1", got)
	}
	s.fake.with(func(f *fakeAllocator) { f.block = nil })
	close(block)
	<-done
}

// TestStaticHotAndBack: a key the hot-key set gains stops static decisions
// at once and takes a new key's path; once the set loses it and it holds
// no lease, it is static again with a full share.
func TestStaticHotAndBack(t *testing.T) {
	s := newStatic(t)
	s.fake.with(func(f *fakeAllocator) { f.ttl = time.Second })
	a := desc("k", "a")
	wantSource(t, s, a, SourceStatic)
	h := staticHash(t, s, a)
	s.fake.with(func(f *fakeAllocator) { f.static.HotVersion, f.static.HotAdded = 2, []uint64{h} })
	n0, _, _ := s.fake.counts()
	s.clock.advance(time.Second)
	s.step() // the renewal brings the delta
	if got := s.ss.hotLen.Load(); got != 1 {
		t.Fatalf("hot set size %d, want 1", got)
	}
	wantSource(t, s, a, SourceFallback)
	s.clock.advance(50 * time.Millisecond)
	s.step()
	kas, hv := keyCalls(s, n0, a)
	if len(kas) != 1 || kas[0].Promote || kas[0].Charged != 1 || kas[0].Want < 1 {
		t.Fatalf("hot key sent %v, want a charge of 1 and a want, no promote", kas)
	}
	if len(hv) != 2 || hv[0] != 1 || hv[1] != 2 {
		t.Fatalf("hot versions sent %v, want [1 2]", hv)
	}
	wantSource(t, s, a, SourceLease)

	// The set loses it while it holds a lease: it stays leased until the
	// lease ends.
	s.fake.with(func(f *fakeAllocator) { f.static.HotVersion, f.static.HotRemoved = 3, []uint64{h} })
	ks := keyOf(t, s.Agent, a)
	back := false
	for range 40 {
		s.clock.advance(100 * time.Millisecond)
		s.step()
		if ks.smode.Load() == staticOn {
			back = true
			break
		}
		if s.ss.version == 3 && s.clock.now() < ks.expiry.Load() && ks.smode.Load() != staticOff {
			t.Fatalf("static while the lease lives")
		}
	}
	if !back || s.ss.hotLen.Load() != 0 {
		t.Fatalf("not static again (mode %d, hot %d)", ks.smode.Load(), s.ss.hotLen.Load())
	}
	if got := wantSource(t, s, a, SourceStatic); got.Remaining != 9 {
		t.Fatalf("remaining %d, want a full share less one (9)", got.Remaining)
	}
}

// TestStaticLapse: once the permission has lapsed, a static key takes a
// new key's path (fallback, charge, want), and its first call promotes it
// with what its share holds: the allocator counts the share of a holder
// that says nothing of it as full.
func TestStaticLapse(t *testing.T) {
	s := newStatic(t)
	a, b := desc("k", "a"), desc("slow", "b") // shares of 100/s and 10 an hour, burst 10
	wantSource(t, s, a, SourceStatic)
	for range 3 {
		wantSource(t, s, b, SourceStatic)
	}
	n0, _, _ := s.fake.counts()
	s.clock.advance(2 * time.Second) // no answer meanwhile
	wantSource(t, s, a, SourceFallback)
	wantSource(t, s, b, SourceFallback)
	s.step()
	for _, c := range []struct {
		d    Descriptor
		left int64
	}{{a, 10}, {b, 7}} { // a's share refilled meanwhile; b's a token in 6 minutes
		kas, _ := keyCalls(s, n0, c.d)
		if len(kas) != 1 || !kas[0].Promote || kas[0].StaticLeft != c.left || kas[0].Charged != 1 {
			t.Fatalf("lapsed key %v sent %v, want a charge of 1, promoted with static_left %d", c.d.Entries, kas, c.left)
		}
	}
	if ks := keyOf(t, s.Agent, b); ks.sOwe.Load() || ks.smode.Load() != staticOff {
		t.Fatalf("after the answer: owes %v, mode %d; want nothing owed, off", ks.sOwe.Load(), ks.smode.Load())
	}
}

// TestStaticBackendChange: a static key whose rule leaves the lease
// backend (a rules update) stops static decisions and owes its share's
// level, as for any other reason but the hot-key set.
func TestStaticBackendChange(t *testing.T) {
	s := newStatic(t)
	waitFor(t, 10*time.Second, "the allocator's rules", func() bool { return s.rules.Load().Version() == 1 })
	b := desc("slow", "b")
	ks := spendStatic(t, s, b, 3)
	keys := s.ss.keys.Load()
	s.setRules(mustCompile(t, 2, strings.Replace(staticRules, "      requests_per_unit: 40\n      burst: 40\n", "      requests_per_unit: 40\n      burst: 40\n      backend: redis\n", 1)), true)
	if r := s.rules.Load().Match("test", b.Entries); r == nil || r.Backend != rules.BackendRedis {
		t.Fatalf("slow's rule after the update: %+v, want the Redis backend", r)
	}
	if got := check(t, s.Agent, b); got.Source == SourceStatic {
		t.Fatalf("check after the backend change: %+v, want not from the share", got)
	}
	wantMode(t, ks, staticOff, "after the backend change")
	if !ks.sOwe.Load() || s.ss.keys.Load() != keys-1 {
		t.Fatalf("owes %v, static keys %d; want owes, %d", ks.sOwe.Load(), s.ss.keys.Load(), keys-1)
	}
}

// TestStaticLapseBuilt: a promotion built after the permission lapsed
// still carries the share's level, and the key decides nothing more from
// its share.
func TestStaticLapseBuilt(t *testing.T) {
	s := newStatic(t)
	b := desc("slow", "b")
	ks := spendStatic(t, s, b, 6)
	wantMode(t, ks, staticPromote, "after 6 of 10")
	n0, _, _ := s.fake.counts()
	s.clock.advance(2 * time.Second) // lapsed before the build
	s.step()
	kas, _ := keyCalls(s, n0, b)
	if len(kas) != 1 || !kas[0].Promote || kas[0].StaticLeft != 4 {
		t.Fatalf("sent %v, want a promotion with static_left 4", kas)
	}
	if m := ks.smode.Load(); m != staticOff || ks.sOwe.Load() {
		t.Fatalf("mode %d, owes %v; want off, nothing", m, ks.sOwe.Load())
	}
}

// TestStaticOweHot: a key that owes its share's level and turns hot before
// its promotion is built is reported with that level, in the call that
// acknowledges the version, and not promoted.
func TestStaticOweHot(t *testing.T) {
	s := newStatic(t)
	b := desc("slow", "b")
	for range 2 {
		wantSource(t, s, b, SourceStatic)
	}
	// A call in flight, applied (its answer makes b hot) and its answer
	// lost: retried before b is sent.
	wantSource(t, s, desc("window", "x"), SourceFallback)
	makeHot(t, s, 2, b)
	s.fake.with(func(f *fakeAllocator) { f.dropReplies = 1 })
	s.step()
	if s.rf.unacked == nil {
		t.Fatalf("no unacknowledged call")
	}
	s.clock.advance(2 * time.Second) // the permission lapses
	wantSource(t, s, b, SourceFallback)
	ks := keyOf(t, s.Agent, b)
	if !ks.sOwe.Load() {
		t.Fatalf("b owes nothing after the lapse")
	}
	n0, _, _ := s.fake.counts()
	s.step() // the retry, answered from the record; then b's first use
	calls := callsSince(s, n0)
	if len(calls) != 2 || s.ss.version != 2 {
		t.Fatalf("%d calls, version %d; want the retry and b's, 2", len(calls), s.ss.version)
	}
	if entryOf(calls[0], b) != nil {
		t.Fatalf("the retry carries b")
	}
	k := entryOf(calls[1], b)
	if k == nil || !k.StaticReport || k.StaticLeft != 8 || k.Promote || k.Charged != 1 || calls[1].HotVersion != 2 {
		t.Fatalf("b's call: %v at hot_version %d; want its first use with a report of 8, no promote, at 2", k, calls[1].HotVersion)
	}
	if ks.sOwe.Load() || len(s.ss.reports) != 0 {
		t.Fatalf("owes %v, %d pending reports; want nothing", ks.sOwe.Load(), len(s.ss.reports))
	}
}

// TestStaticOweKept: a key that owes its share's level is not forgotten
// before that share is full again, even idle with nothing to send.
func TestStaticOweKept(t *testing.T) {
	s := newStatic(t)
	b := desc("slow", "b")
	ks := spendStatic(t, s, b, 4)
	ks.mu.Lock()
	s.ss.leaveLocked(ks)
	ks.mu.Unlock()
	o := ks.obs()
	now := o.StaticFullAt - 1 // idle: the share refills in 24 minutes
	if o.StaticFullAt <= ks.lastUse.Load()+int64(time.Minute) || s.rf.core.Forgettable(&ks.Key, &o, now) {
		t.Fatalf("owing key: full at %d, forgettable %v at %d; want full later, not forgettable", o.StaticFullAt, s.rf.core.Forgettable(&ks.Key, &o, now), now)
	}
	if o := ks.obs(); !s.rf.core.Forgettable(&ks.Key, &o, o.StaticFullAt) {
		t.Fatalf("owing key not forgettable once its share is full")
	}
}

// TestStaticRenewal: a slot holder with nothing to send renews with an
// empty Acquire once its permission is half its validity old, and not
// more often; an agent without a slot sends none.
func TestStaticRenewal(t *testing.T) {
	for _, slot := range []bool{true, false} {
		t.Run(fmt.Sprint("slot=", slot), func(t *testing.T) {
			s := newStatic(t)
			if !slot {
				s = newStaticSlots(t, 0)
			}
			n0, _, _ := s.fake.counts()
			last := s.clock.now()
			var empties []time.Duration
			for range 35 {
				s.clock.advance(100 * time.Millisecond)
				s.step()
				if n, _, _ := s.fake.counts(); n > n0 {
					req := s.fake.lastAcquire()
					if len(req.Keys) == 0 {
						empties = append(empties, time.Duration(s.clock.now()-last))
					}
					last, n0 = s.clock.now(), n
				}
			}
			if !slot {
				if len(empties) != 0 {
					t.Fatalf("empty calls without a slot: %v", empties)
				}
				return
			}
			if len(empties) != 3 {
				t.Fatalf("empty calls %v over 3.5 s, want 3", empties)
			}
			for _, d := range empties {
				if d < time.Second {
					t.Fatalf("empty calls %v: one under half the validity after the previous call", empties)
				}
			}
			if !s.ss.validUntil.CompareAndSwap(s.ss.validUntil.Load(), s.ss.validUntil.Load()) || s.clock.now() >= s.ss.validUntil.Load() {
				t.Fatalf("permission lapsed despite the renewals")
			}
		})
	}
}

// TestStaticSeveralGroups: an agent routing to several data groups does
// not ask for static shares and decides nothing from them.
func TestStaticSeveralGroups(t *testing.T) {
	s := newStatic(t)
	a := desc("k", "a")
	wantSource(t, s, a, SourceStatic)
	if !s.build(s.clock.now(), nil).req.StaticShares {
		t.Fatalf("one group: static_shares not set")
	}
	s.noteTopology(&allotv1.Topology{Version: 2, Groups: []*allotv1.GroupRoute{
		{Id: 1, Slots: "0-1023", LeaderAddr: s.srv.addr}}})
	if !s.build(s.clock.now(), nil).req.StaticShares {
		t.Fatalf("one data group: static_shares not set")
	}
	wantSource(t, s, a, SourceStatic)
	s.noteTopology(&allotv1.Topology{Version: 3, Groups: []*allotv1.GroupRoute{
		{Id: 1, Slots: "0-511", LeaderAddr: s.srv.addr}, {Id: 2, Slots: "512-1023", LeaderAddr: s.srv.addr}}})
	if s.build(s.clock.now(), nil).req.StaticShares {
		t.Fatalf("two data groups: static_shares set")
	}
	wantSource(t, s, a, SourceFallback)
	wantSource(t, s, desc("k", "b"), SourceFallback)
}

// TestStaticConcurrent: checks on static keys while answers bring hot-set
// changes, promotions and static reports (run with -race).
func TestStaticConcurrent(t *testing.T) {
	s := newStatic(t)
	const nKeys = 16
	descs := make([]Descriptor, nKeys)
	hashes := make([]uint64, nKeys)
	for i := range descs {
		descs[i] = desc("k", fmt.Sprintf("c%d", i))
		hashes[i] = staticHash(t, s, descs[i])
	}
	// Keys decided from their shares but not checked meanwhile: each turns
	// hot once, while the checks go on, and is reported.
	const nQuiet = 8
	quiet := make([]uint64, nQuiet)
	for i := range quiet {
		wantSource(t, s, desc("slow", fmt.Sprintf("q%d", i)), SourceStatic)
		quiet[i] = staticHash(t, s, desc("slow", fmt.Sprintf("q%d", i)))
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	var bad atomic.Int64
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; !stop.Load(); i++ {
				d, err := s.Check(context.Background(), "test", descs[i%nKeys:i%nKeys+1], 1)
				if err != nil || d.Source != SourceStatic && d.Source != SourceFallback && d.Source != SourceLease {
					bad.Add(1)
				}
			}
		}()
	}
	version := uint64(1)
	for i := range 150 {
		version++
		hs := hashes[(i*3)%nKeys : (i*3)%nKeys+1]
		s.fake.with(func(f *fakeAllocator) {
			f.static.HotVersion = version
			if i%2 == 0 {
				f.static.HotAdded = append(f.static.HotAdded, hs...)
			} else {
				f.static.HotRemoved = append(f.static.HotRemoved, hashes[((i-1)*3)%nKeys])
			}
			if i%15 == 14 {
				f.static.HotReset, f.static.HotAdded, f.static.HotRemoved = true, hashes[:2], nil
			}
			if i >= 30 && i < 30+nQuiet {
				f.static.HotAdded = append(f.static.HotAdded, quiet[i-30])
			}
		})
		s.clock.advance(50 * time.Millisecond)
		check(t, s.Agent, desc("window", fmt.Sprint(i))) // something to send: never static
		s.step()
	}
	stop.Store(true)
	wg.Wait()
	if bad.Load() != 0 {
		t.Fatalf("%d checks failed or came from an unexpected source", bad.Load())
	}
	if s.met.decisions(SourceStatic, true) == 0 || s.met.decisions(SourceFallback, true) == 0 {
		t.Fatalf("static %d, fallback %d decisions: the test exercised one path only",
			s.met.decisions(SourceStatic, true), s.met.decisions(SourceFallback, true))
	}
	// Keys that turned hot while decided from their shares were reported,
	// each in the call that acknowledged its version.
	check(t, s.Agent, desc("window", "last"))
	s.clock.advance(50 * time.Millisecond)
	s.step()
	if got := len(s.ss.reports); got != 0 {
		t.Fatalf("%d reports pending after the last answer, want 0", got)
	}
	reports := map[string]int64{}
	s.fake.with(func(f *fakeAllocator) {
		for _, req := range f.acquires {
			for _, k := range req.Keys {
				if k.StaticReport && k.Entries[0].Key == "slow" {
					reports[k.Entries[0].Value] += k.StaticLeft
				}
			}
		}
	})
	if len(reports) != nQuiet {
		t.Fatalf("reports of %v, want each of %d quiet keys", reports, nQuiet)
	}
	for q, left := range reports {
		if left != 9 {
			t.Fatalf("%s reported %d in all, want once with 9", q, left)
		}
	}
	s.ss.mu.Lock()
	defer s.ss.mu.Unlock()
	for h := range s.ss.hot {
		for ks := s.ss.idx[h]; ks != nil; ks = ks.snext {
			if ks.smode.Load() != staticOff {
				t.Fatalf("hot key %s is static", ks.key)
			}
		}
	}
}

// TestStaticShareKept: an idle static key is forgotten only once its share
// is full again: a key seen again starts from a full share, which must not
// come before the spent one has refilled (nothing charged it).
func TestStaticShareKept(t *testing.T) {
	s := newStatic(t)
	d := desc("slow", "a") // a share of 10 per hour, burst 10
	for range 3 {
		wantSource(t, s, d, SourceStatic)
	}
	for range 3 {
		s.clock.advance(5 * time.Second)
		s.step()
	}
	if keyOf(t, s.Agent, d) == nil {
		t.Fatalf("forgotten idle with its share short of 3 tokens")
	}
	s.clock.advance(18 * time.Minute) // 3 tokens at 10/h
	s.step()
	s.clock.advance(100 * time.Millisecond)
	s.step()
	if keyOf(t, s.Agent, d) != nil {
		t.Fatalf("kept once idle with a full share")
	}
	if got := s.ss.keys.Load(); got != 0 {
		t.Fatalf("static keys %d after it was forgotten, want 0", got)
	}
}

// TestStaticPromotionRejected: a promotion the allocator rejects ends the
// key's static decisions; it is sent again, as any key, and promoted with
// the level its share had when the rejected call was built.
func TestStaticPromotionRejected(t *testing.T) {
	s := newStatic(t)
	a := desc("slow", "a")
	ks := spendStatic(t, s, a, 6)
	n0, _, _ := s.fake.counts()
	s.fake.with(func(f *fakeAllocator) { f.rejectNext = 1 })
	s.step()
	if m := ks.smode.Load(); m != staticOff || ks.charged.Load() != 0 || !ks.sOwe.Load() {
		t.Fatalf("after a rejected promotion: mode %d, charged %d, owes %v; want off, 0, owes", m, ks.charged.Load(), ks.sOwe.Load())
	}
	wantSource(t, s, a, SourceFallback)
	if got := ks.charged.Load(); got != 1 {
		t.Fatalf("charged %d, want 1", got)
	}
	for range 80 { // it is sent alone after policy.NotLeasedRetry
		s.clock.advance(100 * time.Millisecond)
		s.step()
	}
	kas, _ := keyCalls(s, n0, a)
	if len(kas) < 2 {
		t.Fatalf("sent %v, want the rejected promotion and another", kas)
	}
	for i, k := range kas[:2] {
		if !k.Promote || k.StaticLeft != 4 {
			t.Fatalf("call %d: %v, want a promotion with static_left 4", i, k)
		}
	}
	for _, k := range kas[2:] {
		if k.Promote {
			t.Fatalf("promoted again after the answer: %v", k)
		}
	}
	if ks.sOwe.Load() {
		t.Fatalf("owes after the answer")
	}
}

// BenchmarkCheckStatic: a key decided from its static share (through the
// request memo, then the shard read lock and the key's mutex), to set
// against BenchmarkCheckLeased.
func BenchmarkCheckStatic(b *testing.B) {
	fake := newFake(b, func() int64 { return time.Now().UnixNano() }, testRules)
	fake.static = &allotv1.StaticShares{Slots: 2, ValidMs: 3_600_000, HotVersion: 1, MaxRefillMs: 118_000}
	srv := serveFake(b, fake)
	cfg := DefaultConfig()
	cfg.Allocators = []string{srv.addr}
	cfg.Rules = mustCompile(b, 1, testRules)
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.CallTimeout = 10 * time.Second
	cfg.manual = true
	a := newAgent(b, cfg)
	ctx := context.Background()
	if _, err := a.Check(ctx, "test", []Descriptor{deepDesc(1)}, 1); err != nil {
		b.Fatal(err)
	}
	for range 10 {
		if a.refillOnce(ctx); a.rf.unacked == nil {
			break
		}
	}
	descs := []Descriptor{deepDesc(0)}
	if d, err := a.Check(ctx, "test", descs, 1); err != nil || d.Source != SourceStatic {
		b.Fatalf("check: %+v %v, want static", d, err)
	}
	b.ReportAllocs()
	reportCPU(b)
	for b.Loop() {
		if _, err := a.Check(ctx, "test", descs, 1); err != nil {
			b.Fatal(err)
		}
	}
}

// TestStaticClosed: checks after Close decide nothing from static shares,
// even when the last call's answer arrives during Close.
func TestStaticClosed(t *testing.T) {
	s := newStatic(t)
	a := desc("k", "a")
	wantSource(t, s, a, SourceStatic)
	wantSource(t, s, desc("window", "x"), SourceFallback) // not eligible: a call for Close to deliver
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1 })
	s.step()
	if s.rf.unacked == nil {
		t.Fatalf("no unacknowledged call")
	}
	if err := s.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := check(t, s.Agent, a); got.Source == SourceStatic {
		t.Fatalf("static decision after Close")
	}
}

// TestStaticLapseOutage: a permission that lapses because the allocator
// is unreachable leaves static keys to the breaker's outage rules.
func TestStaticLapseOutage(t *testing.T) {
	s := newStatic(t)
	a := desc("k", "a")
	wantSource(t, s, a, SourceStatic)
	s.fake.with(func(f *fakeAllocator) { f.failNext = 1000 })
	for range 30 {
		s.clock.advance(100 * time.Millisecond)
		s.step()
	}
	if !s.breakerOpen.Load() {
		t.Fatalf("breaker closed")
	}
	wantSource(t, s, a, SourceFallback)
	if ks := keyOf(t, s.Agent, a); ks.outage.Load() != 1 || ks.charged.Load() != 0 {
		t.Fatalf("outage %d charged %d, want an outage admission", ks.outage.Load(), ks.charged.Load())
	}
}
