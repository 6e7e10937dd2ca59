package agent

import (
	"hash/maphash"
	"math/rand/v2"
	"sync/atomic"

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
// (Agent.checkLeasedHit), read again after the spend, which shard.remove
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
	seed  maphash.Seed
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

func newMemo() *memo { return &memo{seed: maphash.MakeSeed()} }

// appendIdent encodes domain and descs injectively into dst: each string
// preceded by its length in one byte, each descriptor by its entry count.
// ok is false when the result would outgrow memoBufLen (so every length
// fits a byte) or there are more than stackDescs descriptors. The encoding
// keeps every byte of every string, so equal identities are equal requests
// (TestIdentInjective decodes it back); check relies on it to skip
// validation on a hit. dst must have capacity memoBufLen: the strings are
// copied in one pass, without a size pass before.
func appendIdent(dst []byte, domain string, descs []Descriptor) ([]byte, bool) {
	if len(descs) > stackDescs || cap(dst)-len(dst) < memoBufLen {
		return dst, false
	}
	buf := dst[len(dst) : len(dst)+memoBufLen]
	n := 1 + len(domain)
	if n > len(buf) {
		return dst, false
	}
	buf[0] = byte(len(domain))
	copy(buf[1:], domain)
	for i := range descs {
		es := descs[i].Entries
		if n >= len(buf) {
			return dst, false
		}
		buf[n] = byte(len(es)) // bounded below: each entry takes at least 2 bytes
		n++
		for j := range es {
			k, v := es[j].Key, es[j].Value
			if n+2+len(k)+len(v) > len(buf) {
				return dst, false
			}
			buf[n] = byte(len(k))
			copy(buf[n+1:], k)
			n += 1 + len(k)
			buf[n] = byte(len(v))
			copy(buf[n+1:], v)
			n += 1 + len(v)
		}
	}
	return dst[:len(dst)+n], true
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
