package state

import (
	"math/bits"

	"github.com/allot/allot/pkg/bucket"
)

// The key table is an ordered open-addressing hash table (Amble and Knuth's
// "ordered hash table" with linear probing): a slot's home is
// ⌊hash·capacity/2⁶⁴⌋ (monotone in the hash, so the capacity need not be a
// power of two), and every cluster is kept sorted by hash. Two properties
// follow that the state relies on:
//
//   - the layout depends only on the set of keys, not on insertion order, so
//     the slot array is in hash order and Persist streams it without sorting;
//   - a hash range is a contiguous run of slots, so the Expire sweep visits
//     one segment of the hash space cheaply.
//
// There is no wrap-around: the array has a tail chunk of slack after the
// capacity, and an insertion that would run past the end grows the table.
//
// Memory is 32 bytes per slot divided by the load, so the table runs full:
// it grows when the load would pass 15/16 and is then resized to a load of
// 5/6, a multiple of the chunk size (an ordered table keeps lookups short
// at such loads: a search stops at the first larger hash). Slots are stored in fixed-size chunks so that a snapshot shares
// them and a write after a snapshot copies one 128 KiB chunk at most
// (copy-on-write by generation).

const (
	chunkBits   = 12
	chunkSize   = 1 << chunkBits // slots per chunk
	chunkMask   = chunkSize - 1
	minTableCap = chunkSize
	// maxLoadNum/maxLoadDen: grow when n > cap·15/16.
	maxLoadNum = 15
	maxLoadDen = 16
	// fitLoadNum/fitLoadDen: the load a resized table starts at (5/6).
	fitLoadNum = 5
	fitLoadDen = 6
)

// slot is one tracked key: 32 bytes.
type slot struct {
	hash uint64
	st   bucket.State
	lim  uint32 // interned limit index (≥ 1); 0 marks an empty slot
	link uint32 // the key's leased-key entry in the arena; 0: no live lease
}

type chunk [chunkSize]slot

type table struct {
	chunks []*chunk
	gens   []uint32 // generation each chunk was made private at
	capa   int      // a multiple of chunkSize; home(h) = ⌊h·capa/2⁶⁴⌋
	size   int      // capa + chunkSize (tail slack)
	n      int      // occupied slots
}

// fitCap returns the capacity for n keys at the resize load (at least
// minTableCap, a multiple of chunkSize).
func fitCap(n int) int {
	c := (n*fitLoadDen + fitLoadNum - 1) / fitLoadNum
	c = (c + chunkMask) &^ chunkMask
	return max(c, minTableCap)
}

func (t *table) init(capa int) {
	t.capa = capa
	t.size = capa + chunkSize
	t.chunks = make([]*chunk, t.size/chunkSize)
	t.gens = make([]uint32, len(t.chunks))
	for i := range t.chunks {
		t.chunks[i] = new(chunk)
	}
	t.n = 0
}

func log2(n int) int {
	l := 0
	for 1<<l < n {
		l++
	}
	return l
}

func (t *table) home(h uint64) int {
	hi, _ := bits.Mul64(h, uint64(t.capa))
	return int(hi)
}

// at returns slot i for reading.
func (t *table) at(i int) *slot { return &t.chunks[i>>chunkBits][i&chunkMask] }

// mut returns slot i for writing, copying its chunk first if a snapshot
// shares it.
func (t *table) mut(c *core, i int) *slot {
	ci := i >> chunkBits
	if c.cow && t.gens[ci] != c.gen {
		cp := new(chunk)
		*cp = *t.chunks[ci]
		t.chunks[ci] = cp
		t.gens[ci] = c.gen
	}
	return &t.chunks[ci][i&chunkMask]
}

// find returns the index of h's slot, or -1.
func (t *table) find(h uint64) int {
	if i, ok := t.search(h); ok {
		return i
	}
	return -1
}

// search returns the index of h's slot and true or, if h is absent, the
// index where it would be inserted (the first slot from its home that is
// empty or holds a larger hash; t.size past the end) and false.
func (t *table) search(h uint64) (int, bool) {
	i := t.home(h)
	for ; i < t.size; i++ {
		s := t.at(i)
		if s.lim == 0 || s.hash > h {
			return i, false
		}
		if s.hash == h {
			return i, true
		}
	}
	return i, false
}

// lowerBound returns the first index at or after which keys with hash ≥ h
// live (every occupied slot before it in h's cluster has a smaller hash).
func (t *table) lowerBound(h uint64) int {
	i := t.home(h)
	for ; i < t.size; i++ {
		s := t.at(i)
		if s.lim == 0 || s.hash >= h {
			return i
		}
	}
	return t.size
}

// insert adds h with limit lim and a zero state and returns its index. h
// must not be present. It may grow the table (which moves every slot).
func (t *table) insert(c *core, h uint64, lim uint32) int {
	i, _ := t.search(h)
	return t.insertAt(c, h, lim, i)
}

// insertAt is insert given i, where search placed the absent h (the table
// unchanged since).
func (t *table) insertAt(c *core, h uint64, lim uint32, i int) int {
	for {
		if (t.n+1)*maxLoadDen > t.capa*maxLoadNum {
			t.grow(c)
			i, _ = t.search(h)
		}
		// Find the first empty slot at or after i.
		j := i
		for j < t.size && t.at(j).lim != 0 {
			j++
		}
		if j >= t.size {
			t.grow(c)
			i, _ = t.search(h)
			continue
		}
		t.shiftRight(c, i, j)
		*t.mut(c, i) = slot{hash: h, lim: lim}
		t.n++
		return i
	}
}

// shiftRight moves slots [i, j) to [i+1, j+1), a chunk's run at a time.
func (t *table) shiftRight(c *core, i, j int) {
	for j > i {
		base := j &^ chunkMask // first index of j's chunk
		t.mut(c, j)            // make j's chunk private
		ch := t.chunks[j>>chunkBits]
		lo := max(i, base) // sources [lo, j) stay in the chunk
		copy(ch[lo-base+1:j-base+1], ch[lo-base:j-base])
		if lo == i {
			return
		}
		ch[0] = *t.at(base - 1) // the previous chunk's last slot
		j = base - 1
	}
}

// remove deletes slot i with backward-shift deletion, keeping the order.
func (t *table) remove(c *core, i int) {
	j := i + 1
	for j < t.size {
		s := t.at(j)
		if s.lim == 0 || t.home(s.hash) >= j {
			break
		}
		*t.mut(c, j-1) = *s
		j++
	}
	*t.mut(c, j-1) = slot{}
	t.n--
}

// grow resizes the table to the resize load for one more key than it holds
// (at least one chunk more) and re-places every slot in order.
func (t *table) grow(c *core) {
	old := *t
	t.init(max(fitCap(old.n+1), old.capa+chunkSize))
	t.fill(c, &old)
}

// fill places every occupied slot of old into t, in hash order.
func (t *table) fill(c *core, old *table) {
	for {
		next := 0
		ok := true
		old.each(func(_ int, s *slot) bool {
			i := max(t.home(s.hash), next)
			if i >= t.size {
				ok = false
				return false
			}
			*t.at(i) = *s
			next = i + 1
			t.n++
			return true
		})
		if ok {
			break
		}
		t.init(t.capa + t.capa/2) // pathological clustering at the tail
	}
	for i := range t.gens {
		t.gens[i] = c.gen
	}
}

// maybeShrink resizes the table to the resize load when it is below half
// that load, to return memory after a burst of keys has been swept.
func (t *table) maybeShrink(c *core) {
	if t.capa <= minTableCap || t.n*fitLoadDen*2 > t.capa*fitLoadNum {
		return
	}
	old := *t
	t.init(fitCap(t.n))
	t.fill(c, &old)
}

// each calls f for every occupied slot in index (= hash) order until f
// returns false.
func (t *table) each(f func(i int, s *slot) bool) {
	for ci, ch := range t.chunks {
		for k := range ch {
			if ch[k].lim != 0 {
				if !f(ci<<chunkBits|k, &ch[k]) {
					return
				}
			}
		}
	}
}
