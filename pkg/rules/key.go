package rules

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// The canonical budget key is
//
//	domain:k1=v1,k2=v2
//
// with '%', ':', ',', '=' and every byte below 0x20 written as %XX
// (upper-case hex) in the domain, keys and values. Every other byte,
// including UTF-8 and '*', is written as is. The encoding is injective:
// ParseKey inverts it, and only canonical keys parse.

const hexDigits = "0123456789ABCDEF"

// mustEscape reports whether b is written as %XX.
func mustEscape(b byte) bool {
	return b < 0x20 || b == '%' || b == ':' || b == ',' || b == '='
}

func appendEscaped(dst []byte, s string) []byte {
	start := 0
	for i := 0; i < len(s); i++ {
		if c := s[i]; mustEscape(c) {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '%', hexDigits[c>>4], hexDigits[c&15])
			start = i + 1
		}
	}
	return append(dst, s[start:]...)
}

// keyValue returns the value that goes into the budget key for entry i: the
// request's value, or the wildcard pattern when the rule's level at i shares
// its budget (share_threshold).
func keyValue(r *Rule, i int, e *Entry) string {
	if r != nil && i < len(r.levels) {
		if l := &r.levels[i]; l.share && l.key == e.Key {
			return l.value
		}
	}
	return e.Value
}

// AppendKey appends the canonical budget key of (domain, entries) under rule
// r to dst. r may be nil. When r has share_threshold levels, those levels
// contribute the wildcard pattern instead of the request's value, so every
// matching value shares one budget.
func AppendKey(dst []byte, r *Rule, domain string, entries []Entry) []byte {
	dst = appendEscaped(dst, domain)
	dst = append(dst, ':')
	for i := range entries {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = appendEscaped(dst, entries[i].Key)
		dst = append(dst, '=')
		dst = appendEscaped(dst, keyValue(r, i, &entries[i]))
	}
	return dst
}

// hashEscaped writes s, escaped, into d without allocating.
func hashEscaped(d *xxhash.Digest, s string) {
	start := 0
	for i := 0; i < len(s); i++ {
		if c := s[i]; mustEscape(c) {
			if start < i {
				_, _ = d.WriteString(s[start:i])
			}
			esc := [3]byte{'%', hexDigits[c>>4], hexDigits[c&15]}
			_, _ = d.Write(esc[:])
			start = i + 1
		}
	}
	if start < len(s) {
		_, _ = d.WriteString(s[start:])
	}
}

var (
	sepColon = []byte{':'}
	sepComma = []byte{','}
	sepEq    = []byte{'='}
)

// KeyHash returns xxhash64 of AppendKey(nil, r, domain, entries), computed
// without allocating: keys up to 256 bytes are built in a stack buffer and
// hashed in one call, longer ones are streamed into the digest. Use it to
// index budgets; it is deterministic across processes and versions.
func KeyHash(r *Rule, domain string, entries []Entry) uint64 {
	var buf [256]byte
	// Every byte escapes to at most 3, so a short raw key always fits;
	// only longer ones need the exact count.
	raw := len(domain) + 1
	for i := range entries {
		raw += len(entries[i].Key) + len(keyValue(r, i, &entries[i])) + 2
	}
	if raw*3 <= len(buf) || keyLenAtMost(r, domain, entries, len(buf)) {
		return xxhash.Sum64(AppendKey(buf[:0], r, domain, entries))
	}
	return streamKeyHash(r, domain, entries)
}

// keyLenAtMost reports whether the escaped key fits in max bytes, counting
// each byte to escape as 3.
func keyLenAtMost(r *Rule, domain string, entries []Entry, max int) bool {
	n := escapedLen(domain) + 1
	for i := range entries {
		n += escapedLen(entries[i].Key) + 1 + escapedLen(keyValue(r, i, &entries[i]))
		if i > 0 {
			n++
		}
		if n > max {
			return false
		}
	}
	return n <= max
}

func escapedLen(s string) int {
	n := len(s)
	for i := 0; i < len(s); i++ {
		if mustEscape(s[i]) {
			n += 2
		}
	}
	return n
}

// streamKeyHash hashes the key by writing its pieces into a digest.
func streamKeyHash(r *Rule, domain string, entries []Entry) uint64 {
	var d xxhash.Digest
	d.Reset()
	hashEscaped(&d, domain)
	_, _ = d.Write(sepColon)
	for i := range entries {
		if i > 0 {
			_, _ = d.Write(sepComma)
		}
		hashEscaped(&d, entries[i].Key)
		_, _ = d.Write(sepEq)
		hashEscaped(&d, keyValue(r, i, &entries[i]))
	}
	return d.Sum64()
}

// ErrBadKey is wrapped by every ParseKey error.
var ErrBadKey = errors.New("rules: malformed budget key")

// ParseKey splits a canonical budget key into its domain and entries. It
// accepts only canonical keys (AppendKey(nil, nil, ParseKey(k)) == k): upper-case
// %XX escapes of exactly the escaped bytes, no raw control bytes.
func ParseKey(key string) (domain string, entries []Entry, err error) {
	colon := strings.IndexByte(key, ':')
	if colon < 0 {
		return "", nil, fmt.Errorf("%w: no ':' after the domain", ErrBadKey)
	}
	if domain, err = unescape(key[:colon]); err != nil {
		return "", nil, err
	}
	rest := key[colon+1:]
	if rest == "" {
		return domain, nil, nil
	}
	entries = make([]Entry, 0, strings.Count(rest, ",")+1)
	for {
		part := rest
		i := strings.IndexByte(rest, ',')
		if i >= 0 {
			part, rest = rest[:i], rest[i+1:]
		}
		eq := strings.IndexByte(part, '=')
		if eq < 0 {
			return "", nil, fmt.Errorf("%w: entry %q has no '='", ErrBadKey, part)
		}
		k, err := unescape(part[:eq])
		if err != nil {
			return "", nil, err
		}
		v, err := unescape(part[eq+1:])
		if err != nil {
			return "", nil, err
		}
		entries = append(entries, Entry{Key: k, Value: v})
		if i < 0 {
			break
		}
	}
	return domain, entries, nil
}

func unhex(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// unescape decodes one canonical component.
func unescape(s string) (string, error) {
	if strings.IndexByte(s, '%') < 0 {
		for i := 0; i < len(s); i++ {
			if mustEscape(s[i]) {
				return "", fmt.Errorf("%w: unescaped byte 0x%02x", ErrBadKey, s[i])
			}
		}
		return s, nil
	}
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '%' {
			if mustEscape(c) {
				return "", fmt.Errorf("%w: unescaped byte 0x%02x", ErrBadKey, c)
			}
			b = append(b, c)
			continue
		}
		if i+2 >= len(s) {
			return "", fmt.Errorf("%w: truncated escape", ErrBadKey)
		}
		hi, ok1 := unhex(s[i+1])
		lo, ok2 := unhex(s[i+2])
		if !ok1 || !ok2 {
			return "", fmt.Errorf("%w: bad escape %q", ErrBadKey, s[i:i+3])
		}
		d := hi<<4 | lo
		if !mustEscape(d) {
			return "", fmt.Errorf("%w: needless escape %q", ErrBadKey, s[i:i+3])
		}
		b = append(b, d)
		i += 2
	}
	return string(b), nil
}

// RedactKey returns a short, stable stand-in for a budget key, for logs and
// error texts: "key#" and the first 8 hex digits of the key's xxhash64.
// Budget keys hold descriptor values (API keys, client IPs, user ids),
// which must never reach a log or a metric; the hash still lets an operator
// correlate log lines with a key they know (allotctl inspect prints it).
func RedactKey(key string) string {
	const hexdigits = "0123456789abcdef"
	h := xxhash.Sum64String(key)
	var b [12]byte
	copy(b[:], "key#")
	for i := range 8 {
		b[4+i] = hexdigits[(h>>(60-4*i))&0xf]
	}
	return string(b[:])
}
