package httplimit

import (
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/sfv/sfvtest"
)

var (
	docsTRow      = regexp.MustCompile("^\\| `([a-z_]+)` \\| (\\d+)/minute(?:, burst (\\d+))? \\| ([^|]+) \\| `([^`]+)` \\|$")
	docsTRequests = regexp.MustCompile(`^(\d+) at 12:(\d\d):(\d\d)$`)
)

// TestDocsTExamples replays docs/gateway.md's table of t on allowed
// responses: each row's requests against a fresh state of its algorithm at
// the given times (2026-01-01, UTC), then the fields SetFields writes for
// the last one, which must parse as a Structured Fields List and equal the
// row's RateLimit byte for byte.
func TestDocsTExamples(t *testing.T) {
	doc, err := os.ReadFile("../../docs/gateway.md")
	if err != nil {
		t.Fatal(err)
	}
	day := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC).UnixNano()
	rows := 0
	seen := map[bucket.Algorithm]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		m := docsTRow.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		rows++
		alg, err := bucket.ParseAlgorithm(m[1])
		if err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		seen[alg] = true
		quota, _ := strconv.ParseInt(m[2], 10, 64)
		burst := quota
		if m[3] != "" {
			burst, _ = strconv.ParseInt(m[3], 10, 64)
		}
		l, err := bucket.NewLimit(alg, quota, time.Minute, burst)
		if err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		var st bucket.State
		var res bucket.Result
		var now int64
		for _, group := range strings.Split(m[4], ", ") {
			g := docsTRequests.FindStringSubmatch(strings.TrimSpace(group))
			if g == nil {
				t.Fatalf("%q: requests %q: want \"N at 12:MM:SS\"", line, group)
			}
			n, _ := strconv.Atoi(g[1])
			mm, _ := strconv.Atoi(g[2])
			ss, _ := strconv.Atoi(g[3])
			now = day + int64(mm)*int64(time.Minute) + int64(ss)*int64(time.Second)
			if n == 0 {
				res = l.AllowN(&st, now, 0)
			}
			for range n {
				if res = l.AllowN(&st, now, 1); !res.Allowed {
					t.Fatalf("%q: a request was denied", line)
				}
			}
		}
		if _, err := sfvtest.ParseList(m[5]); err != nil {
			t.Errorf("%q: the documented RateLimit does not parse: %v", line, err)
		}
		d := agent.Decision{
			Allowed: true, Policy: "p", Quota: quota, Window: time.Minute,
			Remaining: res.Remaining, ResetAfter: res.ResetAfter, NextAfter: l.NextAfter(now, res.ResetAfter),
			Rule: &rules.Rule{Name: "p", RequestsPerUnit: uint32(quota), Unit: rules.UnitMinute},
		}
		h := http.Header{}
		SetFields(h, d, nil)
		if got := h.Get("RateLimit"); got != m[5] {
			t.Errorf("%q: SetFields writes RateLimit %s", line, got)
		}
	}
	if rows == 0 || len(seen) != 4 {
		t.Fatalf("docs/gateway.md: %d rows of t examples covering %d algorithms, want every algorithm", rows, len(seen))
	}
}
