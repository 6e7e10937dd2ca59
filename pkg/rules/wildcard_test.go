package rules

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/internal/proccpu"
)

// The wildcard matcher agrees with the equivalent anchored regexp, where '*'
// is ".*" and everything else is literal.
func TestWildcardMatchesRegexp(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		alphabet := rapid.SampledFrom([]string{"a", "b", "*", "/", "ab"})
		pattern := strings.Join(rapid.SliceOfN(alphabet, 0, 8).Draw(t, "pattern"), "")
		value := strings.Join(rapid.SliceOfN(rapid.SampledFrom([]string{"a", "b", "/", "ab", "ba"}), 0, 8).Draw(t, "value"), "")
		parts := strings.Split(pattern, "*")
		for i := range parts {
			parts[i] = regexp.QuoteMeta(parts[i])
		}
		re := regexp.MustCompile("^(?s:" + strings.Join(parts, ".*") + ")$")
		if got, want := compileWildcard(pattern).match(value), re.MatchString(value); got != want {
			t.Fatalf("wildcard %q match %q = %v, regexp says %v", pattern, value, got, want)
		}
	})
}

// Match on random trees agrees with a direct reading of Envoy's rules: the
// rule found is the one at the end of the unique precedence path.
func TestMatchAgreesWithReference(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		keys := []string{"a", "b"}
		vals := []string{"", "x", "y", "x*", "*"}
		type desc struct {
			key, value string
			limit      bool
			children   []desc
		}
		var gen func(depth int) []desc
		gen = func(depth int) []desc {
			if depth > 3 {
				return nil
			}
			var out []desc
			seen := map[string]bool{}
			n := rapid.IntRange(0, 4).Draw(t, "n")
			for i := 0; i < n; i++ {
				d := desc{key: rapid.SampledFrom(keys).Draw(t, "k"), value: rapid.SampledFrom(vals).Draw(t, "v"), limit: rapid.Bool().Draw(t, "limit")}
				if seen[d.key+"\x00"+d.value] {
					continue
				}
				seen[d.key+"\x00"+d.value] = true
				d.children = gen(depth + 1)
				out = append(out, d)
			}
			return out
		}
		tree := gen(1)
		var b strings.Builder
		b.WriteString("domain: r\n")
		var emit func(ds []desc, indent string)
		emit = func(ds []desc, indent string) {
			b.WriteString(indent + "descriptors:\n")
			for _, d := range ds {
				b.WriteString(indent + "  - key: " + d.key + "\n")
				if d.value != "" {
					b.WriteString(indent + "    value: \"" + d.value + "\"\n")
				}
				if d.limit {
					b.WriteString(indent + "    rate_limit: {unit: second, requests_per_unit: 1}\n")
				}
				if len(d.children) > 0 {
					emit(d.children, indent+"    ")
				}
			}
		}
		if len(tree) > 0 {
			emit(tree, "")
		}
		s, err := Compile(1, []File{{Name: "r.yaml", Source: []byte(b.String())}})
		if err != nil {
			t.Fatalf("%v\n%s", err, b.String())
		}
		// Reference: at each level pick exact, else first wildcard in
		// order, else key-only; the rule is the limit of the last level.
		ref := func(entries []Entry) string {
			level := tree
			path := ""
			for i, e := range entries {
				var pick *desc
				for j := range level {
					if d := &level[j]; d.key == e.Key && d.value == e.Value && !strings.Contains(d.value, "*") && d.value != "" {
						pick = d
						break
					}
				}
				if pick == nil {
					for j := range level {
						if d := &level[j]; d.key == e.Key && strings.Contains(d.value, "*") && compileWildcard(d.value).match(e.Value) {
							pick = d
							break
						}
					}
				}
				if pick == nil {
					for j := range level {
						if d := &level[j]; d.key == e.Key && d.value == "" {
							pick = d
							break
						}
					}
				}
				if pick == nil {
					return ""
				}
				if path != "" {
					path += "/"
				}
				path += pick.key
				if pick.value != "" {
					path += "=" + pick.value
				}
				if i == len(entries)-1 {
					if pick.limit {
						return path
					}
					return ""
				}
				level = pick.children
			}
			return ""
		}
		entries := make([]Entry, rapid.IntRange(1, 4).Draw(t, "depth"))
		for i := range entries {
			entries[i] = Entry{rapid.SampledFrom(keys).Draw(t, "ek"), rapid.SampledFrom([]string{"", "x", "y", "xz", "z"}).Draw(t, "ev")}
		}
		got := ""
		if r := s.Match("r", entries); r != nil {
			got = r.Path
		}
		if want := ref(entries); got != want {
			t.Fatalf("Match(%v) = %q, reference %q\n%s", entries, got, want, b.String())
		}
	})
}

// TestManyWildcardsCompileInLinearTime: the duplicate check of wildcard
// values under one key is a set lookup, so compiling four times as many
// wildcards costs about four times the CPU (a scan of the earlier
// wildcards made it sixteen), and the duplicate is still found.
func TestManyWildcardsCompileInLinearTime(t *testing.T) {
	src := func(n int) []byte {
		var b strings.Builder
		b.WriteString("domain: d\ndescriptors:\n")
		for i := 0; i < n; i++ {
			fmt.Fprintf(&b, "- {key: k, value: '%07d*'}\n", i)
		}
		b.WriteString("- {key: k, value: '0000007*'}\n")
		return []byte(b.String())
	}
	// The CPU time of compiling n and 4n wildcards, the least of three
	// runs each: linear is about 4× (a scan of every earlier wildcard was
	// 16×); the ratio holds on a busy machine, a bound in seconds does not.
	cpu := func(n int) time.Duration {
		best := time.Duration(math.MaxInt64)
		for range 3 {
			b := src(n)
			c0, _ := proccpu.Self()
			_, err := Compile(1, []File{{Name: "f.yaml", Source: b}})
			c1, _ := proccpu.Self()
			best = min(best, c1-c0)
			var e *Error
			if !errors.As(err, &e) || e.Line != n+3 || !strings.Contains(e.Msg, "duplicate descriptor composite key 'd.k_0000007*'") {
				t.Fatalf("%d wildcards: err = %v, want the duplicate on line %d", n, err, n+3)
			}
		}
		return best
	}
	const n = 20000
	small, large := cpu(n), cpu(4*n)
	t.Logf("CPU to compile %d wildcards %v, %d %v", n, small, 4*n, large)
	if r := float64(large) / float64(max(small, time.Millisecond)); r > 10 {
		t.Errorf("%d wildcards took %v of CPU, %d took %v: %.1f×, want about 4× (linear)", 4*n, large, n, small, r)
	}
}
