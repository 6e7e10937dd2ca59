package state

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/bits"
	"slices"
)

// A leased key (a key with at least one live lease) has an entry in the
// arena, named by its slot's link. The entry holds everything the state
// keeps about the key beyond its slot: its recent grant and deny rates, its
// leases and its canonical key. For a key of ~24 bytes with one lease it is
// 54 bytes:
//
//	word   uint64  base (bits 0-41) | queued (42-49) | n (50-56) | template (57-63)
//	grant  uint32  packed rate (packRate), milli-tokens per second at base
//	deny   uint32  packed rate, milli-requests per second at base
//	[n]    uvarint when n ≥ 127 (n field = 127)
//	[tpl]  uvarint when the template id ≥ 127 (template field = 127)
//	vlen   uvarint, then the key's values (below)
//	leases n × 22 bytes, sorted by agent number
//
// base is the Unix millisecond of the key's last Acquire or Release that
// kept it leased: the rates' timestamp and the origin of the leases' times.
// queued is the low byte of the second the key's expiry wheel entry is in
// (wheel.go).
//
// The key is stored as an interned template and its values: the canonical
// key "domain:k1=v1,k2=v2" becomes the template "domain:k1=,k2=" and the
// values "v1,v2" (canonical escaping leaves no raw ',' or '=' in a value),
// so the domain and the descriptor keys, shared by every key of a rule, are
// stored once.
//
// A lease is 22 bytes:
//
//	agent  uint32  agent number
//	held   uint24  tokens held; leaseEscaped: the lease's numbers are in core.ext
//	need   uint24  tokens per refresh interval it may hold
//	win    uint24  tokens granted in the refresh window of the latest grant
//	demand 24 bits reported demand, tokens per second: the high 24 bits of
//	               its float32 (15-bit mantissa; roundDemand)
//	expiry int24   in units of core.codec.unit (1 ms by default) after the
//	               origin, rounded up (a lease never ends early)
//	grant  uint24  the latest grant, before the anchor: milliseconds below
//	               2²³, else 2²³ + seconds; noGrant: none
//
// The times are offsets not from base but from base's epoch, base rounded
// down to a multiple of 2²² ms (about 70 minutes): the expiry from the
// epoch's start (the origin, in units), the grant back from its end (the
// anchor, in ms). So an entry stored again within one epoch, which is
// almost every update, leaves the bytes of its unchanged leases as they
// are: encode copies them, or skips them where they already are, without
// decoding them; only when base enters a new epoch are they rewritten.
//
// A lease whose held, need or win do not fit in 24 bits (held: below
// leaseEscaped), whose expiry is too far after the origin or whose latest
// grant is too far before the anchor (97 days) is escaped: its exact
// numbers are in the small map core.codec.ext. An expiry more than 2²³
// units before the origin is recorded as exactly 2²³ units before it:
// such a lease is already due, and it ends at the next Expire either way.

const (
	entryFixed   = 16
	leaseBytes   = 22
	baseBits     = 42
	baseMax      = 1<<baseBits - 1 // year 2109
	fieldEsc     = 127             // the n or template field is a uvarint that follows
	leaseEscaped = 1<<24 - 1       // held: the lease's numbers are in core.ext
	expMax       = 1<<23 - 1       // expiry offsets are in [-2²³, 2²³)
	grantSecs    = 1 << 23         // grant ≥ grantSecs: seconds
	noGrant      = 1<<24 - 1       // grant: no grant yet
	epochBits    = 22              // an epoch is 2²² ms
	epochMs      = 1 << epochBits
)

// epochOf returns the start (Unix ms) of the epoch base (Unix ms, ≥ 0) is
// in: the times of an entry's leases are offsets from it.
func epochOf(base int64) int64 { return base &^ (epochMs - 1) }

// anchor returns the end of base's epoch (Unix ms): the latest grant is
// an offset back from it.
func anchor(base int64) int64 { return epochOf(base) + epochMs }

// lease is one agent's lease on a key, decoded.
type lease struct {
	agent uint32
	// enc is the offset of the lease's record in its entry's src block
	// when the lease is unchanged since it was decoded from there (0: it
	// is new or changed; a record never starts at 0). Code that changes
	// a decoded lease builds a new lease value, whose enc is 0.
	enc       uint32
	need      int64 // tokens per refresh interval the agent asked to hold (fair share input)
	held      int64 // tokens the state records the agent as holding
	win       int64 // tokens granted in the refresh window grantedAt is in (policy.go)
	grantedAt int64 // Unix ms of the latest grant; 0: none
	expiry    int64 // Unix ns
	demand    float32
	ext       bool // its numbers are in core.ext
}

// extKey names an escaped lease.
type extKey struct {
	hash  uint64
	agent uint32
}

// extLease holds an escaped lease's numbers.
type extLease struct {
	need, held, win, grantedAt, expiry int64
}

// entry is a leased key's entry, decoded.
type entry struct {
	link uint32 // its block (0: not stored yet)
	size int    // its block size (0: not stored yet)

	base        int64 // Unix ms; see above
	grant, deny int64 // rates in milli-units per second as of base
	queued      uint8
	tpl         uint32
	value       []byte // the key's values; aliases the arena: read only
	leases      []lease

	// src is the block the entry was decoded from (to the end of its
	// page; it aliases the arena: read only) and srcBase its base then: a
	// lease whose enc is set is still as encoded there, and encode copies
	// it from there (its times moved when base entered a later epoch)
	// rather than encoding it afresh.
	src     []byte
	srcBase int64
	srcN    int // the number of leases in src
}

// entrySize returns the encoded size of an entry (before alignment).
func entrySize(n int, tpl uint32, vlen int) int {
	s := entryFixed + uvarintLen(uint64(vlen)) + vlen + n*leaseBytes
	if n >= fieldEsc {
		s += uvarintLen(uint64(n))
	}
	if tpl >= fieldEsc {
		s += uvarintLen(uint64(tpl))
	}
	return s
}

func uvarintLen(x uint64) int { return (bits.Len64(x|1) + 6) / 7 }

// parseHeader decodes an entry's header from b (which may extend past the
// entry) and returns the entry's n, the offset of its leases and its
// encoded size. It reports false if b is not a well-formed entry.
func parseHeader(b []byte, e *entry) (n, leasesAt, size int, ok bool) {
	if len(b) < entryFixed {
		return 0, 0, 0, false
	}
	w := binary.LittleEndian.Uint64(b)
	e.base = int64(w & baseMax)
	e.queued = uint8(w >> baseBits)
	n = int(w >> 50 & 127)
	e.tpl = uint32(w >> 57)
	e.grant = unpackRate(binary.LittleEndian.Uint32(b[8:]))
	e.deny = unpackRate(binary.LittleEndian.Uint32(b[12:]))
	p := entryFixed
	if n == fieldEsc {
		v, k := binary.Uvarint(b[p:])
		if k <= 0 || v < fieldEsc || v > math.MaxInt32 {
			return 0, 0, 0, false
		}
		n, p = int(v), p+k
	}
	if n == 0 {
		return 0, 0, 0, false
	}
	if e.tpl == fieldEsc {
		v, k := binary.Uvarint(b[p:])
		if k <= 0 || v < fieldEsc || v > math.MaxUint32 {
			return 0, 0, 0, false
		}
		e.tpl, p = uint32(v), p+k
	}
	vlen, k := binary.Uvarint(b[p:])
	if k <= 0 || vlen > uint64(len(b)) {
		return 0, 0, 0, false
	}
	p += k
	if p+int(vlen)+n*leaseBytes > len(b) {
		return 0, 0, 0, false
	}
	e.value = b[p : p+int(vlen) : p+int(vlen)]
	p += int(vlen)
	return n, p, p + n*leaseBytes, true
}

// leaseCodec holds what encoding and decoding leases need: the expiry unit
// and the escaped leases.
type leaseCodec struct {
	unit int64 // ns per expiry unit (a multiple of 1 ms)
	ext  map[extKey]extLease
}

// expUnitFor returns the expiry unit for a configuration: 1 ms, or coarser
// so that an epoch and MaxLeaseTTL (plus slack) fit in 2²³ units: a lease
// expires at most MaxLeaseTTL after base, which is less than an epoch
// after the origin.
func expUnitFor(cfg Config) int64 {
	span := epochMs*1e6 + int64(cfg.MaxLeaseTTL) + 1e9
	u := (span + expMax - 1) / expMax
	u = (u + 999_999) / 1e6 * 1e6
	return max(u, 1e6)
}

// origin returns the start of base's epoch (base in Unix ms) in expiry
// units, rounded down: the origin of an entry's expiry offsets.
func (lc *leaseCodec) origin(base int64) int64 {
	ep := epochOf(base)
	if lc.unit == 1e6 { // the unit for leases of up to an hour: no division
		return ep
	}
	return floorDiv(ep*1e6, lc.unit)
}

// units returns ns (Unix ns) in expiry units, rounded down.
func (lc *leaseCodec) units(ns int64) int64 {
	if lc.unit == 1e6 {
		return floorDiv(ns, 1e6) // by a constant: no division instruction
	}
	return floorDiv(ns, lc.unit)
}

// u24Max is the largest count a compact lease stores (held must also
// differ from leaseEscaped).
const u24Max = 1<<24 - 1

// roundDemand returns a reported demand as a lease stores it: float32,
// truncated to its high 24 bits (a 15-bit mantissa, relative error below
// 2⁻¹⁵). Demand is validated finite and non-negative, so the sign bit is 0.
func roundDemand(d float64) float32 { return roundDemand32(float32(d)) }

func roundDemand32(d float32) float32 {
	return math.Float32frombits(math.Float32bits(d) &^ 0xff)
}

func getU24(b []byte) uint32    { return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 }
func putU24(b []byte, v uint32) { b[0], b[1], b[2] = byte(v), byte(v>>8), byte(v>>16) }

// getI24 sign-extends a 24-bit value.
func getI24(b []byte) int64 { return int64(int32(getU24(b)<<8) >> 8) }

// decodeLeases decodes the n leases of key h at offset at of the entry
// b.
func (lc *leaseCodec) decodeLeases(dst []lease, b []byte, at, n int, h uint64, base int64) []lease {
	origin, anc := lc.origin(base), anchor(base)
	dst = slices.Grow(dst[:0], n)[:n]
	b = b[:at+n*leaseBytes]
	for i := range dst {
		p := at + i*leaseBytes
		r := b[p : p+leaseBytes]
		// Three overlapping words: bytes 0-7 (agent, held, need's low
		// byte), 8-15 (need's high bytes, win, demand), 14-21 (expiry,
		// grant in bits 16-63).
		w0 := binary.LittleEndian.Uint64(r)
		w1 := binary.LittleEndian.Uint64(r[8:])
		w2 := binary.LittleEndian.Uint64(r[14:])
		l := &dst[i]
		l.enc = uint32(p)
		l.agent = uint32(w0)
		l.demand = math.Float32frombits(uint32(w1>>40) << 8)
		if held := uint32(w0>>32) & u24Max; held == leaseEscaped {
			x := lc.ext[extKey{h, l.agent}]
			l.need, l.held, l.win, l.grantedAt, l.expiry, l.ext = x.need, x.held, x.win, x.grantedAt, x.expiry, true
			continue
		}
		l.held = int64(uint32(w0>>32) & u24Max)
		l.need = int64(w0>>56 | (w1&0xffff)<<8)
		l.win = int64(w1 >> 16 & u24Max)
		l.expiry = (origin + int64(int32(uint32(w2>>16)<<8)>>8)) * lc.unit
		l.ext = false
		switch g := uint32(w2 >> 40); {
		case g == noGrant:
			l.grantedAt = 0
		case g >= grantSecs:
			l.grantedAt = (anc/1000 - int64(g-grantSecs)) * 1000
		default:
			l.grantedAt = anc - int64(g)
		}
	}
	return dst
}

// times returns how l's expiry and latest grant encode at base: the
// expiry's offset from the origin in units, rounded up (or, if long past,
// 2²³ units before the origin), the grant field and the grant time it
// decodes to; fits is false if the lease must be escaped for them.
func (lc *leaseCodec) times(l *lease, base int64) (off, g, gAt int64, fits bool) {
	origin, anc := lc.origin(base), anchor(base)
	off = lc.units(l.expiry) - origin
	if off*lc.unit+origin*lc.unit < l.expiry {
		off++
	}
	off = max(off, -(expMax + 1)) // long past: still due
	g = noGrant
	if l.grantedAt != 0 {
		switch dg, ds := anc-l.grantedAt, anc/1000-l.grantedAt/1000; {
		case dg >= 0 && dg < grantSecs:
			g, gAt = dg, l.grantedAt
		case dg >= 0 && ds < noGrant-grantSecs:
			g, gAt = grantSecs+ds, l.grantedAt/1000*1000
		default:
			g = -1
		}
	}
	return off, g, gAt, off <= expMax && g >= 0
}

// putTimes writes a lease's expiry offset and grant field (from times)
// and sets l's expiry and latest grant to what they decode to.
func (lc *leaseCodec) putTimes(b []byte, l *lease, base, off, g, gAt int64) {
	l.expiry, l.grantedAt = (lc.origin(base)+off)*lc.unit, gAt
	putU24(b[16:], uint32(off)&(1<<24-1))
	putU24(b[19:], uint32(g))
}

// encodeLease writes l (of key h) at b, escaping it if needed, and sets
// l's demand, expiry and latest grant to what they decode to: the demand
// truncated by roundDemand, the expiry rounded up to a multiple of the
// unit (or, if long past, moved to 2²³ units before the origin), a grant
// older than 2²³ ms before the anchor rounded down to the second. Both
// are rounded in absolute time, so re-encoding at a later base changes
// nothing.
func (lc *leaseCodec) encodeLease(b []byte, l *lease, h uint64, base int64) {
	binary.LittleEndian.PutUint32(b, l.agent)
	l.demand = roundDemand32(l.demand)
	putU24(b[13:], math.Float32bits(l.demand)>>8)
	off, g, gAt, fits := lc.times(l, base)
	fits = fits && l.held < leaseEscaped && l.need <= u24Max && l.win <= u24Max
	k := extKey{h, l.agent}
	if !fits {
		if lc.ext == nil {
			lc.ext = make(map[extKey]extLease)
		}
		lc.ext[k] = extLease{need: l.need, held: l.held, win: l.win, grantedAt: l.grantedAt, expiry: l.expiry}
		l.ext = true
		putU24(b[4:], leaseEscaped)
		clear(b[7:13])
		clear(b[16:22])
		return
	}
	if l.ext {
		delete(lc.ext, k)
		l.ext = false
	}
	putU24(b[4:], uint32(l.held))
	putU24(b[7:], uint32(l.need))
	putU24(b[10:], uint32(l.win))
	lc.putTimes(b, l, base, off, g, gAt)
}

// putHeader writes e's header word and rates at b.
func putHeader(b []byte, e *entry) {
	nf, tf := uint64(min(len(e.leases), fieldEsc)), uint64(min(e.tpl, fieldEsc))
	w := uint64(e.base) | uint64(e.queued)<<baseBits | nf<<50 | tf<<57
	binary.LittleEndian.PutUint64(b, w)
	binary.LittleEndian.PutUint32(b[8:], packRate(e.grant))
	binary.LittleEndian.PutUint32(b[12:], packRate(e.deny))
}

// encode writes e (of key h) into b (entrySize bytes), updating e.leases'
// expiries and escape flags to what they decode to, and makes b e's src.
// It returns the earliest lease expiry (math.MaxInt64 with no lease).
//
// A lease unchanged since it was decoded from e.src is not encoded
// afresh. If base is in e.src's epoch, its bytes are what encodeLease
// would write: each run of such leases consecutive in e.src is copied
// from there as it is (one copy per run), or left alone where b holds
// it already. If base entered a later epoch, each one is copied with its
// expiry and grant fields moved to the new origin and anchor
// (copyLease), which writes what encodeLease would. b may be e.src's own
// block when the entry kept its block or shrank in it: no lease then
// moves to a later offset, so copying the leases in order reads each one
// before it is overwritten.
//
// kept says that b holds the bytes of e.src's block (it is that block,
// or a copy of its page made before any write): then the key's values
// are not written again when the number of leases is unchanged, and an
// unchanged lease still at its offset is left as it is, or has only its
// time fields patched (patchLease) in a later epoch.
func (lc *leaseCodec) encode(b []byte, e *entry, h uint64, kept bool) int64 {
	n := len(e.leases)
	putHeader(b, e)
	p := entryFixed
	if kept && n == e.srcN {
		p = entrySize(n, e.tpl, len(e.value)) - n*leaseBytes
	} else {
		if n >= fieldEsc {
			p += binary.PutUvarint(b[p:], uint64(n))
		}
		if e.tpl >= fieldEsc {
			p += binary.PutUvarint(b[p:], uint64(e.tpl))
		}
		p += binary.PutUvarint(b[p:], uint64(len(e.value)))
		p += copy(b[p:], e.value)
	}
	dOrig := lc.origin(e.base) - lc.origin(e.srcBase)
	dAnc := anchor(e.base) - anchor(e.srcBase)
	same := dOrig == 0 && dAnc == 0
	m := int64(math.MaxInt64)
	for i := 0; i < n; {
		l := &e.leases[i]
		at := p + i*leaseBytes
		if same && l.enc != 0 && !l.ext {
			// A run of unchanged leases, consecutive in src.
			j, from := i+1, int(l.enc)
			for j < n && e.leases[j].enc == l.enc+uint32((j-i)*leaseBytes) && !e.leases[j].ext {
				j++
			}
			if end := at + (j-i)*leaseBytes; !kept || from != at {
				copy(b[at:end], e.src[from:from+(j-i)*leaseBytes])
			}
			for k := i; k < j; k++ {
				e.leases[k].enc = uint32(at + (k-i)*leaseBytes)
				m = min(m, e.leases[k].expiry)
			}
			i = j
			continue
		}
		r := b[at : at+leaseBytes : at+leaseBytes]
		switch {
		case l.enc == 0 || l.ext || dOrig < 0 || dAnc < 0:
			lc.encodeLease(r, l, h, e.base)
		case kept && int(l.enc) == at:
			if !lc.patchLease(r, l, e.base, dOrig, dAnc) {
				lc.encodeLease(r, l, h, e.base)
			}
		case !lc.copyLease(r, l, e.src, e.base, dOrig, dAnc):
			lc.encodeLease(r, l, h, e.base)
		}
		l.enc = uint32(at)
		m = min(m, l.expiry)
		i++
	}
	clear(b[p+n*leaseBytes:])
	e.src, e.srcBase, e.srcN = b, e.base, n
	return m
}

// copyLease writes at r the lease l, unchanged and not escaped since it
// was encoded in src in an epoch dOrig units and dAnc ms before base's,
// as encodeLease would write it at base: its time fields moved
// (movedTimes). It reports false, and writes nothing, when movedTimes
// does.
func (lc *leaseCodec) copyLease(r []byte, l *lease, src []byte, base, dOrig, dAnc int64) bool {
	s := src[l.enc : l.enc+leaseBytes : l.enc+leaseBytes]
	w2, ok := lc.movedTimes(binary.LittleEndian.Uint64(s[14:]), l, base, dOrig, dAnc)
	if !ok {
		return false
	}
	// Every load before any store: r may overlap s (encode).
	w0, w1 := binary.LittleEndian.Uint64(s), binary.LittleEndian.Uint64(s[8:])
	binary.LittleEndian.PutUint64(r, w0)
	binary.LittleEndian.PutUint64(r[8:], w1)
	binary.LittleEndian.PutUint64(r[14:], w2)
	return true
}

// patchLease is copyLease for a lease whose record r is where it was
// encoded: it writes only the time fields, and nothing when they do not
// change.
func (lc *leaseCodec) patchLease(r []byte, l *lease, base, dOrig, dAnc int64) bool {
	w2 := binary.LittleEndian.Uint64(r[14:])
	moved, ok := lc.movedTimes(w2, l, base, dOrig, dAnc)
	if ok && moved != w2 {
		binary.LittleEndian.PutUint64(r[14:], moved)
	}
	return ok
}

// movedTimes returns w2, a lease record's last word as encoded in an
// epoch dOrig units (its origin) and dAnc ms (its anchor) before base's,
// with its time fields as encodeLease would write them at base: the
// expiry offset less dOrig units (clamped 2²³ units before the origin
// when long past, l.expiry with it), the grant offset plus dAnc ms. It
// reports false when the grant is in seconds or reaches 2²³ ms (then
// encodeLease rounds it).
func (lc *leaseCodec) movedTimes(w2 uint64, l *lease, base, dOrig, dAnc int64) (uint64, bool) {
	g := uint32(w2 >> 40)
	if g != noGrant {
		if g >= grantSecs || int64(g)+dAnc >= grantSecs {
			return 0, false
		}
		g += uint32(dAnc)
	}
	if dOrig == 0 && dAnc == 0 {
		return w2, true
	}
	off := int64(int32(uint32(w2>>16)<<8)>>8) - dOrig
	if off < -(expMax + 1) { // long past: still due, kept 2²³ units back
		off = -(expMax + 1)
		l.expiry = (lc.origin(base) + off) * lc.unit
	}
	return w2&0xffff | uint64(uint32(off)&u24Max)<<16 | uint64(g)<<40, true
}

// clampBase returns the base (Unix ms) for a command at now (Unix ns ≥ 0).
func clampBase(now int64) int64 { return min(max(now/1e6, 0), baseMax) }

// minSec returns the second of the earliest lease expiry (math.MaxInt64
// with no lease).
func (e *entry) minSec() int64 {
	m := int64(math.MaxInt64)
	for i := range e.leases {
		m = min(m, e.leases[i].expiry)
	}
	if m == math.MaxInt64 {
		return m
	}
	return floorDiv(m, 1e9)
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// find returns the position of agent's lease (leases are sorted by agent
// number) and whether it exists.
func (e *entry) find(agent uint32) (int, bool) {
	lo, hi := 0, len(e.leases)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if e.leases[m].agent < agent {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < len(e.leases) && e.leases[lo].agent == agent
}

// rates at now, decayed from base.
func (e *entry) ratesAt(now int64) (grant, deny int64) {
	at := e.base * 1e6
	return decayRate(e.grant, at, now), decayRate(e.deny, at, now)
}

// addRates records granted tokens and denied requests at now (the caller
// then moves base to now).
func (e *entry) addRates(now, granted, denied int64) {
	if granted <= 0 && denied <= 0 && e.grant == 0 && e.deny == 0 {
		return
	}
	e.grant, e.deny = e.ratesAt(now)
	e.grant = bump(e.grant, granted)
	e.deny = bump(e.deny, denied)
}

// Packed rates: a uint32 with a 5-bit exponent and a 27-bit mantissa, so
// v = m for m < 2²⁷ and v = m·2^e otherwise (m in [2²⁶, 2²⁷)), truncated;
// relative precision 2⁻²⁶, saturating near 2⁵⁸ milli-units per second.
const (
	rateMantBits = 27
	rateMax      = (1<<rateMantBits - 1) << 31
)

func packRate(v int64) uint32 {
	if v <= 0 {
		return 0
	}
	if v < 1<<rateMantBits {
		return uint32(v)
	}
	if v >= rateMax {
		return math.MaxUint32
	}
	e := bits.Len64(uint64(v)) - rateMantBits // 1..31
	m := uint64(v) >> e                       // in [2²⁶, 2²⁷)
	return uint32(e)<<rateMantBits | uint32(m-1<<(rateMantBits-1))
}

func unpackRate(u uint32) int64 {
	e := u >> rateMantBits
	m := int64(u & (1<<rateMantBits - 1))
	if e == 0 {
		return m
	}
	return (m + 1<<(rateMantBits-1)) << e
}

// Templates: the interned key templates (see above), reference counted by
// entries. Ids are internal (the snapshot stores whole keys).
type templates struct {
	strs  []string
	refs  []uint32
	idx   map[string]uint32
	freed []uint32 // free ids, reused first
}

func (ts *templates) init() { *ts = templates{idx: make(map[string]uint32)} }

// peek returns the id ref(tpl) would return.
func (ts *templates) peek(tpl []byte) uint32 {
	if id, ok := ts.idx[string(tpl)]; ok {
		return id
	}
	if k := len(ts.freed); k > 0 {
		return ts.freed[k-1]
	}
	return uint32(len(ts.strs))
}

// ref interns tpl and takes a reference.
func (ts *templates) ref(tpl []byte) uint32 {
	if id, ok := ts.idx[string(tpl)]; ok {
		ts.refs[id]++
		return id
	}
	s := string(tpl)
	var id uint32
	if k := len(ts.freed); k > 0 {
		id = ts.freed[k-1]
		ts.freed = ts.freed[:k-1]
		ts.strs[id], ts.refs[id] = s, 1
	} else {
		id = uint32(len(ts.strs))
		ts.strs = append(ts.strs, s)
		ts.refs = append(ts.refs, 1)
	}
	ts.idx[s] = id
	return id
}

func (ts *templates) unref(id uint32) {
	ts.refs[id]--
	if ts.refs[id] == 0 {
		delete(ts.idx, ts.strs[id])
		ts.strs[id] = ""
		ts.freed = append(ts.freed, id)
	}
}

// splitKey splits a canonical key into its template and values (appended
// to tpl and val). It reports false for a key that is not canonical in
// form.
func splitKey(key, tpl, val []byte) ([]byte, []byte, bool) {
	colon := bytes.IndexByte(key, ':')
	if colon < 0 {
		return tpl, val, false
	}
	tpl = append(tpl, key[:colon+1]...)
	rest := key[colon+1:]
	for i := 0; len(rest) > 0; i++ {
		ent := rest
		if j := bytes.IndexByte(rest, ','); j >= 0 {
			ent, rest = rest[:j], rest[j+1:]
			if len(rest) == 0 {
				return tpl, val, false // a trailing ','
			}
		} else {
			rest = nil
		}
		eq := bytes.IndexByte(ent, '=')
		if eq < 0 {
			return tpl, val, false
		}
		if i > 0 {
			tpl = append(tpl, ',')
			val = append(val, ',')
		}
		tpl = append(tpl, ent[:eq+1]...)
		val = append(val, ent[eq+1:]...)
	}
	return tpl, val, true
}

// joinKey appends the key of template tpl and values val to dst.
func joinKey(dst []byte, tpl string, val []byte) []byte {
	for i := 0; i < len(tpl); i++ {
		dst = append(dst, tpl[i])
		if tpl[i] == '=' {
			j := bytes.IndexByte(val, ',')
			if j < 0 {
				j = len(val)
			}
			dst = append(dst, val[:j]...)
			val = val[min(j+1, len(val)):]
		}
	}
	return dst
}
