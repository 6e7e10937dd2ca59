package rules

import (
	"bytes"
	"os"
	"testing"
)

// The example rules: descriptors D1=[tier, api_key],
// D2=[tier, route, api_key], D3=[api_key] for every request.
func designCardDescs(tier, route, key string) [][]Entry {
	return [][]Entry{
		{{"tier", tier}, {"api_key", key}},
		{{"tier", tier}, {"route", route}, {"api_key", key}},
		{{"api_key", key}},
	}
}

func mustCompileExample(t testing.TB) *Set {
	t.Helper()
	s, err := Compile(1, ExampleFiles())
	if err != nil {
		t.Fatalf("Compile(ExampleYAML) = %v", err)
	}
	return s
}

func names(rs []*Rule) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		if r != nil {
			out[i] = r.Name
		}
	}
	return out
}

func TestExampleYAMLMatchesTestdata(t *testing.T) {
	b, err := os.ReadFile("testdata/public-api.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, []byte(ExampleYAML)) {
		t.Fatal("testdata/public-api.yaml and example.yaml differ; keep them identical")
	}
}

func TestDesignCardExample(t *testing.T) {
	s := mustCompileExample(t)
	if got := s.Domains(); len(got) != 1 || got[0] != "public-api" {
		t.Fatalf("Domains() = %v", got)
	}
	if w := s.Warnings(); len(w) != 0 {
		t.Fatalf("Warnings() = %v, want none", w)
	}
	cases := []struct {
		name             string
		tier, route, key string
		want             [3]string // rule name per descriptor after replaces, "" = none
	}{
		{"free key on /v1/search", "free", "/v1/search", "k_free_1", [3]string{"", "free_search", ""}},
		{"premium key", "premium", "/v1/search", "k_prem_1", [3]string{"premium", "", ""}},
		{"premium key on another route", "premium", "/v1/other", "k_prem_1", [3]string{"premium", "", ""}},
		{"override key as premium", "premium", "/v1/search", "k_live_abc123", [3]string{"", "", "key_override"}},
		{"override key as free on /v1/search", "free", "/v1/search", "k_live_abc123", [3]string{"", "", "key_override"}},
		{"free key on /v1/other", "free", "/v1/other", "k_free_1", [3]string{"", "", ""}},
		{"unknown tier", "gold", "/v1/search", "k_free_1", [3]string{"", "", ""}},
	}
	for _, c := range cases {
		got := s.MatchAll("public-api", designCardDescs(c.tier, c.route, c.key), nil)
		if len(got) != 3 {
			t.Fatalf("%s: MatchAll returned %d rules, want 3", c.name, len(got))
		}
		if n := names(got); n[0] != c.want[0] || n[1] != c.want[1] || n[2] != c.want[2] {
			t.Errorf("%s: MatchAll = %q, want %q", c.name, n, c.want)
		}
	}

	// Budgets are per key within the tier: distinct keys, distinct budgets.
	d1 := designCardDescs("free", "/v1/search", "k_a")[1]
	d2 := designCardDescs("free", "/v1/search", "k_b")[1]
	r := s.Match("public-api", d1)
	if got, want := string(AppendKey(nil, r, "public-api", d1)), "public-api:tier=free,route=/v1/search,api_key=k_a"; got != want {
		t.Errorf("AppendKey = %q, want %q", got, want)
	}
	if KeyHash(r, "public-api", d1) == KeyHash(r, "public-api", d2) {
		t.Error("two free keys share a budget hash")
	}

	// The compiled limits.
	fs := s.Match("public-api", d1)
	if fs.RequestsPerUnit != 30 || fs.Unit != UnitMinute || fs.Burst != 10 || fs.ShadowMode ||
		fs.Limit.Quota() != 30 || fs.Limit.Burst() != 10 || fs.Limit.Window().Seconds() != 60 {
		t.Errorf("free_search compiled to %+v", fs)
	}
	if fs.Path != "tier=free/route=/v1/search/api_key" || fs.Depth != 3 {
		t.Errorf("free_search Path=%q Depth=%d", fs.Path, fs.Depth)
	}
	ko := s.Match("public-api", []Entry{{"api_key", "k_live_abc123"}})
	if ko == nil || !ko.ShadowMode || ko.RequestsPerUnit != 5 || ko.Burst != 5 {
		t.Errorf("key_override compiled to %+v", ko)
	}
	pr := s.Match("public-api", []Entry{{"tier", "premium"}, {"api_key", "x"}})
	if pr == nil || pr.RequestsPerUnit != 1000 || pr.Burst != 200 {
		t.Errorf("premium compiled to %+v", pr)
	}
}
