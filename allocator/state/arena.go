package state

// The arena stores the leased keys' entries (entry.go) as byte blocks in
// 64 KiB pages, so that a leased key costs no Go object, no string header
// and no pointer for the garbage collector to trace. A block is named by a
// uint32 link: tag<<31 | page<<15 | offset/2 (blocks are 2-byte aligned),
// so an arena addresses 4 GiB; page 0 is never used, so link 0 names no
// block. A block larger than arenaLarge gets a page of its own (its link
// has offset 0).
//
// Freed blocks go on exact-size free lists. An allocation takes a free
// block of its size, else bumps the current page, else splits the smallest
// free block that leaves a usable remainder, else opens a page; a page
// tail too short for the next block goes on its free list. An entry that
// shrinks moves into a free block of its new size when there is one,
// freeing its whole block, and otherwise shrinks in place, freeing its
// tail (core.storeEntry): a tail of a lease or two is shorter than any
// entry, so under steady lease churn, leases added and ended all the
// time, shrinking in place alone would leave free space that only
// compaction takes back (TestLeaseChurnNeedsNoCompaction).
//
// Compaction is incremental (core.compactStep): when more than a third of
// the arena is free, a new arena with the other tag takes all allocations,
// and each Expire moves a bounded number of entries into it, in hash order;
// when every key has been passed, the old arena is dropped whole. The tag
// bit tells which arena a link is in.
//
// A free block starts with eight zero bytes, which no entry does (an entry
// always has at least one lease, encoded in its first word), followed by
// the next free link and the block size.
//
// Pages are shared copy-on-write with snapshots, like the table's chunks:
// a page whose generation is older than the core's is copied before its
// first write.

import (
	"encoding/binary"
	"math/bits"
)

const (
	arenaPageBits = 16
	arenaPageSize = 1 << arenaPageBits
	arenaOffBits  = arenaPageBits - 1 // offsets in 2-byte units
	arenaOffMask  = 1<<arenaOffBits - 1
	arenaMaxPages = 1 << (31 - arenaOffBits) // 4 GiB of pages
	arenaLarge    = arenaPageSize / 4        // larger blocks get their own page
	minBlock      = 16                       // a free block's marker, link and size
)

type arena struct {
	tag   uint32   // 0 or 1: bit 31 of its links
	pages [][]byte // nil: a released large page (its index is on freePages)
	gens  []uint32 // generation each page was made private at
	// free[s/2] is the first free block of s bytes (0: none); nonEmpty has
	// bit s/2 set when free[s/2] != 0.
	free      []uint32
	nonEmpty  []uint64
	freePages []uint32 // released page indices, reused first
	cur       int      // page being filled, -1 when none
	off       int      // next free byte of cur
	live      int64    // bytes in live blocks
	idle      int64    // bytes in free blocks and lost page tails
	maxPages  int      // arenaMaxPages (tests lower it)
}

func (a *arena) init(tag uint32) {
	// Page 0 is never allocated, so that link 0 names no block.
	*a = arena{tag: tag, pages: [][]byte{nil}, gens: []uint32{0}, free: make([]uint32, arenaLarge/2+1), cur: -1,
		nonEmpty: make([]uint64, (arenaLarge/2+1+63)/64), maxPages: arenaMaxPages}
}

// blockSize rounds an entry's size up to the arena's 2-byte alignment.
func blockSize(n int) int { return max(n+n&1, minBlock) }

func (a *arena) mkLink(page, off int) uint32 {
	return a.tag<<31 | uint32(page)<<arenaOffBits | uint32(off/2)
}

func linkTag(l uint32) uint32 { return l >> 31 }
func linkPage(l uint32) int   { return int(l >> arenaOffBits & (arenaMaxPages - 1)) }
func linkOff(l uint32) int    { return int(l&arenaOffMask) * 2 }

// bytes returns the block at l (size bytes) for reading. The caller knows
// the link is live.
func (a *arena) bytes(l uint32, size int) []byte {
	p, off := linkPage(l), linkOff(l)
	return a.pages[p][off : off+size : off+size]
}

// pageSets are the pages of the arenas, by tag (nil: no such arena), for
// reading entries: the live state's (core.pageSets) or a snapshot's.
type pageSets [2][][]byte

// head returns the bytes from l to the end of its page if l may name a
// live entry. A link that may be stale (the wheel's) can name anything:
// the caller checks that the key's slot links to it.
func (ps *pageSets) head(l uint32) ([]byte, bool) {
	pages := ps[linkTag(l)]
	p, off := linkPage(l), linkOff(l)
	if p >= len(pages) || pages[p] == nil || off+minBlock > len(pages[p]) {
		return nil, false
	}
	b := pages[p][off:]
	if binary.LittleEndian.Uint64(b) == 0 {
		return nil, false // a free block
	}
	return b, true
}

// mut returns the block at l for writing, copying its page first if a
// snapshot shares it.
func (a *arena) mut(c *core, l uint32, size int) []byte {
	p, off := linkPage(l), linkOff(l)
	if c.cow && a.gens[p] != c.gen {
		a.pages[p] = append(make([]byte, 0, len(a.pages[p])), a.pages[p]...)
		a.gens[p] = c.gen
	}
	return a.pages[p][off : off+size : off+size]
}

// canAlloc reports whether alloc(size) will succeed.
func (a *arena) canAlloc(size int) bool {
	size = blockSize(size)
	if len(a.freePages) > 0 || len(a.pages) < a.maxPages {
		return true
	}
	if size > arenaLarge {
		return false
	}
	return a.free[size/2] != 0 || (a.cur >= 0 && a.off+size <= arenaPageSize) || a.fit(size) != 0
}

// canAllocAll reports whether allocs of sizes, one after another, will
// all succeed. It counts the pages they open as if every block were bumped
// from the current page or a new one, not cut from a free block (which
// alloc tries first, opening no page): so it may refuse blocks that would
// fit in free ones, never accept blocks that do not fit.
func (a *arena) canAllocAll(sizes []int) bool {
	pages := a.maxPages - len(a.pages) + len(a.freePages)
	cur, off := a.cur >= 0, a.off
	for _, size := range sizes {
		size = blockSize(size)
		switch {
		case size > arenaLarge:
			pages--
		case cur && off+size <= arenaPageSize:
			off += size
			continue
		default:
			pages--
			cur, off = true, size
		}
		if pages < 0 {
			return false
		}
	}
	return true
}

// fit returns the smallest size s ≥ size+minBlock with a free block (0:
// none), so that a block of size can be cut from it.
func (a *arena) fit(size int) int {
	i := (size + minBlock) / 2
	for w := i / 64; w < len(a.nonEmpty); w++ {
		m := a.nonEmpty[w]
		if w == i/64 {
			m &^= 1<<(i%64) - 1
		}
		if m != 0 {
			return (w*64 + bits.TrailingZeros64(m)) * 2
		}
	}
	return 0
}

// popFree takes the first free block of s bytes.
func (a *arena) popFree(s int) uint32 {
	l := a.free[s/2]
	a.free[s/2] = binary.LittleEndian.Uint32(a.bytes(l, s)[8:])
	if a.free[s/2] == 0 {
		a.nonEmpty[s/128] &^= 1 << (s / 2 % 64)
	}
	return l
}

// newPage returns a page index for a page of n bytes.
func (a *arena) newPage(c *core, n int) int {
	pg := make([]byte, n)
	if k := len(a.freePages); k > 0 {
		p := int(a.freePages[k-1])
		a.freePages = a.freePages[:k-1]
		a.pages[p], a.gens[p] = pg, c.gen
		return p
	}
	a.pages = append(a.pages, pg)
	a.gens = append(a.gens, c.gen)
	return len(a.pages) - 1
}

// alloc returns a block of size bytes (rounded by blockSize; its content
// is undefined). Call canAlloc first: alloc panics when the arena is full.
func (a *arena) alloc(c *core, size int) uint32 {
	size = blockSize(size)
	if !a.canAlloc(size) {
		panic("state: lease arena full") // callers check canAlloc
	}
	a.live += int64(size)
	if size > arenaLarge {
		return a.mkLink(a.newPage(c, size), 0)
	}
	if a.free[size/2] != 0 {
		a.idle -= int64(size)
		return a.popFree(size)
	}
	if a.cur < 0 || a.off+size > arenaPageSize {
		if s := a.fit(size); s != 0 {
			l := a.popFree(s)
			a.idle -= int64(size)
			a.pushFree(c, l+uint32(size/2), s-size)
			return l
		}
		if a.cur >= 0 {
			a.retireTail(c)
		}
		a.cur, a.off = a.newPage(c, arenaPageSize), 0
	}
	l := a.mkLink(a.cur, a.off)
	a.off += size
	return l
}

// retireTail puts the unused end of the current page on a free list.
func (a *arena) retireTail(c *core) {
	n := arenaPageSize - a.off
	a.idle += int64(n)
	if n >= minBlock {
		a.pushFree(c, a.mkLink(a.cur, a.off), n)
	}
	a.off = arenaPageSize
}

// release frees the block at l of size bytes.
func (a *arena) release(c *core, l uint32, size int) {
	size = blockSize(size)
	a.live -= int64(size)
	if linkOff(l) == 0 && len(a.pages[linkPage(l)]) == size && size > arenaLarge {
		p := linkPage(l)
		a.pages[p] = nil
		a.freePages = append(a.freePages, uint32(p))
		return
	}
	a.idle += int64(size)
	a.pushFree(c, l, size)
}

func (a *arena) pushFree(c *core, l uint32, size int) {
	b := a.mut(c, l, size)
	binary.LittleEndian.PutUint64(b, 0)
	binary.LittleEndian.PutUint32(b[8:], a.free[size/2])
	binary.LittleEndian.PutUint32(b[12:], uint32(size))
	a.free[size/2] = l
	a.nonEmpty[size/128] |= 1 << (size / 2 % 64)
}

// split frees the tail of the block at l beyond its first keep bytes (the
// entry at l shrank in place); keep and size are block sizes and the tail
// is at least minBlock bytes. A block with a page of its own is not split.
func (a *arena) split(c *core, l uint32, size, keep int) {
	a.live -= int64(size - keep)
	a.idle += int64(size - keep)
	a.pushFree(c, l+uint32(keep/2), size-keep)
}
