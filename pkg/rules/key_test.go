package rules

import (
	"errors"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
)

func TestAppendKeyEscaping(t *testing.T) {
	cases := []struct {
		domain  string
		entries []Entry
		want    string
	}{
		{"d", nil, "d:"},
		{"d", []Entry{{"", ""}}, "d:="},
		{"public-api", E("tier=free", "api_key=k_1"), "public-api:tier=free,api_key=k_1"},
		{"a:b", []Entry{{"k,=", "v%:\n\x00"}}, "a%3Ab:k%2C%3D=v%25%3A%0A%00"},
		{"d", []Entry{{"path", "/v1/*?q=ü"}}, "d:path=/v1/*?q%3Dü"},
		{"d", []Entry{{"k", "\x7f\x1f"}}, "d:k=\x7f%1F"},
	}
	for _, c := range cases {
		got := string(AppendKey(nil, nil, c.domain, c.entries))
		if got != c.want {
			t.Errorf("AppendKey(%q, %q) = %q, want %q", c.domain, c.entries, got, c.want)
		}
		if h := KeyHash(nil, c.domain, c.entries); h != xxhash.Sum64String(got) {
			t.Errorf("KeyHash(%q) = %x, want xxhash of the key %x", got, h, xxhash.Sum64String(got))
		}
		d, es, err := ParseKey(got)
		if err != nil || d != c.domain || !sameEntries(es, c.entries) {
			t.Errorf("ParseKey(%q) = %q, %q, %v", got, d, es, err)
		}
	}
	// AppendKey appends.
	if got := string(AppendKey([]byte("x|"), nil, "d", E("a=b"))); got != "x|d:a=b" {
		t.Errorf("AppendKey to a prefix = %q", got)
	}
}

// KeyHash has three paths (short raw key, exact length check, streamed long
// key); all must equal xxhash of AppendKey, at and around the 256-byte
// buffer boundary, without allocating.
func TestKeyHashLengths(t *testing.T) {
	for _, fill := range []string{"a", ",", "a,"} {
		for n := 0; n < 400; n += 7 {
			v := strings.Repeat(fill, n)[:n]
			d := []Entry{{"k", v}, {"k2", "x"}}
			want := xxhash.Sum64(AppendKey(nil, nil, "dom", d))
			if got := KeyHash(nil, "dom", d); got != want {
				t.Fatalf("fill %q n=%d: KeyHash = %x, want %x", fill, n, got, want)
			}
			if a := testing.AllocsPerRun(10, func() { _ = KeyHash(nil, "dom", d) }); a != 0 {
				t.Fatalf("fill %q n=%d: %.0f allocs", fill, n, a)
			}
		}
	}
}

func sameEntries(a, b []Entry) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestParseKeyRejects(t *testing.T) {
	for _, k := range []string{
		"",          // no colon
		"domain",    // no colon
		"d:a",       // entry without '='
		"d:a=b,",    // trailing comma: empty entry
		"d:a=b,c",   // second entry without '='
		"d:a=b=c",   // raw '=' in value
		"d:a=b:c",   // raw ':' in value
		"d:a=%",     // truncated escape
		"d:a=%4",    // truncated escape
		"d:a=%zz",   // bad hex
		"d:a=%3a",   // lower-case hex is not canonical
		"d:a=%41",   // needless escape of 'A'
		"d:a=\n",    // raw control byte
		"d\x01:a=b", // raw control byte in domain
		"d%:a=b",    // bad escape in domain
	} {
		if _, _, err := ParseKey(k); !errors.Is(err, ErrBadKey) {
			t.Errorf("ParseKey(%q) error = %v, want ErrBadKey", k, err)
		}
	}
}

// Keys hash without allocating, whatever needs escaping.
func TestZeroAllocs(t *testing.T) {
	s := mustCompileExample(t)
	d := E("tier=free", "route=/v1/search", "api_key=k_live_%x:y,z=\x01")
	r := s.Match("public-api", d)
	descs := designCardDescs("premium", "/v1/search", "k_live_abc123")
	out := make([]*Rule, 0, len(descs))
	allocs := map[string]float64{
		"Match":    testing.AllocsPerRun(100, func() { _ = s.Match("public-api", d) }),
		"KeyHash":  testing.AllocsPerRun(100, func() { _ = KeyHash(r, "public-api", d) }),
		"MatchAll": testing.AllocsPerRun(100, func() { out = s.MatchAll("public-api", descs, out) }),
	}
	buf := make([]byte, 0, 256)
	allocs["AppendKey"] = testing.AllocsPerRun(100, func() { buf = AppendKey(buf[:0], r, "public-api", d) })
	for name, n := range allocs {
		if n != 0 {
			t.Errorf("%s allocates %.1f times per call, want 0", name, n)
		}
	}
	if out[2] == nil || out[0] != nil {
		t.Errorf("MatchAll = %v", names(out))
	}
}

func FuzzKey(f *testing.F) {
	f.Add("public-api", "tier", "free", "api_key", "k_1", uint8(2))
	f.Add("a:b", "k,=", "v%:\n", "", "", uint8(1))
	f.Add("", "", "", "", "", uint8(0))
	f.Add("d", "%41", "%3a", "ü", "\xff", uint8(2))
	f.Fuzz(func(t *testing.T, domain, k1, v1, k2, v2 string, n uint8) {
		all := []Entry{{k1, v1}, {k2, v2}}
		entries := all[:int(n)%3]
		key := AppendKey(nil, nil, domain, entries)
		if h := KeyHash(nil, domain, entries); h != xxhash.Sum64(key) {
			t.Fatalf("KeyHash = %x, xxhash(AppendKey) = %x", h, xxhash.Sum64(key))
		}
		d, es, err := ParseKey(string(key))
		if err != nil {
			t.Fatalf("ParseKey(%q) = %v", key, err)
		}
		if d != domain || !sameEntries(es, entries) {
			t.Fatalf("ParseKey(AppendKey(%q, %q)) = %q, %q", domain, entries, d, es)
		}
		// Any string that parses is canonical: re-encoding gives it back.
		raw := domain + ":" + k1 + "=" + v1
		if d, es, err := ParseKey(raw); err == nil {
			if back := string(AppendKey(nil, nil, d, es)); back != raw {
				t.Fatalf("ParseKey accepted non-canonical %q (re-encodes to %q)", raw, back)
			}
		}
		if strings.ContainsAny(k1, ":,=%") && len(entries) > 0 && strings.Count(string(key), "%") == 0 {
			t.Fatalf("special bytes not escaped in %q", key)
		}
	})
}
