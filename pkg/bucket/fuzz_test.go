package bucket

import (
	"encoding/binary"
	"math"
	"strings"
	"testing"
	"time"
)

// FuzzLimit drives every operation with arbitrary parameters, an arbitrary
// (possibly corrupt) starting State and arbitrary instants and counts: huge
// rates, huge n, times far in the future or past, negative times. Nothing may
// panic, and every Result must stay in range: Remaining ∈ [−burst, burst],
// durations ≥ 0, RetryAfter > 0 exactly when denied.
//
// ops is a sequence of 17-byte records: an operation byte, then the instant
// and n as little-endian int64s.
func FuzzLimit(f *testing.F) {
	op := func(kind byte, now, n int64) []byte {
		b := []byte{kind}
		b = binary.LittleEndian.AppendUint64(b, uint64(now))
		return binary.LittleEndian.AppendUint64(b, uint64(n))
	}
	cat := func(bs ...[]byte) []byte {
		var out []byte
		for _, b := range bs {
			out = append(out, b...)
		}
		return out
	}
	day := int64(24 * time.Hour)
	for alg := range uint8(4) {
		f.Add(alg, int64(30), int64(time.Minute), int64(30), int64(0), int64(0),
			cat(op(0, base, 10), op(0, base, 30), op(3, base+1, 1<<62), op(4, base, 0), op(2, base-day, 5), op(1, base+day, 100)))
		f.Add(alg, int64(MaxTokens), int64(1), int64(MaxTokens), int64(0), int64(0),
			cat(op(0, math.MaxInt64, math.MaxInt64), op(3, math.MinInt64, math.MaxInt64), op(1, 0, math.MaxInt64), op(2, -1, math.MaxInt64)))
		f.Add(alg, int64(1), int64(MaxWindow), int64(1), int64(math.MaxInt64), int64(math.MaxInt64),
			cat(op(0, MaxTime, 1), op(4, MaxTime+1, 0), op(3, 1, 1), op(0, 0, 0)))
		f.Add(alg, int64(7), int64(3), int64(7), int64(math.MinInt64), int64(-1),
			cat(op(3, 5, 14), op(0, 4, 1), op(2, 3, 100), op(1, 2, 3), op(0, 1, -5)))
	}
	f.Fuzz(func(t *testing.T, alg uint8, quota, window, burst, a, b int64, ops []byte) {
		l, err := NewLimit(Algorithm(alg), quota, time.Duration(window), burst)
		if err != nil {
			if !strings.HasPrefix(err.Error(), "bucket: ") {
				t.Fatalf("error %q does not start with the package name", err)
			}
			return
		}
		st := State{a, b}
		for i := 0; len(ops) >= 17; i, ops = i+1, ops[17:] {
			now := int64(binary.LittleEndian.Uint64(ops[1:]))
			n := int64(binary.LittleEndian.Uint64(ops[9:]))
			switch ops[0] % 5 {
			case 0:
				checkResult(t, l, l.AllowN(&st, now, n), n, i)
			case 1:
				if g := l.TakeUpTo(&st, now, n); g < 0 || g > max64(n, 0) || g > l.Burst() {
					t.Fatalf("step %d: %v: TakeUpTo(%d, %d) = %d", i, l, now, n, g)
				}
			case 2:
				l.GiveBack(&st, now, n)
			case 3:
				l.Debit(&st, now, n)
			case 4:
				checkResult(t, l, l.Peek(st, now), 1, i)
			}
			checkResult(t, l, l.Peek(st, now), 1, i)
		}
	})
}
