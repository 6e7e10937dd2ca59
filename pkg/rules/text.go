package rules

import (
	"encoding/binary"
	"unicode/utf8"
)

// ValidText reports whether s can travel as a descriptor's domain, entry key
// or value: valid UTF-8 (a proto3 string field refuses anything else) with
// no control characters (below 0x20, DEL, and U+0080–U+009F). Length limits
// are the caller's. ASCII is checked eight bytes at a time; other text is
// decoded rune by rune. It does not allocate.
func ValidText(s string) bool {
	const (
		lo   = 0x0101010101010101
		high = 0x8080808080808080
	)
	i := 0
	for ; i+8 <= len(s); i += 8 {
		x := binary.LittleEndian.Uint64([]byte(s[i : i+8]))
		if x&high != 0 {
			return validUTF8Text(s[i:])
		}
		// A byte below 0x20, or equal to 0x7f (x^0x7f… has a zero byte).
		y := x ^ (0x7f * lo)
		if (x-0x20*lo)&^x&high != 0 || (y-lo)&^y&high != 0 {
			return false
		}
	}
	for ; i < len(s); i++ {
		c := s[i]
		if c >= utf8.RuneSelf {
			return validUTF8Text(s[i:])
		}
		if c < 0x20 || c == 0x7f {
			return false
		}
	}
	return true
}

func validUTF8Text(s string) bool {
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		if r == utf8.RuneError && n <= 1 {
			return false
		}
		if r < 0x20 || (r >= 0x7f && r < 0xa0) {
			return false
		}
		s = s[n:]
	}
	return true
}
