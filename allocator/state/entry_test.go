package state

import (
	"bytes"
	"maps"
	"math"
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/rules"
)

// genEntry draws an entry with leases whose numbers span the compact and
// the escaped forms: huge holdings, expiries long past or far ahead,
// grants older than the millisecond and second ranges, n and template ids
// past their one-byte fields.
func genEntry(t *rapid.T) entry {
	base := rapid.OneOf(rapid.Int64Range(0, 1<<20), rapid.Int64Range(1_700_000_000_000, 1_900_000_000_000),
		rapid.Int64Range(baseMax-1<<20, baseMax)).Draw(t, "base")
	e := entry{
		base:  base,
		grant: rapid.OneOf(rapid.Int64Range(0, 1<<27), rapid.Int64Range(0, 1<<62)).Draw(t, "grant"),
		deny:  rapid.OneOf(rapid.Just(int64(0)), rapid.Int64Range(0, 1<<62)).Draw(t, "deny"),
		tpl:   rapid.OneOf(rapid.Uint32Range(0, 200), rapid.Uint32()).Draw(t, "tpl"),
		value: rapid.SliceOfN(rapid.Byte(), 0, 200).Draw(t, "value"),
	}
	e.grant, e.deny = unpackRate(packRate(e.grant)), unpackRate(packRate(e.deny))
	n := rapid.OneOf(rapid.IntRange(1, 3), rapid.IntRange(126, 129)).Draw(t, "n")
	agents := rapid.SliceOfNDistinct(rapid.Uint32Range(1, math.MaxUint32), n, n, rapid.ID[uint32]).Draw(t, "agents")
	slices.Sort(agents)
	for _, a := range agents {
		amount := rapid.OneOf(rapid.Int64Range(0, 1000), rapid.Int64Range(0, 1e12))
		l := lease{agent: a, need: amount.Draw(t, "need"), held: amount.Draw(t, "held"), win: amount.Draw(t, "win"),
			demand: rapid.Float32Range(0, 1e12).Draw(t, "demand")}
		ms := int64(rapid.OneOf(rapid.Int64Range(-100_000, 100_000), rapid.Int64Range(-1e10, 1e10)).Draw(t, "expiryMs"))
		l.expiry = base*1e6 + ms*1e6 + rapid.Int64Range(-999_999, 999_999).Draw(t, "expiryNs")
		if rapid.Bool().Draw(t, "granted") {
			l.grantedAt = max(1, base-rapid.OneOf(rapid.Int64Range(-1000, 1<<23), rapid.Int64Range(0, 1e11)).Draw(t, "grantAgoMs"))
		}
		e.leases = append(e.leases, l)
	}
	return e
}

// encodeAt encodes e for key h with lc into a fresh block.
func encodeAt(lc *leaseCodec, e *entry, h uint64) []byte {
	b := make([]byte, blockSize(entrySize(len(e.leases), e.tpl, len(e.value))))
	lc.encode(b, e, h, false)
	return b
}

func decodeAt(t *rapid.T, lc *leaseCodec, b []byte, h uint64) entry {
	var d entry
	n, at, size, ok := parseHeader(b, &d)
	if !ok || blockSize(size) != len(b) {
		t.Fatalf("parseHeader: ok %v, size %d of a %d-byte block", ok, size, len(b))
	}
	d.leases = lc.decodeLeases(nil, b, at, n, h, d.base)
	d.src, d.srcBase, d.srcN = b, d.base, n
	d.value = slices.Clone(d.value)
	return d
}

// The lease codec: an encoded entry decodes to what encode reported
// (exactly the input, except expiries rounded up by less than a unit or
// moved later when long past, grants older than 2²³ ms before the anchor rounded down to the
// second, and demands truncated to 24 bits); decoding and re-encoding changes no byte; re-encoding at
// a later base changes no time (no drift).
func TestEntryCodec(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		unit := rapid.SampledFrom([]int64{1e6, 2e6, 7e6}).Draw(t, "unit")
		lc := &leaseCodec{unit: unit}
		h := rapid.Uint64().Draw(t, "hash")
		in := genEntry(t)
		want := in
		want.leases = slices.Clone(in.leases)
		b := encodeAt(lc, &want, h)
		got := decodeAt(t, lc, b, h)
		if got.base != in.base || got.grant != in.grant || got.deny != in.deny || got.tpl != in.tpl || !bytes.Equal(got.value, in.value) {
			t.Fatalf("header: got %+v, want %+v", got, in)
		}
		if !slices.Equal(got.leases, want.leases) {
			t.Fatalf("leases decode to %+v, encode reported %+v", got.leases, want.leases)
		}
		origin := floorDiv(epochOf(in.base)*1e6, unit)
		for i, l := range in.leases {
			g := got.leases[i]
			if g.agent != l.agent || g.need != l.need || g.held != l.held || g.win != l.win || g.demand != roundDemand32(l.demand) {
				t.Fatalf("lease %d: %+v, want %+v", i, g, l)
			}
			switch {
			case g.ext:
				if g.expiry != l.expiry || g.grantedAt != l.grantedAt {
					t.Fatalf("escaped lease %d: %+v, want %+v", i, g, l)
				}
			case g.expiry == (origin-expMax-1)*unit:
				if l.expiry > g.expiry {
					t.Fatalf("lease %d: expiry %d moved to %d, earlier", i, l.expiry, g.expiry)
				}
			default:
				if g.expiry < l.expiry || g.expiry-l.expiry >= unit {
					t.Fatalf("lease %d: expiry %d stored as %d (unit %d)", i, l.expiry, g.expiry, unit)
				}
			}
			if !g.ext && g.grantedAt != l.grantedAt &&
				(anchor(in.base)-l.grantedAt < 1<<23 || g.grantedAt != l.grantedAt/1000*1000) {
				t.Fatalf("lease %d: grant %d stored as %d (base %d)", i, l.grantedAt, g.grantedAt, in.base)
			}
		}
		if b2 := encodeAt(lc, &got, h); !bytes.Equal(b2, b) {
			t.Fatalf("re-encoding the decoded entry changed bytes")
		}
		// Later bases move no time, except that a grant reaching 2²³ ms
		// before the anchor is rounded down to its second, once.
		moved := got
		for range 2 {
			later := moved
			later.leases = slices.Clone(moved.leases)
			later.base = min(baseMax, moved.base+rapid.Int64Range(0, 1e9).Draw(t, "dt"))
			again := decodeAt(t, lc, encodeAt(lc, &later, h), h)
			for i, l := range moved.leases {
				g := again.leases[i]
				if l.ext || g.ext {
					continue // exact, or rounded once when it becomes compact
				}
				if g.grantedAt != l.grantedAt && (anchor(later.base)-l.grantedAt < 1<<23 || g.grantedAt != l.grantedAt/1000*1000) {
					t.Fatalf("lease %d: grant drifted %d → %d at base %d → %d", i, l.grantedAt, g.grantedAt, moved.base, later.base)
				}
				if g.expiry != l.expiry && l.expiry > (floorDiv(epochOf(later.base)*1e6, unit)-expMax-1)*unit {
					t.Fatalf("lease %d: expiry drifted %d → %d", i, l.expiry, g.expiry)
				}
			}
			moved = again
		}
	})
}

// Encoding a decoded entry that copies its unchanged leases from the
// block it was decoded from (their times moved to the new base) writes
// the bytes, reports the leases and leaves the escaped leases that
// encoding every lease afresh does: for any later base (grants crossing
// into seconds or escaping, expiries falling long past), with a lease
// changed, dropped or added, into a new block or over the entry's own
// block when it kept or shrank in it.
func TestEntryCopiedLeases(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lc := &leaseCodec{unit: rapid.SampledFrom([]int64{1e6, 2e6, 7e6}).Draw(t, "unit")}
		h := rapid.Uint64().Draw(t, "hash")
		in := genEntry(t)
		b := encodeAt(lc, &in, h)
		e := decodeAt(t, lc, b, h)
		// Base moves a little (within its epoch, as a rule: the leases are
		// copied as they are), a lot, to either side of the next epoch's
		// start, or about to where a grant made at the entry's base
		// reaches 2²³ ms.
		toNext := epochOf(e.base) + epochMs - e.base
		e.base = min(baseMax, e.base+rapid.OneOf(rapid.Int64Range(0, 10), rapid.Int64Range(-10, 1e11),
			rapid.Int64Range(toNext-2, toNext+2), rapid.Int64Range(grantSecs-2, grantSecs+2)).Draw(t, "dt"))
		e.base = max(e.base, 0)
		e.grant = unpackRate(packRate(rapid.Int64Range(0, 1<<40).Draw(t, "grant")))
		e.queued = rapid.Uint8().Draw(t, "queued")
		amount := rapid.OneOf(rapid.Int64Range(0, 1000), rapid.Int64Range(0, 1e12))
		newLease := func(agent uint32) lease {
			l := lease{agent: agent, need: amount.Draw(t, "need"), held: amount.Draw(t, "held"), win: amount.Draw(t, "win"),
				demand: rapid.Float32Range(0, 1e12).Draw(t, "demand"), expiry: e.base*1e6 + rapid.Int64Range(-1e10, 1e13).Draw(t, "ttl")}
			if rapid.Bool().Draw(t, "granted") {
				l.grantedAt = max(1, e.base-rapid.OneOf(rapid.Int64Range(0, 3), rapid.Int64Range(0, 1e11)).Draw(t, "grantAgo"))
			}
			return l
		}
		switch rapid.IntRange(0, 3).Draw(t, "change") {
		case 1:
			i := rapid.IntRange(0, len(e.leases)-1).Draw(t, "i")
			l := newLease(e.leases[i].agent)
			l.ext = e.leases[i].ext
			e.leases[i] = l
		case 2:
			if len(e.leases) > 1 { // drop a run anywhere, leaving one lease at least
				from := rapid.IntRange(0, len(e.leases)-1).Draw(t, "dropFrom")
				to := from + 1 + rapid.IntRange(0, len(e.leases)-from-1).Draw(t, "drop")
				if to-from == len(e.leases) {
					to--
				}
				e.leases = slices.Delete(e.leases, from, max(to, from+1))
			}
		case 3:
			if a := e.leases[0].agent; a > 1 {
				e.leases = slices.Insert(e.leases, 0, newLease(a-1))
			}
		}
		whole := e
		whole.leases = slices.Clone(e.leases)
		for i := range whole.leases {
			whole.leases[i].enc = 0
		}
		lcWhole := &leaseCodec{unit: lc.unit, ext: maps.Clone(lc.ext)}
		want := encodeAt(lcWhole, &whole, h)

		var got []byte
		var gotMin int64
		switch where := rapid.IntRange(0, 2).Draw(t, "where"); {
		case where > 0 && len(want) <= len(b):
			// As storeEntry: in place (or in a copy of the page a
			// snapshot shares, made before any write), the tail split
			// off after.
			got = b[:len(want)]
			if where == 2 {
				got = slices.Clone(got)
			}
			gotMin = lc.encode(got, &e, h, true)
		default:
			got = make([]byte, len(want))
			gotMin = lc.encode(got, &e, h, false)
		}
		if m := e.minSec(); floorDiv(gotMin, 1e9) != m {
			t.Fatalf("encode reported the earliest expiry %d, the leases' is in second %d", gotMin, m)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("copying leases wrote\n%x, encoding them\n%x", got, want)
		}
		for i := range e.leases {
			if e.leases[i] != whole.leases[i] {
				t.Fatalf("lease %d: copying reported %+v, encoding %+v", i, e.leases[i], whole.leases[i])
			}
		}
		if !maps.Equal(lc.ext, lcWhole.ext) {
			t.Fatalf("escaped leases: copying %v, encoding %v", lc.ext, lcWhole.ext)
		}
	})
}

// Packed rates are monotone, truncate by less than 2⁻²⁶, and every packed
// value the codec produces is canonical.
func TestPackRate(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		a := rapid.Int64Range(0, 1<<62).Draw(t, "a")
		b := rapid.Int64Range(0, 1<<62).Draw(t, "b")
		ua, ub := unpackRate(packRate(a)), unpackRate(packRate(b))
		if a <= b && ua > ub {
			t.Fatalf("not monotone: %d→%d, %d→%d", a, ua, b, ub)
		}
		if a < rateMax && (ua > a || float64(a-ua) > float64(a)/(1<<26)) {
			t.Fatalf("%d packs to %d", a, ua)
		}
		if p := packRate(a); packRate(unpackRate(p)) != p {
			t.Fatalf("%d packs to a non-canonical %#x", a, p)
		}
	})
	if unpackRate(packRate(1<<27-1)) != 1<<27-1 || unpackRate(packRate(100)) != 100 {
		t.Fatalf("small rates are not exact")
	}
}

// Canonical keys split into a template and values and join back; keys of
// one rule share a template.
func TestSplitJoinKey(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		domain := rapid.StringN(1, 10, -1).Draw(t, "domain")
		n := rapid.IntRange(0, 4).Draw(t, "entries")
		var es []rules.Entry
		for range n {
			es = append(es, rules.Entry{Key: rapid.StringN(0, 8, -1).Draw(t, "key"), Value: rapid.String().Draw(t, "value")})
		}
		key := rules.AppendKey(nil, nil, domain, es)
		tpl, val, ok := splitKey(key, nil, nil)
		if !ok {
			t.Fatalf("splitKey(%q) failed", key)
		}
		if got := joinKey(nil, string(tpl), val); !bytes.Equal(got, key) {
			t.Fatalf("joinKey(splitKey(%q)) = %q", key, got)
		}
		for i := range es {
			es[i].Value = rapid.String().Draw(t, "other")
		}
		tpl2, _, _ := splitKey(rules.AppendKey(nil, nil, domain, es), nil, nil)
		if !bytes.Equal(tpl, tpl2) {
			t.Fatalf("keys of one shape have templates %q and %q", tpl, tpl2)
		}
	})
	for _, bad := range []string{"no-colon", "d:k", "d:a=1,", "d:,a=1"} {
		if _, _, ok := splitKey([]byte(bad), nil, nil); ok {
			t.Errorf("splitKey(%q) accepted a non-canonical key", bad)
		}
	}
}

// The arena against a model: blocks never overlap, keep their bytes, are
// reused from the free lists, and a snapshot's pages never change.
func TestArenaModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		c := newCore(testConfig())
		a := &c.ar
		type blk struct {
			size int
			fill byte
		}
		live := map[uint32]blk{}
		var snapPages [][]byte
		var snapCopy [][]byte
		check := func() {
			var links []uint32
			for l, b := range live {
				got := a.bytes(l, b.size)
				for _, x := range got[minBlock:] {
					if x != b.fill {
						t.Fatalf("block %#x lost its bytes", l)
					}
				}
				links = append(links, l)
			}
			slices.Sort(links)
			for i := 1; i < len(links); i++ {
				p, q := links[i-1], links[i]
				if linkPage(p) == linkPage(q) && linkOff(p)+live[p].size > linkOff(q) {
					t.Fatalf("blocks %#x and %#x overlap", p, q)
				}
			}
			var sum int64
			for _, b := range live {
				sum += int64(b.size)
			}
			if sum != a.live {
				t.Fatalf("live %d, blocks %d", a.live, sum)
			}
			for i, p := range snapPages {
				if !bytes.Equal(p, snapCopy[i]) {
					t.Fatalf("a snapshot's page %d changed", i)
				}
			}
		}
		write := func(l uint32, b blk) {
			m := a.mut(c, l, b.size)
			m[0] = 1 // not a free marker
			for i := minBlock; i < b.size; i++ {
				m[i] = b.fill
			}
		}
		for i := range rapid.IntRange(1, 400).Draw(t, "ops") {
			switch op := rapid.IntRange(0, 9).Draw(t, "op"); {
			case op < 5 || len(live) == 0:
				size := blockSize(rapid.OneOf(rapid.IntRange(minBlock, 120), rapid.IntRange(minBlock, 3*arenaLarge)).Draw(t, "size"))
				l := a.alloc(c, size)
				if l == 0 {
					t.Fatalf("alloc returned link 0")
				}
				b := blk{size, byte(i)}
				write(l, b)
				live[l] = b
			case op < 8:
				l := rapid.SampledFrom(slices.Sorted(func(yield func(uint32) bool) {
					for l := range live {
						if !yield(l) {
							return
						}
					}
				})).Draw(t, "victim")
				b := live[l]
				delete(live, l)
				ps := pageSets{a.pages}
				if _, ok := ps.head(l); !ok {
					t.Fatalf("live block %#x reads as free", l)
				}
				if op == 7 && b.size <= arenaLarge && b.size >= 2*minBlock+2 {
					keep := blockSize(rapid.IntRange(minBlock, b.size-minBlock).Draw(t, "keep"))
					if keep <= b.size-minBlock {
						a.split(c, l, b.size, keep)
						b.size = keep
						live[l] = b
						break
					}
				}
				a.release(c, l, b.size)
				if _, ok := (&pageSets{a.pages}).head(l); ok {
					t.Fatalf("released block %#x reads as live", l)
				}
			default: // a snapshot shares the pages from now on
				c.gen++
				c.cow = true
				snapPages = slices.Clone(a.pages)
				snapCopy = nil
				for _, p := range snapPages {
					snapCopy = append(snapCopy, slices.Clone(p))
				}
			}
			check()
		}
	})
}
