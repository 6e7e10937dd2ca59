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
// it grows when the load would pass 9/10 and is then resized to a load of
// 4/5, a multiple of the chunk size (an ordered table keeps lookups short
// at such loads: a search stops at the first larger hash). An insertion
// shifts the rest of its cluster by one slot, about ½(1+1/(1−load)²)
// slots: 13 at 4/5, 50 at 9/10 (and 128 at 15/16, which costs more CPU
// than the under 2 bytes a key it saves). A resize re-places the slots in the
// chunks the table has plus new ones, from the last slot to the first.
// Slots are stored in fixed-size chunks so that a snapshot shares them and
// a write after a snapshot copies one 128 KiB chunk at most (copy-on-write
// by generation).
//
// A key's lookup misses the cache (the table is far larger than it) and
// the next key's lookup waits for it; touch reads the slots of many keys
// at once, so that their misses overlap.

const (
	chunkBits   = 12
	chunkSize   = 1 << chunkBits // slots per chunk
	chunkMask   = chunkSize - 1
	minTableCap = chunkSize
	// maxLoadNum/maxLoadDen: grow when n > cap·9/10.
	maxLoadNum = 9
	maxLoadDen = 10
	// fitLoadNum/fitLoadDen: the load a resized table starts at (4/5).
	fitLoadNum = 4
	fitLoadDen = 5
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
	gens   []uint32          // generation each chunk was made private at
	capa   int               // a multiple of chunkSize; home(h) = ⌊h·capa/2⁶⁴⌋
	size   int               // capa + chunkSize (tail slack)
	n      int               // occupied slots
	sink   uint32            // what touch read
	pos    *[chunkSize]int32 // growInPlace's scratch
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
	return &t.mutChunk(c, i>>chunkBits)[i&chunkMask]
}

// mutChunk returns chunk ci for writing, copying it first if a snapshot
// shares it.
func (t *table) mutChunk(c *core, ci int) *chunk {
	if c.cow && t.gens[ci] != c.gen {
		cp := new(chunk)
		*cp = *t.chunks[ci]
		t.chunks[ci] = cp
		t.gens[ci] = c.gen
	}
	return t.chunks[ci]
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
	i := t.lowerBound(h)
	return i, i < t.size && t.at(i).lim != 0 && t.at(i).hash == h
}

// lowerBound returns the first index at or after which keys with hash ≥ h
// live (every occupied slot before it in h's cluster has a smaller hash):
// the first slot from h's home that is empty or holds a hash ≥ h.
func (t *table) lowerBound(h uint64) int {
	for i := t.home(h); i < t.size; i = i&^chunkMask + chunkSize {
		ch := t.chunks[i>>chunkBits]
		for k := i & chunkMask; k < chunkSize; k++ {
			if s := &ch[k]; s.lim == 0 || s.hash >= h {
				return i&^chunkMask | k
			}
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
	if (t.n+1)*maxLoadDen > t.capa*maxLoadNum {
		t.grow(c)
		i, _ = t.search(h)
	}
	for {
		if j := t.emptyFrom(i); j < t.size {
			t.shiftRight(c, i, j)
			*t.mut(c, i) = slot{hash: h, lim: lim}
			t.n++
			return i
		}
		t.grow(c)
		i, _ = t.search(h)
	}
}

// emptyFrom returns the first empty slot at or after i (t.size if none).
func (t *table) emptyFrom(i int) int {
	for ; i < t.size; i = i&^chunkMask + chunkSize {
		ch := t.chunks[i>>chunkBits]
		for k := i & chunkMask; k < chunkSize; k++ {
			if ch[k].lim == 0 {
				return i&^chunkMask | k
			}
		}
	}
	return t.size
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
	capa := max(fitCap(t.n+1), t.capa+chunkSize)
	if t.growInPlace(c, capa) {
		return
	}
	old := *t
	t.init(capa)
	t.fill(c, &old)
}

// growInPlace re-places every slot for the larger capacity capa in the
// chunks the table has and new ones after them, with the layout fill
// gives: each slot at its new home or just after the slot before it. No
// slot's new index is below its old one (its home only moves up, and by
// induction so does the slot before it), so moving the slots from the
// last to the first never overwrites one not yet moved. The slots are
// moved a chunk at a time, from the new index of the slot before each
// chunk (found in a first pass). It reports false, changing nothing, if
// the slots would run past the new end.
func (t *table) growInPlace(c *core, capa int) bool {
	size := capa + chunkSize
	home := func(h uint64) int {
		hi, _ := bits.Mul64(h, uint64(capa))
		return int(hi)
	}
	oldChunks := len(t.chunks)
	starts := make([]int, oldChunks) // the new index free at each chunk's start
	next := 0
	for ci, ch := range t.chunks {
		starts[ci] = next
		for k := range ch {
			if s := &ch[k]; s.lim != 0 {
				next = max(home(s.hash), next) + 1
			}
		}
	}
	if next > size {
		return false
	}
	for len(t.chunks) < size/chunkSize {
		t.chunks = append(t.chunks, new(chunk))
		t.gens = append(t.gens, c.gen)
	}
	if t.pos == nil {
		t.pos = new([chunkSize]int32)
	}
	pos := t.pos
	for ci := oldChunks - 1; ci >= 0; ci-- {
		next := starts[ci]
		ch := t.chunks[ci]
		last := -1
		for k := range ch {
			if s := &ch[k]; s.lim != 0 {
				next = max(home(s.hash), next)
				pos[k] = int32(next)
				next++
				last = k
			}
		}
		if last < 0 {
			continue
		}
		ch = t.mutChunk(c, ci)
		for k := last; k >= 0; k-- {
			s := ch[k]
			if to := int(pos[k]); s.lim != 0 && to != ci<<chunkBits|k {
				ch[k] = slot{}
				*t.mut(c, to) = s
			}
		}
	}
	t.capa, t.size = capa, size
	return true
}

// fill places every occupied slot of old into t, in hash order.
func (t *table) fill(c *core, old *table) {
	for !t.place(old) {
		t.init(t.capa + t.capa/2) // pathological clustering at the tail
	}
	for i := range t.gens {
		t.gens[i] = c.gen
	}
}

// place puts every occupied slot of old into the empty t, each at its home
// or just after the slot placed before it, and reports whether they fit.
func (t *table) place(old *table) bool {
	next := 0
	for _, och := range old.chunks {
		for k := range och {
			s := &och[k]
			if s.lim == 0 {
				continue
			}
			i := max(t.home(s.hash), next)
			if i >= t.size {
				return false
			}
			t.chunks[i>>chunkBits][i&chunkMask] = *s
			next = i + 1
			t.n++
		}
	}
	return true
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

// touch reads the home slot of every hash in hs, so that the slots are in
// the cache when the hashes are searched for next. The reads are
// independent, so their cache misses overlap.
func (t *table) touch(hs []uint64) {
	var x uint32
	for _, h := range hs {
		i := t.home(h)
		x += t.chunks[i>>chunkBits][i&chunkMask].lim
	}
	t.sink = x
}
