package raftmux

import (
	"errors"
	"testing"
)

func TestHeaderRoundTrip(t *testing.T) {
	for _, id := range []uint32{0, 1, 7, 1 << 16, 1<<32 - 1} {
		h := AppendHeader(nil, id)
		if len(h) != HeaderLen || !Tagged(h[0]) {
			t.Fatalf("AppendHeader(%d) = % x", id, h)
		}
		got, err := ParseHeader(h)
		if err != nil || got != id {
			t.Fatalf("ParseHeader(AppendHeader(%d)) = %d, %v", id, got, err)
		}
	}
}

func TestParseHeaderRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"short", []byte{0xA7, 'r', 'g', 1, 0, 0, 1}},
		{"long", []byte{0xA7, 'r', 'g', 1, 0, 0, 0, 1, 0}},
		{"magic", []byte{0xA6, 'r', 'g', 1, 0, 0, 0, 1}},
		{"magic2", []byte{0xA7, 'R', 'g', 1, 0, 0, 0, 1}},
		{"version0", []byte{0xA7, 'r', 'g', 0, 0, 0, 0, 1}},
		{"version2", []byte{0xA7, 'r', 'g', 2, 0, 0, 0, 1}},
	} {
		if _, err := ParseHeader(tc.b); !errors.Is(err, ErrBadHeader) {
			t.Errorf("%s: ParseHeader(% x) error = %v, want ErrBadHeader", tc.name, tc.b, err)
		}
	}
}

// Raft's own RPC types (0-4) are never taken for a header.
func TestRaftRPCTypesUntagged(t *testing.T) {
	for b := 0; b < 0x20; b++ {
		if Tagged(byte(b)) {
			t.Fatalf("Tagged(%#x) = true", b)
		}
	}
}

func FuzzParseHeader(f *testing.F) {
	f.Add(AppendHeader(nil, 3))
	f.Add([]byte{0xA7, 'r', 'g', 2, 0, 0, 0, 1})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		id, err := ParseHeader(b)
		if err != nil {
			if !errors.Is(err, ErrBadHeader) {
				t.Fatalf("error %v does not wrap ErrBadHeader", err)
			}
			return
		}
		// Only the canonical encoding parses.
		if h := AppendHeader(nil, id); string(h) != string(b) {
			t.Fatalf("ParseHeader(% x) = %d, but AppendHeader(%d) = % x", b, id, id, h)
		}
	})
}
