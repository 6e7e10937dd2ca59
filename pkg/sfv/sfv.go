// Package sfv writes the small subset of HTTP Structured Field Values
// (RFC 9651) that the RateLimit and RateLimit-Policy fields of
// draft-ietf-httpapi-ratelimit-headers need: Lists of String items with
// Integer parameters.
//
// Every function appends to a caller-owned buffer and never fails: input that
// cannot be represented is sanitised (strings) or clamped (integers), so the
// output is always a syntactically valid field value. Most callers want
// AppendPolicy and AppendRateLimit. All functions are safe for concurrent use.
package sfv

// MaxInteger is the largest magnitude an sf-integer may have (15 digits).
const MaxInteger = 999_999_999_999_999

// MaxStringLen bounds the sanitised content of a String written by
// AppendString (before escaping). Longer input is truncated.
const MaxStringLen = 128

// Replacement is written in place of every byte that an sf-string cannot hold
// (control characters, DEL and non-ASCII bytes).
const Replacement = '_'

// AppendString appends s as an sf-string: DQUOTE, the printable-ASCII content
// with '"' and '\' backslash-escaped, DQUOTE. Bytes outside %x20-7E become
// Replacement, and content beyond MaxStringLen bytes is dropped, so the result
// is always a valid sf-string whatever s holds.
func AppendString(dst []byte, s string) []byte {
	if len(s) > MaxStringLen {
		s = s[:MaxStringLen]
	}
	dst = append(dst, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			dst = append(dst, '\\', c)
		case c < 0x20 || c > 0x7e:
			dst = append(dst, Replacement)
		default:
			dst = append(dst, c)
		}
	}
	return append(dst, '"')
}

// AppendInteger appends v as an sf-integer, clamped to ±MaxInteger.
func AppendInteger(dst []byte, v int64) []byte {
	if v > MaxInteger {
		v = MaxInteger
	} else if v < -MaxInteger {
		v = -MaxInteger
	}
	if v < 0 {
		dst = append(dst, '-')
		v = -v
	}
	var buf [16]byte
	i := len(buf)
	for {
		i--
		buf[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			break
		}
	}
	return append(dst, buf[i:]...)
}

// AppendIntParam appends the parameter ";key=v". key must be a valid sf key
// (lcalpha or "*", then lcalpha, DIGIT, "_", "-", ".", "*"); the callers in
// this module pass constants. An invalid key is replaced by "x" so that the
// output stays valid.
func AppendIntParam(dst []byte, key string, v int64) []byte {
	dst = append(dst, ';')
	if validKey(key) {
		dst = append(dst, key...)
	} else {
		dst = append(dst, 'x')
	}
	dst = append(dst, '=')
	return AppendInteger(dst, v)
}

// AppendPolicy appends one RateLimit-Policy list member:
// "<name>";q=<quota>;w=<window seconds>. A window ≤ 0 omits w. When dst is
// not empty a ", " separator is written first, so successive calls build a
// List.
func AppendPolicy(dst []byte, name string, quota, windowSeconds int64) []byte {
	dst = appendSep(dst)
	dst = AppendString(dst, name)
	dst = AppendIntParam(dst, "q", quota)
	if windowSeconds > 0 {
		dst = AppendIntParam(dst, "w", windowSeconds)
	}
	return dst
}

// AppendRateLimit appends one RateLimit list member:
// "<name>";r=<remaining>;t=<seconds>. A negative t omits the parameter.
// Remaining below zero is written as 0. When dst is not empty a ", "
// separator is written first.
func AppendRateLimit(dst []byte, name string, remaining, t int64) []byte {
	dst = appendSep(dst)
	dst = AppendString(dst, name)
	if remaining < 0 {
		remaining = 0
	}
	dst = AppendIntParam(dst, "r", remaining)
	if t >= 0 {
		dst = AppendIntParam(dst, "t", t)
	}
	return dst
}

func appendSep(dst []byte) []byte {
	if len(dst) > 0 {
		dst = append(dst, ',', ' ')
	}
	return dst
}

func validKey(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		lc := c >= 'a' && c <= 'z'
		if i == 0 {
			if !lc && c != '*' {
				return false
			}
			continue
		}
		if !lc && !(c >= '0' && c <= '9') && c != '_' && c != '-' && c != '.' && c != '*' {
			return false
		}
	}
	return true
}
