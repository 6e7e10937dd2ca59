package sfvtest

import "testing"

func TestParseList(t *testing.T) {
	good := map[string]int{
		``:                                  0,
		`"a";q=1`:                           1,
		`"burst";q=100;w=60,"daily";q=1000`: 2,
		`  "x" ,  "y";r=0;t=2  `:            2,
		`tok;a;b=?0, 1.5;c="s\"q"`:          2,
		`-12;x=-3`:                          1,
	}
	for in, n := range good {
		items, err := ParseList(in)
		if err != nil || len(items) != n {
			t.Errorf("ParseList(%q) = %d items, %v; want %d items", in, len(items), err, n)
		}
	}
	bad := []string{`"a`, `"a",`, `"a";Q=1`, `"\x"`, `1234567890123456`, `"a" "b"`, `(1 2)`, "\"\x01\"", `1.`, `1.2345`, `@`}
	for _, in := range bad {
		if _, err := ParseList(in); err == nil {
			t.Errorf("ParseList(%q) succeeded, want an error", in)
		}
	}
	items, _ := ParseList(`"n";r=1;r=2`)
	if v, _ := items[0].Param("r"); v != int64(2) {
		t.Errorf("duplicate param: got %v, want the last value 2", v)
	}
}

func FuzzParseList(f *testing.F) {
	f.Add(`"burst";q=100;w=60, "daily";q=1000;w=86400`)
	f.Add(`a;b;c=?1`)
	f.Fuzz(func(t *testing.T, s string) {
		_, _ = ParseList(s) // must not panic
	})
}
