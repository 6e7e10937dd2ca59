package bucket

import (
	"testing"
	"time"

	"pgregory.net/rapid"
)

// Drain after any history leaves no token, is idempotent, and, with k
// tokens given back at once, never holds more at a later instant than a
// full state drained and given k back: what pkg/redislimit relies on when
// it empties a sub-key and then gives it its share.
func TestDrainNoFullerThanEmptied(t *testing.T) {
	for a := TokenBucket; a <= FixedWindow; a++ {
		t.Run(a.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				l := drawLimit(t, a)
				s, now := randomHistory(t, l)
				now += drawDt(t, l, "dt") - drawDt(t, l, "back")/2
				d := s
				l.Drain(&d, now)
				if r := l.Peek(d, now); r.Remaining > 0 {
					t.Fatalf("%v: drained at %d: %+v, want no token", l, now-base, r)
				}
				again := d
				if l.Drain(&again, now); again != d {
					t.Fatalf("%v: draining twice: %+v, once: %+v", l, again, d)
				}
				var e State
				l.Drain(&e, now)
				k := rapid.Int64Range(0, l.Burst()).Draw(t, "k")
				l.GiveBack(&d, now, k)
				l.GiveBack(&e, now, k)
				for _, dt := range []int64{0, 1, drawDt(t, l, "later"), int64(l.Window()) / 2, int64(l.Window()), 3 * int64(l.Window()) / 2, 2 * int64(l.Window())} {
					if got, want := l.Peek(d, now+dt).Remaining, l.Peek(e, now+dt).Remaining; got > want {
						t.Fatalf("%v: %v after draining and giving back %d: %d tokens, a full state drained: %d", l, time.Duration(dt), k, got, want)
					}
				}
			})
		})
	}
}
