package descconf

import (
	"errors"
	"strings"
	"testing"
)

func TestCompile(t *testing.T) {
	b := Bounds{MaxDescriptors: 2, MaxEntries: 2, DefaultMaxValue: 256}
	upper := func(e string) (string, error) {
		if e == "" {
			return "", errors.New("empty entry")
		}
		return strings.ToUpper(e), nil
	}
	for i, tc := range []struct {
		domain   string
		maxValue int
		descs    [][]string
		want     string // error text, or "" for success
	}{
		{"d", 0, [][]string{{"a", "b"}, {"c"}}, ""},
		{"", 0, nil, ""},
		{"d", -1, nil, "x: max_value_bytes must be ≥ 0"},
		{"d", 0, [][]string{{"a"}, {"b"}, {"c"}}, "x: descriptors: 3 configured, at most 2"},
		{"", 0, [][]string{{"a"}}, "x: domain: must be set when descriptors are configured"},
		{"d", 0, [][]string{{}}, "x: descriptors[0]: needs 1 to 2 entries, has 0"},
		{"d", 0, [][]string{{"a"}, {"a", "b", "c"}}, "x: descriptors[1]: needs 1 to 2 entries, has 3"},
		{"d", 0, [][]string{{"a", ""}}, "x: descriptors[0][1]: empty entry"},
	} {
		c, err := Compile("x", b, tc.domain, tc.maxValue, tc.descs, upper)
		switch {
		case tc.want != "" && (err == nil || err.Error() != tc.want):
			t.Errorf("case %d: error %v, want %q", i, err, tc.want)
		case tc.want == "" && err != nil:
			t.Errorf("case %d: %v", i, err)
		case tc.want == "" && tc.descs != nil:
			if c.MaxValue != 256 || c.Total != 3 || c.Descs[0][1] != "B" || c.Descs[1][0] != "C" {
				t.Errorf("case %d: %+v", i, c)
			}
		}
	}
}
