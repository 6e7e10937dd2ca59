package agent

import (
	"encoding/binary"
	"math/bits"
	"math/rand/v2"
	"sync/atomic"
	"unsafe"

	"github.com/allot/allot/pkg/rules"
)

// The request memo lets a check skip rule matching and the key-table lookup
// for a request it has seen before: a direct-mapped table from the request's
// identity (the domain and every descriptor's entries) to what the slow path
// found for it under one rule set: the matched rule of each descriptor
// (after `replaces`, which depends on the whole request) and its key state.
//
// An entry is immutable once published and is used only when its rule set
// is the agent's current one, its identity matches the request (so the
// request is byte-identical to one that passed validation: a hit is not
// validated again), and,
// for each key, the key is still in the table. The last is checked under the
// key's shard read lock (keyState.dropped is set under the write lock before
// a key leaves the table), or, on the fast path for a leased key
// (Agent.spendLive), read again after the spend, which shard.remove
// sees or undoes; so a check through the memo decides only on keys the
// refill loop can still see, as a check through the table does.
//
// Entries are written on a miss whose request the memo takes (identHash), into an
// empty slot or one of an older rule set, over the request's own entry, or
// over another request's entry 1 time in memoReplace, so that a working set
// larger than the table does not allocate on every check
// (BenchmarkCheckMemoMiss: a miss costs about 80 ns more than a check
// before the memo; a hit saves 30-160 ns, BenchmarkCheckLeased and
// BenchmarkCheckStatuses3). The table holds at most memoSlots entries, and
// through them at most that many dropped key states and old rule sets.
type memo struct {
	seed  uint64
	slots [memoSlots]memoSlot
}

// memoSlot holds an entry and its hash: a probe compares the hash without
// touching the entry (another request's entry, on a miss, is a cache miss
// of its own). The two are not updated together; the hash is only a hint,
// and a hit is decided on the entry itself.
type memoSlot struct {
	hash  atomic.Uint64
	entry atomic.Pointer[memoEntry]
}

const (
	memoSlots   = 1 << 13 // power of two; 128 KiB of slots
	memoReplace = 32
	// memoBufLen bounds the requests the memo takes, in bytes, each
	// string counted with a byte more and each descriptor as one byte
	// (identHash); longer requests take the slow path. So an entry's
	// identity holds at most that many bytes, and a descriptor's entry
	// count fits a byte.
	memoBufLen = 255
)

type memoEntry struct {
	hash  uint64
	set   *rules.Set
	ident identity
	rules [stackDescs]*rules.Rule
	keys  [stackDescs]*keyState // nil: decided by the slow path (no rule, unlimited, the Redis backend)
}

func newMemo() *memo { return &memo{seed: rand.Uint64() | 1} }

// identity is a request's identity as an entry holds it, in one of two
// forms. A request whose strings (the domain, every entry's key and
// value) are at most 16 bytes each is held as words: the descriptors'
// shape, the strings' count, lengths and words (strWords), which
// determine its bytes. Any other is held as its strings: the domain, the
// entry count of each descriptor and every entry's key and value, in
// order, copies the entry owns. A request matches an identity (memo.get)
// when every one of those is equal, so a match is a byte-identical
// request; check relies on it to skip validation on a hit. A request is
// held in the first form exactly when a request equal to it is.
type identity struct {
	// The first form (words not nil).
	shape uint64
	lens  uint64   // of the first identFast strings, as identWords
	n     int      // strings
	words []uint64 // two per string
	tail  []uint8  // the lengths of the strings after the first identFast

	// The second form.
	domain identStr
	descs  uint8             // descriptors
	counts [stackDescs]uint8 // entries of each descriptor
	pairs  []identPair       // every descriptor's entries, one after another
}

type identPair struct{ key, value identStr }

// identStr is a string and its words (strWords): a string of up to 16
// bytes equals another of its length when their words do, without a
// look at either's bytes.
type identStr struct {
	a, b uint64
	s    string
}

// identFast bounds the strings of a request of the first form that
// identHash keeps the words of: the domain and 7 entries (a hit compares
// those and reads the rest of the request again); their lengths, from 0
// to 16, are the digits of a number in base 17, under 17^identFast < 2^63.
const identFast = 15

// identWords is the first form of a request's identity, as identHash
// reads it: its shape, its strings' count and the lengths and words of
// the first identFast of them; n is 0 when the request has the second
// form.
type identWords struct {
	n     int    // strings
	shape uint64 // descriptors, then the entries of each, a byte each
	lens  uint64 // the first identFast strings' lengths, in base 17
	w     [2 * identFast]uint64
}

// identHash hashes the identity of the request (domain, descs) under
// seed, from every byte of it, and reads its first form into *iw; ok is
// false when the memo does not take the request: more than stackDescs
// descriptors, or more than memoBufLen bytes once each string takes a
// byte more and each descriptor one byte. Equal identities hash alike;
// the hash need only spread requests over the memo's slots (a hit is
// decided by memo.get).
//
// A request of the first form with at most identFast strings (the
// commonest) is hashed by identHashShort, which answers for it what
// identHashAny answers, in a leaner loop; any other by identHashAny
// (TestIdentHashShort).
func identHash(seed uint64, domain string, descs []Descriptor, iw *identWords) (h uint64, ok bool) {
	if h, ok := identHashShort(seed, domain, descs, iw); ok {
		return h, true
	}
	return identHashAny(seed, domain, descs, iw)
}

// identHashShort is identHashAny of a request whose strings are at most 16
// bytes each and at most identFast in all, and which the memo takes (the
// same hash and words); ok is false for any other (identHashAny then
// decides). Knowing the form, it keeps fewer values through its loop than
// identHashAny (the size is added up once, the shape after the loop) and
// writes the words unchecked.
func identHashShort(seed uint64, domain string, descs []Descriptor, iw *identWords) (h uint64, ok bool) {
	if len(domain) > 16 || len(descs) > stackDescs {
		return 0, false
	}
	a, b := strWords(domain)
	iw.w[0], iw.w[1] = a, b
	lens := uint64(len(domain))
	h = strMix(seed, a, b, len(domain))
	bytes := len(domain) // of the strings
	n := 1               // strings; odd, as entries come in pairs
	for i := range descs {
		es := descs[i].Entries
		if len(es) > (identFast-n)/2 {
			return 0, false
		}
		h = bits.RotateLeft64(h, 17) ^ uint64(len(es))
		for j := range es {
			e := &es[j]
			if len(e.Key) > 16 || len(e.Value) > 16 {
				return 0, false
			}
			bytes += len(e.Key) + len(e.Value)
			// Within iw.w: n ≤ identFast-2 here (the check above),
			// so the words end by 2·identFast.
			w := (*[4]uint64)(unsafe.Pointer(&iw.w[2*n]))
			w[0], w[1] = strWords(e.Key)
			w[2], w[3] = strWords(e.Value)
			lens = (lens*17+uint64(len(e.Key)))*17 + uint64(len(e.Value))
			h = bits.RotateLeft64(bits.RotateLeft64(h, 17)^strMix(seed, w[0], w[1], len(e.Key)), 17) ^ strMix(seed, w[2], w[3], len(e.Value))
			n += 2
		}
	}
	// The size as identHashAny counts it: a byte more for each of the
	// n-1 strings of the entries, and one per descriptor.
	size := 1 + len(descs) + n - 1 + bytes
	if size > memoBufLen {
		return 0, false
	}
	shape := uint64(len(descs))
	for i := range descs {
		shape |= uint64(len(descs[i].Entries)) << (8 * (i + 1))
	}
	iw.n, iw.shape, iw.lens = n, shape, lens
	return mum(h^identK1, seed^uint64(size)), true
}

// identHashAny is identHash of any request. The strings' words are read
// and mixed in the loop rather than by a function of one string, which
// would not be inlined.
func identHashAny(seed uint64, domain string, descs []Descriptor, iw *identWords) (h uint64, ok bool) {
	size := 1 + len(domain)
	if len(descs) > stackDescs || size > memoBufLen {
		return 0, false
	}
	n, lens := 0, uint64(0) // n < 0: the second form
	shape := uint64(len(descs))
	if len(domain) > 16 {
		h = hashLong(seed, domain)
		n = -1
	} else {
		a, b := strWords(domain)
		h = strMix(seed, a, b, len(domain))
		iw.w[0], iw.w[1], lens, n = a, b, uint64(len(domain)), 1
	}
	for i := range descs {
		es := descs[i].Entries
		size++
		h = bits.RotateLeft64(h, 17) ^ uint64(len(es))
		shape |= uint64(len(es)) << (8 * (i + 1))
		for j := range es {
			k, v := es[j].Key, es[j].Value
			if size += 2 + len(k) + len(v); size > memoBufLen {
				return 0, false
			}
			var hk, hv uint64
			if len(k) > 16 || len(v) > 16 {
				hk, hv = strHashLong(seed, k), strHashLong(seed, v)
				n = -1
			} else {
				ka, kb := strWords(k)
				va, vb := strWords(v)
				hk = strMix(seed, ka, kb, len(k))
				hv = strMix(seed, va, vb, len(v))
				if uint(n) <= identFast-2 {
					w := (*[4]uint64)(iw.w[2*n:])
					w[0], w[1], w[2], w[3] = ka, kb, va, vb
					lens = (lens*17+uint64(len(k)))*17 + uint64(len(v))
				}
				if n >= 0 {
					n += 2
				}
			}
			h = bits.RotateLeft64(bits.RotateLeft64(h, 17)^hk, 17) ^ hv
		}
	}
	if size > memoBufLen {
		return 0, false
	}
	iw.n, iw.shape, iw.lens = max(n, 0), shape, lens
	return mum(h^identK1, seed^uint64(size)), true
}

// strHashLong is a string's hash in identHash, of any length.
func strHashLong(seed uint64, s string) uint64 {
	if len(s) > 16 {
		return hashLong(seed, s)
	}
	a, b := strWords(s)
	return strMix(seed, a, b, len(s))
}

// strMix is the hash of a string of l bytes, at most 16, whose words are
// a and b: a product of each with an odd constant (one IMUL each, in any
// registers, where mum's 128-bit product takes fixed ones). Each is a
// bijection of its word, carrying changes only upwards; the fold in
// identHash's last mum brings the upper bits down. A weak hash, and
// enough: it only spreads requests over the memo's slots, and requests
// that share a slot only miss the memo, as more requests than its slots do.
func strMix(seed, a, b uint64, l int) uint64 {
	return (a^seed)*identK1 ^ bits.RotateLeft64((b^uint64(l))*identK2, 32)
}

// newIdentity copies the identity of a request identHash took (so at
// most memoBufLen bytes, entry counts under 256) whose first form is iw.
func newIdentity(domain string, descs []Descriptor, iw *identWords) identity {
	if iw.n > 0 {
		id := identity{shape: iw.shape, lens: iw.lens, n: iw.n, words: make([]uint64, 0, 2*iw.n)}
		id.words = append(id.words, iw.w[:2*min(iw.n, identFast)]...)
		forTail(descs, func(s string) {
			a, b := strWords(s)
			id.words = append(id.words, a, b)
			id.tail = append(id.tail, uint8(len(s)))
		})
		return id
	}
	n, size := 0, len(domain)
	for i := range descs {
		n += len(descs[i].Entries)
		for _, e := range descs[i].Entries {
			size += len(e.Key) + len(e.Value)
		}
	}
	buf := make([]byte, 0, size) // the strings, in one allocation
	own := func(s string) identStr {
		buf = append(buf, s...)
		c := buf[len(buf)-len(s):]
		a, b := strWords(s)
		return identStr{a: a, b: b, s: unsafe.String(unsafe.SliceData(c), len(c))}
	}
	id := identity{domain: own(domain), descs: uint8(len(descs)), pairs: make([]identPair, 0, n)}
	for i := range descs {
		id.counts[i] = uint8(len(descs[i].Entries))
		for _, e := range descs[i].Entries {
			id.pairs = append(id.pairs, identPair{own(e.Key), own(e.Value)})
		}
	}
	return id
}

// A request matches an identity (memo.get) when it is the one the identity
// was made from, byte for byte: matchesWords for a request of the first
// form, matchesStrings for one of the second.

// matchesWords is a match of a request of the first form, whose
// identWords are iw, in its first identFast strings (and its shape and
// count); matchesTail compares the rest.
func (id *identity) matchesWords(iw *identWords) bool {
	w := iw.w[:2*min(iw.n, identFast)]
	if id.shape != iw.shape || id.lens != iw.lens || id.n != iw.n || len(id.words) < len(w) {
		return false
	}
	diff := uint64(0)
	for i, x := range id.words[:len(w)] {
		diff |= x ^ w[i]
	}
	return diff == 0
}

// matchesTail compares the strings of descs after the first identFast
// with those of id, of the first form and of descs's shape (so the two
// have the same number of strings). It walks descs as forTail does, with
// the comparison written out.
func (id *identity) matchesTail(descs []Descriptor) bool {
	words, tail := id.words[2*identFast:], id.tail
	skip := (identFast - 1) / 2 // entries
	for i := range descs {
		es := descs[i].Entries
		if skip >= len(es) {
			skip -= len(es)
			continue
		}
		for _, e := range es[skip:] {
			if len(tail) < 2 || len(words) < 4 {
				return false
			}
			ka, kb := strWords(e.Key)
			va, vb := strWords(e.Value)
			if len(e.Key) != int(tail[0]) || len(e.Value) != int(tail[1]) ||
				(ka^words[0])|(kb^words[1])|(va^words[2])|(vb^words[3]) != 0 {
				return false
			}
			words, tail = words[4:], tail[2:]
		}
		skip = 0
	}
	return true
}

// forTail calls f with each string of descs after the first identFast
// (the domain counts as one), in order.
func forTail(descs []Descriptor, f func(string)) {
	skip := (identFast - 1) / 2 // entries
	for i := range descs {
		es := descs[i].Entries
		if skip >= len(es) {
			skip -= len(es)
			continue
		}
		for _, e := range es[skip:] {
			f(e.Key)
			f(e.Value)
		}
		skip = 0
	}
}

// matchesStrings is a match of a request of the second form.
func (id *identity) matchesStrings(domain string, descs []Descriptor) bool {
	if id.words != nil || len(descs) != int(id.descs) {
		return false
	}
	if a, b := strWords(domain); !id.domain.eq(domain, a, b) {
		return false
	}
	pairs := id.pairs
	for i := range descs {
		es := descs[i].Entries
		if i >= len(id.counts) || len(es) != int(id.counts[i]) || len(es) > len(pairs) {
			return false
		}
		ps := pairs[:len(es)]
		for j := range ps {
			k, v := es[j].Key, es[j].Value
			ka, kb := strWords(k)
			va, vb := strWords(v)
			if !ps[j].key.eq(k, ka, kb) || !ps[j].value.eq(v, va, vb) {
				return false
			}
		}
		pairs = pairs[len(es):]
	}
	return true
}

// eq reports whether s, whose words are a and b, is x's string.
func (x *identStr) eq(s string, a, b uint64) bool {
	return len(s) == len(x.s) && a == x.a && b == x.b && (len(s) <= 16 || s == x.s)
}

// Odd constants for the identity's hash (wyhash's).
const (
	identK1 = 0xa0761d6478bd642f
	identK2 = 0xe7037ed1a0b428db
)

// mum is the folded 128-bit product of a and b.
func mum(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}

// strWords reads s as two words: for 8 bytes or more its first and last 8
// (overlapping), for 4 to 7 its first and last 4, for 1 to 3 its first,
// middle and last byte in a. Up to 16 bytes, the words and the length
// determine the string.
func strWords(s string) (a, b uint64) {
	l := len(s)
	p := unsafe.Slice(unsafe.StringData(s), l)
	if l >= 8 {
		return binary.LittleEndian.Uint64(p), binary.LittleEndian.Uint64(p[l-8:])
	}
	if l >= 4 {
		return uint64(binary.LittleEndian.Uint32(p)), uint64(binary.LittleEndian.Uint32(p[l-4:]))
	}
	if l > 0 {
		return uint64(p[0])<<16 | uint64(p[l>>1])<<8 | uint64(p[l-1]), 0
	}
	return 0, 0
}

// hashLong hashes s, longer than 16 bytes, under seed: one product per 16
// bytes, the last 16 overlapping the ones before.
func hashLong(seed uint64, s string) uint64 {
	p := unsafe.Slice(unsafe.StringData(s), len(s))
	h := seed ^ uint64(len(p))
	for i := 0; i+16 < len(p); i += 16 {
		h = mum(binary.LittleEndian.Uint64(p[i:])^h, binary.LittleEndian.Uint64(p[i+8:])^identK2)
	}
	t := p[len(p)-16:]
	return mum(binary.LittleEndian.Uint64(t)^h, binary.LittleEndian.Uint64(t[8:])^identK1)
}

// get returns the entry for the request (domain, descs), whose identity
// hashes to h and whose first form is iw, under set, or nil.
func (m *memo) get(h uint64, set *rules.Set, domain string, descs []Descriptor, iw *identWords) *memoEntry {
	slot := &m.slots[h&(memoSlots-1)]
	if slot.hash.Load() != h {
		return nil
	}
	e := slot.entry.Load()
	if e == nil || e.hash != h || e.set != set {
		return nil
	}
	if iw.n > 0 {
		if !e.ident.matchesWords(iw) || iw.n > identFast && !e.ident.matchesTail(descs) {
			return nil
		}
	} else if !e.ident.matchesStrings(domain, descs) {
		return nil
	}
	return e
}

// store publishes e in its slot.
func (m *memo) store(e *memoEntry) {
	slot := &m.slots[e.hash&(memoSlots-1)]
	slot.entry.Store(e)
	slot.hash.Store(e.hash)
}

// wants reports whether an entry for (h, set) should be written: its slot
// is empty, holds another rule set or this request's entry (incomplete, or
// with a key that left the table); or, 1 time in memoReplace, whatever it
// holds. (Another request's entry with a dropped key is not looked into:
// that request, when it comes back, replaces it.)
func (m *memo) wants(h uint64, set *rules.Set) bool {
	old := m.slots[h&(memoSlots-1)].entry.Load()
	return old == nil || old.set != set || old.hash == h || rand.Uint32N(memoReplace) == 0
}
