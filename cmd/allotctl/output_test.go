package main

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"sync"
	"testing"

	"pgregory.net/rapid"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// safeBuffer is a bytes.Buffer safe for a writer goroutine and a reader.
type safeBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (s *safeBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *safeBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestFmtMS(t *testing.T) {
	cases := []struct {
		ms   int64
		want string
	}{
		{-1, "-"}, {0, "0s"}, {1, "1ms"}, {999, "999ms"}, {1000, "1s"}, {1500, "1.5s"},
		{9949, "9.9s"}, {10_000, "10s"}, {59_999, "59s"}, {60_000, "1m"}, {125_000, "2m5s"},
		{3_600_000, "1h"}, {3_720_000, "1h2m"}, {47 * 3_600_000, "47h"}, {49 * 3_600_000, "2d1h"},
		{72 * 3_600_000, "3d"},
	}
	for _, c := range cases {
		if got := fmtMS(c.ms); got != c.want {
			t.Errorf("fmtMS(%d) = %q, want %q", c.ms, got, c.want)
		}
	}
}

func TestFmtRate(t *testing.T) {
	cases := []struct {
		r    float64
		want string
	}{{0, "0"}, {0.005, "0.01"}, {0.5, "0.50"}, {1, "1.0"}, {3.25, "3.2"}, {99.96, "100.0"}, {152.4, "152"}}
	for _, c := range cases {
		if got := fmtRate(c.r); got != c.want {
			t.Errorf("fmtRate(%v) = %q, want %q", c.r, got, c.want)
		}
	}
}

func TestCellQuotesControlCharacters(t *testing.T) {
	cases := map[string]string{
		"":              "-",
		"gw-1":          "gw-1",
		"a\tb":          `"a\tb"`,
		"x\x1b[2Jy":     `"x\x1b[2Jy"`,
		"bad\xffutf8":   `"bad\xffutf8"`,
		"ключ=значение": "ключ=значение",
	}
	for in, want := range cases {
		if got := cell(in); got != want {
			t.Errorf("cell(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestTransportReason(t *testing.T) {
	cases := map[string]string{
		`connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:7420: connect: connection refused"`:             "connection refused",
		`connection error: desc = "transport: authentication handshake failed: tls: first record does not look like a TLS handshake"`: "authentication handshake failed: tls: first record does not look like a TLS handshake",
		`connection error: desc = "transport: Error while dialing: dial tcp: lookup x.invalid: no such host"`:                         "no such host",
		"name resolver error: produced zero addresses":                                                                                "name resolver error: produced zero addresses",
	}
	for in, want := range cases {
		if got := transportReason(in); got != want {
			t.Errorf("transportReason(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestParseDescriptor(t *testing.T) {
	d, err := parseDescriptor("-D", `tier=free,route=/v1/a\,b,q=x=y,bs=\\`)
	if err != nil {
		t.Fatal(err)
	}
	want := "tier=free, route=/v1/a,b, q=x=y, bs=\\"
	if got := fmtEntries(d.Entries); got != want {
		t.Errorf("entries = %q, want %q", got, want)
	}
	for _, bad := range []string{"", "a", "=v", "a=1,,b=2"} {
		if _, err := parseDescriptor("-D", bad); err == nil {
			t.Errorf("parseDescriptor(%q) succeeded, want a usage error", bad)
		}
	}
}

func TestJSONIsStableAndYAMLKeepsOrder(t *testing.T) {
	m := &allotv1.Lease{Key: "d:k=v", AgentId: "a", Tokens: 5, Demand: 1.5}
	first, err := protoJSON(m)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		again, _ := protoJSON(m)
		if !bytes.Equal(first, again) {
			t.Fatalf("protoJSON not stable:\n%s\n%s", first, again)
		}
	}
	if !strings.Contains(string(first), `"agent_id": "a"`) || !strings.Contains(string(first), `"expires_in_ms": 0`) {
		t.Errorf("want proto field names, unpopulated fields and 64-bit integers as numbers:\n%s", first)
	}
	y, err := jsonToYAML(first)
	if err != nil {
		t.Fatal(err)
	}
	want := "key: d:k=v\ndomain: \"\"\nagent_id: a\ntokens: 5\ngranted_unix_ms: 0\nexpires_in_ms: 0\ndemand: 1.5\nrule: \"\"\n"
	if string(y) != want {
		t.Errorf("yaml =\n%s\nwant\n%s", y, want)
	}
}

// TestJSONNumbers: 64-bit integers print as JSON numbers with every digit
// (not through float64), in nested and repeated messages too; strings that
// look like numbers stay strings.
func TestJSONNumbers(t *testing.T) {
	m := &allotv1.ListLeasesResponse{
		Leases: []*allotv1.Lease{
			{Key: "123", AgentId: "9", Tokens: math.MaxInt64, GrantedUnixMs: -42},
			{Tokens: 1},
		},
		NowUnixMs: 1700000000000,
	}
	js, err := protoJSON(m)
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Leases []struct {
			Key     string          `json:"key"`
			AgentID string          `json:"agent_id"`
			Tokens  json.RawMessage `json:"tokens"`
			Granted int64           `json:"granted_unix_ms"`
		} `json:"leases"`
		Now int64 `json:"now_unix_ms"`
	}
	if err := json.Unmarshal(js, &v); err != nil {
		t.Fatalf("%v\n%s", err, js)
	}
	if len(v.Leases) != 2 || string(v.Leases[0].Tokens) != "9223372036854775807" || v.Leases[0].Granted != -42 ||
		string(v.Leases[1].Tokens) != "1" || v.Now != 1700000000000 || v.Leases[0].Key != "123" || v.Leases[0].AgentID != "9" {
		t.Errorf("decoded %+v from\n%s", v, js)
	}
}

// lcsLen is the textbook dynamic program, the oracle for the diff's
// minimality.
func lcsLen(a, b []string) int {
	dp := make([][]int, len(a)+1)
	for i := range dp {
		dp[i] = make([]int, len(b)+1)
	}
	for i := len(a) - 1; i >= 0; i-- {
		for j := len(b) - 1; j >= 0; j-- {
			if a[i] == b[j] {
				dp[i][j] = dp[i+1][j+1] + 1
			} else {
				dp[i][j] = max(dp[i+1][j], dp[i][j+1])
			}
		}
	}
	return dp[0][0]
}

// TestDiffLinesProperties: the script rebuilds both sides and is a
// shortest edit script (as many kept lines as the LCS).
func TestDiffLinesProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		line := rapid.SampledFrom([]string{"a", "b", "c", "d", ""})
		a := rapid.SliceOfN(line, 0, 30).Draw(t, "a")
		b := rapid.SliceOfN(line, 0, 30).Draw(t, "b")
		script := diffLines(a, b)
		var ra, rb []string
		kept := 0
		for _, e := range script {
			switch e.op {
			case ' ':
				ra, rb = append(ra, e.line), append(rb, e.line)
				kept++
			case '-':
				ra = append(ra, e.line)
			case '+':
				rb = append(rb, e.line)
			default:
				t.Fatalf("bad op %q", e.op)
			}
		}
		if strings.Join(ra, "\n") != strings.Join(a, "\n") || len(ra) != len(a) {
			t.Fatalf("script does not rebuild a: %q vs %q", ra, a)
		}
		if strings.Join(rb, "\n") != strings.Join(b, "\n") || len(rb) != len(b) {
			t.Fatalf("script does not rebuild b: %q vs %q", rb, b)
		}
		if want := lcsLen(a, b); kept != want {
			t.Fatalf("script keeps %d lines, LCS is %d", kept, want)
		}
	})
}

func TestDiffLinesBeyondMaxD(t *testing.T) {
	var a, b []string
	for i := 0; i < maxDiffD+10; i++ {
		a = append(a, "a")
		b = append(b, "b")
	}
	script := diffLines(a, b)
	if len(script) != len(a)+len(b) {
		t.Fatalf("script has %d edits, want %d", len(script), len(a)+len(b))
	}
}

func TestWriteUnified(t *testing.T) {
	a := splitLines("1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n11\n12\n13\n14\n15\n16\n")
	b := splitLines("1\n2\nthree\n4\n5\n6\n7\n8\n9\n10\n11\n12\n13\n14\n15\n16\n17\n")
	var out strings.Builder
	if !writeUnified(&out, "old", "new", diffLines(a, b), 3) {
		t.Fatal("writeUnified reported no change")
	}
	want := `--- old
+++ new
@@ -1,6 +1,6 @@
 1
 2
-3
+three
 4
 5
 6
@@ -14,3 +14,4 @@
 14
 15
 16
+17
`
	if out.String() != want {
		t.Errorf("got\n%s\nwant\n%s", out.String(), want)
	}
	out.Reset()
	if writeUnified(&out, "old", "new", diffLines(a, a), 3) || out.Len() != 0 {
		t.Errorf("identical input printed %q", out.String())
	}
	out.Reset()
	writeUnified(&out, "old", "new", diffLines(nil, splitLines("x\ny\n")), 3)
	if want := "--- old\n+++ new\n@@ -0,0 +1,2 @@\n+x\n+y\n"; out.String() != want {
		t.Errorf("new file diff = %q, want %q", out.String(), want)
	}
}
