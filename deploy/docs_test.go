package deploy_test

import (
	"bufio"
	"bytes"
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// mdSections splits a Markdown file into its "## " sections, by title.
func mdSections(t *testing.T, path string) map[string]string {
	t.Helper()
	out := map[string]string{}
	title := ""
	var cur strings.Builder
	for _, l := range strings.Split(string(readFile(t, path)), "\n") {
		if strings.HasPrefix(l, "## ") {
			out[title] = cur.String()
			title = strings.TrimPrefix(l, "## ")
			cur.Reset()
			continue
		}
		cur.WriteString(l)
		cur.WriteByte('\n')
	}
	out[title] = cur.String()
	return out
}

// allotctlCommands lists allotctl's command paths ("status", "rules
// apply", …) from its help output, recursively.
func allotctlCommands(t *testing.T, bin string, path ...string) [][]string {
	t.Helper()
	out, err := exec.Command(bin, append(path, "--help")...).CombinedOutput()
	if err != nil {
		t.Fatalf("allotctl %s --help: %v\n%s", strings.Join(path, " "), err, out)
	}
	var cmds [][]string
	in := false
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "Available Commands:"):
			in = true
		case in && strings.HasPrefix(line, "  "):
			name := strings.Fields(line)[0]
			if name == "help" {
				continue
			}
			sub := append(append([]string{}, path...), name)
			cmds = append(cmds, sub)
			cmds = append(cmds, allotctlCommands(t, bin, sub...)...)
		case in:
			in = false
		}
	}
	return cmds
}

var (
	docFlagRow   = regexp.MustCompile("^\\| `-")
	docBacktick  = regexp.MustCompile("`(-{1,2}[a-zA-Z][a-zA-Z0-9-]*)`")
	docYAMLTag   = regexp.MustCompile(`yaml:"([a-z_]+)[,"]`)
	docEntryCase = regexp.MustCompile(`case "([a-z_]+)":`)
	docEnvVar    = regexp.MustCompile(`\$\{(ALLOT_[A-Z_]+)`)
)

// checkFlagSection: every flag of want appears as `-flag` (or `--flag`) in
// section, and every flag in the first cell of the section's table rows
// exists in want.
func checkFlagSection(t *testing.T, name, section string, want map[string]bool, dashes string) {
	t.Helper()
	for f := range want {
		if f == "h" || f == "help" {
			continue
		}
		d := dashes
		if len(f) == 1 {
			d = "-"
		}
		if !strings.Contains(section, "`"+d+f+"`") {
			t.Errorf("docs/configuration.md, %s: flag %s%s is not documented", name, d, f)
		}
	}
	for _, l := range strings.Split(section, "\n") {
		if !strings.HasPrefix(l, "|") {
			continue
		}
		cells := strings.Split(l, "|")
		if len(cells) < 3 {
			continue
		}
		// The flag column: the first cell, or the second in "command | flag" tables.
		cell := cells[1]
		if !docFlagRow.MatchString(l) && len(cells) > 3 {
			cell = cells[2]
		}
		for _, m := range docBacktick.FindAllStringSubmatch(cell, -1) {
			if f := strings.TrimLeft(m[1], "-"); !want[f] {
				t.Errorf("docs/configuration.md, %s: %s is documented but does not exist", name, m[1])
			}
		}
	}
}

// stringListVars returns the string literals of the package-level var
// named name (a []string composite literal) in file.
func stringListVars(t *testing.T, file string, names ...string) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	found := 0
	ast.Inspect(f, func(n ast.Node) bool {
		vs, ok := n.(*ast.ValueSpec)
		if !ok {
			return true
		}
		for i, id := range vs.Names {
			for _, want := range names {
				if id.Name != want || i >= len(vs.Values) {
					continue
				}
				cl, ok := vs.Values[i].(*ast.CompositeLit)
				if !ok {
					continue
				}
				found++
				for _, el := range cl.Elts {
					if bl, ok := el.(*ast.BasicLit); ok && bl.Kind == token.STRING {
						s, _ := strconv.Unquote(bl.Value)
						out = append(out, s)
					}
				}
			}
		}
		return true
	})
	if found != len(names) {
		t.Fatalf("%s: found %d of the lists %v", file, found, names)
	}
	return out
}

// TestConfigurationDoc keeps docs/configuration.md true: every flag of
// allocator, gateway and allotctl (each command), every gateway config key,
// every rules key and every cluster.sh variable is documented, and no
// documented flag is missing from the binaries.
func TestConfigurationDoc(t *testing.T) {
	doc := mdSections(t, filepath.Join(root, "docs", "configuration.md"))
	for _, s := range []string{"allocator", "gateway", "Rules files", "allotctl", "deploy/local/cluster.sh"} {
		if doc[s] == "" {
			t.Fatalf("docs/configuration.md has no section %q", s)
		}
	}
	bin := binaries(t)
	checkFlagSection(t, "allocator", doc["allocator"], helpFlags(t, filepath.Join(bin, "allocator"), "-h"), "-")

	gwSection := doc["gateway"]
	checkFlagSection(t, "gateway", gwSection, helpFlags(t, filepath.Join(bin, "gateway"), "-h"), "-")

	ctl := filepath.Join(bin, "allotctl")
	all := helpFlags(t, ctl, "--help")
	for _, cmd := range allotctlCommands(t, ctl) {
		for f := range helpFlags(t, ctl, append(cmd, "--help")...) {
			all[f] = true
		}
	}
	checkFlagSection(t, "allotctl", doc["allotctl"], all, "--")

	// Gateway config keys: the yaml tags of the config structs, and the
	// entry mapping's keys.
	var keys []string
	for _, f := range []string{"cmd/gateway/config.go", "agent/httplimit/config.go", "pkg/redislimit/fileconfig.go"} {
		for _, m := range docYAMLTag.FindAllStringSubmatch(string(readFile(t, filepath.Join(root, f))), -1) {
			keys = append(keys, m[1])
		}
	}
	for _, m := range docEntryCase.FindAllStringSubmatch(string(readFile(t, filepath.Join(root, "agent/httplimit/config.go"))), -1) {
		keys = append(keys, m[1])
	}
	if len(keys) < 20 {
		t.Fatalf("only %d gateway config keys found: %v", len(keys), keys)
	}
	for _, k := range keys {
		if !strings.Contains(gwSection, "`"+k+"`") {
			t.Errorf("docs/configuration.md, gateway: config key %s is not documented", k)
		}
	}

	// Rules keys, as pkg/rules accepts them at each level.
	for _, k := range stringListVars(t, filepath.Join(root, "pkg/rules/compile.go"), "rootKeys", "descKeys", "limitKeys") {
		if !strings.Contains(doc["Rules files"], "`"+k+"`") {
			t.Errorf("docs/configuration.md, Rules files: key %s is not documented", k)
		}
	}

	// cluster.sh's environment.
	vars := docEnvVar.FindAllStringSubmatch(string(readFile(t, "local/cluster.sh")), -1)
	if len(vars) < 10 {
		t.Fatalf("only %d ALLOT_ variables found in cluster.sh", len(vars))
	}
	for _, m := range vars {
		if !strings.Contains(doc["deploy/local/cluster.sh"], "`"+m[1]+"`") {
			t.Errorf("docs/configuration.md, cluster.sh: %s is not documented", m[1])
		}
	}
}

// TestDocsMetricNames: every allot_* metric name the operator docs mention
// (tables, PromQL alerts) is defined in the code.
func TestDocsMetricNames(t *testing.T) {
	names := metricNames(t)
	re := regexp.MustCompile(`\ballot_[a-z]+_[a-z0-9_]*[a-z0-9]\b`)
	for _, doc := range []string{"operations.md", "failure-modes.md", "configuration.md", "migrating-from-envoy-ratelimit.md", "comparison.md"} {
		src := string(readFile(t, filepath.Join(root, "docs", doc)))
		n := 0
		for _, loc := range re.FindAllStringIndex(src, -1) {
			m := src[loc[0]:loc[1]]
			if loc[1] < len(src) && src[loc[1]] == '_' {
				continue // a prefix such as allot_allocator_
			}
			n++
			if !knownMetric(names, m) {
				t.Errorf("docs/%s mentions metric %s, which the code does not define", doc, m)
			}
		}
		t.Logf("docs/%s: %d metric mentions", doc, n)
	}
}
