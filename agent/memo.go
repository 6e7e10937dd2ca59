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
// is the agent's current one, its identity bytes equal the request's (so
// the request is byte-identical to one that passed validation: a hit is
// not validated again), and,
// for each key, the key is still in the table. The last is checked under the
// key's shard read lock (keyState.dropped is set under the write lock before
// a key leaves the table), or, on the fast path for a leased key
// (Agent.spendLive), read again after the spend, which shard.remove
// sees or undoes; so a check through the memo decides only on keys the
// refill loop can still see, as a check through the table does.
//
// Entries are written on a miss whose request fits the stack buffer, into an
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
	// memoBufLen bounds the encoded request the memo accepts (on the
	// stack); longer requests take the slow path. At most 255, so that
	// every string's length fits appendIdent's one byte.
	memoBufLen = 255
)

type memoEntry struct {
	hash  uint64
	set   *rules.Set
	ident string
	rules [stackDescs]*rules.Rule
	keys  [stackDescs]*keyState // nil: decided by the slow path (no rule, unlimited, the Redis backend)
}

func newMemo() *memo { return &memo{seed: rand.Uint64() | 1} }

// appendIdent encodes domain and descs injectively into dst: each string
// preceded by its length in one byte, each descriptor by its entry count.
// ok is false when the result would outgrow memoBufLen (so every length
// fits a byte) or there are more than stackDescs descriptors. The encoding
// keeps every byte of every string, so equal identities are equal requests
// (TestIdentInjective decodes it back); check relies on it to skip
// validation on a hit. dst must have capacity memoBufLen: the strings are
// copied in one pass, without a size pass before.
//
// h is the identity's hash under seed, computed from the words the copy
// loads: hashing the buffer afterwards would read it while its stores are
// still in flight, which stalls the loads (store forwarding fails for a
// wide load over narrower stores). Equal identities hash alike; the hash
// need only spread requests over the memo's slots.
func appendIdent(dst []byte, seed uint64, domain string, descs []Descriptor) (_ []byte, h uint64, ok bool) {
	if len(descs) > stackDescs || cap(dst)-len(dst) < memoBufLen || len(domain) >= memoBufLen {
		return dst, 0, false
	}
	buf := dst[len(dst) : len(dst)+memoBufLen]
	n, h := putStr(buf, 0, seed, seed, domain)
	for i := range descs {
		es := descs[i].Entries
		if n >= memoBufLen {
			return dst, 0, false
		}
		buf[n] = byte(len(es)) // bounded below: each entry takes at least 2 bytes
		n++
		h = bits.RotateLeft64(h, 17) ^ uint64(len(es))
		for j := range es {
			k, v := es[j].Key, es[j].Value
			if n+2+len(k)+len(v) > memoBufLen {
				return dst, 0, false
			}
			n, h = putStr(buf, n, seed, h, k)
			n, h = putStr(buf, n, seed, h, v)
		}
	}
	return dst[:len(dst)+n], mum(h^identK1, seed^uint64(n)), true
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

// putStr writes s's length and its bytes at buf[n:], folds s into the
// hash h, and returns the offset after s and the new hash. A string of up
// to 16 bytes is read as two words that overlap (all of it, with its
// length) and written back the same way, inside its own bytes, rather
// than by a call to memmove.
func putStr(buf []byte, n int, seed, h uint64, s string) (int, uint64) {
	l := len(s)
	buf[n] = byte(l)
	d := buf[n+1:]
	p := unsafe.Slice(unsafe.StringData(s), l)
	var a, b uint64
	switch {
	case l > 16:
		copy(d, p)
		return n + 1 + l, bits.RotateLeft64(h, 17) ^ hashLong(seed, p)
	case l >= 8:
		a, b = binary.LittleEndian.Uint64(p), binary.LittleEndian.Uint64(p[l-8:])
		binary.LittleEndian.PutUint64(d, a)
		binary.LittleEndian.PutUint64(d[l-8:], b)
	case l >= 4:
		a, b = uint64(binary.LittleEndian.Uint32(p)), uint64(binary.LittleEndian.Uint32(p[l-4:]))
		binary.LittleEndian.PutUint32(d, uint32(a))
		binary.LittleEndian.PutUint32(d[l-4:], uint32(b))
	case l > 0:
		d[0], d[l>>1], d[l-1] = p[0], p[l>>1], p[l-1]
		a = uint64(p[0])<<16 | uint64(p[l>>1])<<8 | uint64(p[l-1])
	}
	return n + 1 + l, bits.RotateLeft64(h, 17) ^ mum(a^seed, b^uint64(l)^identK2)
}

// hashLong hashes p, longer than 16 bytes, under seed: one product per 16
// bytes, the last 16 overlapping the ones before.
func hashLong(seed uint64, p []byte) uint64 {
	h := seed ^ uint64(len(p))
	for i := 0; i+16 < len(p); i += 16 {
		h = mum(binary.LittleEndian.Uint64(p[i:])^h, binary.LittleEndian.Uint64(p[i+8:])^identK2)
	}
	t := p[len(p)-16:]
	return mum(binary.LittleEndian.Uint64(t)^h, binary.LittleEndian.Uint64(t[8:])^identK1)
}

// get returns the entry for (h, set, ident), or nil.
func (m *memo) get(h uint64, set *rules.Set, ident []byte) *memoEntry {
	slot := &m.slots[h&(memoSlots-1)]
	if slot.hash.Load() != h {
		return nil
	}
	e := slot.entry.Load()
	if e == nil || e.hash != h || e.set != set || e.ident != string(ident) {
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
