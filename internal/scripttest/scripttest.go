// Package scripttest runs data-driven test scripts: the testdata files that
// specify the pure policies (agent/internal/policy, allocator/upstream) in
// a form someone who never read the code can review.
//
// A script is a sequence of blocks:
//
//	command key=value ...
//	----
//	expected output
//	<blank line>
//
// Lines starting with # are comments. Run runs each block's command through
// do and compares its output with the expected one, or, with the test flag
// -rewrite, writes the output back into the file (review the diff).
package scripttest

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of the testdata scripts")

// Do runs one command with its key=value arguments and returns its output.
type Do func(t *testing.T, cmd string, args map[string]string) string

// Run runs the script at path.
func Run(t *testing.T, path string, do Do) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	sc := bufio.NewScanner(strings.NewReader(string(raw)))
	line := 0
	next := func() (string, bool) {
		if !sc.Scan() {
			return "", false
		}
		line++
		return sc.Text(), true
	}
	for {
		l, ok := next()
		if !ok {
			break
		}
		if strings.TrimSpace(l) == "" || strings.HasPrefix(l, "#") {
			out.WriteString(l + "\n")
			continue
		}
		at := line
		fields := strings.Fields(l)
		cmd, args := fields[0], map[string]string{}
		for _, f := range fields[1:] {
			k, v, _ := strings.Cut(f, "=")
			args[k] = v
		}
		if sep, ok := next(); !ok || sep != "----" {
			t.Fatalf("%s:%d: %q is not followed by ----", path, at, l)
		}
		var want []string
		for {
			e, ok := next()
			if !ok || e == "" {
				break
			}
			want = append(want, e)
		}
		got := strings.TrimRight(do(t, cmd, args), "\n")
		if !*rewrite && got != strings.Join(want, "\n") {
			t.Errorf("%s:%d: %s\ngot:\n%s\nwant:\n%s", path, at, l, got, strings.Join(want, "\n"))
		}
		fmt.Fprintf(&out, "%s\n----\n%s\n\n", l, got)
	}
	if *rewrite {
		if err := os.WriteFile(path, []byte(strings.TrimRight(out.String(), "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// Files runs every file in testdata matching glob (directories are
// skipped: rapid keeps its failing cases in testdata/rapid), each as a
// subtest named after the file. newDo is called once per file, so each
// script starts from fresh state.
func Files(t *testing.T, glob string, newDo func() Do) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", glob))
	if err != nil {
		t.Fatalf("bad glob %s: %v", glob, err)
	}
	n := 0
	for _, f := range files {
		if st, err := os.Stat(f); err != nil || st.IsDir() {
			continue
		}
		n++
		t.Run(filepath.Base(f), func(t *testing.T) { Run(t, f, newDo()) })
	}
	if n == 0 {
		t.Fatalf("no scripts match testdata/%s", glob)
	}
}
