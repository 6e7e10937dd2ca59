package rules

import (
	"testing"
	"unicode/utf8"
)

func TestValidText(t *testing.T) {
	for i, tc := range []struct {
		s    string
		want bool
	}{
		{"", true},
		{"key-123_ABC.~!@#$%^&*()", true},
		{"k\xff", false},
		{"k\x00", false},
		{"k\r\nX-Evil: 1", false},
		{"\t", false},
		{"k\x7f", false},
		{"k\u0085", false},          // C1 control (NEL)
		{"clé", true},               // two-byte
		{"ключ-日本語-🔑", true},        // two-, three- and four-byte
		{"\uFFFD", true},            // the replacement character itself is text
		{"\xc0\xaf", false},         // overlong '/'
		{"\xed\xa0\x80", false},     // surrogate
		{"\xf4\x90\x80\x80", false}, // beyond U+10FFFF
		{"é\xff", false},
	} {
		if got := ValidText(tc.s); got != tc.want {
			t.Errorf("case %d: ValidText(%q) = %v, want %v", i, tc.s, got, tc.want)
		}
	}
}

// FuzzValidText checks ValidText against a rune-by-rune reference: valid
// text is exactly valid UTF-8 without C0, DEL or C1 controls.
func FuzzValidText(f *testing.F) {
	for _, s := range []string{"", "k", "k\xff", "k\x00", "a\r\nb", "\xc0\xaf", "clé", "日本語🔑", "\u0085", "\x7f"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want := utf8.ValidString(s)
		for _, r := range s {
			if r < 0x20 || (r >= 0x7f && r < 0xa0) {
				want = false
			}
		}
		if got := ValidText(s); got != want {
			t.Fatalf("ValidText(%q) = %v, want %v", s, got, want)
		}
	})
}

func BenchmarkValidText(b *testing.B) {
	s := "api-key-0123456789abcdef0123456789abcdef"
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if !ValidText(s) {
			b.Fatal("invalid")
		}
	}
}
