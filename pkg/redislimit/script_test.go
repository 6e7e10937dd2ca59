package redislimit

import (
	"fmt"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
	"pgregory.net/rapid"
)

// base is 2023-11-15T00:00:00Z, a multiple of every window used here.
const base = int64(1_700_006_400) * int64(time.Second)

// tstep is one operation at base+at.
type tstep struct {
	at time.Duration
	op op // opAllow, opTake, opGive, opDebit or opDrain
	n  int64
}

// tb is what the helpers need from *testing.T and *rapid.T.
type tb interface {
	Helper()
	Fatal(...any)
	Fatalf(string, ...any)
}

func mustLimit(t tb, alg bucket.Algorithm, quota int64, window time.Duration, burst int64) bucket.Limit {
	t.Helper()
	l, err := bucket.NewLimit(alg, quota, window, burst)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// sharedTable is the shared test table: each sequence runs through
// pkg/bucket's Limit methods and through the backend's script, which must
// agree exactly (all instants are whole milliseconds).
func sharedTable(t testing.TB) []struct {
	name  string
	lim   bucket.Limit
	steps []tstep
} {
	ms := time.Millisecond
	burstOf := func(at time.Duration, n int) []tstep {
		var s []tstep
		for range n {
			s = append(s, tstep{at, opAllow, 1})
		}
		return s
	}
	cat := func(parts ...[]tstep) []tstep {
		var s []tstep
		for _, p := range parts {
			s = append(s, p...)
		}
		return s
	}
	mixed := cat(
		burstOf(0, 4),
		[]tstep{
			{0, opAllow, 3}, {1 * ms, opAllow, 0}, {10 * ms, opTake, 5}, {10 * ms, opAllow, 1},
			{250 * ms, opAllow, 1}, {999 * ms, opAllow, 2}, {1000 * ms, opGive, 2}, {1000 * ms, opAllow, 3},
			{1001 * ms, opDebit, 4}, {1002 * ms, opAllow, 0}, {1500 * ms, opAllow, 1}, {3 * time.Second, opAllow, 1},
			{2 * time.Second, opAllow, 1}, // the clock went backwards
			{2 * time.Second, opTake, 100}, {7 * time.Second, opGive, 1000}, {7 * time.Second, opAllow, 1000},
			{61 * time.Second, opAllow, 1}, {61 * time.Second, opTake, 2}, {125 * time.Second, opDebit, 100},
			{125 * time.Second, opAllow, 0}, {126 * time.Second, opGive, 1}, {400 * time.Second, opAllow, 1},
			{400 * time.Second, opDrain, 0}, {400*time.Second + ms, opAllow, 1}, {401 * time.Second, opGive, 2},
			{401 * time.Second, opDrain, 0}, {401 * time.Second, opDrain, 0}, {399 * time.Second, opDrain, 0},
			{430 * time.Second, opAllow, 1}, {431 * time.Second, opDebit, 3}, {431 * time.Second, opDrain, 0},
			{432 * time.Second, opAllow, 0},
		},
	)
	var cases []struct {
		name  string
		lim   bucket.Limit
		steps []tstep
	}
	add := func(name string, lim bucket.Limit, steps []tstep) {
		cases = append(cases, struct {
			name  string
			lim   bucket.Limit
			steps []tstep
		}{name, lim, steps})
	}
	for _, alg := range []bucket.Algorithm{bucket.TokenBucket, bucket.GCRA} {
		// The example rules: 30/minute burst 10; the 11th immediate request is
		// denied with RetryAfter 2s.
		add(alg.String()+"/design-card", mustLimit(t, alg, 30, time.Minute, 10),
			cat(burstOf(0, 11), []tstep{{1999 * ms, opAllow, 1}, {2000 * ms, opAllow, 1}, {2000 * ms, opAllow, 1}}))
		add(alg.String()+"/5ps", mustLimit(t, alg, 5, time.Second, 5), mixed)
		// 7 per 3 s: a token every 428.57 ms, not a whole number of ms.
		add(alg.String()+"/7per3s", mustLimit(t, alg, 7, 3*time.Second, 3), mixed)
		add(alg.String()+"/1000perDay", mustLimit(t, alg, 1000, 24*time.Hour, 100), mixed)
		add(alg.String()+"/fast", mustLimit(t, alg, 100_000, time.Second, 50), mixed)
	}
	for _, alg := range []bucket.Algorithm{bucket.FixedWindow, bucket.SlidingWindow} {
		add(alg.String()+"/10perMin", mustLimit(t, alg, 10, time.Minute, 10), mixed)
		add(alg.String()+"/3perSec", mustLimit(t, alg, 3, time.Second, 3), mixed)
		add(alg.String()+"/5perHour", mustLimit(t, alg, 5, time.Hour, 5), mixed)
	}
	return cases
}

// runAgainstBucket runs steps through lim with a pkg/bucket State and
// through b on key, failing on the first difference.
func runAgainstBucket(t tb, b *Backend, key string, lim bucket.Limit, steps []tstep, offset int64) {
	t.Helper()
	var s bucket.State
	for i, st := range steps {
		now := base + int64(st.at) + offset
		ref := msFloor(now) // the script sees whole milliseconds
		switch st.op {
		case opAllow:
			want := lim.AllowN(&s, ref, st.n)
			got, err := b.AllowNAt(bg, key, lim, 1, now, st.n)
			if err != nil {
				t.Fatalf("step %d: AllowN(t+%v, %d): %v", i, st.at, st.n, err)
			}
			if got != want {
				t.Fatalf("step %d: AllowN(t+%v, %d) = %+v, want %+v (pkg/bucket)", i, st.at, st.n, got, want)
			}
		case opTake:
			want := lim.TakeUpTo(&s, ref, st.n)
			got, err := b.TakeUpTo(bg, key, lim, 1, 0, now, st.n)
			if err != nil || got != want {
				t.Fatalf("step %d: TakeUpTo(t+%v, %d) = %d, %v; want %d", i, st.at, st.n, got, err, want)
			}
		case opGive:
			lim.GiveBack(&s, ref, st.n)
			if err := b.GiveBack(bg, key, lim, 1, 0, now, st.n); err != nil {
				t.Fatalf("step %d: GiveBack: %v", i, err)
			}
		case opDebit:
			lim.Debit(&s, ref, st.n)
			if err := b.Debit(bg, key, lim, 1, 0, now, st.n); err != nil {
				t.Fatalf("step %d: Debit: %v", i, err)
			}
		case opDrain:
			lim.Drain(&s, ref)
			if _, err := b.single(bg, key, lim, 1, 0, opDrain, now, 0); err != nil {
				t.Fatalf("step %d: Drain: %v", i, err)
			}
		}
	}
}

func TestRedisScriptMatchesBucket(t *testing.T) {
	srv := startRedis(t)
	backends := map[string]*Backend{"redis": newTestBackend(t, nil, srv.addr())}
	mem, err := NewInmem(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	backends["inmem"] = mem
	for bname, b := range backends {
		for _, c := range sharedTable(t) {
			t.Run(bname+"/"+c.name, func(t *testing.T) {
				runAgainstBucket(t, b, "table:"+c.name, c.lim, c.steps, 0)
			})
		}
	}
	// Instants between milliseconds: the script sees them floored, which
	// runAgainstBucket models; the results are pkg/bucket's at the floored
	// instant, so within 1 ms of its results at the exact instant.
	t.Run("redis/sub-millisecond", func(t *testing.T) {
		lim := mustLimit(t, bucket.TokenBucket, 7, 3*time.Second, 3)
		runAgainstBucket(t, backends["redis"], "table:subms", lim, sharedTable(t)[2].steps, 999_999)
	})

	// Random sequences, clock going backwards included.
	b := backends["redis"]
	seq := 0
	t.Run("redis/random", func(t *testing.T) {
		rapid.Check(t, func(rt *rapid.T) {
			alg := rapid.SampledFrom([]bucket.Algorithm{bucket.TokenBucket, bucket.GCRA, bucket.FixedWindow, bucket.SlidingWindow}).Draw(rt, "alg")
			quota := rapid.Int64Range(1, 2000).Draw(rt, "quota")
			window := rapid.SampledFrom([]time.Duration{time.Millisecond, 250 * time.Millisecond, time.Second, 7 * time.Second, time.Minute, time.Hour}).Draw(rt, "window")
			burst := quota
			if alg == bucket.TokenBucket || alg == bucket.GCRA {
				burst = rapid.Int64Range(1, 3*quota).Draw(rt, "burst")
			}
			lim := mustLimit(rt, alg, quota, window, burst)
			var steps []tstep
			at := time.Duration(0)
			for range rapid.IntRange(1, 40).Draw(rt, "len") {
				at += time.Duration(rapid.Int64Range(-2000, 5000).Draw(rt, "dt")) * time.Millisecond
				at = max(at, -time.Minute)
				o := rapid.SampledFrom([]op{opAllow, opAllow, opAllow, opTake, opGive, opDebit, opDrain}).Draw(rt, "op")
				n := rapid.Int64Range(-1, burst+1).Draw(rt, "n")
				steps = append(steps, tstep{at, o, n})
			}
			seq++
			runAgainstBucket(rt, b, fmt.Sprintf("rapid:%d", seq), lim, steps, int64(time.Hour))
		})
		t.Logf("%d random sequences, %d script calls", seq, b.Stats().Calls)
	})
}

func TestLimitParams(t *testing.T) {
	ok := []bucket.Limit{
		mustLimit(t, bucket.TokenBucket, 30, time.Minute, 10),
		mustLimit(t, bucket.GCRA, 1_000_000_000, 24*time.Hour, 1_000_000_000),
		mustLimit(t, bucket.TokenBucket, 7, 3*time.Second+1, 3), // any window for the token algorithms
		mustLimit(t, bucket.FixedWindow, 1000, 365*24*time.Hour, 1000),
		mustLimit(t, bucket.SlidingWindow, 100_000, time.Hour, 100_000),
	}
	for _, l := range ok {
		if _, err := limitParams(l); err != nil {
			t.Errorf("limitParams(%v) = %v, want nil", l, err)
		}
	}
	bad := []bucket.Limit{
		mustLimit(t, bucket.FixedWindow, 10, time.Second+time.Microsecond, 10), // not whole ms
		mustLimit(t, bucket.TokenBucket, 1<<60, time.Nanosecond*3, 1<<60),      // refill per ms too large
		mustLimit(t, bucket.SlidingWindow, 2_000_000_000, 365*24*time.Hour, 2_000_000_000),
	}
	for _, l := range bad {
		if _, err := limitParams(l); err == nil {
			t.Errorf("limitParams(%v) = nil, want ErrUnsupportedLimit", l)
		}
	}
}
