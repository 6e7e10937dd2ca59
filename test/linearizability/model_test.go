package linearizability

import (
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/bucket"
)

const ms = int64(time.Millisecond)

// slow is a rule that barely refills during a test: 10 per minute, burst 10.
var slow = Params{Quota: 10, Window: time.Minute, Burst: 10, RefreshInterval: time.Second}

// acq is an Acquire answered at stamp (ms) with call/return ±d ms around it.
func acq(client int, stamp, d int64, want, held, returned, charged, granted, remaining, heldAfter int64) Op {
	st := StatusOK
	if want > 0 && granted == 0 && remaining < 1 {
		st = StatusExhausted
	}
	return Op{Client: client, Agent: "a", Key: "k", Kind: Acquire,
		Want: want, Held: held, Returned: returned, Charged: charged,
		Call: (stamp - d) * ms, Return: (stamp + d) * ms,
		Status: st, Granted: granted, Remaining: remaining, HeldAfter: heldAfter, NowMs: stamp, LeaseTTLMs: 10_000}
}

func rel(client int, call, ret int64, held, returned, credited int64) Op {
	return Op{Client: client, Agent: "a", Key: "k", Kind: Release, Held: held, Returned: returned,
		Call: call * ms, Return: ret * ms, Credited: credited}
}

func check(t *testing.T, p Params, ops []Op) Result {
	t.Helper()
	r, err := Check(p, ops, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

const t0 = 1_700_000_000_000 // ms

func TestAccepts(t *testing.T) {
	ops := []Op{
		acq(0, t0, 1, 6, 0, 0, 0, 6, 4, 6),
		acq(1, t0+10, 1, 6, 0, 0, 0, 4, 0, 4),  // only 4 left
		acq(1, t0+20, 1, 6, 4, 0, 0, 0, 0, 4),  // exhausted: nothing granted
		acq(0, t0+30, 1, 0, 2, 4, 0, 0, 4, 2),  // returns 4 of the 6, keeps 2
		rel(1, t0+31, t0+40, 0, 4, 4),          // releases its 4
		acq(0, t0+50, 1, 10, 2, 0, 1, 7, 0, 9), // charged 1 (→ 7 left), granted those 7
	}
	if r := check(t, slow, ops); r.Outcome != porcupine.Ok {
		t.Fatalf("valid history: %v\n%s", r.Outcome, r.Explain)
	}
}

// TestConcurrentOrder: overlapping ops are linearized by their stamps, not
// by their call times.
func TestConcurrentOrder(t *testing.T) {
	a := acq(0, t0+50, 0, 8, 0, 0, 0, 8, 2, 8)
	a.Call = t0 * ms // called first, applied second
	b := acq(1, t0+40, 0, 5, 0, 0, 0, 5, 5, 5)
	b.Call = (t0 + 10) * ms
	b.Return = (t0 + 60) * ms
	a.Granted, a.Remaining, a.HeldAfter = 5, 0, 5 // only 5 left after b
	if r := check(t, slow, []Op{a, b}); r.Outcome != porcupine.Ok {
		t.Fatalf("%v\n%s", r.Outcome, r.Explain)
	}
}

func TestRejects(t *testing.T) {
	cases := []struct {
		name string
		ops  []Op
		why  string
	}{
		{"double grant", []Op{
			acq(0, t0, 1, 10, 0, 0, 0, 10, 0, 10),
			acq(1, t0+10, 1, 5, 0, 0, 0, 5, 0, 5), // the bucket was empty
		}, "double grant"},
		{"phantom grant (answered, never committed)", []Op{
			acq(0, t0, 1, 5, 0, 0, 0, 5, 5, 5),       // answered by a node without quorum
			acq(1, t0+10, 1, 10, 0, 0, 0, 10, 0, 10), // the real log: 10 were available
		}, "double grant"},
		{"lost return", []Op{
			acq(0, t0, 1, 10, 0, 0, 0, 10, 0, 10),
			acq(0, t0+10, 1, 0, 0, 10, 0, 0, 0, 0), // returned 10, remaining still 0
		}, "lost return"},
		{"lost release credit", []Op{
			acq(0, t0, 1, 10, 0, 0, 0, 10, 0, 10),
			rel(0, t0+5, t0+8, 0, 10, 10),
			acq(1, t0+10, 1, 1, 0, 0, 0, 0, 0, 0), // the 10 never came back
		}, "lost return"},
		{"release credits more than held", []Op{
			acq(0, t0, 1, 3, 0, 0, 0, 3, 7, 3),
			rel(0, t0+5, t0+8, 0, 5, 5),
		}, "credited 5"},
		{"stamp outside the interval", []Op{
			func() Op { o := acq(0, t0, 1, 3, 0, 0, 0, 3, 7, 3); o.NowMs = t0 + 100; return o }(),
		}, "outside"},
		{"stamps going back", []Op{
			acq(0, t0+50, 1, 3, 0, 0, 0, 3, 7, 3),
			func() Op {
				o := acq(1, t0+40, 1, 3, 0, 0, 0, 3, 4, 3)
				o.Call = (t0 + 60) * ms
				o.Return = (t0 + 70) * ms
				return o
			}(),
		}, ""},
		{"held record wrong", []Op{
			acq(0, t0, 1, 3, 0, 0, 0, 3, 7, 4),
		}, "records held"},
		{"grant above want", []Op{
			acq(0, t0, 1, 3, 0, 0, 0, 4, 6, 4),
		}, "> want"},
		{"exhausted with tokens left", []Op{
			func() Op { o := acq(0, t0, 1, 3, 0, 0, 0, 0, 10, 0); o.Status = StatusExhausted; return o }(),
		}, "status"},
		{"another status", []Op{
			func() Op { o := acq(0, t0, 1, 3, 0, 0, 0, 3, 7, 3); o.Status = StatusOther; return o }(),
		}, "status"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := check(t, slow, c.ops)
			if r.Outcome != porcupine.Illegal {
				t.Fatalf("outcome %v, want Illegal", r.Outcome)
			}
			if !strings.Contains(r.Explain, c.why) {
				t.Errorf("explanation %q lacks %q", r.Explain, c.why)
			}
		})
	}
}

// TestLeaseExpiry: a lease not renewed within its TTL may have been ended
// (tokens not credited): both outcomes are accepted after the expiry, only
// the live one before.
func TestLeaseExpiry(t *testing.T) {
	first := acq(0, t0, 1, 10, 0, 0, 0, 10, 0, 10)
	first.LeaseTTLMs = 1000
	// After the expiry: the allocator ended the lease, the return is not credited.
	expired := acq(0, t0+1500, 1, 0, 0, 10, 0, 0, 0, 0)
	if r := check(t, slow, []Op{first, expired}); r.Outcome != porcupine.Ok {
		t.Fatalf("expired lease: %v\n%s", r.Outcome, r.Explain)
	}
	// After the expiry but before the leader's Expire ran: credited.
	live := acq(0, t0+1500, 1, 0, 0, 10, 0, 0, 10, 0)
	if r := check(t, slow, []Op{first, live}); r.Outcome != porcupine.Ok {
		t.Fatalf("not yet expired lease: %v\n%s", r.Outcome, r.Explain)
	}
	// Before the expiry the lease cannot have ended.
	early := acq(0, t0+500, 1, 0, 0, 10, 0, 0, 0, 0)
	if r := check(t, slow, []Op{first, early}); r.Outcome != porcupine.Illegal {
		t.Fatalf("lease ended before its expiry accepted: %v", r.Outcome)
	}
}

// TestRefill: tokens come back at the rule's rate, known to ±1 ms a stamp.
func TestRefill(t *testing.T) {
	p := Params{Quota: 100, Window: time.Second, Burst: 100, RefreshInterval: time.Second} // 0.1 per ms
	ops := []Op{
		acq(0, t0, 1, 100, 0, 0, 0, 100, 0, 100),
		acq(1, t0+200, 1, 100, 0, 0, 0, 20, 0, 20), // 20 refilled in 200 ms
	}
	if r := check(t, p, ops); r.Outcome != porcupine.Ok {
		t.Fatalf("%v\n%s", r.Outcome, r.Explain)
	}
	ops[1].Granted, ops[1].HeldAfter = 25, 25 // 5 more than 200 ms refill
	if r := check(t, p, ops); r.Outcome != porcupine.Illegal {
		t.Fatalf("over-refill accepted: %v", r.Outcome)
	}
}

func TestCheckInputErrors(t *testing.T) {
	if _, err := Check(Params{}, nil, 0); err == nil {
		t.Error("zero params accepted")
	}
	if _, err := Check(slow, []Op{{Client: MaxClients}}, 0); err == nil {
		t.Error("client out of range accepted")
	}
	if _, err := Check(slow, []Op{{Call: 2, Return: 1}}, 0); err == nil {
		t.Error("return before call accepted")
	}
	if r, _ := Check(slow, []Op{rel(0, t0, t0+1, 0, 0, 0)}, 0); r.Outcome != porcupine.Ok || r.Keys != 1 || r.Ops != 1 {
		t.Errorf("one empty release: %+v", r)
	}
	o := rel(0, t0, t0+1, 0, 0, 0)
	o.Charged = 1
	if r, _ := Check(slow, []Op{o}, 0); r.Outcome != porcupine.Illegal {
		t.Error("charging release accepted")
	}
	if Acquire.String() != "acquire" || Release.String() != "release" {
		t.Error("Kind.String")
	}
}

// sim is the allocator's per-key algorithm (docs/leases.md) on pkg/bucket,
// with a random fair-share cut and random Expire commands: histories it
// produces are linearizable by construction.
type sim struct {
	p   Params
	lim bucket.Limit
	st  bucket.State
	now int64 // ns, monotone
	h   [MaxClients]int64
	exp [MaxClients]int64 // ns; 0 none
}

func (s *sim) expire(at int64) {
	for i := range s.exp {
		if s.exp[i] != 0 && s.exp[i] <= at {
			s.h[i], s.exp[i] = 0, 0
		}
	}
}

func (s *sim) credit(c int, held, returned int64) int64 {
	r := min(returned, max(0, s.h[c]-held))
	if r > 0 {
		s.lim.GiveBack(&s.st, s.now, r)
		s.h[c] -= r
	} else {
		r = 0
	}
	s.h[c] = min(s.h[c], held)
	return r
}

func (s *sim) apply(op *Op, cut int64, ttl time.Duration) {
	c := op.Client
	if op.Kind == Release {
		op.Credited = s.credit(c, op.Held, op.Returned)
		s.h[c], s.exp[c] = 0, 0
		return
	}
	s.credit(c, op.Held, op.Returned)
	if op.Charged > 0 {
		s.lim.Debit(&s.st, s.now, op.Charged)
	}
	capacity := s.p.Capacity()
	want := min(op.Want, capacity)
	var g int64
	if want > 0 {
		if ask := min(want, capacity-cut-s.h[c]); ask > 0 {
			g = s.lim.TakeUpTo(&s.st, s.now, ask)
			s.h[c] += g
		}
	}
	pk := s.lim.Peek(s.st, s.now)
	op.Granted, op.Remaining, op.NowMs = g, pk.Remaining, s.now/ms
	op.Status = StatusOK
	if want > 0 && g == 0 && pk.Remaining < 1 {
		op.Status = StatusExhausted
	}
	if want > 0 || s.h[c] > 0 {
		op.HeldAfter = s.h[c]
		op.LeaseTTLMs = ttl.Milliseconds()
		s.exp[c] = s.now + int64(ttl)
	} else {
		op.HeldAfter, op.LeaseTTLMs = 0, 0
		s.h[c], s.exp[c] = 0, 0
	}
}

// genHistory draws a linearizable history: ops applied in log order at
// increasing times, each by a client that is idle, with call and return
// around the apply time.
func genHistory(t *rapid.T) (Params, []Op) {
	p := Params{
		Quota:           rapid.Int64Range(1, 200).Draw(t, "quota"),
		Window:          rapid.SampledFrom([]time.Duration{time.Second, time.Minute}).Draw(t, "window"),
		Burst:           rapid.Int64Range(1, 50).Draw(t, "burst"),
		RefreshInterval: time.Second,
	}
	lim, err := bucket.NewLimit(bucket.TokenBucket, p.Quota, p.Window, p.Burst)
	if err != nil {
		t.Fatal(err)
	}
	s := &sim{p: p, lim: lim, now: t0*ms + rapid.Int64Range(0, ms-1).Draw(t, "ns")}
	clients := rapid.IntRange(1, 6).Draw(t, "clients")
	ttl := rapid.SampledFrom([]time.Duration{300 * time.Millisecond, 10 * time.Second}).Draw(t, "ttl")
	lastRet := make([]int64, clients)
	held := make([]int64, clients) // what each client keeps (its view)
	n := rapid.IntRange(1, 60).Draw(t, "ops")
	var ops []Op
	for range n {
		s.now += rapid.Int64Range(0, 40*ms).Draw(t, "gap")
		if rapid.IntRange(0, 9).Draw(t, "expire?") == 0 {
			s.expire(s.now)
		}
		var free []int
		for c := range clients {
			if lastRet[c] < s.now {
				free = append(free, c)
			}
		}
		if len(free) == 0 {
			continue
		}
		c := rapid.SampledFrom(free).Draw(t, "client")
		op := Op{Client: c, Agent: "a", Key: "k"}
		op.Call = max(lastRet[c]+1, s.now-rapid.Int64Range(0, 50*ms).Draw(t, "before"))
		op.Return = s.now + rapid.Int64Range(0, 50*ms).Draw(t, "after")
		lastRet[c] = op.Return
		spend := rapid.Int64Range(0, held[c]).Draw(t, "spend")
		keep := held[c] - spend
		if rapid.IntRange(0, 9).Draw(t, "release?") == 0 {
			op.Kind, op.Returned = Release, keep
			s.apply(&op, 0, ttl)
			held[c] = 0
		} else {
			op.Returned = rapid.Int64Range(0, keep).Draw(t, "returned")
			op.Held = keep - op.Returned
			op.Want = rapid.Int64Range(0, 15).Draw(t, "want")
			op.Charged = rapid.Int64Range(0, 3).Draw(t, "charged")
			s.apply(&op, rapid.Int64Range(0, 5).Draw(t, "cut"), ttl)
			held[c] = op.HeldAfter
		}
		ops = append(ops, op)
	}
	return p, ops
}

// TestPropertySound: every history the allocator's algorithm can produce
// is accepted (no false alarm in the fault tests).
func TestPropertySound(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		p, ops := genHistory(t)
		r, err := Check(p, ops, 20*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if r.Outcome != porcupine.Ok {
			t.Fatalf("valid history rejected (%v):\n%s", r.Outcome, r.Explain)
		}
	})
}

// TestPropertyDoubleGrant: granting any op tokens beyond what the bucket
// held (a duplicated grant of the whole burst) is rejected.
func TestPropertyDoubleGrant(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		p, ops := genHistory(t)
		if len(ops) == 0 || ops[0].Kind != Acquire || ops[0].Charged > 0 {
			// A ghost before a release may be refilled away unseen, and a
			// charge may hit the debt floor (−burst) either way.
			return
		}
		// A phantom client takes the whole burst at the first op's stamp,
		// on top of what the real log granted there.
		t1 := ops[0].NowMs
		ghost := acq(MaxClients-1, t1-1, 0, p.Burst, 0, 0, 0, p.Burst, 0, p.Burst)
		ghost.Want = min(p.Burst, p.Capacity())
		ghost.Return = ghost.Call
		ops = append(ops, ghost)
		r, err := Check(p, ops, 20*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		// The ghost emptied the bucket 1 ms before the first real op, which
		// saw it (nearly) full: no longer linearizable.
		if r.Outcome != porcupine.Illegal {
			t.Fatalf("phantom grant of %d accepted: %v", p.Burst, r.Outcome)
		}
	})
}
