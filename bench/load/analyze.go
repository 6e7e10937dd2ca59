package main

import (
	"cmp"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/bucket"
)

// accuracy is what the admission record says about the limit, over all
// keys. docs/performance.md#how-to-reproduce defines each figure.
type accuracy struct {
	WindowSeconds float64 `json:"window_seconds"`
	Keys          int     `json:"keys_requested"`     // keys with at least one check
	KeysAtLimit   int     `json:"keys_at_limit"`      // keys the ideal limiter denied at least once
	Offered       int64   `json:"checks"`             // checks recorded
	Admitted      int64   `json:"admitted"`           // allowed by the system under test
	Rejected      int64   `json:"rejected"`           // denied by the system under test
	IdealAdmitted int64   `json:"ideal_admitted"`     // allowed by the ideal central limiter (in-quota requests)
	ColdShare     float64 `json:"cold_request_share"` // share of checks to keys under 1 req/s over the run

	// Over-admission: per key, the most checks admitted in any window of
	// WindowSeconds (sliding) beyond burst + R·window, as % of R·window.
	WorstOverPct       float64 `json:"worst_over_admission_pct"`
	WorstKey           string  `json:"worst_key,omitempty"`
	WorstWindowCount   int64   `json:"worst_window_admitted"`
	WorstWindowBound   float64 `json:"worst_window_bound"`
	KeysOver1Pct       int     `json:"keys_over_1pct"`
	OverAdmittedTokens float64 `json:"over_admitted_tokens"`    // Σ over keys of the excess in the key's worst window
	OverAdmittedPct    float64 `json:"over_admitted_pct"`       // OverAdmittedTokens as % of Admitted
	OverAdmittedPctIn  float64 `json:"over_admitted_pct_of_rw"` // Σ excess / Σ R·window over keys at the limit

	// False rejects: per key and tumbling window, the shortfall of admitted
	// checks against what the ideal limiter admitted from the same checks,
	// as % of IdealAdmitted.
	FalseRejects   int64   `json:"false_rejects"`
	FalseRejectPct float64 `json:"false_reject_pct"`
	// The same shortfall for a static R/N split: each agent limiting each
	// key alone at R/N with burst ⌈burst/N⌉ (replayed, not run).
	StaticFalseRejectPct float64 `json:"static_split_false_reject_pct"`
	// FalseRejectsBy splits FalseRejects by the source that decided: a
	// key's shortfall in a window is shared among the sources of that
	// key's denials in the window, in proportion (rounded).
	FalseRejectsBy map[string]int64 `json:"false_rejects_by_source,omitempty"`
	// The same shortfall past the first window, as % of what the ideal
	// limiter admitted there: the run without its start, when every key
	// is first seen (0 when the run has one window).
	LaterFalseRejects   int64   `json:"later_false_rejects"`
	LaterIdealAdmitted  int64   `json:"later_ideal_admitted"`
	LaterFalseRejectPct float64 `json:"later_false_reject_pct"`
}

// analyze computes the accuracy of one run from its events (which it
// sorts). limit and burst are the per-key rule; agents is N.
func analyze(events []event, limit, burst int64, agents int, window, run time.Duration) (accuracy, error) {
	acc := accuracy{WindowSeconds: window.Seconds(), Offered: int64(len(events))}
	ideal, err := bucket.NewLimit(bucket.TokenBucket, limit, time.Second, burst)
	if err != nil {
		return acc, fmt.Errorf("ideal limit: %w", err)
	}
	split, err := bucket.NewLimit(bucket.TokenBucket, limit, time.Duration(agents)*time.Second, (burst+int64(agents)-1)/int64(agents))
	if err != nil {
		return acc, fmt.Errorf("static split limit: %w", err)
	}
	slices.SortFunc(events, func(a, b event) int {
		if c := cmp.Compare(a.key, b.key); c != 0 {
			return c
		}
		return cmp.Compare(a.us, b.us)
	})
	wus := uint32(window / time.Microsecond)
	nWin := int(run/window) + 2
	rw := float64(limit) * window.Seconds()
	bound := float64(burst) + rw
	var (
		admittedTS []uint32
		inA, inI   = make([]int64, nWin), make([]int64, nWin)
		inS        = make([]int64, nWin)
		denied     = make([][8]int64, nWin) // by agent.Source
		bySource   [8]float64
		agentState = make([]bucket.State, agents)
		coldChecks int64
		staticMiss int64
		sumRWAt    float64
	)
	for lo := 0; lo < len(events); {
		hi := lo
		for hi < len(events) && events[hi].key == events[lo].key {
			hi++
		}
		ks := events[lo:hi]
		lo = hi
		acc.Keys++
		if float64(len(ks)) < run.Seconds() {
			coldChecks += int64(len(ks))
		}
		clear(inA)
		clear(inI)
		clear(inS)
		clear(denied)
		clear(agentState)
		var st bucket.State
		atLimit := false
		admittedTS = admittedTS[:0]
		for _, e := range ks {
			now := replayBase + int64(e.us)*int64(time.Microsecond)
			w := min(int(e.us/wus), nWin-1)
			if e.allowed {
				acc.Admitted++
				inA[w]++
				admittedTS = append(admittedTS, e.us)
			} else {
				acc.Rejected++
				denied[w][min(int(e.source), len(denied[w])-1)]++
			}
			if ideal.AllowN(&st, now, 1).Allowed {
				acc.IdealAdmitted++
				inI[w]++
			} else {
				atLimit = true
			}
			if int(e.agent) < agents && split.AllowN(&agentState[e.agent], now, 1).Allowed {
				inS[w]++
			}
		}
		for w := range nWin {
			short := max(inI[w]-inA[w], 0)
			acc.FalseRejects += short
			if w > 0 {
				acc.LaterFalseRejects += short
				acc.LaterIdealAdmitted += inI[w]
			}
			if n := sum(denied[w][:]); short > 0 && n > 0 {
				for src, d := range denied[w] {
					bySource[src] += float64(short) * float64(d) / float64(n)
				}
			}
			staticMiss += max(inI[w]-inS[w], 0)
		}
		if atLimit {
			acc.KeysAtLimit++
			sumRWAt += rw
		}
		peak := slidingMax(admittedTS, wus)
		if over := float64(peak) - bound; over > 0 {
			acc.OverAdmittedTokens += over
			pct := 100 * over / rw
			if pct > 1 {
				acc.KeysOver1Pct++
			}
			if pct > acc.WorstOverPct {
				acc.WorstOverPct = pct
				acc.WorstKey = "u" + strconv.FormatUint(uint64(ks[0].key), 10)
				acc.WorstWindowCount = int64(peak)
				acc.WorstWindowBound = bound
			}
		}
	}
	for src, f := range bySource {
		if n := int64(math.Round(f)); n > 0 {
			if acc.FalseRejectsBy == nil {
				acc.FalseRejectsBy = map[string]int64{}
			}
			acc.FalseRejectsBy[agent.Source(src).String()] = n
		}
	}
	if acc.WorstKey == "" {
		acc.WorstWindowBound = bound
	}
	if acc.Offered > 0 {
		acc.ColdShare = float64(coldChecks) / float64(acc.Offered)
	}
	if acc.Admitted > 0 {
		acc.OverAdmittedPct = 100 * acc.OverAdmittedTokens / float64(acc.Admitted)
	}
	if sumRWAt > 0 {
		acc.OverAdmittedPctIn = 100 * acc.OverAdmittedTokens / sumRWAt
	}
	if acc.IdealAdmitted > 0 {
		acc.FalseRejectPct = 100 * float64(acc.FalseRejects) / float64(acc.IdealAdmitted)
		acc.StaticFalseRejectPct = 100 * float64(staticMiss) / float64(acc.IdealAdmitted)
	}
	if acc.LaterIdealAdmitted > 0 {
		acc.LaterFalseRejectPct = 100 * float64(acc.LaterFalseRejects) / float64(acc.LaterIdealAdmitted)
	}
	return acc, nil
}

// traceKey prints, for the key named name (u<index>), the checks per step
// since the run started: admitted from the lease, admitted by the fallback
// bucket, denied, and the running admitted total (events must be sorted by
// key and time, as analyze leaves them), and which agents denied (agent:count)
// when any did.
func traceKey(w io.Writer, events []event, name string, step time.Duration) {
	idx, err := strconv.ParseUint(strings.TrimPrefix(name, "u"), 10, 32)
	if err != nil {
		fmt.Fprintf(w, "trace: bad key %q (want u<index>)\n", name)
		return
	}
	lo, _ := slices.BinarySearchFunc(events, uint32(idx), func(e event, k uint32) int { return cmp.Compare(e.key, k) })
	fmt.Fprintf(w, "trace %s: t(s)  lease  fallback  denied  admitted_total  denied_by\n", name)
	sus := uint32(max(step/time.Microsecond, 1))
	var lease, fb, denied, total int64
	by := map[uint16]int64{}
	cur := uint32(0)
	flush := func() {
		var who strings.Builder
		for _, a := range slices.Sorted(maps.Keys(by)) {
			fmt.Fprintf(&who, " a%d:%d", a, by[a])
		}
		fmt.Fprintf(w, "trace %s: %6.2f %6d %9d %7d %15d %s\n", name, (time.Duration(cur) * step).Seconds(), lease, fb, denied, total, who.String())
		lease, fb, denied = 0, 0, 0
		clear(by)
	}
	for _, e := range events[lo:] {
		if e.key != uint32(idx) {
			break
		}
		for e.us/sus > cur {
			flush()
			cur++
		}
		switch {
		case !e.allowed:
			denied++
			by[e.agent]++
		case e.source == agent.SourceLease:
			lease++
			total++
		default:
			fb++
			total++
		}
	}
	flush()
}

// replayBase is the Unix time (ns) the replayed limiters take as the run's
// start; any fixed instant works (the zero State is a full bucket).
var replayBase = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()

// slidingMax returns the largest number of timestamps (sorted, µs) in any
// half-open window (t−w, t] of length w µs.
func slidingMax(ts []uint32, w uint32) int {
	best, j := 0, 0
	for i, t := range ts {
		for t-ts[j] >= w {
			j++
		}
		best = max(best, i-j+1)
	}
	return best
}

// round returns v rounded to d decimals, for readable JSON.
func round(v float64, d int) float64 {
	p := math.Pow(10, float64(d))
	return math.Round(v*p) / p
}

func sum(xs []int64) (n int64) {
	for _, x := range xs {
		n += x
	}
	return n
}
