package sfv_test

import (
	"strings"
	"testing"

	"github.com/allot/allot/pkg/sfv"
	"github.com/allot/allot/pkg/sfv/sfvtest"
)

func TestAppendPolicyAndRateLimit(t *testing.T) {
	tests := []struct {
		name string
		got  string
		want string
	}{
		{"policy", string(sfv.AppendPolicy(nil, "free_search", 30, 60)), `"free_search";q=30;w=60`},
		{"policy no window", string(sfv.AppendPolicy(nil, "p", 5, 0)), `"p";q=5`},
		{"ratelimit", string(sfv.AppendRateLimit(nil, "free_search", 0, 2)), `"free_search";r=0;t=2`},
		{"ratelimit no t", string(sfv.AppendRateLimit(nil, "x", 7, -1)), `"x";r=7`},
		{"negative remaining", string(sfv.AppendRateLimit(nil, "x", -3, 0)), `"x";r=0;t=0`},
		{"list", string(sfv.AppendPolicy(sfv.AppendPolicy(nil, "burst", 100, 60), "daily", 1000, 86400)),
			`"burst";q=100;w=60, "daily";q=1000;w=86400`},
		{"escape", string(sfv.AppendString(nil, `a"b\c`)), `"a\"b\\c"`},
		{"sanitise", string(sfv.AppendString(nil, "é\x00\x7f\tz")), `"___` + "__z" + `"`},
		{"clamp", string(sfv.AppendInteger(nil, 1<<62)), "999999999999999"},
		{"clamp negative", string(sfv.AppendInteger(nil, -1<<63)), "-999999999999999"},
		{"zero", string(sfv.AppendInteger(nil, 0)), "0"},
		{"bad key", string(sfv.AppendIntParam(nil, "Q", 1)), ";x=1"},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s: got %s, want %s", tc.name, tc.got, tc.want)
		}
	}
}

func TestAppendStringTruncates(t *testing.T) {
	s := string(sfv.AppendString(nil, strings.Repeat("a", 1000)))
	if len(s) != sfv.MaxStringLen+2 {
		t.Fatalf("len = %d, want %d", len(s), sfv.MaxStringLen+2)
	}
}

func TestAppendZeroAlloc(t *testing.T) {
	buf := make([]byte, 0, 256)
	allocs := testing.AllocsPerRun(100, func() {
		b := sfv.AppendPolicy(buf[:0], "free_search", 30, 60)
		b = sfv.AppendRateLimit(b, "free_search", 3, 14)
		_ = b
	})
	if allocs != 0 {
		t.Fatalf("allocs = %v, want 0", allocs)
	}
}

// sanitised is what AppendString promises to carry: printable ASCII only,
// truncated to MaxStringLen.
func sanitised(s string) string {
	if len(s) > sfv.MaxStringLen {
		s = s[:sfv.MaxStringLen]
	}
	b := []byte(s)
	for i, c := range b {
		if c < 0x20 || c > 0x7e {
			b[i] = sfv.Replacement
		}
	}
	return string(b)
}

// FuzzStructuredFields checks that whatever the policy name and numbers, the
// two fields parse as sf-lists of exactly the expected shape and values.
func FuzzStructuredFields(f *testing.F) {
	f.Add("free_search", int64(30), int64(60), int64(0), int64(2), "premium", int64(1000))
	f.Add(`we"ird\name`, int64(-5), int64(0), int64(-7), int64(-1), "", int64(0))
	f.Add("\x00\xff\n,;=", int64(1<<62), int64(1<<62), int64(1<<62), int64(1<<62), "é", int64(-1<<63))
	f.Fuzz(func(t *testing.T, name string, q, w, r, tt int64, name2 string, q2 int64) {
		policy := sfv.AppendPolicy(nil, name, q, w)
		policy = sfv.AppendPolicy(policy, name2, q2, 1)
		rl := sfv.AppendRateLimit(nil, name, r, tt)

		items, err := sfvtest.ParseList(string(policy))
		if err != nil {
			t.Fatalf("RateLimit-Policy %q does not parse: %v", policy, err)
		}
		if len(items) != 2 {
			t.Fatalf("RateLimit-Policy %q: %d members, want 2", policy, len(items))
		}
		checkMember(t, items[0], name, map[string]int64{"q": clamp(q), "w": clamp(w)}, w > 0)
		checkMember(t, items[1], name2, map[string]int64{"q": clamp(q2), "w": 1}, true)

		items, err = sfvtest.ParseList(string(rl))
		if err != nil {
			t.Fatalf("RateLimit %q does not parse: %v", rl, err)
		}
		if len(items) != 1 {
			t.Fatalf("RateLimit %q: %d members, want 1", rl, len(items))
		}
		wantR := clamp(r)
		if wantR < 0 {
			wantR = 0
		}
		checkMember(t, items[0], name, map[string]int64{"r": wantR, "t": clamp(tt)}, tt >= 0)
	})
}

// checkMember verifies a member's String value and integer parameters. The
// last parameter (w or t) is optional, present only when withLast is set.
func checkMember(t *testing.T, it sfvtest.Item, name string, params map[string]int64, withLast bool) {
	t.Helper()
	s, ok := it.Value.(string)
	if !ok || s != sanitised(name) {
		t.Fatalf("member value %#v, want String %q", it.Value, sanitised(name))
	}
	wantN := len(params)
	if !withLast {
		wantN--
	}
	if len(it.Params) != wantN {
		t.Fatalf("member %q has %d params %v, want %d", s, len(it.Params), it.Params, wantN)
	}
	for i, p := range it.Params {
		want, ok := params[p.Key]
		if !ok {
			t.Fatalf("unexpected param %q", p.Key)
		}
		if i == 0 && p.Key != "q" && p.Key != "r" {
			t.Fatalf("first param %q, want q or r", p.Key)
		}
		if v, ok := p.Value.(int64); !ok || v != want {
			t.Fatalf("param %s = %#v, want %d", p.Key, p.Value, want)
		}
	}
}

func clamp(v int64) int64 {
	if v > sfv.MaxInteger {
		return sfv.MaxInteger
	}
	if v < -sfv.MaxInteger {
		return -sfv.MaxInteger
	}
	return v
}

func BenchmarkAppendFields(b *testing.B) {
	b.ReportAllocs()
	buf := make([]byte, 0, 256)
	for b.Loop() {
		buf = sfv.AppendPolicy(buf[:0], "free_search", 30, 60)
		buf = sfv.AppendRateLimit(buf[:0], "free_search", 3, 14)
	}
}
