package policy

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/pkg/breaker"
)

// coreKey is one key in a core script: the core's state of it and the
// counters the check path would publish (obs), played by the script's
// check and deny lines.
type coreKey struct {
	name string
	k    Key
	o    Obs
	thin bool // its fallback bucket is a thin share (ThinShare)
}

// coreBatch is a batch sent and not yet answered.
type coreBatch struct {
	id          uint64
	keys        []*coreKey
	want        []int64
	ret         []int64 // returned: put back if the batch is rejected
	chg, out    []int64 // charged, outage: put back if rejected
	spent, deny []int64
	demand      []float64
	held        []int64
	sent        int64
}

// coreWorld runs a Core the way the refill loop does (agent/refill.go),
// with a simplified check path: a check spends from a live lease, is denied
// while a dry lease denies, and is otherwise admitted by the fallback
// bucket (charged, or counted as an outage admission while the breaker is
// open); the fallback bucket itself is not modelled (deny plays its
// denials).
type coreWorld struct {
	cfg     Config
	c       *Core
	now     int64
	keys    map[string]*coreKey
	awake   []*coreKey
	queue   []*coreKey
	later   []*coreKey // picked, for the calls after this tick's
	unacked *coreBatch
	// auto, when set (allocator), answers every call at once with these
	// arguments.
	auto map[string]string
}

func newCoreWorld(cfg Config) *coreWorld {
	cfg.Jitter = func(d time.Duration) time.Duration { return d } // no jitter: the longest wait
	cfg.Breaker.Jitter = cfg.Jitter
	// Time starts at 1000 s: 0 is "never" for a lease's expiry.
	return &coreWorld{cfg: cfg, c: NewCore(cfg), now: int64(1000 * time.Second), keys: map[string]*coreKey{}}
}

func (w *coreWorld) at(t int64) string {
	switch {
	case t == 0:
		return "never"
	case t == math.MaxInt64 || t == RefusedForever:
		return "forever"
	}
	return "t=" + time.Duration(t-int64(1000*time.Second)).Round(time.Millisecond).String()
}

func (w *coreWorld) key(name string) *coreKey {
	ck := w.keys[name]
	if ck == nil {
		ck = &coreKey{name: name}
		ck.o.LastUse = w.now
		ck.o.LowWater = 1
		w.keys[name] = ck
		w.awake = append(w.awake, ck)
	}
	return ck
}

func (w *coreWorld) enqueue(ck *coreKey) {
	if !ck.o.Queued {
		ck.o.Queued = true
		w.queue = append(w.queue, ck)
	}
}

// check plays n admissions (or the denial) of the check path.
func (w *coreWorld) check(ck *coreKey, n int64) string {
	o := &ck.o
	o.LastUse = w.now
	if w.now < o.Expiry && o.Balance >= n {
		o.Balance -= n
		o.Spent += n
		if o.Balance < o.LowWater {
			w.enqueue(ck)
			return fmt.Sprintf("lease: balance %d, below the low watermark: queued", o.Balance)
		}
		return fmt.Sprintf("lease: balance %d", o.Balance)
	}
	if w.now < o.DeniedUntil {
		o.Denied++
		return "denied by the lease, retry after " + time.Duration(o.DeniedUntil-w.now).String()
	}
	o.Spent += n
	switch open := w.c.Probing(); {
	case !open && !o.NotLeased:
		o.Charged += n
		w.enqueue(ck)
		return fmt.Sprintf("fallback: charged %d", o.Charged)
	case open && !o.NotLeased:
		o.Outage += n
		return fmt.Sprintf("fallback (breaker open): outage %d", o.Outage)
	}
	return "fallback (not leased)"
}

// tick is one tick of the refill loop: the scan when due, then the queued
// keys, then the batch (all picked keys in one, or each suspect one alone).
func (w *coreWorld) tick() string {
	var out []string
	pick := w.later
	w.later = nil
	if scan, dt, alpha := w.c.Tick(w.now); scan {
		awake := w.awake[:0]
		var gone []string
		for _, ck := range w.awake {
			switch w.c.Visit(&ck.k, &ck.o, w.now, dt, alpha) {
			case Pick:
				pick = append(pick, ck)
			case Forget:
				gone = append(gone, ck.name)
				delete(w.keys, ck.name)
				continue
			}
			awake = append(awake, ck)
		}
		w.awake = awake
		out = append(out, "scan")
		if len(gone) > 0 {
			out = append(out, "forgotten: "+strings.Join(gone, " "))
		}
	}
	if w.cfg.Standalone {
		return strings.Join(out, "\n")
	}
	release := func() {
		for _, ck := range pick {
			ck.k.Inflight = false
		}
	}
	if !w.c.MaySend(w.now) {
		release()
		return strings.Join(append(out, "no call: the breaker or the overload backoff holds"), "\n")
	}
	if w.unacked != nil {
		release() // one call per tick: the picked keys wait for the next scan
		return strings.Join(append(out, w.send(w.unacked, "retry")), "\n")
	}
	for _, ck := range w.queue {
		ck.o.Queued = false
		if w.c.Queued(&ck.k, &ck.o, w.now) {
			pick = append(pick, ck)
		}
	}
	w.queue = w.queue[:0]
	if len(pick) == 0 {
		if w.c.Probing() {
			return strings.Join(append(out, w.send(w.build(nil), "probe")), "\n")
		}
		return strings.Join(append(out, "no call"), "\n")
	}
	slices.SortFunc(pick, func(x, y *coreKey) int { return strings.Compare(x.name, y.name) })
	SortPicks(pick, coreKeyOf)
	// One call per tick: the keys of the next calls (in flight already)
	// are sent by the next ticks.
	n := BatchLen(pick, coreKeyOf, 1000)
	w.later = append(w.later, pick[n:]...)
	pick = pick[:n]
	return strings.Join(append(out, w.send(w.build(pick), "call")), "\n")
}

func coreKeyOf(ck *coreKey) *Key { return &ck.k }

// build plans each key's part of a batch and moves its tokens, as
// agent.build does.
func (w *coreWorld) build(keys []*coreKey) *coreBatch {
	b := &coreBatch{id: w.c.NextID(), keys: keys}
	b.demand = make([]float64, 0, len(keys))
	for _, ck := range keys {
		o := &ck.o
		if w.now >= o.Expiry {
			o.Balance = 0
		}
		snap := *o
		chg, out := o.Charged, o.Outage
		o.Charged, o.Outage = 0, 0
		snap.Charged, snap.Outage = chg, out
		p := w.c.Plan(&ck.k, &snap, w.now, func() bool { return ck.thin })
		var ret, want int64
		switch p.Entry {
		case HandBack:
			ret, o.Balance = o.Balance, 0
		case Refill:
			o.LowWater = p.LowWater
			if w.now < o.Expiry {
				ret = Excess(o.Balance, p.Target)
				o.Balance -= ret
			}
			want = WantOf(p.Target, o.Balance)
		}
		b.want = append(b.want, want)
		b.ret = append(b.ret, ret)
		b.chg = append(b.chg, chg)
		b.out = append(b.out, out)
		b.spent = append(b.spent, o.Spent)
		b.deny = append(b.deny, o.Denied)
		b.demand = append(b.demand, p.Demand)
		b.held = append(b.held, max(o.Balance, 0))
	}
	return b
}

func (w *coreWorld) send(b *coreBatch, what string) string {
	if b.sent == 0 {
		b.sent = w.now
	}
	w.unacked = b
	lines := []string{fmt.Sprintf("%s #%d", what, b.id)}
	for i, ck := range b.keys {
		s := fmt.Sprintf("  %s: want %d", ck.name, b.want[i])
		if b.ret[i] != 0 {
			s += fmt.Sprintf(" returned %d", b.ret[i])
		}
		if b.chg[i] != 0 {
			s += fmt.Sprintf(" charged %d", b.chg[i])
		}
		if b.out[i] != 0 {
			s += fmt.Sprintf(" outage %d", b.out[i])
		}
		if d := b.deny[i] - ck.k.DeniedSent; d != 0 {
			s += fmt.Sprintf(" denied %d", d)
		}
		s += fmt.Sprintf(" held %d demand %.4g", b.held[i], b.demand[i])
		lines = append(lines, s)
	}
	return strings.Join(lines, "\n")
}

// answer is the allocator's answer to the unacknowledged batch, rtt after
// the call went out; arg(k, name) reads key k's answer.
func (w *coreWorld) answer(t *testing.T, args map[string]string) string {
	b := w.unacked
	if b == nil {
		return "error: no call in flight"
	}
	rtt := argD(t, args, "rtt", 10*time.Millisecond)
	sent := w.now
	w.now += int64(rtt)
	var out []string
	if w.c.Answered(sent, w.now) {
		out = append(out, "  the breaker closes")
	}
	w.unacked = nil
	for i, ck := range b.keys {
		w.c.Acked(&ck.k, b.spent[i], b.deny[i])
		a := keyArgs(args, ck.name)
		ans := Answer{
			Status:          OK,
			Granted:         b.want[i],
			Remaining:       argI(t, a, "remaining"),
			TTL:             argD(t, a, "ttl", 10*time.Second),
			RefreshAfter:    argD(t, a, "refresh", time.Second),
			RetryAfter:      argD(t, a, "retry", 0),
			ResetAfter:      argD(t, a, "reset", 0),
			RequestsPerUnit: uint32(argI(t, a, "rpu")),
			WindowSeconds:   argI(t, a, "window"),
			Burst:           argI(t, a, "burst"),
			Agents:          uint32(argI(t, a, "agents")),
		}
		if _, ok := a["granted"]; ok {
			ans.Granted = argI(t, a, "granted")
		}
		switch a["status"] {
		case "", "ok":
		case "exhausted":
			ans.Status = Exhausted
		case "notleased":
			ans.Status = NotLeased
		case "unknown":
			ans.Status = Unknown
		default:
			t.Fatalf("answer: status %q", a["status"])
		}
		o := &ck.o
		if ans.Status == OK || ans.Status == Exhausted {
			o.Leased, o.NotLeased = true, false
			pay := min(max(o.Charged, 0), ans.Granted)
			o.Charged -= pay
			ck.k.Paid += pay
			o.Balance += ans.Granted - pay
		} else if ans.Status == NotLeased {
			o.Leased, o.NotLeased = true, true
		}
		l := w.c.Grant(&ck.k, ans, b.want[i], b.sent, w.now)
		if l.Rebase {
			if l.Expiry != 0 {
				o.Expiry = l.Expiry
			}
			o.DeniedUntil = l.DeniedUntil
		}
		line := fmt.Sprintf("  %s: granted %d", ck.name, ans.Granted)
		if l.Rebase && l.RebaseAt != w.now {
			line += ", fallback from " + w.at(l.RebaseAt)
		}
		out = append(out, line)
	}
	return fmt.Sprintf("t=%v answered #%d\n%s", w.clock(), b.id, strings.Join(out, "\n"))
}

// run: see TestCore.
func (w *coreWorld) run(t *testing.T, args map[string]string) string {
	every := max(int(argD(t, args, "every", w.cfg.Tick)/w.cfg.Tick), 1)
	_, summary := args["summary"]
	var lines []string
	calls, last := 0, ""
	for i, end := 0, w.now+int64(argD(t, args, "d", 0)); w.now < end; i++ {
		w.now += int64(w.cfg.Tick)
		for _, kn := range strings.Split(args["check"], ",") {
			if k, n, ok := strings.Cut(kn, ":"); ok && i%every == 0 {
				for range max(argI(t, map[string]string{"n": n}, "n"), 1) {
					w.check(w.key(k), 1)
				}
			}
		}
		out := w.tickAuto(t)
		if !strings.Contains(out, "#") {
			continue
		}
		calls++
		last = out
		if !summary {
			lines = append(lines, out)
		}
		if w.auto == nil {
			break // the call waits for its answer
		}
	}
	switch {
	case calls == 0:
		return fmt.Sprintf("t=%v no call", w.clock())
	case summary:
		return fmt.Sprintf("%d calls, the last:\n%s", calls, last)
	}
	return strings.Join(lines, "\n")
}

// tickAuto runs a tick, and answers its call when the allocator is
// automatic.
func (w *coreWorld) tickAuto(t *testing.T) string {
	out := fmt.Sprintf("t=%v ", w.clock()) + w.tick()
	if w.auto != nil && w.unacked != nil {
		out += "\n" + w.answer(t, w.auto)
	}
	return out
}

// keyArgs returns the answer arguments for key k: name=value applies to
// every key, k.name=value to k alone.
func keyArgs(args map[string]string, k string) map[string]string {
	a := map[string]string{}
	for n, v := range args {
		if !strings.Contains(n, ".") {
			a[n] = v
		}
	}
	for n, v := range args {
		if kk, nn, ok := strings.Cut(n, "."); ok && kk == k {
			a[nn] = v
		}
	}
	return a
}

// clock is the script's time: 0 at the start.
func (w *coreWorld) clock() time.Duration { return time.Duration(w.now - int64(1000*time.Second)) }

func (w *coreWorld) show(ck *coreKey) string {
	o, k := &ck.o, &ck.k
	s := fmt.Sprintf("%s: balance %d charged %d outage %d lowwater %d demand %.4g", ck.name,
		o.Balance, o.Charged, o.Outage, o.LowWater, k.Demand.Rate)
	if o.Expiry != 0 {
		s += " expires " + w.at(o.Expiry)
	}
	if w.now < o.DeniedUntil {
		s += " denies-until " + w.at(o.DeniedUntil)
	}
	if k.Paced {
		s += " paced, asks at " + w.at(k.RefreshAt)
	}
	if w.now < k.HoldUntil {
		s += " held until " + w.at(k.HoldUntil)
	}
	if k.Suspect {
		s += " suspect"
	}
	if k.Inflight {
		s += " in-flight"
	}
	if o.NotLeased {
		s += " not-leased"
	}
	if until, ok := w.c.RestUntil(k, o, w.now); !ok {
		s += "\n  must stay awake"
	} else {
		s += "\n  a scan's verdict holds until " + w.at(until)
	}
	return s
}

// TestCore runs testdata/core-*: the refill loop's policy, tick by tick.
//
//	config [tick=50ms] [scan=100ms] [idle=10s] [threshold=3] [probe=100ms] [maxprobe=2s] [standalone]
//	                                 a new world at t=0 with no key
//	advance [d=<duration>]           the clock moves (default one tick)
//	check k [n=1]                    a check of key k admits n tokens (see coreWorld.check)
//	deny k                           a check of k is denied by its fallback bucket
//	thin k                           k's fallback bucket is a thin share
//	tick                             one refill tick: prints the batch sent, if any
//	allocator <answer arguments>|off every call is answered at once with these arguments
//	run d=<duration> [check=k:n,...] [every=<tick>] [summary]
//	                                 ticks for d, the first of every `every` after n checks of each
//	                                 key k, until a call that is not answered at once; prints the
//	                                 calls (summary: their count and the last)
//	answer [granted=] [ttl=10s] [refresh=1s] [status=ok|exhausted|notleased|unknown] [retry=] [reset=]
//	       [remaining=] [rpu= window= burst= agents=] [rtt=10ms]
//	                                 the allocator answers the call in flight (granted defaults to the
//	                                 want; k.granted=... applies to key k alone); the clock moves by rtt
//	fail                             the call in flight fails in transit
//	throttle [retry=]                the allocator refuses it as overloaded (RetryInfo retry)
//	reject                           the allocator rejects it: nothing was applied
//	show k                           k's state
//	breaker                          the breaker's state
func TestCore(t *testing.T) {
	var w *coreWorld
	scripts(t, "core-*", func(t *testing.T, cmd string, args map[string]string) string {
		if cmd != "config" && w == nil {
			t.Fatal("a core script starts with config")
		}
		var name string
		for k, v := range args {
			if v == "" {
				name = k
			}
		}
		switch cmd {
		case "config":
			_, standalone := args["standalone"]
			w = newCoreWorld(Config{
				Tick: argD(t, args, "tick", 50*time.Millisecond), Scan: argD(t, args, "scan", 100*time.Millisecond),
				IdleTimeout: argD(t, args, "idle", 10*time.Second), Standalone: standalone,
				Breaker: breaker.Config{Threshold: int(max(argI(t, args, "threshold"), 3)),
					Cooldown: argD(t, args, "probe", 100*time.Millisecond), MaxCooldown: argD(t, args, "maxprobe", 2*time.Second)},
			})
			return "t=0"
		case "advance":
			w.now += int64(argD(t, args, "d", w.cfg.Tick))
			return fmt.Sprintf("t=%v", w.clock())
		case "check":
			ck := w.key(name)
			n := max(argI(t, args, "n"), 1)
			var s string
			for range n {
				s = w.check(ck, 1)
			}
			return s
		case "deny":
			ck := w.key(name)
			ck.o.LastUse = w.now
			ck.o.Denied++
			return fmt.Sprintf("denied %d", ck.o.Denied)
		case "thin":
			w.key(name).thin = true
			return "thin share"
		case "tick":
			return w.tickAuto(t)
		case "allocator":
			w.auto = args
			if _, off := args["off"]; off {
				w.auto = nil
			}
			return "ok"
		case "run":
			return w.run(t, args)
		case "answer":
			return w.answer(t, args)
		case "fail", "throttle", "reject":
			b := w.unacked
			if b == nil {
				return "error: no call in flight"
			}
			switch cmd {
			case "fail":
				opened, open := w.c.Failed(w.now)
				if open {
					for i := range b.want {
						b.want[i] = 0 // see agent.callFailed
					}
				}
				if opened {
					return fmt.Sprintf("failed: the breaker opens, probe in %v", time.Duration(w.c.NextProbe()-w.now))
				}
				return fmt.Sprintf("failed (%d in a row)", w.c.Failures())
			case "throttle":
				wait := w.c.Throttled(w.now, argD(t, args, "retry", 0))
				return fmt.Sprintf("throttled: retry in %v", wait)
			}
			w.unacked = nil
			w.c.Reachable()
			for i, ck := range b.keys {
				ck.o.Charged += b.chg[i]
				ck.o.Outage += b.out[i]
				if w.now < ck.o.Expiry {
					ck.o.Balance += b.ret[i]
				}
				w.c.Rejected(&ck.k, w.now)
			}
			return "rejected"
		case "show":
			ck := w.keys[name]
			if ck == nil {
				return name + ": not tracked"
			}
			return w.show(ck)
		case "breaker":
			if !w.c.Probing() {
				return fmt.Sprintf("closed, %d failures", w.c.Failures())
			}
			return fmt.Sprintf("open, %d failures, probe in %v", w.c.Failures(), time.Duration(w.c.NextProbe()-w.now))
		}
		t.Fatalf("unknown command %q", cmd)
		return ""
	})
}
