package state

import (
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// decodeEntry decodes the entry at link of key h from pages into e (its
// leases slice is reused). It reports false if link does not name a
// well-formed entry.
func decodeEntry(pages [][]byte, lc *leaseCodec, link uint32, h uint64, e *entry) bool {
	b, ok := arenaHead(pages, link)
	if !ok {
		return false
	}
	n, at, size, ok := parseHeader(b, e)
	if !ok {
		return false
	}
	e.link, e.size = link, blockSize(size)
	e.leases = lc.decodeLeases(e.leases[:0], b[at:], n, h, e.base)
	return true
}

// loadEntry decodes the live entry at link of key h into e.
func (c *core) loadEntry(e *entry, h uint64, link uint32) {
	if !decodeEntry(c.ar.pages, &c.codec, link, h, e) {
		panic(fmt.Sprintf("state: key %016x: corrupt lease entry at %#x", h, link))
	}
}

// keyOf appends e's canonical key to dst.
func (c *core) keyOf(dst []byte, e *entry) []byte {
	return joinKey(dst, c.tpls.strs[e.tpl], e.value)
}

// splitNew splits key (canonical) into c.scr.tpl and c.scr.val, for
// newEntry, and returns the id its template has or will get and the
// values' length.
func (c *core) splitNew(key []byte) (tpl uint32, vlen int) {
	var ok bool
	c.scr.tpl, c.scr.val, ok = splitKey(key, c.scr.tpl[:0], c.scr.val[:0])
	if !ok {
		// AppendKey's output always splits; keep the whole key as the
		// template rather than fail.
		c.scr.tpl, c.scr.val = append(c.scr.tpl[:0], key...), c.scr.val[:0]
	}
	return c.tpls.peek(c.scr.tpl), len(c.scr.val)
}

// newEntry prepares e as a new entry, with no lease, for the key split by
// splitNew, interning its template. The caller stores it (storeEntry).
func (c *core) newEntry(e *entry) {
	*e = entry{leases: e.leases[:0], tpl: c.tpls.ref(c.scr.tpl), value: c.scr.val}
}

// addLease inserts l at position i of e (key h's entry) and counts it.
func (c *core) addLease(e *entry, i int, l lease) {
	ag := c.mutAgent(c.byNum[l.agent])
	ag.keysHeld++
	ag.tokensHeld += l.held
	c.leases++
	e.leases = slices.Insert(e.leases, i, l)
}

// dropLease ends lease i of e (key h's entry). Its tokens are not credited
// back: the agent may have spent them (docs/architecture.md, invariant
// (c)).
func (c *core) dropLease(e *entry, i int, h uint64) {
	l := e.leases[i]
	if ag := c.byNum[l.agent]; ag != nil {
		ag = c.mutAgent(ag)
		ag.keysHeld--
		ag.tokensHeld -= l.held
	}
	if l.ext {
		delete(c.codec.ext, extKey{h, l.agent})
	}
	e.leases = slices.Delete(e.leases, i, i+1)
	c.leases--
}

// storeEntry writes e, key h's entry (slot idx), back to the arena:
// freeing it when it has no lease left, allocating or moving it when its
// size changed, and queueing it on the expiry wheel when its earliest
// expiry moved earlier than oldMin (a second), when it moved to another
// block, or when consumed (its wheel entry was just taken).
func (c *core) storeEntry(h uint64, idx int, e *entry, oldMin int64, consumed bool) {
	if len(e.leases) == 0 {
		if e.link != 0 {
			c.ar.release(c, e.link, e.size)
			c.tab.mut(c, idx).link = 0
		}
		c.tpls.unref(e.tpl)
		e.link, e.size = 0, 0
		return
	}
	size := blockSize(entrySize(len(e.leases), e.tpl, len(e.value)))
	push := consumed
	var old uint32
	oldSize := e.size
	switch {
	case e.link == 0:
		e.link, e.size, push = c.ar.alloc(c, size), size, true
		c.tab.mut(c, idx).link = e.link
	case size == e.size:
	case size < e.size && e.size <= arenaLarge:
		c.ar.split(c, e.link, e.size, size)
		e.size = size
	default:
		old = e.link
		e.link, e.size, push = c.ar.alloc(c, size), size, true
		c.tab.mut(c, idx).link = e.link
	}
	b := c.ar.mut(c, e.link, size)
	c.codec.encode(b, e, h) // e.value may alias the old block: release it after
	m := e.minSec()
	if push || m < oldMin {
		e.queued = uint8(m)
		setQueued(b, e.queued)
		c.wheel.push(m, e.link)
	}
	if old != 0 {
		c.ar.release(c, old, oldSize)
	}
}

// setQueued writes the queued byte of the entry b.
func setQueued(b []byte, q uint8) {
	w := binary.LittleEndian.Uint64(b)
	w = w&^(0xff<<baseBits) | uint64(q)<<baseBits
	binary.LittleEndian.PutUint64(b, w)
}

// expireEntry takes the wheel entry (s, link) at now: it ends the key's
// due leases and re-queues the key, or ignores the entry if it is stale.
func (c *core) expireEntry(s int64, link uint32, now int64) {
	e := &c.scr.e
	b, ok := c.ar.head(link)
	if !ok {
		return
	}
	if _, _, _, ok := parseHeader(b, e); !ok || e.queued != uint8(s) {
		return
	}
	c.scr.key = c.keyOf(c.scr.key[:0], e)
	h := xxhash.Sum64(c.scr.key)
	idx := c.tab.find(h)
	if idx < 0 || c.tab.at(idx).link != link {
		return
	}
	c.loadEntry(e, h, link)
	oldMin := e.minSec()
	due := false
	for i := 0; i < len(e.leases); {
		if e.leases[i].expiry <= now {
			c.dropLease(e, i, h)
			due = true
			continue
		}
		i++
	}
	if due {
		c.storeEntry(h, idx, e, oldMin, true)
		return
	}
	// Nothing due yet: re-queue at the earliest expiry.
	e.queued = uint8(oldMin)
	setQueued(c.ar.mut(c, link, e.size), e.queued)
	c.wheel.push(oldMin, link)
}

// rebuildWheel queues every leased key afresh (after Restore or
// compaction, when no old entry may remain).
func (c *core) rebuildWheel() {
	c.wheel.init()
	e := &c.scr.e
	t := &c.tab
	for i := 0; i < t.size; i++ {
		s := t.at(i)
		if s.link == 0 {
			continue
		}
		c.loadEntry(e, s.hash, s.link)
		m := e.minSec()
		setQueued(c.ar.mut(c, s.link, e.size), uint8(m))
		c.wheel.push(m, s.link)
	}
}

// maybeCompact rebuilds the arena when more than a third of it is free
// (and it is more than a few pages), copying the live entries in table
// order into fresh pages. It waits while a snapshot shares the pages.
func (c *core) maybeCompact() {
	a := &c.ar
	if c.cow || a.idle*2 <= a.live || len(a.pages) < 9 {
		return
	}
	c.compact()
}

func (c *core) compact() {
	old := c.ar
	c.ar.init()
	c.ar.maxPages = old.maxPages
	e := &c.scr.e
	t := &c.tab
	for i := 0; i < t.size; i++ {
		s := t.at(i)
		if s.link == 0 {
			continue
		}
		b, _ := arenaHead(old.pages, s.link)
		_, _, size, ok := parseHeader(b, e)
		if !ok {
			panic(fmt.Sprintf("state: key %016x: corrupt lease entry at %#x", s.hash, s.link))
		}
		size = blockSize(size)
		l := c.ar.alloc(c, size)
		copy(c.ar.mut(c, l, size), b[:size])
		t.mut(c, i).link = l
	}
	c.rebuildWheel()
}
