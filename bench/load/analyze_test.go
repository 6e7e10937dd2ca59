package main

import (
	"flag"
	"io"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/agent"
)

func TestSlidingMax(t *testing.T) {
	for i, tc := range []struct {
		ts   []uint32
		w    uint32
		want int
	}{
		{nil, 10, 0},
		{[]uint32{5}, 10, 1},
		{[]uint32{0, 9}, 10, 2},
		{[]uint32{0, 10}, 10, 1}, // (t−w, t] is half-open: 0 is outside (0, 10]
		{[]uint32{0, 1, 2, 30, 31, 32, 33}, 10, 4},
		{[]uint32{0, 0, 0, 100}, 10, 3},
		{[]uint32{0, 5, 10, 15, 20}, 11, 3},
	} {
		if got := slidingMax(tc.ts, tc.w); got != tc.want {
			t.Errorf("case %d: slidingMax(%v, %d) = %d, want %d", i, tc.ts, tc.w, got, tc.want)
		}
	}
}

// steady returns one check of key every period over [0, d), all on agent
// 0, with allowed deciding each.
func steady(key uint32, period, d time.Duration, allowed func(i int) bool) []event {
	var out []event
	for i := 0; time.Duration(i)*period < d; i++ {
		out = append(out, event{us: uint32(time.Duration(i) * period / time.Microsecond), key: key, allowed: allowed(i), source: agent.SourceLease})
	}
	return out
}

func TestAnalyzeWithinLimit(t *testing.T) {
	// 8 req/s for 20 s under 10/s, burst 5: the ideal limiter admits all,
	// so every rejection is false, and nothing is over the limit.
	ev := steady(0, 125*time.Millisecond, 20*time.Second, func(i int) bool { return i%40 != 7 })
	acc, err := analyze(ev, 10, 5, 1, 10*time.Second, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if acc.Offered != 160 || acc.Admitted != 156 || acc.Rejected != 4 || acc.IdealAdmitted != 160 {
		t.Errorf("counts: offered %d admitted %d rejected %d ideal %d, want 160 156 4 160", acc.Offered, acc.Admitted, acc.Rejected, acc.IdealAdmitted)
	}
	if acc.FalseRejects != 4 || math.Abs(acc.FalseRejectPct-2.5) > 1e-9 {
		t.Errorf("false rejects %d (%.3f%%), want 4 (2.5%%)", acc.FalseRejects, acc.FalseRejectPct)
	}
	if acc.LaterFalseRejects != 2 || acc.LaterIdealAdmitted != 80 {
		t.Errorf("past the first window: %d false rejects of %d, want 2 of 80", acc.LaterFalseRejects, acc.LaterIdealAdmitted)
	}
	if got := acc.FalseRejectsBy; len(got) != 1 || got["lease"] != 4 {
		t.Errorf("false rejects by source %v, want lease 4", got)
	}
	if acc.WorstOverPct != 0 || acc.KeysOver1Pct != 0 || acc.KeysAtLimit != 0 {
		t.Errorf("over-admission %.3f%% (%d keys over 1%%, %d at limit), want 0", acc.WorstOverPct, acc.KeysOver1Pct, acc.KeysAtLimit)
	}
	if acc.ColdShare != 0 {
		t.Errorf("cold share %v, want 0 (8 req/s)", acc.ColdShare)
	}
}

func TestAnalyzeOverAdmission(t *testing.T) {
	// 20 req/s for 10 s, all admitted, under 10/s with burst 5: the worst
	// 10 s window holds 200 admissions against a bound of 5 + 100.
	ev := steady(3, 50*time.Millisecond, 10*time.Second, func(int) bool { return true })
	// A key seen once: cold, never over.
	ev = append(ev, event{us: 42, key: 9, allowed: true})
	acc, err := analyze(ev, 10, 5, 1, 10*time.Second, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if acc.WorstKey != "u3" || acc.WorstWindowCount != 200 || acc.WorstWindowBound != 105 {
		t.Errorf("worst %s: %d in a window, bound %v; want u3: 200, bound 105", acc.WorstKey, acc.WorstWindowCount, acc.WorstWindowBound)
	}
	if math.Abs(acc.WorstOverPct-95) > 1e-9 || acc.KeysOver1Pct != 1 || acc.OverAdmittedTokens != 95 {
		t.Errorf("over %.3f%%, %d keys over 1%%, %v tokens; want 95%%, 1, 95", acc.WorstOverPct, acc.KeysOver1Pct, acc.OverAdmittedTokens)
	}
	if acc.Keys != 2 || acc.KeysAtLimit != 1 {
		t.Errorf("keys %d at limit %d, want 2 and 1", acc.Keys, acc.KeysAtLimit)
	}
	// The ideal limiter admits the burst and then 10/s: 5 + ~100.
	if acc.IdealAdmitted < 104 || acc.IdealAdmitted > 107 {
		t.Errorf("ideal admitted %d, want ≈ 106", acc.IdealAdmitted)
	}
	if acc.FalseRejects != 0 {
		t.Errorf("false rejects %d, want 0 (everything was admitted)", acc.FalseRejects)
	}
	if want := 1.0 / 201; math.Abs(acc.ColdShare-want) > 1e-9 {
		t.Errorf("cold share %v, want %v", acc.ColdShare, want)
	}
}

func TestAnalyzeStaticSplit(t *testing.T) {
	// 8 req/s under 10/s, burst 10, over 2 agents, all to agent 0: a
	// static split gives agent 0 5/s (burst 5), so about 3 of every 8
	// requests are refused after the burst; the system admitted all.
	ev := steady(0, 125*time.Millisecond, 20*time.Second, func(int) bool { return true })
	acc, err := analyze(ev, 10, 10, 2, 10*time.Second, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if acc.FalseRejects != 0 {
		t.Errorf("false rejects %d, want 0", acc.FalseRejects)
	}
	// Admitted by the split: 5 (burst) + 5/s × 20 s = 105 of 160.
	if got, want := acc.StaticFalseRejectPct, 100*float64(160-105)/160; math.Abs(got-want) > 1.5 {
		t.Errorf("static split false rejects %.2f%%, want ≈ %.2f%%", got, want)
	}
}

func TestAnalyzeShortfallIsPerWindow(t *testing.T) {
	// 4 req/s under 10/s, burst 10, for 20 s. The system rejects every
	// request in the first 10 s window and admits every one in the second:
	// the second window's admissions do not make up for the first's
	// rejections.
	ev := steady(0, 250*time.Millisecond, 20*time.Second, func(i int) bool { return i >= 40 })
	acc, err := analyze(ev, 10, 10, 1, 10*time.Second, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if acc.FalseRejects != 40 || acc.IdealAdmitted != 80 {
		t.Errorf("false rejects %d of %d, want 40 of 80", acc.FalseRejects, acc.IdealAdmitted)
	}
}

func TestTraceKey(t *testing.T) {
	ev := []event{
		{us: 100, key: 1, allowed: true, source: agent.SourceLease},
		{us: 200, key: 1, allowed: true, source: agent.SourceFallback},
		{us: 1_200_000, key: 1, agent: 3, allowed: false, source: agent.SourceLease},
		{us: 1_300_000, key: 1, agent: 3, allowed: false, source: agent.SourceLease},
		{us: 1_400_000, key: 1, agent: 0, allowed: false, source: agent.SourceLease},
		{us: 50, key: 2, allowed: true, source: agent.SourceLease},
	}
	if _, err := analyze(ev, 10, 10, 1, time.Second, 2*time.Second); err != nil { // sorts
		t.Fatal(err)
	}
	var b strings.Builder
	traceKey(&b, ev, "u1", time.Second)
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("trace has %d lines, want 3:\n%s", len(lines), b.String())
	}
	for i, want := range [][]string{{"0.00", "1", "1", "0", "2"}, {"1.00", "0", "0", "3", "2", "a0:1", "a3:2"}} {
		if got := strings.Fields(lines[i+1])[2:]; strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("line %d = %q, want fields %v", i+1, lines[i+1], want)
		}
	}
}

func TestColdShareExpected(t *testing.T) {
	// The long-tail workload: about 18% of requests go to keys
	// under 1 req/s.
	if got := coldShareExpected(100_000, 1.1, 50_000); got < 0.17 || got > 0.19 {
		t.Errorf("cold share of 100k keys, Zipf 1.1, 50k req/s = %.3f, want ≈ 0.18", got)
	}
	if got := coldShareExpected(10, 0, 1000); got != 0 {
		t.Errorf("uniform 10 keys at 1000 req/s: cold share %v, want 0", got)
	}
}

func TestParseFlagsPreset(t *testing.T) {
	parse := func(args ...string) options {
		t.Helper()
		fs := flag.NewFlagSet("load", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o, err := parseFlags(fs, args)
		if err != nil {
			t.Fatalf("parseFlags(%q): %v", args, err)
		}
		return o
	}
	o := parse("-workload", "longtail")
	if o.keys != 100000 || o.zipfS != 1.1 || o.agents != 10 || o.rate != 50000 {
		t.Errorf("longtail preset: keys %d zipf %v agents %d rate %v", o.keys, o.zipfS, o.agents, o.rate)
	}
	o = parse("-workload", "skew", "-rate", "4750")
	if o.rate != 4750 || o.skew != 0.5 || o.skewRotate != 5*time.Second || o.keys != 1 {
		t.Errorf("skew preset with -rate: rate %v skew %v rotate %v keys %d", o.rate, o.skew, o.skewRotate, o.keys)
	}
	for _, bad := range [][]string{{"-workload", "nope"}, {"-zipf", "0.5"}, {"-skew", "2"}, {"-agents", "0"}, {"extra"}} {
		fs := flag.NewFlagSet("load", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		if _, err := parseFlags(fs, bad); err == nil {
			t.Errorf("parseFlags(%q) succeeded, want an error", bad)
		}
	}
}

func TestWorkloadRouting(t *testing.T) {
	o := options{keys: 10, zipfS: 1.1, agents: 10, skew: 0.5, skewRotate: time.Second, seed: 7}
	w := newWorkload(o)
	r := w.picker(1)
	counts := make([]int, o.keys)
	for range 100000 {
		counts[r.next()]++
	}
	for i := 1; i < len(counts); i++ {
		if counts[i] > counts[i-1]+500 {
			t.Errorf("Zipf counts not decreasing: key %d %d > key %d %d", i, counts[i], i-1, counts[i-1])
		}
	}
	route := w.picker(2).r
	fav := make([]int, o.agents)
	for range 10000 {
		fav[w.agentFor(route, 2500*time.Millisecond)]++
	}
	// Favored agent at 2.5 s with 1 s rotation: agent 2, with 0.5 + 0.5/10.
	if share := float64(fav[2]) / 10000; share < 0.52 || share > 0.58 {
		t.Errorf("favored agent share %.3f, want ≈ 0.55", share)
	}
	if got := w.descs[7].Entries[0]; got.Key != "user" || got.Value != "u7" {
		t.Errorf("descriptor 7 = %+v", got)
	}
}

// TestAnalyzeFalseRejectsBySource: a window's shortfall is split among the
// sources of its denials, in proportion; a window with no shortfall
// attributes nothing, however many denials it has.
func TestAnalyzeFalseRejectsBySource(t *testing.T) {
	// Key 0, 8 req/s under 10/s: every denial is false; one in four is
	// the static share's.
	ev := steady(0, 125*time.Millisecond, 10*time.Second, func(i int) bool { return i%10 != 3 })
	n := 0
	for i := range ev {
		if !ev[i].allowed {
			if n%4 == 0 {
				ev[i].source = agent.SourceStatic
			} else {
				ev[i].source = agent.SourceFallback
			}
			n++
		}
	}
	// Key 1, 40 req/s under 10/s: the ideal limiter admits 104 of 400, the
	// fallback admits 107 and denies the rest: no shortfall.
	ev = append(ev, steady(1, 25*time.Millisecond, 10*time.Second, func(i int) bool { return i%4 == 0 || i < 10 })...)
	for i := range ev {
		if ev[i].key == 1 {
			ev[i].source = agent.SourceFallback
		}
	}
	acc, err := analyze(ev, 10, 5, 1, 10*time.Second, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if acc.FalseRejects != 8 {
		t.Fatalf("false rejects %d, want 8", acc.FalseRejects)
	}
	if got := acc.FalseRejectsBy; len(got) != 2 || got["static"] != 2 || got["fallback"] != 6 {
		t.Errorf("false rejects by source %v, want static 2, fallback 6", got)
	}
}

// TestAnalyzeFalseRejectsSplit: a window whose shortfall is less than its
// denials shares it among their sources in proportion: 112 requests over
// 10 s under 10/s, burst 5, the ideal limiter admitting 104; 100 admitted,
// so 4 false rejects among 12 denials, 3 of them the static share's.
func TestAnalyzeFalseRejectsSplit(t *testing.T) {
	period := 10 * time.Second / 111
	ev := steady(0, period, 10*time.Second, func(i int) bool { return true })
	acc, err := analyze(ev, 10, 5, 1, 10*time.Second, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if len(ev) != 112 || acc.IdealAdmitted != 104 {
		t.Fatalf("%d requests, the ideal limiter admits %d; want 112, 104", len(ev), acc.IdealAdmitted)
	}
	denied := 0
	for i := 50; denied < 12; i += 5 { // 12 denials spread over the run
		ev[i].allowed = false
		if denied%4 == 0 {
			ev[i].source = agent.SourceStatic
		} else {
			ev[i].source = agent.SourceFallback
		}
		denied++
	}
	if acc, err = analyze(ev, 10, 5, 1, 10*time.Second, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if acc.FalseRejects != 4 {
		t.Fatalf("false rejects %d, want 4", acc.FalseRejects)
	}
	if got := acc.FalseRejectsBy; len(got) != 2 || got["static"] != 1 || got["fallback"] != 3 {
		t.Errorf("false rejects by source %v, want static 1, fallback 3", got)
	}
}
