package agent

import (
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/agent/internal/policy"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// callsSince returns the Acquire requests the fake got after the first n.
func callsSince(s *steppedAgent, n int) []*allotv1.AcquireRequest {
	var out []*allotv1.AcquireRequest
	s.fake.with(func(f *fakeAllocator) { out = append(out, f.acquires[n:]...) })
	return out
}

// entryOf is req's entry for d (nil: none).
func entryOf(req *allotv1.AcquireRequest, d Descriptor) *allotv1.KeyAcquire {
	for _, k := range req.Keys {
		if k.Domain == "test" && entriesEqual(fromProto(k.Entries), d.Entries) {
			return k
		}
	}
	return nil
}

// reportOf is req's static report for d (nil: none).
func reportOf(req *allotv1.AcquireRequest, d Descriptor) *allotv1.KeyAcquire {
	if k := entryOf(req, d); k != nil && k.StaticReport {
		return k
	}
	return nil
}

// makeHot has the fake's next answer bring the hot-key set to version,
// adding ds.
func makeHot(t *testing.T, s *steppedAgent, version uint64, ds ...Descriptor) {
	t.Helper()
	hs := make([]uint64, len(ds))
	for i, d := range ds {
		hs[i] = staticHash(t, s, d)
	}
	s.fake.with(func(f *fakeAllocator) { f.static.HotVersion, f.static.HotAdded = version, hs })
}

// hotByRenewal makes ds hot, one version each after version 1 (the
// allocator numbers each change of the set), and steps a second on, when
// the agent's renewal brings the delta; it wants reports pending.
func hotByRenewal(t *testing.T, s *steppedAgent, reports int, ds ...Descriptor) {
	t.Helper()
	makeHot(t, s, 1+uint64(len(ds)), ds...)
	s.clock.advance(time.Second)
	s.step()
	if got := len(s.ss.reports); got != reports {
		t.Fatalf("%d pending reports, want %d", got, reports)
	}
}

// staticSlowKeys returns n keys of the slow rule, each decided once from
// its static share.
func staticSlowKeys(t *testing.T, s *steppedAgent, n int) []Descriptor {
	t.Helper()
	ds := make([]Descriptor, n)
	for i := range ds {
		ds[i] = desc("slow", fmt.Sprint("s", i))
		wantSource(t, s, ds[i], SourceStatic)
	}
	return ds
}

// TestStaticReport: keys that turn hot while the agent decides them from
// their shares are reported, with what each share held, in the next call
// (packed), which acknowledges the version: merged into the entry of a key
// the call has anyway (its first use), else in an entry that asks for
// nothing. Once that call is answered, no call reports them again.
func TestStaticReport(t *testing.T) {
	s := newStaticPacked(t)
	a, b := desc("slow", "a"), desc("slow", "b") // shares of 10 an hour, burst 10
	for range 3 {
		wantSource(t, s, a, SourceStatic)
	}
	wantSource(t, s, b, SourceStatic)
	hotByRenewal(t, s, 2, a, b)
	n0, _, _ := s.fake.counts()
	packed := func() (n int) { s.fake.with(func(f *fakeAllocator) { n = f.packedCalls }); return n }
	packed0 := packed()
	wantSource(t, s, a, SourceFallback) // a's first use: a call has it anyway
	s.clock.advance(50 * time.Millisecond)
	s.step()
	calls := callsSince(s, n0)
	if len(calls) != 1 || packed() != packed0+1 {
		t.Fatalf("%d calls (%d packed), want 1 packed", len(calls), packed()-packed0)
	}
	req := calls[0]
	if req.HotVersion != 3 {
		t.Fatalf("hot_version %d, want 3", req.HotVersion)
	}
	ka, kb := reportOf(req, a), reportOf(req, b)
	if ka == nil || ka.StaticLeft != 7 || ka.Charged != 1 || ka.Want < 1 || ka.Promote {
		t.Fatalf("a's entry %v, want its first use (charge 1, a want) with a report of 7", entryOf(req, a))
	}
	want := &allotv1.KeyAcquire{Domain: "test", Entries: kb.GetEntries(), StaticReport: true, StaticLeft: 9}
	if kb == nil || !proto.Equal(kb, want) {
		t.Fatalf("b's entry %v, want %v", entryOf(req, b), want)
	}
	if len(req.Keys) != 2 {
		t.Fatalf("%d keys, want a and b", len(req.Keys))
	}
	if got := len(s.ss.reports); got != 0 {
		t.Fatalf("%d pending reports after the answer, want 0", got)
	}
	n1, _, _ := s.fake.counts()
	for range 15 {
		s.clock.advance(100 * time.Millisecond)
		s.step()
	}
	calls = callsSince(s, n1)
	if len(calls) == 0 {
		t.Fatalf("no call after the report")
	}
	for _, req := range calls {
		if reportOf(req, a) != nil || reportOf(req, b) != nil || req.HotVersion != 3 {
			t.Fatalf("a later call reports again or acknowledges %d: %v", req.HotVersion, req.Keys)
		}
	}
}

// TestStaticReportNone: no report for a key that was not decided from its
// share when it turned hot: one whose permission had lapsed (its first
// use was a promotion, with static_left), one whose promotion was in
// flight (its static_left went with it), one first seen while hot.
func TestStaticReportNone(t *testing.T) {
	s := newStatic(t)
	n0, _, _ := s.fake.counts()
	l := desc("slow", "l")
	wantSource(t, s, l, SourceStatic)
	s.clock.advance(2 * time.Second) // the permission lapses
	wantSource(t, s, l, SourceFallback)
	makeHot(t, s, 2, l)
	s.step() // l's first use; the answer makes it hot
	if s.ss.version != 2 || len(s.ss.reports) != 0 {
		t.Fatalf("version %d, %d pending reports; want 2, none", s.ss.version, len(s.ss.reports))
	}

	p := desc("k", "p") // a share of 100/s, burst 10
	for range 6 {
		wantSource(t, s, p, SourceStatic)
	}
	if m := keyOf(t, s.Agent, p).smode.Load(); m != staticPromote {
		t.Fatalf("mode %d, want promote", m)
	}
	makeHot(t, s, 3, p)
	s.step() // the promotion; its answer makes p hot
	if s.ss.version != 3 || len(s.ss.reports) != 0 {
		t.Fatalf("version %d, %d pending reports; want 3, none", s.ss.version, len(s.ss.reports))
	}

	q := desc("slow", "q")
	makeHot(t, s, 4, q)
	s.clock.advance(time.Second)
	s.step() // the renewal
	wantSource(t, s, q, SourceFallback)
	s.fake.with(func(f *fakeAllocator) {
		f.static.HotVersion, f.static.HotReset = 5, true
		f.static.HotAdded = []uint64{staticHash(t, s, q), staticHash(t, s, l), staticHash(t, s, p)}
	})
	s.clock.advance(50 * time.Millisecond)
	s.step() // q's first use; the answer resets the set
	for range 5 {
		s.clock.advance(100 * time.Millisecond)
		s.step()
	}
	if s.ss.version != 5 || len(s.ss.reports) != 0 {
		t.Fatalf("version %d, %d pending reports; want 5, none", s.ss.version, len(s.ss.reports))
	}
	for _, req := range callsSince(s, n0) {
		for _, k := range req.Keys {
			if k.StaticReport {
				t.Fatalf("call %d reports %v", req.RequestId, k)
			}
		}
	}
}

// TestStaticReportHeldBack: reports a call has no room for (more than
// maxBatchKeys entries) hold its acknowledgement back to the version
// before theirs, and a call without keys follows in the same tick for
// them, acknowledging their version.
func TestStaticReportHeldBack(t *testing.T) {
	s := newStatic(t)
	ds := staticSlowKeys(t, s, maxBatchKeys)
	wantSource(t, s, ds[7], SourceStatic) // its share holds 8, the others 9
	hotByRenewal(t, s, len(ds), ds...)
	n0, _, _ := s.fake.counts()
	wantSource(t, s, desc("window", "x"), SourceFallback) // something to send
	s.clock.advance(50 * time.Millisecond)
	s.step()
	calls := callsSince(s, n0)
	if len(calls) != 2 {
		t.Fatalf("%d calls, want 2", len(calls))
	}
	if req := calls[0]; len(req.Keys) != 1 || req.HotVersion != 1 {
		t.Fatalf("first call: %d keys, hot_version %d; want x alone, hot_version 1", len(req.Keys), req.HotVersion)
	}
	if req := calls[1]; len(req.Keys) != maxBatchKeys || req.HotVersion != 1+maxBatchKeys {
		t.Fatalf("second call: %d keys, hot_version %d; want %d reports, hot_version %d", len(req.Keys), req.HotVersion, maxBatchKeys, 1+maxBatchKeys)
	}
	for _, k := range calls[1].Keys {
		want := int64(9)
		if k.Entries[0].Value == "s7" {
			want = 8
		}
		if !k.StaticReport || k.Want != 0 || k.StaticLeft != want {
			t.Fatalf("report %v, want static_left %d, no want", k, want)
		}
	}
	if got := len(s.ss.reports); got != 0 {
		t.Fatalf("%d pending reports, want 0", got)
	}
}

// TestStaticReportOverflow: reports of one version that outnumber what any
// call holds are never sent: the acknowledgement waits until they are
// moot, a static TTL after the answer that brought them (the allocator
// merges no share once a transition has ended), and no call is sent for
// them meanwhile.
func TestStaticReportOverflow(t *testing.T) {
	s := newStatic(t) // valid_ms 2000
	ds := staticSlowKeys(t, s, maxBatchKeys+1)
	hotByRenewal(t, s, len(ds), ds...)
	v := 1 + uint64(len(ds)) // the answer's version
	n0, _, _ := s.fake.counts()
	x := desc("window", "x")
	wantSource(t, s, x, SourceFallback)
	s.clock.advance(50 * time.Millisecond)
	s.step()
	calls := callsSince(s, n0)
	if len(calls) != 1 || len(calls[0].Keys) != 1 || calls[0].HotVersion != 1 {
		t.Fatalf("%d calls (%v); want one, x alone, hot_version 1", len(calls), calls)
	}
	// 2 s after the answer the reports are moot: the next call (a
	// renewal at the latest) acknowledges the answer's version and
	// reports nothing.
	for range 40 {
		s.clock.advance(100 * time.Millisecond)
		check(t, s.Agent, x) // x keeps calls coming
		s.step()
	}
	acked := false
	for _, req := range callsSince(s, n0) {
		for _, k := range req.Keys {
			if k.StaticReport {
				t.Fatalf("call %d reports %v", req.RequestId, k)
			}
		}
		acked = acked || req.HotVersion == v
	}
	if !acked || len(s.ss.reports) != 0 || s.ss.acked != v {
		t.Fatalf("acknowledged %v (agent %d), %d pending reports; want version %d, none", acked, s.ss.acked, len(s.ss.reports), v)
	}
}

// TestStaticReportFailedCall: a report stays pending across a call that
// failed in transit (the retry, under the same request id, carries it)
// and across one the allocator rejected (applied nothing); a key sent
// alone after a rejection carries no other key's report, and its call
// does not acknowledge the report's version.
func TestStaticReportFailedCall(t *testing.T) {
	s := newStatic(t)
	a, b := desc("slow", "a"), desc("slow", "b")
	wantSource(t, s, a, SourceStatic)
	wantSource(t, s, b, SourceStatic)
	wantSource(t, s, b, SourceStatic)
	makeHot(t, s, 2, a)
	s.clock.advance(time.Second)
	s.step() // the renewal brings the delta

	n0, _, _ := s.fake.counts()
	s.fake.with(func(f *fakeAllocator) { f.dropReplies = 1 }) // applied, answer lost
	wantSource(t, s, a, SourceFallback)
	s.step()
	if s.rf.unacked == nil || len(s.ss.reports) != 1 {
		t.Fatalf("after a lost answer: unacked %v, %d pending reports; want the call unacknowledged, 1", s.rf.unacked != nil, len(s.ss.reports))
	}
	makeHot(t, s, 3, b) // for the next call that is applied
	s.step()            // the retry
	calls := callsSince(s, n0)
	if len(calls) != 2 || calls[0].RequestId != calls[1].RequestId {
		t.Fatalf("%d calls, want a call and its retry", len(calls))
	}
	for _, req := range calls {
		if k := reportOf(req, a); k == nil || k.StaticLeft != 9 || req.HotVersion != 2 {
			t.Fatalf("call %d: report %v, hot_version %d; want a's report of 9, hot_version 2", req.RequestId, k, req.HotVersion)
		}
	}
	if len(s.ss.reports) != 0 || s.ss.version != 2 {
		t.Fatalf("%d pending reports at version %d after the answer, want 0 at 2 (the recorded answer)", len(s.ss.reports), s.ss.version)
	}

	// The next call brings version 3; the one after reports b, and is
	// rejected.
	wantSource(t, s, desc("window", "x"), SourceFallback)
	s.clock.advance(50 * time.Millisecond)
	s.step()
	if len(s.ss.reports) != 1 || s.ss.version != 3 {
		t.Fatalf("%d pending reports at version %d, want 1 at 3", len(s.ss.reports), s.ss.version)
	}
	n1, _, _ := s.fake.counts()
	s.fake.with(func(f *fakeAllocator) { f.rejectNext = 1 })
	wantSource(t, s, desc("window", "y"), SourceFallback)
	s.clock.advance(50 * time.Millisecond)
	s.step()
	if len(s.ss.reports) != 1 {
		t.Fatalf("%d pending reports after a rejected call, want 1", len(s.ss.reports))
	}
	// y is sent alone now (to learn whether the allocator refuses it):
	// without b's report, so without acknowledging its version.
	ky := keyOf(t, s.Agent, desc("window", "y"))
	if !ky.Suspect {
		t.Fatalf("y not suspect after the rejection")
	}
	if bb := s.build(s.clock.now(), []*keyState{ky}); reportOf(bb.req, b) != nil || bb.req.HotVersion != 2 {
		t.Fatalf("y's call alone: report %v, hot_version %d; want none, 2", reportOf(bb.req, b), bb.req.HotVersion)
	} else {
		s.reject(bb, false, false) // never sent: give back what the build took
	}
	for range 80 {
		s.clock.advance(100 * time.Millisecond)
		s.step()
	}
	calls = callsSince(s, n1)
	if k := reportOf(calls[0], b); k == nil || k.StaticLeft != 8 || calls[0].HotVersion != 3 {
		t.Fatalf("rejected call: report %v, hot_version %d; want b's report of 8, hot_version 3", k, calls[0].HotVersion)
	}
	reported := 0
	for _, req := range calls[1:] {
		k := reportOf(req, b)
		switch {
		case k != nil:
			reported++
			if req.HotVersion != 3 || k.StaticLeft != 8 {
				t.Fatalf("call %d: report %v, hot_version %d; want b's report of 8, hot_version 3", req.RequestId, k, req.HotVersion)
			}
		case reported == 0 && req.HotVersion != 2:
			t.Fatalf("call %d acknowledges %d before b's report is sent, want 2", req.RequestId, req.HotVersion)
		}
	}
	if reported != 1 || len(s.ss.reports) != 0 {
		t.Fatalf("b reported in %d later calls, %d pending; want 1, 0", reported, len(s.ss.reports))
	}
}

// TestStaticReportNoSlot: an answer that gives no slot (and so no
// valid_ms, as the allocator answers while a settings change has revoked
// every slot) keeps the pending reports, and those it brings are moot only
// a static TTL after it, the latest TTL given: a holder whose slot a
// settings change revokes still counts in transitions until the change
// takes force, and its acknowledgement would merge a full share. The next
// call reports the key and acknowledges. A key that owes its share's
// level when such an answer makes it hot (its permission lapsed: no slot)
// is reported the same way.
func TestStaticReportNoSlot(t *testing.T) {
	for _, owed := range []bool{false, true} {
		t.Run(fmt.Sprint("owed=", owed), func(t *testing.T) {
			s := newStatic(t)
			a := desc("slow", "a")
			spendStatic(t, s, a, 3)
			s.fake.with(func(f *fakeAllocator) {
				f.static.Slots, f.static.ValidMs = 0, 0
				f.static.HotVersion, f.static.HotAdded = 2, []uint64{staticHash(t, s, a)}
			})
			n0, _, _ := s.fake.counts()
			wantSource(t, s, desc("window", "x"), SourceFallback) // a call, whose answer makes a hot
			s.clock.advance(50 * time.Millisecond)
			if owed {
				// Its answer is lost; the permission lapses and a owes its
				// share's level before the retry is answered.
				s.fake.with(func(f *fakeAllocator) { f.dropReplies = 1 })
				s.step()
				s.clock.advance(2 * time.Second)
				wantSource(t, s, a, SourceFallback)
				if !keyOf(t, s.Agent, a).sOwe.Load() {
					t.Fatalf("a owes nothing")
				}
				s.step() // the retry, then a's first use
			} else {
				s.step()
				if len(s.ss.reports) != 1 || s.ss.version != 2 {
					t.Fatalf("%d pending reports at version %d, want 1 at 2", len(s.ss.reports), s.ss.version)
				}
				// Moot a TTL (the latest given, 2 s) and the margin after
				// the answer.
				valid := 2 * time.Second
				if got, want := s.ss.reports[0].until, s.clock.now()+int64(valid+policy.LeaseMargin(valid)); got != want {
					t.Fatalf("report moot at %d, want %d", got, want)
				}
				wantSource(t, s, a, SourceFallback)
				s.clock.advance(50 * time.Millisecond)
				s.step()
			}
			reported := false
			for _, req := range callsSince(s, n0) {
				if k := reportOf(req, a); k != nil {
					if k.StaticLeft != 7 || k.Promote || req.HotVersion != 2 {
						t.Fatalf("call %d: %v, hot_version %d; want a report of 7, 2", req.RequestId, k, req.HotVersion)
					}
					reported = true
				} else if req.HotVersion > 1 {
					t.Fatalf("call %d acknowledges %d without a's report", req.RequestId, req.HotVersion)
				}
			}
			if !reported || len(s.ss.reports) != 0 {
				t.Fatalf("reported %v, %d pending; want a reported, none pending", reported, len(s.ss.reports))
			}
		})
	}
}
