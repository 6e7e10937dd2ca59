package state

import (
	"testing"

	"pgregory.net/rapid"
)

// TestTouchEntryStaysInBounds: touchEntry reads only inside the page a
// link names, whatever the link and the bytes there (a free block, a
// released large page, a block at a page's end, a header claiming 127
// leases), so reading ahead can never panic.
func TestTouchEntryStaysInBounds(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		pages := make([][]byte, rapid.IntRange(0, 4).Draw(t, "pages"))
		for i := range pages {
			switch rapid.IntRange(0, 2).Draw(t, "kind") {
			case 0: // released
			case 1:
				pages[i] = make([]byte, arenaPageSize)
			default:
				pages[i] = make([]byte, rapid.IntRange(0, arenaLarge*2).Draw(t, "large"))
			}
			for j := range min(len(pages[i]), 4096) {
				pages[i][j] = rapid.Byte().Draw(t, "b")
			}
		}
		page := rapid.IntRange(0, 5).Draw(t, "page")
		off := rapid.IntRange(0, arenaPageSize/2-1).Draw(t, "off") * 2
		l := uint32(page)<<arenaOffBits | uint32(off/2)
		touchEntry(pages, l)
	})
}
