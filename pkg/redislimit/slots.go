package redislimit

import (
	"strconv"
	"sync"
)

// Redis Cluster places a key on one of 16384 slots: CRC16 (XMODEM) of the
// key's hash tag (the part between the first '{' and the next '}', when that
// is non-empty) modulo 16384. Every key this package writes carries an
// explicit tag picked from a precomputed table with one short tag per slot,
// so the package chooses each key's slot itself: a budget key's slot follows
// its hash, and a hot key's sub-keys are spread across the slot space on
// purpose (see subSlot).

// numSlots is the number of Redis Cluster hash slots.
const numSlots = 16384

// crcTable is the CRC16-CCITT (XMODEM) table, polynomial 0x1021.
var crcTable = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()

// crc16 is the CRC16 Redis Cluster hashes keys with.
func crc16(s string) uint16 {
	var c uint16
	for i := 0; i < len(s); i++ {
		c = c<<8 ^ crcTable[byte(c>>8)^s[i]]
	}
	return c
}

// keySlot returns the cluster slot of a full Redis key, honouring hash tags
// as Redis does.
func keySlot(key string) int {
	for i := 0; i < len(key); i++ {
		if key[i] == '{' {
			for j := i + 1; j < len(key); j++ {
				if key[j] == '}' {
					if j > i+1 {
						return int(crc16(key[i+1:j])) % numSlots
					}
					break
				}
			}
			break
		}
	}
	return int(crc16(key)) % numSlots
}

var (
	slotTagsOnce sync.Once
	slotTags     *[numSlots]string
)

// slotTag returns a short alphanumeric tag whose CRC16 lands on slot s.
// The table is built on first use by trying base-36 strings in order until
// every slot has one (about 170k CRCs, a few milliseconds); the result is
// deterministic, so every agent derives the same key names.
func slotTag(s int) string {
	slotTagsOnce.Do(func() {
		t := new([numSlots]string)
		left := numSlots
		var buf []byte
		for c := uint64(0); left > 0; c++ {
			buf = strconv.AppendUint(buf[:0], c, 36)
			slot := int(crc16(string(buf))) % numSlots
			if t[slot] == "" {
				t[slot] = string(buf)
				left--
			}
		}
		slotTags = t
	})
	return slotTags[s]
}

// subSlot returns the slot of sub-key i of n for a key with hash h. The slot
// space is cut into n equal parts and sub-key i lands in the middle half of
// part i, at an offset that follows the key's hash. A cluster whose masters
// own contiguous, roughly equal slot ranges (what `redis-cli --cluster
// create` and rebalancing produce) therefore puts the sub-keys of one key on
// different masters whenever n ≤ masters, and spreads them evenly when n is
// a multiple of the number of masters, while different keys still use
// different slots within each part.
func subSlot(h uint64, n, i int) int {
	lo := i * numSlots / n
	hi := (i + 1) * numSlots / n
	span := hi - lo
	if span < 4 {
		return lo
	}
	return lo + span/4 + int(h%uint64(span/2))
}
