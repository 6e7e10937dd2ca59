package state

import (
	"bytes"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const staticTTL = 2 * time.Second

func setStatic(t tb, s *State, now int64, n uint32, ttl time.Duration) {
	t.Helper()
	if err, ok := s.Apply(withNow(StaticCommand(StaticSettings{Slots: n, TTL: ttl}), now)).(error); ok {
		t.Fatalf("StaticCommand(%d, %v): %v", n, ttl, err)
	}
}

func withNow(cmd *allotv1.Command, now int64) *allotv1.Command {
	cmd.NowUnixNanos = now
	return cmd
}

// sacquire applies one Acquire that asks for static shares, as a compact
// entry, and returns its answer.
func sacquire(t tb, s *State, now int64, agent string, id, hv uint64, keys ...*allotv1.KeyAcquire) *allotv1.AcquireResponse {
	t.Helper()
	req := &allotv1.AcquireRequest{AgentId: agent, RequestId: id, Keys: keys, StaticShares: true, HotVersion: hv}
	res, err := s.ApplyCompact(compactEntry(now, req))
	if err != nil {
		t.Fatalf("ApplyCompact: %v", err)
	}
	if res.Errs[0] != nil {
		t.Fatalf("Acquire(%s, %d): %v", agent, id, res.Errs[0])
	}
	return res.Responses[0]
}

func promoteKey(k, v string, want, left int64) *allotv1.KeyAcquire {
	x := ka(k, v, want, 0, 0, 0)
	x.Promote, x.StaticLeft = true, left
	return x
}

// keyLimit returns the limit key h is under and what it holds at now.
func keyLimit(t tb, s *State, h uint64, now int64) (bucket.Limit, int64) {
	t.Helper()
	c := s.st
	i := c.tab.find(h)
	if i < 0 {
		t.Fatalf("key %016x is not tracked", h)
	}
	sl := c.tab.at(i)
	l := c.lims.get(sl.lim)
	return l, l.Peek(sl.st, now).Remaining
}

func testLimit(t tb, quota int64, window time.Duration, burst int64) bucket.Limit {
	l, err := bucket.NewLimit(bucket.TokenBucket, quota, window, burst)
	if err != nil {
		t.Fatalf("NewLimit: %v", err)
	}
	return l
}

// TestStaticOff: without a StaticCommand (or with slots 0) answers carry
// no static shares and nothing is hot.
func TestStaticOff(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 0, 0)
	r := sacquire(t, s, at(time.Second), "a", 1, 0, ka("tb", "1", 5, 0, 0, 0))
	if r.Static != nil {
		t.Fatalf("static off: answer carries %v", r.Static)
	}
	if st := s.Stats(); st.HotKeys != 0 || st.StaticSlotsHeld != 0 {
		t.Fatalf("stats %+v", st)
	}
	if ss := s.StaticSettings(); ss != (StaticSettings{}) {
		t.Fatalf("settings %+v", ss)
	}
}

// TestStaticSlots: slots go to the first N agents that ask, are kept,
// and freed when the agent is forgotten.
func TestStaticSlots(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 2, staticTTL)
	if ss := s.StaticSettings(); ss.Slots != 2 || ss.TTL != staticTTL {
		t.Fatalf("settings %+v", ss)
	}
	for i, ag := range []string{"a", "b", "c"} {
		r := sacquire(t, s, at(time.Second), ag, 1, 0)
		want := uint32(2)
		if i == 2 {
			want = 0
		}
		if r.Static == nil || r.Static.Slots != want {
			t.Fatalf("agent %s: static %v, want slots %d", ag, r.Static, want)
		}
		if want > 0 && r.Static.ValidMs != staticTTL.Milliseconds() {
			t.Fatalf("valid_ms %d", r.Static.ValidMs)
		}
	}
	// A call without static_shares gets no static answer.
	if r := mustAcquire(t, s, at(time.Second), "d", 1); r.Static != nil {
		t.Fatalf("no static_shares: %v", r.Static)
	}
	if n := s.Stats().StaticSlotsHeld; n != 2 {
		t.Fatalf("held %d", n)
	}
	// a keeps its slot; c still has none.
	if r := sacquire(t, s, at(30*time.Second), "a", 2, 0); r.Static.Slots != 2 {
		t.Fatalf("a lost its slot: %v", r.Static)
	}
	if r := sacquire(t, s, at(30*time.Second), "c", 2, 0); r.Static.Slots != 0 {
		t.Fatalf("c got a slot: %v", r.Static)
	}
	// b is forgotten (the agent TTL after its last call): c gets its slot.
	expire(s, at(time.Second+testConfig().AgentTTL))
	if n := s.Stats().StaticSlotsHeld; n != 1 {
		t.Fatalf("after b is forgotten: held %d", n)
	}
	if r := sacquire(t, s, at(time.Second+testConfig().AgentTTL), "c", 3, 0); r.Static.Slots != 2 {
		t.Fatalf("c: %v", r.Static)
	}
}

// TestStaticHotSet: a touched eligible key becomes hot; answers bring an
// agent's copy up to date with deltas, or the whole set.
func TestStaticHotSet(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 4, staticTTL)
	r := sacquire(t, s, at(time.Second), "a", 1, 0)
	v0 := r.Static.HotVersion
	if !r.Static.HotReset || len(r.Static.HotAdded) != 0 {
		t.Fatalf("first answer: %v", r.Static)
	}
	h1, h2 := hashOf(s, "tb", "1"), hashOf(s, "gcra", "2")
	// Ineligible keys (fixed window, unlimited, redis) do not become hot.
	r = sacquire(t, s, at(time.Second), "b", 1, 0, ka("tb", "1", 1, 0, 0, 0), ka("fw", "1", 1, 0, 0, 0),
		ka("free", "1", 1, 0, 0, 0), ka("redis", "1", 1, 0, 0, 0), ka("gcra", "2", 1, 0, 0, 0))
	v2 := r.Static.HotVersion
	if v2 != v0+2 || !r.Static.HotReset || !slices.Equal(r.Static.HotAdded, sortedU64(h1, h2)) {
		t.Fatalf("after two eligible keys: %v (v0 %d)", r.Static, v0)
	}
	// An agent at v0 gets the delta; one at v2 nothing.
	r = sacquire(t, s, at(time.Second), "a", 2, v0)
	if r.Static.HotReset || r.Static.HotVersion != v2 || !slices.Equal(sortedU64(r.Static.HotAdded...), sortedU64(h1, h2)) {
		t.Fatalf("delta from v0: %v", r.Static)
	}
	r = sacquire(t, s, at(time.Second), "a", 3, v2)
	if r.Static.HotReset || len(r.Static.HotAdded)+len(r.Static.HotRemoved) != 0 {
		t.Fatalf("delta from v2: %v", r.Static)
	}
	// A version newer than the set's, or older than the log: the whole set.
	for _, hv := range []uint64{v2 + 1, v0 - 1} {
		r = sacquire(t, s, at(time.Second), "a", 4+hv%2, hv)
		if !r.Static.HotReset || !slices.Equal(r.Static.HotAdded, sortedU64(h1, h2)) {
			t.Fatalf("from %d: %v", hv, r.Static)
		}
	}
	if n := s.Stats().HotKeys; n != 2 {
		t.Fatalf("hot keys %d", n)
	}
	// Once idle, the sweep removes them: the delta says so.
	for i := range 4 {
		expire(s, at(90*time.Second+time.Duration(i)))
	}
	r = sacquire(t, s, at(90*time.Second), "a", 10, v2)
	if r.Static.HotReset || !slices.Equal(sortedU64(r.Static.HotRemoved...), sortedU64(h1, h2)) || len(r.Static.HotAdded) != 0 {
		t.Fatalf("after the sweep: %v", r.Static)
	}
	// The recorded answer is replayed as it was.
	again := sacquire(t, s, at(90*time.Second), "a", 10, v2)
	if !bytes.Equal(marshal(t, again), marshal(t, r)) {
		t.Fatal("replay differs")
	}
}

func sortedU64(v ...uint64) []uint64 { return slices.Sorted(slices.Values(v)) }

func marshal(t tb, m *allotv1.AcquireResponse) []byte {
	b, err := marshalDet.Marshal(m)
	if err != nil {
		t.Fatalf("marshal: %v", err)
	}
	return b
}

// TestStaticPromotion: a holder's promotion gives the key the free slots'
// shares and its own, with their tokens; the others' shares join as they
// acknowledge, with their tokens (a full share from a holder that sends no
// report), and the whole limit comes with the last one.
func TestStaticPromotion(t *testing.T) {
	s := newTestState(t) // tb: 10/s, burst 10
	setStatic(t, s, at(0), 4, staticTTL)
	now := at(time.Second)
	var v uint64
	for _, ag := range []string{"a", "b", "c"} {
		v = sacquire(t, s, now, ag, 1, 0).Static.HotVersion
	}
	h := hashOf(s, "tb", "1")
	// a promotes with 1 token left: k = 1 free + a's = 2 (b and c may still
	// decide it); level = 1·⌊10/4⌋ + 1 = 3; a asks for none.
	r := sacquire(t, s, now, "a", 2, v, promoteKey("tb", "1", 0, 1))
	vh := r.Static.HotVersion
	if vh != v+1 {
		t.Fatalf("version %d, want %d", vh, v+1)
	}
	whole := testLimit(t, 10, time.Second, 10)
	share2, _ := whole.Share(2, 4)
	if l, left := keyLimit(t, s, h, now); keyOf(l) != keyOf(share2) || left != 3 {
		t.Fatalf("after promotion: %v holding %d, want %v holding 3", l, left, share2)
	}
	if n := s.Stats().StaticTransitions; n != 1 {
		t.Fatalf("transitions %d", n)
	}
	// b acknowledges: k = 3.
	now = at(1500 * time.Millisecond)
	sacquire(t, s, now, "b", 2, vh)
	share3, _ := whole.Share(3, 4)
	// The key's limit changes when it is next touched (a holds no lease:
	// it reports nothing; a Check-free touch: a's call with want 0).
	sacquire(t, s, now, "a", 3, vh, ka("tb", "1", 0, 0, 0, 0))
	// 3 tokens at 1s, +0.5s at 2·2.5/s → 5.5 capped at 4 (share 2's
	// burst); carried to share 3 (burst 6), not raised; b's full share
	// (2) credited: 6.
	if l, left := keyLimit(t, s, h, now); keyOf(l) != keyOf(share3) || left != 6 {
		t.Fatalf("after b's ack: %v holding %d, want %v holding 6", l, left, share3)
	}
	// c acknowledges: the whole limit, balance kept, c's share credited.
	sacquire(t, s, now, "c", 2, vh)
	sacquire(t, s, now, "a", 4, vh, ka("tb", "1", 0, 0, 0, 0))
	if l, left := keyLimit(t, s, h, now); keyOf(l) != keyOf(whole) || left != 8 {
		t.Fatalf("after c's ack: %v holding %d, want %v holding 8", l, left, whole)
	}
	if _, ok := s.st.static.trans[h]; ok {
		t.Fatal("transition not over")
	}
	// A promoter's static_left counts up to a share's burst: a holder
	// claiming more gets no more.
	h2 := hashOf(s, "tb", "2")
	sacquire(t, s, now, "a", 5, vh, promoteKey("tb", "2", 0, 1000))
	if l, left := keyLimit(t, s, h2, now); keyOf(l) != keyOf(share2) || left != 4 {
		t.Fatalf("static_left 1000: %v holding %d, want %v holding 4 (1 free share + a's)", l, left, share2)
	}
}

// fourHolders is a state with 4 static slots, all held (agents a to d,
// request 1 each) at now; v is the hot-set version of their answers.
func fourHolders(t *testing.T) (s *State, now int64, v uint64) {
	t.Helper()
	s = newTestState(t)
	setStatic(t, s, at(0), 4, staticTTL)
	now = at(time.Second)
	for _, ag := range []string{"a", "b", "c", "d"} {
		v = sacquire(t, s, now, ag, 1, 0).Static.HotVersion
	}
	return s, now, v
}

// TestStaticMergeReports: a holder that acknowledges a key's hot version
// with a static_report merges what its share held, not a full share; a
// report in a later call, or a second acknowledgement, adds nothing; a
// holder whose promotion crossed the key turning hot merges its
// static_left at once and nothing when it acknowledges.
func TestStaticMergeReports(t *testing.T) {
	s, now, v := fourHolders(t) // tb: 10/s, burst 10; shares of 2.5/s, burst 2
	h := hashOf(s, "tb", "1")
	whole := testLimit(t, 10, time.Second, 10)
	// a promotes with 0 left: k = 1 (no free slot), level 0.
	vh := sacquire(t, s, now, "a", 2, v, promoteKey("tb", "1", 0, 0)).Static.HotVersion
	// b acknowledges with a report of 1 token: k = 2, level 1.
	rep := ka("tb", "1", 0, 0, 0, 0)
	rep.StaticReport, rep.StaticLeft = true, 1
	sacquire(t, s, now, "b", 2, vh, rep)
	share2, _ := whole.Share(2, 4)
	if l, left := keyLimit(t, s, h, now); keyOf(l) != keyOf(share2) || left != 1 {
		t.Fatalf("after b's report: %v holding %d, want %v holding 1", l, left, share2)
	}
	// b reports again in a later call: nothing more.
	rep2 := ka("tb", "1", 0, 0, 0, 0)
	rep2.StaticReport, rep2.StaticLeft = true, 2
	sacquire(t, s, now, "b", 3, vh, rep2)
	if _, left := keyLimit(t, s, h, now); left != 1 {
		t.Fatalf("a second report: holding %d, want 1", left)
	}
	// c promotes not knowing the key hot (hot_version v), 0 left: its
	// share merges now with nothing; its acknowledgement adds nothing.
	sacquire(t, s, now, "c", 2, v, promoteKey("tb", "1", 0, 0))
	sacquire(t, s, now, "c", 3, vh)
	share3, _ := whole.Share(3, 4)
	sacquire(t, s, now, "a", 3, vh, ka("tb", "1", 0, 0, 0, 0))
	if l, left := keyLimit(t, s, h, now); keyOf(l) != keyOf(share3) || left != 1 {
		t.Fatalf("after c: %v holding %d, want %v holding 1", l, left, share3)
	}
	// d acknowledges without a report: its full share (2) merges, and the
	// key has its whole limit.
	sacquire(t, s, now, "d", 2, vh)
	sacquire(t, s, now, "a", 4, vh, ka("tb", "1", 0, 0, 0, 0))
	if l, left := keyLimit(t, s, h, now); keyOf(l) != keyOf(whole) || left != 3 {
		t.Fatalf("after d: %v holding %d, want %v holding 3", l, left, whole)
	}
}

// TestStaticTransitionEnd: without acknowledgements the transition ends
// one TTL after it began; an agent without a slot touching a key while
// every slot is held gets nothing until then.
func TestStaticTransitionEnd(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 2, staticTTL)
	now := at(time.Second)
	sacquire(t, s, now, "a", 1, 0)
	sacquire(t, s, now, "b", 1, 0)
	h := hashOf(s, "tb", "1")
	// c holds no slot: no free share, k = 0.
	r := sacquire(t, s, now, "c", 1, 0, ka("tb", "1", 5, 0, 0, 0))
	g, _ := allotv1.GrantsOf(r)
	if g[0].Granted != 0 {
		t.Fatalf("k = 0: granted %d", g[0].Granted)
	}
	// Half a TTL later, still nothing (no refill under no share).
	r = sacquire(t, s, at(2*time.Second), "c", 2, 0, ka("tb", "1", 5, 0, 0, 0))
	if g, _ := allotv1.GrantsOf(r); g[0].Granted != 0 || g[0].Status != allotv1.KeyStatus_KEY_STATUS_EXHAUSTED {
		t.Fatalf("k = 0 later: %v", g[0])
	}
	// At the end (1s + TTL) the whole limit, starting empty: refills from then.
	end := now + int64(staticTTL)
	r = sacquire(t, s, end, "c", 3, 0, ka("tb", "1", 5, 0, 0, 0))
	if l, _ := keyLimit(t, s, h, end); keyOf(l) != keyOf(testLimit(t, 10, time.Second, 10)) {
		t.Fatalf("after the end: %v", l)
	}
	if g, _ := allotv1.GrantsOf(r); g[0].Granted != 0 {
		t.Fatalf("at the end: granted %d from an empty bucket", g[0].Granted)
	}
	r = sacquire(t, s, end+int64(500*time.Millisecond), "c", 4, 0, ka("tb", "1", 5, 0, 0, 0))
	if g, _ := allotv1.GrantsOf(r); g[0].Granted != 5 {
		t.Fatalf("half a second after the end: granted %d, want 5", g[0].Granted)
	}
}

// TestStaticUnhotAfterTransition: the sweep keeps a hot key during its
// transition, however idle, and drops it (and un-hots it) after.
func TestStaticUnhotAfterTransition(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 4, 10*time.Second)
	now := at(time.Second)
	sacquire(t, s, now, "a", 1, 0)
	sacquire(t, s, now, "b", 1, 0)
	h := hashOf(s, "tb", "1")
	sacquire(t, s, now, "a", 2, 0, promoteKey("tb", "1", 0, 2)) // full: 2·2 + 2 = 6 of share 3's 6
	sweepAll := func(at int64) {
		for i := range 4 {
			expire(s, at+int64(i))
		}
	}
	sweepAll(at(5 * time.Second)) // idle (full), but in transition
	if s.st.tab.find(h) < 0 || s.Stats().HotKeys != 1 {
		t.Fatal("dropped during the transition")
	}
	sweepAll(at(12 * time.Second))
	if s.st.tab.find(h) >= 0 || s.Stats().HotKeys != 0 {
		t.Fatal("not dropped after the transition")
	}
}

// TestStaticCommandRevokes: a change of the settings revokes every slot
// for one old TTL and the longest refill an old share may take (the agent
// TTL less the old TTL: an agent TTL in all), then grants under the new
// ones; slots 0 turns static shares off after the pause.
func TestStaticCommandRevokes(t *testing.T) {
	s := newTestState(t)
	pause := s.st.cfg.AgentTTL
	setStatic(t, s, at(0), 2, staticTTL)
	sacquire(t, s, at(time.Second), "a", 1, 0)
	setStatic(t, s, at(time.Second), 2, staticTTL) // no change
	if r := sacquire(t, s, at(time.Second), "a", 2, 0); r.Static.Slots != 2 {
		t.Fatalf("unchanged settings revoked: %v", r.Static)
	}
	setStatic(t, s, at(2*time.Second), 3, time.Second)
	if ss := s.StaticSettings(); ss.Slots != 3 || ss.TTL != time.Second {
		t.Fatalf("settings %+v", ss)
	}
	for _, ag := range []string{"a", "b"} {
		for _, when := range []time.Duration{3 * time.Second, 2*time.Second + pause - time.Millisecond} {
			if r := sacquire(t, s, at(when), ag, uint64(when/time.Millisecond), 0); r.Static.Slots != 0 || r.Static.ValidMs != 0 {
				t.Fatalf("%s during the pause, at %v: %v", ag, when, r.Static)
			}
		}
	}
	// The pause ends at 2s + the agent TTL: slots again, under the new
	// settings.
	end := 2*time.Second + pause
	r := sacquire(t, s, at(end), "b", uint64(end/time.Millisecond), 0)
	if r.Static.Slots != 3 || r.Static.ValidMs != 1000 || r.Static.MaxRefillMs != (pause-time.Second).Milliseconds() {
		t.Fatalf("after the pause: %v", r.Static)
	}
	setStatic(t, s, at(end+time.Second), 0, 0)
	if r := sacquire(t, s, at(end+time.Second), "b", uint64(end/time.Millisecond)+1, 0); r.Static == nil || r.Static.Slots != 0 {
		t.Fatalf("turning off: %v", r.Static)
	}
	if r := sacquire(t, s, at(end+time.Second+pause), "b", uint64(end/time.Millisecond)+2, 0); r.Static != nil {
		t.Fatalf("off: %v", r.Static)
	}
	// Bad settings.
	for _, ss := range []StaticSettings{{Slots: MaxStaticSlots + 1, TTL: time.Second}, {Slots: 2},
		{Slots: 2, TTL: testConfig().AgentTTL}} {
		if err, ok := s.Apply(withNow(StaticCommand(ss), at(7*time.Second))).(error); !ok || !errors.Is(err, ErrInvalid) {
			t.Fatalf("%+v: %v", ss, err)
		}
	}
}

// TestStaticSnapshot: the static state survives a snapshot: the restored
// state persists to the same bytes and answers as the original.
func TestStaticSnapshot(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 4, staticTTL)
	now := at(time.Second)
	for _, ag := range []string{"a", "b", "c"} {
		sacquire(t, s, now, ag, 1, 0)
	}
	sacquire(t, s, now, "a", 2, 0, promoteKey("tb", "1", 3, 1), ka("gcra", "1", 2, 0, 0, 0))
	sacquire(t, s, now, "d", 1, 0, ka("tb", "2", 3, 0, 0, 0)) // k = 1, no slot for d
	setStatic(t, s, at(1100*time.Millisecond), 5, staticTTL)  // paused
	b := persist(t, s)
	r := New(testConfig())
	if err := r.Restore(bytes.NewReader(b)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if !bytes.Equal(persist(t, r), b) {
		t.Fatal("restored state persists to other bytes")
	}
	var outs [2][][]byte
	for i, st := range []*State{s, r} {
		for j, ag := range []string{"b", "c", "d"} {
			resp := sacquire(t, st, at(1200*time.Millisecond), ag, 5, uint64(j), ka("tb", "1", 2, 0, 0, 0))
			outs[i] = append(outs[i], marshal(t, resp))
		}
		resp := sacquire(t, st, at(4*time.Second), "e", 1, 0, ka("tb", "2", 2, 0, 0, 0))
		outs[i] = append(outs[i], marshal(t, resp))
	}
	for j := range outs[0] {
		if !bytes.Equal(outs[0][j], outs[1][j]) {
			t.Errorf("answer %d differs after the restore", j)
		}
	}
	if !bytes.Equal(persist(t, r), persist(t, s)) {
		t.Error("the states differ after the same calls")
	}
	// A snapshot without static shares is as before (version ≤ 9).
	s2 := newTestState(t)
	mustAcquire(t, s2, at(time.Second), "a", 1, ka("tb", "1", 1, 0, 0, 0))
	if b := persist(t, s2); b[len(snapMagic)] != snapVersion {
		t.Fatalf("static off: snapshot version %d", b[len(snapMagic)])
	}
}

// TestStaticValidation: promote and static_left are read from both paths;
// a static_left out of range is refused and changes nothing.
func TestStaticValidation(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 4, staticTTL)
	before := persist(t, s)
	report := func(left int64) *allotv1.KeyAcquire {
		k := ka("tb", "1", 0, 0, 0, 0)
		k.StaticReport, k.StaticLeft = true, left
		return k
	}
	for _, left := range []int64{-1, maxAmount + 1} {
		for _, k := range []*allotv1.KeyAcquire{promoteKey("tb", "1", 1, left), report(left)} {
			req := &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{k}, StaticShares: true}
			if err := ValidateAcquire(req); !errors.Is(err, ErrInvalid) {
				t.Fatalf("%v: %v", k, err)
			}
			packed := &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, PackedKeys: allotv1.AppendPackedKeys(nil, req.Keys)}
			if err := ValidateAcquire(packed); !errors.Is(err, ErrInvalid) {
				t.Fatalf("packed %v: %v", k, err)
			}
			if _, err := acquire(s, at(time.Second), "a", 1, k); !errors.Is(err, ErrInvalid) {
				t.Fatalf("apply %v: %v", k, err)
			}
		}
	}
	if !bytes.Equal(persist(t, s), before) {
		t.Fatal("a refused call changed the state")
	}
	ok := &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, StaticShares: true, HotVersion: 7,
		PackedKeys: allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{promoteKey("tb", "1", 1, maxAmount)})}
	if err := ValidateAcquire(ok); err != nil {
		t.Fatalf("valid packed promote: %v", err)
	}
	// The compact record carries static_shares, hot_version, promote and
	// static_left.
	_, reqs, err := DecodeAcquireEntry(compactEntry(at(0), ok))
	if err != nil {
		t.Fatal(err)
	}
	if g := reqs[0]; !g.StaticShares || g.HotVersion != 7 || !g.Keys[0].Promote || g.Keys[0].StaticLeft != maxAmount {
		t.Fatalf("decoded %v", g)
	}
}

// TestCompactV1: an entry of compact version 1 (no static byte) applies.
func TestCompactV1(t *testing.T) {
	s := newTestState(t)
	req := &allotv1.AcquireRequest{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{ka("tb", "1", 3, 0, 0, 0)}}
	rec := appendStr(nil, "a")
	rec = append(rec, 1, 0, 0) // request_id, rules_version, fallback_keys
	rec = allotv1.AppendPackedKeys(rec, req.Keys)
	data := AppendAcquireEntry(nil, at(time.Second), [][]byte{rec})
	data[1] = compactVersionV1
	res, err := s.ApplyCompact(data)
	if err != nil || res.Errs[0] != nil {
		t.Fatalf("%v %v", err, res.Errs)
	}
	if g, _ := allotv1.GrantsOf(res.Responses[0]); g[0].Granted != 3 {
		t.Fatalf("granted %d", g[0].Granted)
	}
}

// TestStaticOnMakesTrackedHot: keys tracked when static shares turn on
// (leased, maybe) are hot from the start; a Check coordinates a key too.
func TestStaticOnMakesTrackedHot(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(0), "a", 1, ka("tb", "1", 5, 0, 0, 0))
	setStatic(t, s, at(time.Second), 4, staticTTL)
	r := sacquire(t, s, at(time.Second), "b", 1, 0)
	if !slices.Equal(r.Static.HotAdded, []uint64{hashOf(s, "tb", "1")}) {
		t.Fatalf("tracked key not hot: %v", r.Static)
	}
	res := s.Apply(&allotv1.Command{NowUnixNanos: at(time.Second), Cmd: &allotv1.Command_Check{Check: &allotv1.CheckRequest{
		Domain: "test", Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "tb", Value: "2"}}}}}}})
	if c, ok := res.(*allotv1.CheckResponse); !ok || c.OverallCode != allotv1.Code_CODE_OK {
		t.Fatalf("Check: %v", res)
	}
	r = sacquire(t, s, at(time.Second), "b", 2, r.Static.HotVersion)
	if !slices.Equal(r.Static.HotAdded, []uint64{hashOf(s, "tb", "2")}) {
		t.Fatalf("checked key not hot: %v", r.Static)
	}
	// b holds a slot: the Check's key took the 3 free shares (k = 3).
	share3, _ := testLimit(t, 10, time.Second, 10).Share(3, 4)
	if l, left := keyLimit(t, s, hashOf(s, "tb", "2"), at(time.Second)); keyOf(l) != keyOf(share3) || left != 5 {
		t.Fatalf("checked key: %v holding %d, want %v holding 3·2 − 1", l, left, share3)
	}
}

// TestStaticSnapshotCapture: a snapshot persists the static state as it
// was at its capture, whatever is applied meanwhile.
func TestStaticSnapshotCapture(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 4, staticTTL)
	now := at(time.Second)
	sacquire(t, s, now, "a", 1, 0)
	v := sacquire(t, s, now, "b", 1, 0, promoteKey("tb", "1", 0, 1)).Static.HotVersion
	want := persist(t, s)
	snap, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Release()
	sacquire(t, s, now, "a", 2, v, promoteKey("tb", "2", 0, 1), ka("gcra", "1", 1, 0, 0, 0))
	sacquire(t, s, now, "c", 1, 0)
	expire(s, at(time.Minute))
	var got bytes.Buffer
	if err := snap.Persist(&got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatal("the snapshot holds changes applied after its capture")
	}
}

// TestHotLog: the change log keeps at least the last hotLogMax changes; an
// agent further behind gets the whole set.
func TestHotLog(t *testing.T) {
	s := newStatic(2, int64(staticTTL), 100)
	for i := range 2*hotLogMax + 1 {
		h := uint64(i % 3)
		_, hot := s.hot[h]
		if hot {
			delete(s.hot, h)
		} else {
			s.hot[h] = struct{}{}
		}
		s.change(h, hot)
	}
	if s.version != 100+2*hotLogMax+1 || uint64(len(s.log)) != s.version-s.logStart || len(s.log) < hotLogMax {
		t.Fatalf("version %d, log from %d, %d changes", s.version, s.logStart, len(s.log))
	}
	c := &core{static: s}
	if r := c.staticAnswer(1, s.logStart); r.HotReset || len(r.HotAdded)+len(r.HotRemoved) > 3 {
		t.Fatalf("from the log's start: %v", r)
	}
	if r := c.staticAnswer(1, s.logStart-1); !r.HotReset || len(r.HotAdded) != len(s.hot) {
		t.Fatalf("from before the log: %v", r)
	}
}

// TestStaticInspect: InspectKey, ListAgents and StaticStatus show how
// static shares treat a key and who holds a slot, and change nothing.
func TestStaticInspect(t *testing.T) {
	s := newTestState(t) // tb: 10/s, burst 10; 4 slots: shares of burst 2
	inspect := func(k, v string, now int64) *allotv1.InspectKeyResponse {
		t.Helper()
		r, err := s.InspectKey(&allotv1.InspectKeyRequest{Domain: "test", Entries: []*allotv1.Entry{{Key: k, Value: v}}}, now)
		if err != nil {
			t.Fatalf("InspectKey(%s=%s): %v", k, v, err)
		}
		return r
	}
	if r := inspect("tb", "1", at(0)); r.Static != "" || r.StaticSlots != 0 {
		t.Fatalf("static shares off: static %q, slots %d", r.Static, r.StaticSlots)
	}
	if s.StaticStatus(at(0)) != nil {
		t.Fatal("a StaticStatus with static shares off")
	}
	setStatic(t, s, at(0), 4, staticTTL)
	now := at(time.Second)
	var v uint64
	for _, ag := range []string{"a", "b"} {
		v = sacquire(t, s, now, ag, 1, 0).Static.HotVersion
	}
	for _, c := range []struct{ k, want string }{{"tb", "static"}, {"slow", "static"}, {"fw", "not_eligible"}} {
		if r := inspect(c.k, "1", now); r.Static != c.want || r.StaticSlots != 4 || r.Tracked {
			t.Errorf("%s=1: static %q (slots %d, tracked %v), want %q of 4, untracked", c.k, r.Static, r.StaticSlots, r.Tracked, c.want)
		}
	}
	// a promotes tb=1: hot, in transition under a's share and the two
	// free ones until b acknowledges.
	vh := sacquire(t, s, now, "a", 2, v, promoteKey("tb", "1", 0, 1)).Static.HotVersion
	before := persist(t, s)
	r := inspect("tb", "1", now)
	s.StaticStatus(now)
	s.ListAgents(now)
	if !bytes.Equal(persist(t, s), before) {
		t.Fatal("the read paths changed the state")
	}
	if r.Static != "transition" || r.StaticShares != 3 || !r.Tracked {
		t.Fatalf("after the promotion: %q, %d shares, tracked %v; want transition, 3", r.Static, r.StaticShares, r.Tracked)
	}
	// Its tokens are its bucket's, under the 3 shares: the two free
	// ones' full bursts and a's 1 left, none granted (a wants none).
	share3, _ := testLimit(t, 10, time.Second, 10).Share(3, 4)
	l, left := keyLimit(t, s, hashOf(s, "tb", "1"), now)
	if keyOf(l) != keyOf(share3) || r.Tokens != left || left != 5 {
		t.Fatalf("after the promotion: inspect says %d tokens, the bucket (%v) holds %d under %v", r.Tokens, l, left, share3)
	}
	st := s.StaticStatus(now)
	if st.GetSlots() != 4 || st.GetSlotsHeld() != 2 || st.GetHotKeys() != 1 || st.GetHotVersion() != vh ||
		st.GetTransitions() != 1 || st.GetPaused() || st.GetTtlMs() != staticTTL.Milliseconds() {
		t.Fatalf("StaticStatus: %v", st)
	}
	ags := s.ListAgents(now).GetAgents()
	// a's promotion acknowledged v; b has sent no acknowledgement, and
	// counts as having acknowledged v, the version it joined at.
	if len(ags) != 2 || !ags[0].StaticSlot || ags[0].HotVersionAcked != v || !ags[1].StaticSlot || ags[1].HotVersionAcked != v {
		t.Fatalf("ListAgents: %v", ags)
	}
	sacquire(t, s, now, "b", 2, vh)
	// Over: the whole limit, with b's share (a full one: burst 2) merged
	// and credited at the key's next touch.
	if r := inspect("tb", "1", now); r.Static != "hot" || r.StaticShares != 0 || r.Tokens != left+2 {
		t.Fatalf("after b's acknowledgement: %q, %d shares, %d tokens; want hot, %d tokens", r.Static, r.StaticShares, r.Tokens, left+2)
	}
	if st := s.StaticStatus(now); st.GetTransitions() != 0 {
		t.Fatalf("after b's acknowledgement: %d transitions, want 0", st.GetTransitions())
	}
	if ags := s.ListAgents(now).GetAgents(); ags[1].HotVersionAcked != vh {
		t.Fatalf("b acknowledged %d, want %d", ags[1].HotVersionAcked, vh)
	}
	// A key seen by an agent without static shares: not a slot holder.
	if _, err := acquire(s, now, "x", 1, ka("tb", "2", 1, 0, 0, 0)); err != nil {
		t.Fatal(err)
	}
	if ags := s.ListAgents(now).GetAgents(); len(ags) != 3 || ags[2].StaticSlot {
		t.Fatalf("ListAgents with x: %v", ags)
	}
}

// TestStaticInspectConcurrent: the static shares' read paths run beside
// applies that make keys hot and acknowledge them (run with -race).
func TestStaticInspectConcurrent(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 2, staticTTL)
	now := at(time.Second)
	v := sacquire(t, s, now, "a", 1, 0).Static.HotVersion
	sacquire(t, s, now, "b", 1, 0)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			for i := range 8 {
				if _, err := s.InspectKey(&allotv1.InspectKeyRequest{Domain: "test",
					Entries: []*allotv1.Entry{{Key: "tb", Value: strconv.Itoa(i)}}}, now); err != nil {
					t.Error(err)
					return
				}
			}
			s.StaticStatus(now)
			s.ListAgents(now)
		}
	}()
	id := uint64(1)
	for i := range 200 {
		id++
		r := sacquire(t, s, now+int64(i)*int64(time.Millisecond), "a", id, v, promoteKey("tb", strconv.Itoa(i%8), 0, 1))
		v = r.Static.HotVersion
		sacquire(t, s, now+int64(i)*int64(time.Millisecond), "b", id, v)
	}
	close(stop)
	<-done
}

// TestStaticReportOrder: a call's static reports count before any of its
// keys is touched: a report in a later entry than a plain one of the same
// key, or beside a promotion, still sets what the acknowledged share held.
func TestStaticReportOrder(t *testing.T) {
	s, now, v := fourHolders(t) // tb: 10/s, burst 10; shares of 2.5/s, burst 2
	h := hashOf(s, "tb", "1")
	vh := sacquire(t, s, now, "a", 2, v, promoteKey("tb", "1", 0, 0)).Static.HotVersion
	report := func() *allotv1.KeyAcquire {
		k := ka("tb", "1", 0, 0, 0, 0)
		k.StaticReport = true // static_left 0: the share was spent
		return k
	}
	// b acknowledges with a plain entry of the key before its report.
	sacquire(t, s, now, "b", 2, vh, ka("tb", "1", 0, 0, 0, 0), report())
	if _, left := keyLimit(t, s, h, now); left != 0 {
		t.Fatalf("b's report after a plain entry: holding %d, want 0", left)
	}
	// c acknowledges with a promotion that also reports.
	both := report()
	both.Promote = true
	sacquire(t, s, now, "c", 2, vh, both)
	if _, left := keyLimit(t, s, h, now); left != 0 {
		t.Fatalf("c's promotion with a report: holding %d, want 0", left)
	}
	// d acknowledges without a report: its full share (2).
	sacquire(t, s, now, "d", 2, vh)
	sacquire(t, s, now, "a", 3, vh, ka("tb", "1", 0, 0, 0, 0))
	if l, left := keyLimit(t, s, h, now); keyOf(l) != keyOf(testLimit(t, 10, time.Second, 10)) || left != 2 {
		t.Fatalf("after d: %v holding %d, want the whole limit holding 2", l, left)
	}
}

// TestStaticRulesMakeTrackedHot: a rules update that makes a rule eligible
// makes its tracked keys hot (a key leased under the old limit is not
// decided from full shares); one that leaves every tracked key hot
// changes nothing (no walk of the table: hotAllTracked).
func TestStaticRulesMakeTrackedHot(t *testing.T) {
	s := newTestState(t)
	setStatic(t, s, at(0), 4, staticTTL)
	mustAcquire(t, s, at(time.Second), "a", 1, ka("fw", "x", 3, 0, 0, 0), ka("tb", "1", 3, 0, 0, 0))
	r := sacquire(t, s, at(time.Second), "b", 1, 0)
	if !slices.Equal(r.Static.HotAdded, []uint64{hashOf(s, "tb", "1")}) {
		t.Fatalf("hot set %v, want tb=1 alone (fixed windows are not shared)", r.Static.HotAdded)
	}
	// fw becomes a token bucket: eligible.
	putRules(t, s, at(2*time.Second), strings.Replace(testRules, "algorithm: fixed_window", "burst: 5", 1))
	r = sacquire(t, s, at(2*time.Second), "b", 2, r.Static.HotVersion)
	if !slices.Equal(r.Static.HotAdded, []uint64{hashOf(s, "fw", "x")}) {
		t.Fatalf("after the rules update: hot added %v, want fw=x", r.Static.HotAdded)
	}
	v := r.Static.HotVersion
	putRules(t, s, at(3*time.Second), testRules)
	if r = sacquire(t, s, at(3*time.Second), "b", 3, v); r.Static.HotVersion != v || len(r.Static.HotAdded) != 0 {
		t.Fatalf("a rules update with every tracked key hot: version %d → %d, added %v", v, r.Static.HotVersion, r.Static.HotAdded)
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if h, ok := s.st.hotTracked(); !ok {
		t.Fatalf("hot key %x is not tracked", h)
	}
}
