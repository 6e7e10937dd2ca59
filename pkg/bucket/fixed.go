package bucket

import (
	"math"
	"math/bits"
)

// Exact arithmetic helpers. Nothing in this package uses floating point: token
// counts are integers, and instants that fall between nanoseconds are kept as
// rationals with the Limit's quota as denominator (see vt).

// u128 is an unsigned 128-bit integer.
type u128 struct{ hi, lo uint64 }

func mul64(a, b uint64) u128 {
	hi, lo := bits.Mul64(a, b)
	return u128{hi, lo}
}

func (x u128) add(y u128) u128 {
	lo, c := bits.Add64(x.lo, y.lo, 0)
	hi, _ := bits.Add64(x.hi, y.hi, c)
	return u128{hi, lo}
}

func (x u128) add64(y uint64) u128 { return x.add(u128{0, y}) }

// sub returns x−y; the caller guarantees x ≥ y.
func (x u128) sub(y u128) u128 {
	lo, b := bits.Sub64(x.lo, y.lo, 0)
	hi, _ := bits.Sub64(x.hi, y.hi, b)
	return u128{hi, lo}
}

func (x u128) less(y u128) bool { return x.hi < y.hi || (x.hi == y.hi && x.lo < y.lo) }

// divmod returns x/d and x%d; the caller guarantees x/d < 2⁶⁴ (x.hi < d).
func (x u128) divmod(d uint64) (q, r uint64) { return bits.Div64(x.hi, x.lo, d) }

// ceilDiv returns ⌈x/d⌉; the caller guarantees ⌈x/d⌉ < 2⁶⁴.
func (x u128) ceilDiv(d uint64) uint64 {
	q, r := x.divmod(d)
	if r != 0 {
		q++
	}
	return q
}

// sat converts to int64, saturating at MaxInt64.
func sat(u uint64) int64 {
	if u > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(u)
}

// vt is an exact instant or span: ns + frac/quota nanoseconds, with
// 0 ≤ frac < quota. One token takes window/quota ns to refill, which is
// rarely a whole number of nanoseconds; keeping the remainder exactly is what
// keeps a bucket from drifting however often it is called.
type vt struct {
	ns   int64
	frac uint64
}

// span returns the exact refill time of n tokens, n·window/quota. The caller
// guarantees 0 ≤ n ≤ 2·burst (+1), so the result fits (see NewLimit).
func (l *Limit) span(n int64) vt {
	q, r := mul64(uint64(n), uint64(l.window)).divmod(uint64(l.quota))
	return vt{int64(q), r}
}

func (l *Limit) vadd(a, b vt) vt {
	a.ns += b.ns
	a.frac += b.frac // both < quota ≤ 2⁶², no overflow
	if a.frac >= uint64(l.quota) {
		a.frac -= uint64(l.quota)
		a.ns++
	}
	return a
}

func (l *Limit) vsub(a, b vt) vt {
	a.ns -= b.ns
	if a.frac < b.frac {
		a.frac += uint64(l.quota)
		a.ns--
	}
	a.frac -= b.frac
	return a
}

// after reports a > t for a whole-nanosecond instant t.
func (a vt) after(t int64) bool { return a.ns > t || (a.ns == t && a.frac > 0) }

// less reports a < b.
func (a vt) less(b vt) bool { return a.ns < b.ns || (a.ns == b.ns && a.frac < b.frac) }

// ceilSince returns ⌈a − t⌉ in ns, saturating at MaxInt64; the caller
// guarantees a > t ≥ 0.
func (a vt) ceilSince(t int64) int64 {
	d := a.ns - t
	if a.frac > 0 && d < math.MaxInt64 {
		d++
	}
	return d
}

// units returns (a − t)·quota, the span from t to a in units of 1/quota ns,
// for a > t. a − t fits an int64 because callers only pass t ≥ 0.
func (l *Limit) units(a vt, t int64) u128 {
	return mul64(uint64(a.ns-t), uint64(l.quota)).add64(a.frac)
}

func min64(a, b int64) int64 {
	if a < b {
		return a
	}
	return b
}

func max64(a, b int64) int64 {
	if a > b {
		return a
	}
	return b
}
