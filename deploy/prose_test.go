package deploy_test

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// narration matches words about how the project was built rather than what
// it does: numbered sessions or rounds of work, the people who did it,
// planning documents that are not in the repository, and issue numbers.
// It is deliberately narrow: "TLS session", "a session: why is this key
// denied?", "rounds × 8 s" and a peer's "envoyproxy/ratelimit#462" pass.
var narration = regexp.MustCompile(`(?i)\bsessions?[ -][0-9]+\b|\b(build|helper|work) sessions?\b|\b(first|second|third|previous|earlier|later|next) (build |work )?sessions?\b|\bround [0-9]+ of\b|\b(numbered|earlier|later|previous|first|second|third) rounds? of work\b|\bengineers?\b|\bdesign card\b|\bissue #[0-9]+|\bNOTES\.md\b`)

// maxPerformanceLines bounds docs/performance.md: a report, not a log; and
// maxPerformanceLineLen keeps each of its table rows to one figure.
const (
	maxPerformanceLines   = 450
	maxPerformanceLineLen = 600
)

// walkFiles returns the files under dir (relative to the repository root)
// whose name keep accepts, relative to the root, skipping hidden
// directories and testdata.
func walkFiles(t *testing.T, dir string, keep func(name string) bool) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(filepath.Join(root, dir), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		n := d.Name()
		if d.IsDir() {
			if n != "." && n != ".." && (strings.HasPrefix(n, ".") || n == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if keep(n) {
			rel, _ := filepath.Rel(root, p)
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// markdownFiles returns README.md and every Markdown file under docs/ and
// deploy/.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	isMD := func(n string) bool { return strings.HasSuffix(n, ".md") }
	return append(append([]string{"README.md"}, walkFiles(t, "docs", isMD)...), walkFiles(t, "deploy", isMD)...)
}

// goComments calls fn with every comment of every non-test, non-generated
// Go file of the module, and the line it starts on.
func goComments(t *testing.T, fn func(file string, line int, text string)) {
	t.Helper()
	fset := token.NewFileSet()
	for _, f := range walkFiles(t, ".", func(n string) bool {
		return strings.HasSuffix(n, ".go") && !strings.HasSuffix(n, "_test.go") && !strings.HasSuffix(n, ".pb.go")
	}) {
		file, err := parser.ParseFile(fset, filepath.Join(root, f), nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, cg := range file.Comments {
			for _, c := range cg.List {
				fn(f, fset.Position(c.Pos()).Line, c.Text)
			}
		}
	}
}

// proseLines splits Markdown into lines, reporting for each whether it is
// inside a fenced code block.
func proseLines(src string) (lines []string, fenced []bool) {
	in := false
	for _, l := range strings.Split(src, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			in = !in
			lines, fenced = append(lines, l), append(fenced, true)
			continue
		}
		lines, fenced = append(lines, l), append(fenced, in)
	}
	return lines, fenced
}

// TestDocsSpeakOfTheProduct rejects narration of how allot was built in the
// docs, the README and the comments of non-test Go files.
func TestDocsSpeakOfTheProduct(t *testing.T) {
	for _, f := range markdownFiles(t) {
		lines, _ := proseLines(string(readFile(t, filepath.Join(root, f))))
		for i, l := range lines {
			if m := narration.FindString(l); m != "" {
				t.Errorf("%s:%d: %q narrates how the project was built; say what the product does (history belongs in git log)", f, i+1, m)
			}
		}
	}
	goComments(t, func(file string, line int, text string) {
		for _, m := range narration.FindAllStringIndex(text, -1) {
			t.Errorf("%s:%d: comment %q narrates how the project was built", file, line+strings.Count(text[:m[0]], "\n"), text[m[0]:m[1]])
		}
	})
}

// TestPerformanceReportLength keeps docs/performance.md a report.
func TestPerformanceReportLength(t *testing.T) {
	lines := strings.Split(string(readFile(t, filepath.Join(root, "docs", "performance.md"))), "\n")
	if n := len(lines) - 1; n > maxPerformanceLines {
		t.Errorf("docs/performance.md has %d lines, more than %d: keep one table and the method; raw output belongs in bench/*/results", n, maxPerformanceLines)
	}
	for i, l := range lines {
		if n := utf8.RuneCountInString(l); n > maxPerformanceLineLen {
			t.Errorf("docs/performance.md:%d is %d characters long, more than %d: one figure per row", i+1, n, maxPerformanceLineLen)
		}
	}
}

var (
	mdLink     = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	codeSpan   = regexp.MustCompile("`[^`]*`")
	mdHeading  = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	docMention = regexp.MustCompile(`\bdocs/([a-z0-9-]+\.md)(#[a-z0-9-]+)?`)
)

// anchors returns the GitHub anchors of a Markdown file's headings.
func anchors(t *testing.T, path string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	seen := map[string]int{}
	lines, fenced := proseLines(string(readFile(t, path)))
	for i, l := range lines {
		m := mdHeading.FindStringSubmatch(l)
		if m == nil || fenced[i] {
			continue
		}
		a := slug(m[1])
		if n := seen[a]; n > 0 {
			out[a+"-"+strconv.Itoa(n)] = true
		} else {
			out[a] = true
		}
		seen[a]++
	}
	return out
}

// slug is GitHub's heading anchor: lower case, punctuation dropped, spaces
// to hyphens.
func slug(h string) string {
	h = strings.NewReplacer("`", "", "*", "").Replace(h)
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// TestDocsLinks checks every relative link in the Markdown files (the file,
// and the heading its #anchor names) and every docs/*.md a Go comment or a
// document names.
func TestDocsLinks(t *testing.T) {
	cache := map[string]map[string]bool{}
	check := func(where, target string) {
		file, anchor, _ := strings.Cut(target, "#")
		if _, err := os.Stat(filepath.Join(root, file)); err != nil {
			t.Errorf("%s: link to %s: no such file", where, target)
			return
		}
		if anchor == "" || !strings.HasSuffix(file, ".md") {
			return
		}
		a, ok := cache[file]
		if !ok {
			a = anchors(t, filepath.Join(root, file))
			cache[file] = a
		}
		if !a[anchor] {
			t.Errorf("%s: link to %s: %s has no heading with anchor #%s", where, target, file, anchor)
		}
	}
	for _, f := range markdownFiles(t) {
		lines, fenced := proseLines(string(readFile(t, filepath.Join(root, f))))
		for i, l := range lines {
			if fenced[i] {
				continue
			}
			where := f + ":" + strconv.Itoa(i+1)
			for _, m := range mdLink.FindAllStringSubmatch(codeSpan.ReplaceAllString(l, ""), -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				if strings.HasPrefix(target, "#") {
					check(where, f+target)
					continue
				}
				check(where, filepath.ToSlash(filepath.Join(filepath.Dir(f), target)))
			}
			for _, m := range docMention.FindAllStringSubmatch(l, -1) {
				check(where, "docs/"+m[1]+m[2])
			}
		}
	}
	goComments(t, func(file string, line int, text string) {
		for _, m := range docMention.FindAllStringSubmatch(text, -1) {
			check(file+":"+strconv.Itoa(line), "docs/"+m[1]+m[2])
		}
	})
}

// TestNarrationPattern pins what the narration check flags and what it lets
// through.
func TestNarrationPattern(t *testing.T) {
	for _, tc := range []struct {
		text string
		flag bool
	}{
		{"Session 3: the request memo", true},
		{"in session-2 runs", true},
		{"the late session-2 runs", true},
		{"this project's first build session", true},
		{"this engineer's own CPU benchmark", true},
		{"other engineers' builds", true},
		{"the design card's rules", true},
		{"issue #7's targets", true},
		{"see NOTES.md", true},
		{"in round 2 of work", true},
		{"measured in the previous session", true},
		{"TLS session resumption", false},
		{"## A session: why is this key denied?", false},
		{"-rounds 6 -duration 8s", false},
		{"6 rounds × 8 s", false},
		{"envoyproxy/ratelimit#462", false},
		{"engineering", false},
		{"sticky sessions and", false},
	} {
		if got := narration.MatchString(tc.text); got != tc.flag {
			t.Errorf("narration.MatchString(%q) = %v, want %v", tc.text, got, tc.flag)
		}
	}
}

// TestSlug pins GitHub's heading anchors for the headings the docs link to.
func TestSlug(t *testing.T) {
	for h, want := range map[string]string{
		"Summary":                     "summary",
		"How to reproduce":            "how-to-reproduce",
		"The agent's hot path":        "the-agents-hot-path",
		"Fair share: water-filling":   "fair-share-water-filling",
		"The config file (`-config`)": "the-config-file--config",
		"Lease TTL and refresh":       "lease-ttl-and-refresh",
	} {
		if got := slug(h); got != want {
			t.Errorf("slug(%q) = %q, want %q", h, got, want)
		}
	}
}
