package state

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func mustConsistent(t *testing.T, s *State) {
	t.Helper()
	if err := s.consistency(); err != nil {
		t.Fatal(err)
	}
}

func roundTrip(t *testing.T, s *State) {
	t.Helper()
	b := persist(t, s)
	r := New(s.Config())
	if err := r.Restore(bytes.NewReader(b)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	mustConsistent(t, r)
	if b2 := persist(t, r); !bytes.Equal(b, b2) {
		t.Fatalf("restored state re-persists differently")
	}
}

// Holdings beyond 32 bits are kept exactly (escaped leases), and a lease
// that shrinks back is compact again.
func TestEscapedLeases(t *testing.T) {
	s := newTestState(t)
	putRules(t, s, at(0), testRules+`  - key: huge
    rate_limit: {unit: second, requests_per_unit: 4000000000, burst: 10000000000}
`)
	g := mustAcquire(t, s, at(0), "a", 1, ka("huge", "x", 6e9, 0, 0, 0)).Grants[0]
	if g.Granted != 6e9 || g.Held != 6e9 {
		t.Fatalf("grant = %v, want 6e9", g)
	}
	if len(s.st.codec.ext) != 1 {
		t.Fatalf("%d escaped leases, want 1", len(s.st.codec.ext))
	}
	mustConsistent(t, s)
	r, err := s.ListLeases(&allotv1.ListLeasesRequest{Key: "test:huge=x"}, at(0))
	if err != nil || len(r.Leases) != 1 || r.Leases[0].Tokens != 6e9 {
		t.Fatalf("ListLeases = %v, %v", r, err)
	}
	roundTrip(t, s)
	g = mustAcquire(t, s, at(time.Second), "a", 2, ka("huge", "x", 1, 5, 0, 0)).Grants[0]
	if g.Held != 6 {
		t.Fatalf("held %d after spending, want 6", g.Held)
	}
	if len(s.st.codec.ext) != 0 {
		t.Fatalf("%d escaped leases after shrinking, want 0", len(s.st.codec.ext))
	}
	mustConsistent(t, s)
}

// A lease whose expiry passed long ago, with no Expire since, is recorded
// as due when another agent's call moves the key's base; it ends at the
// next Expire, as it would have.
func TestLongPastExpiry(t *testing.T) {
	cfg := testConfig()
	cfg.AgentTTL = 24 * time.Hour
	s := New(cfg)
	putRules(t, s, at(0), testRules)
	mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 10, 0, 0, 0))
	later := at(3 * time.Hour)
	g := mustAcquire(t, s, later, "b", 1, ka("tb", "x", 1, 0, 0, 0)).Grants[0]
	if g.Agents != 2 {
		t.Fatalf("agents on the key = %d, want 2 (a's lease is due but not ended)", g.Agents)
	}
	mustConsistent(t, s)
	h := hashOf(s, "tb", "x")
	var e entry
	s.st.loadEntry(&e, h, s.st.tab.at(s.st.tab.find(h)).link)
	if exp := e.leases[0].expiry; exp > later || exp < at(10*time.Second) {
		t.Fatalf("a's expiry is %v after t0, want between 10s and 3h", time.Duration(exp-t0))
	}
	roundTrip(t, s)
	expire(s, later)
	if st := s.Stats(); st.Leases != 1 {
		t.Fatalf("leases after Expire = %d, want 1 (b's)", st.Leases)
	}
	mustConsistent(t, s)
}

// Many agents on one key: the lease count and then the entry outgrow their
// compact forms (n ≥ 127, an entry with a page of its own) and shrink
// back as agents leave.
func TestManyAgentsOneKey(t *testing.T) {
	s := newTestState(t)
	const n = 800
	for i := range n {
		mustAcquire(t, s, at(time.Duration(i)*time.Millisecond), fmt.Sprint("agent-", i), 1, ka("big", "x", 1, 0, 0, 0))
		if i == 126 || i == 127 || i == n-1 {
			mustConsistent(t, s)
		}
	}
	h := hashOf(s, "big", "x")
	var e entry
	s.st.loadEntry(&e, h, s.st.tab.at(s.st.tab.find(h)).link)
	if len(e.leases) != n || e.size <= arenaLarge {
		t.Fatalf("entry has %d leases in %d bytes, want %d in a large block", len(e.leases), e.size, n)
	}
	roundTrip(t, s)
	now := at(time.Second)
	for i := range n {
		if _, err := release(s, now, fmt.Sprint("agent-", i), 2, true); err != nil {
			t.Fatal(err)
		}
		if i%97 == 0 || n-i < 3 || i == n-128 || i == n-127 {
			mustConsistent(t, s)
		}
	}
	if st := s.Stats(); st.Leases != 0 || s.st.ar.live != 0 {
		t.Fatalf("after every release: %d leases, %d live arena bytes", st.Leases, s.st.ar.live)
	}
}

// More templates than fit the entry's one-byte field.
func TestManyTemplates(t *testing.T) {
	s := New(testConfig())
	var b strings.Builder
	b.WriteString("domain: many\ndescriptors:\n")
	for i := range 200 {
		fmt.Fprintf(&b, "  - key: k%d\n    rate_limit: {unit: second, requests_per_unit: 10}\n", i)
	}
	putRules(t, s, at(0), b.String())
	var keys []*allotv1.KeyAcquire
	for i := range 200 {
		keys = append(keys, &allotv1.KeyAcquire{Domain: "many", Entries: []*allotv1.Entry{{Key: fmt.Sprint("k", i), Value: "v"}}, Want: 1})
	}
	mustAcquire(t, s, at(0), "a", 1, keys...)
	if len(s.st.tpls.idx) != 200 {
		t.Fatalf("%d templates, want 200", len(s.st.tpls.idx))
	}
	mustConsistent(t, s)
	r, err := s.ListLeases(&allotv1.ListLeasesRequest{Key: "many:k150=v"}, at(0))
	if err != nil || len(r.Leases) != 1 || r.Leases[0].Domain != "many" {
		t.Fatalf("ListLeases = %v, %v", r, err)
	}
	roundTrip(t, s)
	if _, err := release(s, at(0), "a", 2, true); err != nil {
		t.Fatal(err)
	}
	if len(s.st.tpls.idx) != 0 {
		t.Fatalf("%d templates after every release, want 0", len(s.st.tpls.idx))
	}
	mustConsistent(t, s)
}

// When more than a third of the arena is free, Expire compacts it, a
// bounded number of entries at a time; the state persists the same
// before and after, and reads see every lease throughout.
func TestArenaCompaction(t *testing.T) {
	var keys, rel []*allotv1.KeyAcquire
	for i := range 20_000 {
		keys = append(keys, ka("big", fmt.Sprint("key-", i), 1, 0, 0, 0))
		if i%10 != 0 {
			rel = append(rel, ka("big", fmt.Sprint("key-", i), 0, 0, 1, 0))
		}
	}
	setup := func() *State {
		s := newTestState(t)
		for i := range 20 {
			mustAcquire(t, s, at(0), "a", uint64(i+1), keys[i*1000:(i+1)*1000]...)
		}
		for i := 0; i < len(rel); i += 1000 { // release 90%
			if _, err := release(s, at(time.Second), "a", uint64(100+i), false, rel[i:min(i+1000, len(rel))]...); err != nil {
				t.Fatal(err)
			}
		}
		mustConsistent(t, s)
		return s
	}
	s := setup()
	pages := len(s.st.ar.pages)
	before := persist(t, s)
	s.mu.Lock()
	s.st.compact()
	s.mu.Unlock()
	mustConsistent(t, s)
	if after := persist(t, s); !bytes.Equal(before, after) {
		t.Fatalf("compaction changed the persisted state")
	}
	if got := len(s.st.ar.pages); got*4 > pages {
		t.Fatalf("%d pages after compaction, %d before", got, pages)
	}

	// Through Expire, steps of at most 300 entries (compactQuota), with
	// acquires, releases and a snapshot between the steps.
	s = setup()
	s.st.compactBudget = 300
	want := persist(t, s)
	snap, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	snap.Release() // compaction starts only without a live snapshot
	now := at(time.Second)
	for step := 0; step == 0 || s.st.old != nil; step++ {
		expire(s, now)
		mustConsistent(t, s)
		if step > 100 {
			t.Fatalf("compaction did not finish in %d steps", step)
		}
		if step == 2 {
			snap, err := s.Snapshot()
			if err != nil {
				t.Fatal(err)
			}
			mustAcquire(t, s, now, "b", 1, ka("big", "key-10", 1, 0, 0, 0), ka("big", "key-15", 1, 0, 0, 0))
			var buf bytes.Buffer
			if err := snap.Persist(&buf); err != nil {
				t.Fatal(err)
			}
			snap.Release()
			r := New(testConfig())
			if err := r.Restore(&buf); err != nil {
				t.Fatal(err)
			}
			mustConsistent(t, r)
			if _, err := release(s, now, "b", 2, true); err != nil {
				t.Fatal(err)
			}
		}
		if r, err := s.ListLeases(&allotv1.ListLeasesRequest{PageSize: 1000}, now); err != nil || len(r.Leases) != 1000 {
			t.Fatalf("step %d: listed %d leases, %v", step, len(r.Leases), err)
		}
	}
	if got := len(s.st.ar.pages); got*4 > pages || s.st.ar.idle*2 > s.st.ar.live {
		t.Fatalf("Expire did not compact: %d pages (%d before), %d idle, %d live bytes", got, pages, s.st.ar.idle, s.st.ar.live)
	}
	// Expire changed only the time and the sweep cursor: compare leases.
	r := New(testConfig())
	if err := r.Restore(bytes.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	a, _ := s.ListLeases(&allotv1.ListLeasesRequest{PageSize: 1000}, now)
	b, _ := r.ListLeases(&allotv1.ListLeasesRequest{PageSize: 1000}, now)
	if fmt.Sprint(a.Leases) != fmt.Sprint(b.Leases) {
		t.Fatalf("leases differ after an incremental compaction")
	}
}

// A full arena grants no new lease (the agent keeps deciding locally) and
// never panics; existing leases keep working and freed room is reused.
func TestArenaFull(t *testing.T) {
	s := newTestState(t)
	s.st.ar.maxPages = 2 // page 0 is reserved: one 64 KiB page
	var keys []*allotv1.KeyAcquire
	for i := range 3000 {
		keys = append(keys, ka("big", fmt.Sprint("key-", i), 1, 0, 0, 0))
	}
	r := mustAcquire(t, s, at(0), "a", 1, keys[:1000]...)
	r2 := mustAcquire(t, s, at(0), "a", 2, keys[1000:2000]...)
	r3 := mustAcquire(t, s, at(0), "a", 3, keys[2000:]...)
	leased := 0
	for _, g := range append(append(r.Grants, r2.Grants...), r3.Grants...) {
		if g.Agents == 1 {
			leased++
			if g.Granted != 1 {
				t.Fatalf("leased key granted %d", g.Granted)
			}
		} else if g.Granted != 0 || g.Held != 0 {
			t.Fatalf("key without a lease: %v", g)
		}
	}
	if st := s.Stats(); leased == 0 || leased == 3000 || st.Leases != uint64(leased) {
		t.Fatalf("%d keys leased (%d leases) in a one-page arena", leased, st.Leases)
	}
	mustConsistent(t, s)
	// Renewals of existing leases still work.
	g := mustAcquire(t, s, at(time.Second), "a", 4, ka("big", "key-0", 1, 1, 0, 0)).Grants[0]
	if g.Agents != 1 || g.Held != 2 {
		t.Fatalf("renewal in a full arena = %v", g)
	}
	// Room freed by a release is used again, by a longer key too.
	if _, err := release(s, at(time.Second), "a", 5, false, ka("big", "key-1000", 0, 0, 0, 0), ka("big", "key-1001", 0, 0, 0, 0)); err != nil {
		t.Fatal(err)
	}
	g = mustAcquire(t, s, at(time.Second), "a", 6, ka("big", "key-2999x", 1, 0, 0, 0)).Grants[0]
	if g.Agents != 1 {
		t.Fatalf("no lease after room was freed: %v", g)
	}
	mustConsistent(t, s)
}

// An arena compaction under way advances at the Expires committed without
// a sweep, which the leader commits every ExpireInterval while it runs
// (ExpireIdle is false then), not only at the once-a-SweepInterval sweep.
func TestSkipSweepExpireAdvancesCompaction(t *testing.T) {
	s := newTestState(t)
	var keys, rel []*allotv1.KeyAcquire
	for i := range 20000 {
		k := ka("big", fmt.Sprint("key-", i), 1, 0, 0, 0)
		keys = append(keys, k)
		if i%10 != 0 {
			rel = append(rel, k)
		}
	}
	for i := range 20 {
		mustAcquire(t, s, at(0), "a", uint64(i+1), keys[i*1000:(i+1)*1000]...)
	}
	for i := 0; i < len(rel); i += 1000 {
		if _, err := release(s, at(time.Second), "a", uint64(100+i), false, rel[i:min(i+1000, len(rel))]...); err != nil {
			t.Fatal(err)
		}
	}
	s.st.compactBudget = 300
	expire(s, at(time.Second)) // a sweep Expire starts it
	if s.st.old == nil {
		t.Fatal("no compaction started")
	}
	for i := 0; s.st.old != nil; i++ {
		now := at(time.Second + time.Duration(i)*100*time.Millisecond)
		if i == 20 {
			t.Fatalf("20 SkipSweep Expires did not finish the compaction (2000 leased keys, at most 300 a step); cursor at %x", s.st.compactFrom)
		}
		if s.ExpireIdle(now, 4096) {
			t.Fatalf("ExpireIdle true during compaction")
		}
		from := s.st.compactFrom
		s.Apply(budgetedExpire(now, 4096))
		mustConsistent(t, s)
		if s.st.old != nil && s.st.compactFrom == from {
			t.Fatalf("a SkipSweep Expire during a compaction did not advance it")
		}
	}
}

// A compaction step moves compactRate entries a second since the last
// step, within [compactMinStep, compactBudget]: Expires that follow each
// other closely take short steps, and the first step after a gap (or of a
// compaction) is bounded either way.
func TestCompactQuota(t *testing.T) {
	s := newTestState(t)
	c := s.st
	c.now = at(time.Second)
	c.startCompaction()
	for _, step := range []struct {
		at   time.Duration
		want int
	}{
		{time.Second, compactMinStep},                          // the starting step
		{time.Second + 10*time.Millisecond, compactMinStep},    // 163 entries' worth
		{time.Second + 110*time.Millisecond, compactRate / 10}, // 100 ms
		{time.Second + 100*time.Millisecond, compactBudget},    // time went back: the cap
		{time.Second + 350*time.Millisecond, compactRate / 4},
		{5 * time.Second, compactBudget}, // a gap
	} {
		if got := c.compactQuota(at(step.at)); got != step.want {
			t.Fatalf("compactQuota at %v = %d, want %d", step.at, got, step.want)
		}
	}
	c.compactBudget = 100 // tests lower the cap below the least step
	if got := c.compactQuota(at(5*time.Second + time.Millisecond)); got != 100 {
		t.Fatalf("compactQuota under a lowered cap = %d, want 100", got)
	}
}

// compacting returns a state with 15,000 leased keys in an arena of at
// most maxPages pages (30,000 leased, every other one released) whose
// compaction an Expire at 1 s has started, and a function that leases keys
// in calls of 1000.
func compacting(t *testing.T, maxPages int) (*State, func(now int64, keys []*allotv1.KeyAcquire)) {
	t.Helper()
	s := newTestState(t)
	s.st.ar.maxPages = maxPages
	var id uint64
	acquireAll := func(now int64, keys []*allotv1.KeyAcquire) {
		for i := 0; i < len(keys); i += 1000 {
			id++
			mustAcquire(t, s, now, "a", id, keys[i:min(i+1000, len(keys))]...)
		}
	}
	acquireAll(at(0), bigKeys("key-", 30000))
	var rel []*allotv1.KeyAcquire // every other key: half the arena is free
	for i := 0; i < 30000; i += 2 {
		rel = append(rel, ka("big", fmt.Sprint("key-", i), 0, 0, 1, 0))
	}
	for i := 0; i < len(rel); i += 1000 {
		id++
		if _, err := release(s, at(time.Second), "a", id, false, rel[i:min(i+1000, len(rel))]...); err != nil {
			t.Fatal(err)
		}
	}
	expire(s, at(time.Second)) // the sweep starts a compaction, whose first step is small
	if s.st.old == nil {
		t.Fatal("no compaction started")
	}
	return s, acquireAll
}

// inOld returns how many keys have their entry in the arena a compaction
// is emptying.
func inOld(s *State) int {
	n := 0
	for i := 0; i < s.st.tab.size; i++ {
		if sl := s.st.tab.at(i); sl.lim != 0 && sl.link != 0 && linkTag(sl.link) == s.st.old.tag {
			n++
		}
	}
	return n
}

// Expires without a sweep (most of them) take paced steps too: 10 ms after
// the last step, the least step; 100 ms after, compactRate/10 entries.
func TestSkipSweepExpireStepIsPaced(t *testing.T) {
	s, _ := compacting(t, arenaMaxPages)
	for _, step := range []struct {
		after time.Duration
		most  int
	}{{10 * time.Millisecond, compactMinStep}, {110 * time.Millisecond, compactRate / 10}} {
		before := inOld(s)
		s.Apply(budgetedExpire(at(time.Second+step.after), 4096))
		if moved := before - inOld(s); moved < step.most/2 || moved > step.most {
			t.Fatalf("the SkipSweep Expire at 1 s + %v moved %d entries, want about %d and no more", step.after, moved, step.most)
		}
	}
}

// New leases are checked against the new arena only while a compaction
// runs, so leases granted between two steps can fill it before the old
// arena's entries are moved: the next step must stop at an entry it has no
// room for (a replicated Expire that panicked would crash every replica),
// and the compaction finish once expiries free room.
func TestCompactionStepStopsWhenNewArenaIsFull(t *testing.T) {
	s, acquireAll := compacting(t, 12)                                      // page 0 reserved: 11 pages of 64 KiB
	acquireAll(at(time.Second+50*time.Millisecond), bigKeys("new-", 30000)) // fills the new arena
	left := inOld(s)
	s.Apply(budgetedExpire(at(time.Second+100*time.Millisecond), 4096))
	mustConsistent(t, s)
	if s.st.old == nil {
		t.Fatal("setup: the compaction finished; the new arena never filled")
	}
	if s.st.ar.canAlloc(arenaLarge) || inOld(s) != left {
		t.Fatalf("the step did not stop at a full new arena: %d keys left in the old arena, was %d", inOld(s), left)
	}
	// Once every lease has ended, room is freed and the compaction ends.
	for i := 0; s.st.old != nil; i++ {
		if i == 100 {
			t.Fatalf("the compaction did not finish after the leases ended (cursor %x)", s.st.compactFrom)
		}
		s.Apply(budgetedExpire(at(time.Minute+time.Duration(i)*100*time.Millisecond), 1<<20))
		mustConsistent(t, s)
	}
}

// An Expire that ends one lease of a key whose entry is a large block
// (> arenaLarge, its own page) moves the entry to a smaller block; with no
// free page in the arena (full, or the new arena of a running compaction
// full) it must still succeed, by freeing the old page first: a replicated
// Expire that panicked would crash every replica.
func TestExpireShrinksLargeEntryInFullArena(t *testing.T) {
	s := newTestState(t)
	putRules(t, s, t0, testRules+`  - key: huge
    rate_limit: {unit: second, requests_per_unit: 1000000, burst: 1000000}
`)
	const agents = 800 // (16384-16)/22 = 744 leases make an entry larger than arenaLarge
	mustAcquire(t, s, at(0), "ag-0", 1, ka("huge", "x", 1, 0, 0, 0))
	for i := 1; i < agents; i++ {
		mustAcquire(t, s, at(5*time.Second), fmt.Sprint("ag-", i), 1, ka("huge", "x", 1, 0, 0, 0))
	}
	c := s.st
	idx := -1
	for i := 0; i < c.tab.capa; i++ {
		if sl := c.tab.at(i); sl.lim != 0 && sl.link != 0 {
			idx = i
		}
	}
	sl := *c.tab.at(idx) // a copy: inserts move the table's slots
	c.loadEntry(&c.scr.e, sl.hash, sl.link)
	if c.scr.e.size <= arenaLarge || len(c.scr.e.leases) != agents {
		t.Fatalf("setup: entry of %d bytes, %d leases", c.scr.e.size, len(c.scr.e.leases))
	}
	// The arena is full: every page it may hold is in use.
	// Leases of other keys take the free pages; then no page is left.
	c.ar.maxPages = len(c.ar.pages)
	for id := uint64(1); c.ar.canAlloc(arenaLarge + 1); id++ {
		if id > 1000 {
			t.Fatal("setup: the arena does not fill")
		}
		mustAcquire(t, s, at(5*time.Second), "filler", id, bigKeys(fmt.Sprint("f", id, "-"), 1000)...)
	}
	// ag-0's lease (granted at 0, LeaseTTL 10 s) is due at 11 s; the others are not.
	before := s.Stats().Leases
	s.Apply(&allotv1.Command{NowUnixNanos: at(11 * time.Second), Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{SkipSweep: true}}})
	if got := s.Stats().Leases; got != before-1 {
		t.Fatalf("%d leases after the Expire, want %d (ag-0's ended)", got, before-1)
	}
	now := c.tab.at(c.tab.lowerBound(sl.hash))
	if now.hash != sl.hash || now.link == 0 {
		t.Fatal("the key's entry is gone")
	}
	c.loadEntry(&c.scr.e, sl.hash, now.link)
	if len(c.scr.e.leases) != agents-1 {
		t.Fatalf("the key holds %d leases after the Expire, want %d", len(c.scr.e.leases), agents-1)
	}
	mustConsistent(t, s)
}

// A compaction step's scan is not paced with its moves: in a table of
// mostly unleased keys (charges) a step whose quota moves few entries still
// passes most of the table, so the compaction ends in a few Expires (the
// leader commits one every ExpireInterval while a compaction runs).
func TestCompactionScanNotPacedWithMoves(t *testing.T) {
	s := newTestState(t)
	var id uint64
	mustAcquire(t, s, at(0), "a", 1, bigKeys("leased-", 100)...)
	for i := 0; i < 60000; i += 1000 {
		var keys []*allotv1.KeyAcquire
		for j := i; j < i+1000; j++ {
			keys = append(keys, ka("slow", fmt.Sprint("charged-", j), 0, 0, 0, 1)) // tracked, no lease
		}
		id++
		mustAcquire(t, s, at(0), "b", id, keys...)
	}
	if st := s.Stats(); st.Keys < 60000 || st.Leases != 100 {
		t.Fatalf("setup: %d keys, %d leases", st.Keys, st.Leases)
	}
	s.st.compactAlways = true
	expire(s, at(time.Second)) // a sweep starts a compaction
	s.st.compactAlways = false
	steps := 0
	for now := at(time.Second); s.st.old != nil; steps++ {
		if steps == 4 {
			t.Fatalf("4 Expires 10 ms apart (each moving at most %d entries) did not pass 60,100 keys; cursor at %x", compactMinStep, s.st.compactFrom)
		}
		now += int64(10 * time.Millisecond)
		s.Apply(budgetedExpire(now, 4096))
	}
	mustConsistent(t, s)
}
