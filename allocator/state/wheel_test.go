package state

import (
	"slices"
	"testing"

	"pgregory.net/rapid"
)

// TestWheelMatchesModel drives the wheel with pushes, popDue and takeDue
// against a model (a map of unit to its entries in push order), with
// pushes made while a taken unit's entries are processed: every entry
// comes out exactly once, in push order within its unit, from the unit it
// was pushed to, earliest unit first; an entry pushed to a unit after it
// was taken comes out of a later take; the counts (n, dueCount) and
// lastUnit agree with the model throughout, and a second's row goes once
// its last entry is taken.
func TestWheelMatchesModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var w wheel
		w.init()
		model := map[int64][]uint32{}
		next := uint32(1)
		push := func(sec int64, prefix uint64) {
			h := prefix << (64 - unitBits)
			w.push(sec, h, next)
			u := unitOf(sec, h)
			model[u] = append(model[u], next)
			next++
		}
		drawPush := func(t *rapid.T, label string) {
			push(rapid.Int64Range(0, 5).Draw(t, label+"-sec"), rapid.Uint64Range(0, 1<<unitBits-1).Draw(t, label+"-prefix"))
		}
		total := func() int {
			n := 0
			for _, l := range model {
				n += len(l)
			}
			return n
		}
		check := func(sec int64) {
			if w.n != total() {
				t.Fatalf("wheel counts %d entries, model %d", w.n, total())
			}
			due := 0
			var units []int64
			for u, l := range model {
				if unitSec(u) <= sec && len(l) > 0 {
					due += len(l)
					units = append(units, u)
				}
			}
			if got := w.dueCount(sec); got != due {
				t.Fatalf("dueCount(%d) = %d, model %d", sec, got, due)
			}
			slices.Sort(units)
			if k := rapid.IntRange(1, 600).Draw(t, "lastUnit n"); true {
				want, left := int64(0), k
				for _, u := range units {
					if left -= len(model[u]); left <= 0 {
						want = u
						break
					}
				}
				if got := w.lastUnit(sec, k); got != want {
					t.Fatalf("lastUnit(%d, %d) = %d, model %d", sec, k, got, want)
				}
			}
			secs := map[int64]bool{}
			for u, l := range model {
				if len(l) > 0 {
					secs[unitSec(u)] = true
				}
			}
			if len(w.rows) != len(secs) {
				t.Fatalf("wheel keeps %d rows for %d seconds with entries", len(w.rows), len(secs))
			}
			seen := map[int64][]uint32{}
			w.each(func(u int64, l uint32) { seen[u] = append(seen[u], l) })
			for u, l := range model {
				if len(l) > 0 && !slices.Equal(seen[u], l) {
					t.Fatalf("unit %d holds %v, model %v", u, seen[u], l)
				}
			}
		}
		// takeOut checks links, taken from unit u, against the model's
		// head of u and removes them from it.
		takeOut := func(u int64, links []uint32) {
			if len(links) > len(model[u]) || !slices.Equal(model[u][:len(links)], links) {
				t.Fatalf("unit %d gave %v, model holds %v", u, links, model[u])
			}
			model[u] = model[u][len(links):]
			if len(model[u]) == 0 {
				delete(model, u)
			}
		}
		steps := rapid.IntRange(1, 60).Draw(t, "steps")
		for range steps {
			switch rapid.IntRange(0, 3).Draw(t, "op") {
			case 0, 1:
				for range rapid.IntRange(1, 300).Draw(t, "pushes") {
					drawPush(t, "push")
				}
			case 2:
				sec := rapid.Int64Range(0, 5).Draw(t, "popDue sec")
				prev := int64(-1)
				for {
					u, b, ok := w.popDue(sec, 0)
					if !ok {
						break
					}
					if u < prev {
						t.Fatalf("unit %d taken after %d", u, prev)
					}
					prev = u
					want := len(model[u])
					// Pushes while the unit is processed, some to it.
					for range rapid.IntRange(0, 3).Draw(t, "during") {
						push(unitSec(u), unitPrefix(u))
					}
					var got []uint32
					b.each(touchAhead, func(links []uint32) { got = append(got, links...) })
					if len(got) != want {
						t.Fatalf("unit %d gave %d entries, had %d when taken", u, len(got), want)
					}
					takeOut(u, got)
					w.recycle(b)
				}
				w.trimPool()
			case 3:
				sec := rapid.Int64Range(0, 5).Draw(t, "takeDue sec")
				before := map[int64]int{}
				for u, l := range model {
					if unitSec(u) <= sec {
						before[u] = len(l)
					}
				}
				w.takeDue(sec, func(u int64, links []uint32) {
					takeOut(u, links)
					before[u] -= len(links)
				})
				for u, left := range before {
					if left != 0 {
						t.Fatalf("takeDue(%d) left %d of unit %d's entries", sec, left, u)
					}
				}
			}
			check(rapid.Int64Range(0, 5).Draw(t, "check sec"))
		}
	})
}
