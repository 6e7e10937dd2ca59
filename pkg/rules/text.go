package rules

import "unicode/utf8"

// ValidText reports whether s can travel as a descriptor's domain, entry key
// or value: valid UTF-8 (a proto3 string field refuses anything else) with
// no control characters (below 0x20, DEL, and U+0080–U+009F). Length limits
// are the caller's. ASCII takes a byte loop; other text is decoded rune by
// rune. It does not allocate.
func ValidText(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return false
			}
			continue
		}
		return validUTF8Text(s[i:])
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
