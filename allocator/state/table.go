package state

import (
	"math/bits"
	"slices"

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
// The table is split into shards by the top bits of the hash (a directory
// of 2^dirBits entries names each prefix's shard; a shard of depth d holds
// the hashes with one d-bit prefix). Each shard is a contiguous run of
// whole chunks in hash order: its capacity, then shardSlack slots. A
// slot's home is its shard's base plus ⌊(hash·2^d mod 2⁶⁴)·capacity/2⁶⁴⌋,
// monotone in the hash over the whole table, so the slot array as a whole
// stays in hash order and a hash range a contiguous run of slots. There is
// no wrap-around: an insertion that would run past its shard's end grows
// that shard.
//
// Memory is 32 bytes per slot divided by the load, so the table runs
// full: a shard grows when its load would pass 88–92% and is then resized
// to a load of 4/5 (its capacity and slack whole chunks; an ordered table
// keeps lookups short at such loads: a search stops at the first larger
// hash). An insertion shifts the rest of its cluster by one slot, about
// ½(1+1/(1−load)²) slots: 13 at 4/5, 50 at 9/10, 78 at 92% (and 128 at
// 15/16, which costs more CPU than the under 2 bytes a key it saves). A
// shard that would grow past maxShardChunks chunks splits instead into
// two of one more bit, half its chunks each. A resize re-places one
// shard's slots in new chunks, which replace its chunks in the table; so
// it moves at most one shard's slots (a few ms), however many keys the
// table holds, and never writes a chunk a snapshot shares. One entry
// grows one shard (more only past lateLoadPct, or at a shard's end), so
// that the shards' growths, which come close together as uniform hashes
// fill them alike, are spread over entries. Slots are stored in
// fixed-size chunks so that a snapshot shares them and a write after a
// snapshot copies one 128 KiB chunk at most (copy-on-write by generation).
//
// A key's lookup misses the cache (the table is far larger than it) and
// the next key's lookup waits for it; touch reads the slots of many keys
// at once, so that their misses overlap.

const (
	chunkBits = 12
	chunkSize = 1 << chunkBits // slots per chunk
	chunkMask = chunkSize - 1
	// shardSlack is the slack after each shard's capacity: the tail of its
	// last cluster (an insertion that would run past it grows the shard).
	shardSlack  = 256
	minTableCap = chunkSize - shardSlack
	// maxShardChunks is the largest shard capacity, in chunks: a shard that
	// would grow past it splits.
	maxShardChunks = 48
	// maxDirBits bounds the directory (and a shard's depth): a shard that
	// deep grows instead of splitting (only hashes crowded into a 2⁻¹⁶ of
	// the hash space come to it).
	maxDirBits = 16
	// maxLoadNum/maxLoadDen: a table restored from a snapshot starts at
	// most this full.
	maxLoadNum = 9
	maxLoadDen = 10
	// fullLoPct, fullHiPct: a shard grows past a load between these
	// (shard.setFull); lateLoadPct: past this one even if another shard
	// has grown in the same entry.
	fullLoPct   = 88
	fullHiPct   = 92
	lateLoadPct = 95
	// fitLoadNum/fitLoadDen: the load a resized shard starts at (4/5).
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

// shard is one run of chunks: slots [base, base+capa+shardSlack).
type shard struct {
	base   int    // first slot, a multiple of chunkSize
	capa   int    // capa+shardSlack a multiple of chunkSize
	n      int    // occupied slots
	full   int    // n at which the shard grows
	prefix uint64 // the top depth bits its hashes share
	depth  uint8
}

// setFull sets the load the shard grows past: between 88% and 92% of
// its capacity, by a hash of its prefix, depth and capacity. Uniform
// hashes fill shards of one size alike; with one load they would all grow
// within a few thousand keys of each other, and the resizes of the whole
// table would come together as one long pause.
func (sh *shard) setFull() {
	x := sh.prefix<<8 ^ uint64(sh.depth) ^ uint64(sh.capa)<<24
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	u := int(x >> 54) // 0..1023
	lo, hi := sh.capa*fullLoPct/100, sh.capa*fullHiPct/100
	sh.full = lo + (hi-lo)*u/1024
}

func (sh *shard) end() int { return sh.base + sh.capa + shardSlack }

// chunks returns how many chunks the shard spans.
func (sh *shard) chunks() int { return (sh.capa + shardSlack) / chunkSize }

type table struct {
	chunks []*chunk
	gens   []uint32 // generation each chunk was made private at
	capa   int      // the shards' capacities summed
	size   int      // len(chunks)·chunkSize
	n      int      // occupied slots
	sink   uint32   // what touch read
	shards []shard  // in hash order
	// grown: a shard has grown since the entry being applied began (the
	// state clears it at each entry); a shard past its growth load then
	// waits for a later entry, up to lateLoadPct.
	grown   bool
	dir     []int32 // shard by the top dirBits bits of a hash
	dirBits uint8
}

// fitCap returns the capacity for n keys at the resize load (at least
// minTableCap; with shardSlack, a multiple of chunkSize).
func fitCap(n int) int {
	return roundCap((n*fitLoadDen + fitLoadNum - 1) / fitLoadNum)
}

// roundCap returns the least capacity ≥ c (and ≥ minTableCap) that spans
// whole chunks with its slack.
func roundCap(c int) int {
	return max((c+shardSlack+chunkMask)&^chunkMask-shardSlack, minTableCap)
}

// init empties the table and lays it out for a total capacity of about
// capa: shards of one depth, each at most maxShardChunks chunks.
func (t *table) init(capa int) {
	d := uint8(0)
	for (capa>>d) > maxShardChunks*chunkSize-shardSlack && d < maxDirBits {
		d++
	}
	per := roundCap(capa >> d)
	t.shards = make([]shard, 1<<d)
	t.chunks, t.gens = nil, nil
	t.capa, t.n = 0, 0
	for i := range t.shards {
		t.shards[i] = shard{base: len(t.chunks) * chunkSize, capa: per, prefix: uint64(i), depth: d}
		t.shards[i].setFull()
		for range t.shards[i].chunks() {
			t.chunks = append(t.chunks, new(chunk))
			t.gens = append(t.gens, 0)
		}
		t.capa += per
	}
	t.size = len(t.chunks) * chunkSize
	t.dirBits = d
	t.rebuildDir()
}

// rebuildDir fills the directory from the shards (a shard of depth d
// covers 2^(dirBits−d) consecutive entries).
func (t *table) rebuildDir() {
	if cap(t.dir) >= 1<<t.dirBits {
		t.dir = t.dir[:1<<t.dirBits]
	} else {
		t.dir = make([]int32, 1<<t.dirBits)
	}
	k := 0
	for si := range t.shards {
		for range 1 << (t.dirBits - t.shards[si].depth) {
			t.dir[k] = int32(si)
			k++
		}
	}
}

func log2(n int) int {
	l := 0
	for 1<<l < n {
		l++
	}
	return l
}

// shardOf returns the index of h's shard.
func (t *table) shardOf(h uint64) int {
	if t.dirBits == 0 {
		return 0
	}
	return int(t.dir[h>>(64-t.dirBits)])
}

func (t *table) home(h uint64) int {
	sh := &t.shards[t.shardOf(h)]
	hi, _ := bits.Mul64(h<<sh.depth, uint64(sh.capa))
	return sh.base + int(hi)
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
// empty or holds a larger hash; past its shard's end if none in it) and
// false.
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
// must not be present. It may grow h's shard (which moves the slots of
// that shard and the indices of every later one).
func (t *table) insert(c *core, h uint64, lim uint32) int {
	i, _ := t.search(h)
	return t.insertAt(c, h, lim, i)
}

// insertAt is insert given i, where search placed the absent h (the table
// unchanged since).
func (t *table) insertAt(c *core, h uint64, lim uint32, i int) int {
	si := t.shardOf(h)
	if sh := &t.shards[si]; sh.n+1 > sh.full && (!t.grown || (sh.n+1)*100 > sh.capa*lateLoadPct) {
		t.grow(c, si)
		i, _ = t.search(h)
		si = t.shardOf(h)
	}
	for {
		sh := &t.shards[si]
		if end := sh.end(); i < end {
			if j := t.emptyFrom(i, end); j < end {
				t.shiftRight(c, i, j)
				*t.mut(c, i) = slot{hash: h, lim: lim}
				sh.n++
				t.n++
				return i
			}
		}
		t.grow(c, si)
		i, _ = t.search(h)
		si = t.shardOf(h)
	}
}

// emptyFrom returns the first empty slot in [i, end) (end if none; end is
// a multiple of chunkSize).
func (t *table) emptyFrom(i, end int) int {
	for ; i < end; i = i&^chunkMask + chunkSize {
		ch := t.chunks[i>>chunkBits]
		for k := i & chunkMask; k < chunkSize; k++ {
			if ch[k].lim == 0 {
				return i&^chunkMask | k
			}
		}
	}
	return end
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
// (A shard's first slot is at its home or empty, so no slot moves across
// shards.)
func (t *table) remove(c *core, i int) {
	t.shards[t.shardOf(t.at(i).hash)].n--
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

// grow resizes shard si to the resize load for one more key than it holds
// (at least one chunk more), or, if that would pass maxShardChunks chunks,
// splits it in two, re-placing its slots in new chunks.
func (t *table) grow(c *core, si int) {
	t.grown = true
	sh := t.shards[si]
	capa := max(fitCap(sh.n+1), sh.capa+chunkSize)
	if capa <= maxShardChunks*chunkSize-shardSlack || sh.depth >= maxDirBits {
		t.replace(c, si, []shard{{capa: capa, prefix: sh.prefix, depth: sh.depth}})
		return
	}
	// Split on the next hash bit: count each half's keys.
	lo := 0
	bit := uint64(1) << (63 - sh.depth)
	for ci := sh.base >> chunkBits; ci < sh.end()>>chunkBits; ci++ {
		for x := range t.chunks[ci] {
			if s := &t.chunks[ci][x]; s.lim != 0 && s.hash&bit == 0 {
				lo++
			}
		}
	}
	// Each half takes half the chunks (more only if its keys would pass the
	// highest growth load there), so that a split adds no memory; a half
	// past its growth load grows at its next insertion.
	d := sh.depth + 1
	half := func(n int) int {
		return max(sh.chunks()/2*chunkSize-shardSlack, roundCap(n*100/fullHiPct+1))
	}
	t.replace(c, si, []shard{
		{capa: half(lo), prefix: sh.prefix << 1, depth: d},
		{capa: half(sh.n - lo), prefix: sh.prefix<<1 | 1, depth: d},
	})
	if d > t.dirBits {
		t.dirBits = d
	}
	t.rebuildDir()
}

// replace re-places the slots of shard si in new chunks laid out as the
// shards ns (consecutive, covering si's hashes; their capa and depth set),
// and puts them in si's place. The chunks si had are left as they were
// (a snapshot may share them).
func (t *table) replace(c *core, si int, ns []shard) {
	old := t.shards[si]
	for {
		var chunks []*chunk
		base := old.base
		for k := range ns {
			ns[k].base, ns[k].n = base, 0
			for range ns[k].chunks() {
				chunks = append(chunks, new(chunk))
			}
			base = ns[k].end()
		}
		k, ok := place(chunks, ns, t, old)
		if ok {
			for k := range ns {
				ns[k].setFull()
			}
			t.splice(c, si, old, chunks, ns)
			return
		}
		ns[k].capa += max(ns[k].capa/2&^chunkMask, chunkSize) // pathological clustering
	}
}

// place puts every occupied slot of shard old of t into chunks, laid out
// as ns (one shard, or the two halves of a split), each at its home or
// just after the slot placed before it. It reports false and the shard
// that overflowed if they do not fit.
func place(chunks []*chunk, ns []shard, t *table, old shard) (int, bool) {
	k, sh := 0, &ns[0]
	next, end := sh.base, sh.end()
	for ci := old.base >> chunkBits; ci < old.end()>>chunkBits; ci++ {
		och := t.chunks[ci]
		for x := range och {
			s := &och[x]
			if s.lim == 0 {
				continue
			}
			if k == 0 && len(ns) == 2 && (s.hash<<old.depth)>>63 == 1 {
				k, sh = 1, &ns[1]
				next, end = sh.base, sh.end()
			}
			hi, _ := bits.Mul64(s.hash<<sh.depth, uint64(sh.capa))
			j := max(sh.base+int(hi), next)
			if j >= end {
				return k, false
			}
			r := j - old.base
			chunks[r>>chunkBits][r&chunkMask] = *s
			next = j + 1
			sh.n++
		}
	}
	return 0, true
}

// splice replaces shard si (old) and its chunks with ns and chunks.
func (t *table) splice(c *core, si int, old shard, chunks []*chunk, ns []shard) {
	c0, c1 := old.base/chunkSize, old.end()/chunkSize
	gens := make([]uint32, len(chunks))
	for i := range gens {
		gens[i] = c.gen
	}
	t.chunks = slices.Replace(t.chunks, c0, c1, chunks...)
	t.gens = slices.Replace(t.gens, c0, c1, gens...)
	t.shards = slices.Replace(t.shards, si, si+1, ns...)
	delta := len(chunks)*chunkSize - (old.end() - old.base)
	for k := si + len(ns); k < len(t.shards); k++ {
		t.shards[k].base += delta
	}
	for _, sh := range ns {
		t.capa += sh.capa
	}
	t.capa -= old.capa
	t.size = len(t.chunks) * chunkSize
}

// maybeShrink lays the table out anew at the resize load when it is below
// half that load, to return memory after a burst of keys has been swept.
func (t *table) maybeShrink(c *core) {
	if t.capa <= minTableCap || t.n*fitLoadDen*2 > t.capa*fitLoadNum {
		return
	}
	old := *t
	t.init(fitCap(t.n))
	for i := range t.gens {
		t.gens[i] = c.gen
	}
	next := 0
	old.each(func(_ int, s *slot) bool {
		next = t.placeNext(c, *s, next)
		return true
	})
}

// placeNext places sl (larger than every key placed so far; next is what
// the previous call returned, 0 at first) and returns what the next call
// takes. It may grow sl's shard.
func (t *table) placeNext(c *core, sl slot, next int) int {
	si := t.shardOf(sl.hash)
	for {
		sh := &t.shards[si]
		if sh.n+1 <= sh.full {
			i := max(t.home(sl.hash), next)
			if i < sh.end() {
				*t.mut(c, i) = sl
				sh.n++
				t.n++
				return i + 1
			}
		}
		t.grow(c, si)
		si = t.shardOf(sl.hash)
		next = t.afterLast(&t.shards[si])
	}
}

// afterLast returns one past the last occupied slot of shard sh, or where
// it starts.
func (t *table) afterLast(sh *shard) int {
	for i := sh.end() - 1; i >= sh.base; i-- {
		if t.at(i).lim != 0 {
			return i + 1
		}
	}
	return sh.base
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

// touchSlots is how many slots from a hash's home touch reads in a table
// of touchWideSlots slots or more: four cache lines of two slots. A
// search at the loads the table runs at (up to 92%) reads past the home
// slot's line about as often as not, and a miss that waits for the one
// before it costs as much again; read together, their misses overlap. An
// apply at fleet shape over 4.5M tracked keys took 11–15% less CPU a key
// than with the home's line alone. A smaller table stays mostly in the
// last-level cache, where the extra reads cost more than they save: at
// 100k keys (4 MiB of slots) bench/acquire's allocators took 1.3% more
// CPU a key-grant with them (docs/performance.md).
const (
	touchSlots     = 8
	touchWideSlots = 1 << 20
)

// touch reads the home slot of every hash in hs, and in a table of
// touchWideSlots slots or more the first touchSlots slots from it (the
// home's alone where they would pass its chunk's end), so that they are
// in the cache when the hashes are searched for next. The reads are
// independent, so their cache misses overlap.
func (t *table) touch(hs []uint64) {
	var x uint32
	wide := t.capa >= touchWideSlots
	for _, h := range hs {
		i := t.home(h)
		ch, k := t.chunks[i>>chunkBits], i&chunkMask
		x += ch[k].lim
		if wide && k+touchSlots <= chunkSize {
			x += ch[k+2].lim + ch[k+4].lim + ch[k+6].lim
		}
	}
	t.sink = x
}
