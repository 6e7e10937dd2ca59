package main

import (
	"strings"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// parseEntries turns repeated "-d key=value" flags into descriptor entries,
// in the order given. The value is everything after the first '=', so it
// may itself contain '=' or ','.
func parseEntries(flag string, kvs []string) ([]*allotv1.Entry, error) {
	out := make([]*allotv1.Entry, 0, len(kvs))
	for _, s := range kvs {
		k, v, ok := strings.Cut(s, "=")
		if !ok || k == "" {
			return nil, usagef("invalid %s %q: want key=value", flag, s)
		}
		out = append(out, &allotv1.Entry{Key: k, Value: v})
	}
	return out, nil
}

// parseDescriptor parses one whole descriptor given as
// "k1=v1,k2=v2"; a literal ',' in a value is written "\,", a literal
// backslash "\\".
func parseDescriptor(flag, s string) (*allotv1.Descriptor, error) {
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\' && i+1 < len(s) && (s[i+1] == ',' || s[i+1] == '\\'):
			cur.WriteByte(s[i+1])
			i++
		case c == ',':
			parts = append(parts, cur.String())
			cur.Reset()
		default:
			cur.WriteByte(c)
		}
	}
	parts = append(parts, cur.String())
	entries, err := parseEntries(flag, parts)
	if err != nil {
		return nil, err
	}
	return &allotv1.Descriptor{Entries: entries}, nil
}

// fmtEntries renders entries as "k1=v1, k2=v2" for humans.
func fmtEntries(es []*allotv1.Entry) string {
	parts := make([]string, len(es))
	for i, e := range es {
		parts[i] = e.GetKey() + "=" + e.GetValue()
	}
	return strings.Join(parts, ", ")
}
