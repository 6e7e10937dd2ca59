// Package deploy_test checks deploy/ and the operator docs: the local
// cluster walk-through of docs/operations.md run for real (TestLocalCluster,
// skipped with -short), and the static validity of everything else — YAML
// and JSON parse, Kubernetes objects are well-formed, the Envoy bootstrap
// is a valid Bootstrap whose descriptors reach the example rules, the
// dashboard's metrics exist in the code, the scripts pass bash -n, the
// flags the units, manifests and scripts use exist in the binaries,
// docs/configuration.md documents every flag and YAML key, and the docs
// speak of the product with working links (prose_test.go).
package deploy_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.yaml.in/yaml/v3"

	"github.com/allot/allot/internal/testproc"
)

// root is the repository root (tests run in deploy/).
const root = ".."

var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	testproc.RemoveBuilds()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// binaries builds ./cmd/... (allocator, gateway, allotctl) once per test
// run into a temporary directory removed by TestMain, and returns it. It
// builds them as testproc.Build does: as they ship, or with -race when
// testproc.RaceBinaries says so.
func binaries(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		binDir, binErr = os.MkdirTemp("", "allot-deploy-bin-")
		if binErr != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		args := []string{"build", "-o", binDir + string(filepath.Separator)}
		if testproc.RaceBinaries() {
			args = append(args, "-race", "-pgo=off")
		}
		cmd := exec.CommandContext(ctx, "go", append(args, "./cmd/...")...)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build ./cmd/...: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binDir
}

// cmdBinaries returns the allocator and gateway that binaries built, for
// testproc's helpers, so that the package builds the commands once rather
// than again through testproc.Build.
func cmdBinaries(t *testing.T) testproc.Binaries {
	dir := binaries(t)
	return testproc.Binaries{Allocator: filepath.Join(dir, "allocator"), Gateway: filepath.Join(dir, "gateway")}
}

// deployFiles lists the files under deploy/ whose names end in one of exts.
func deployFiles(t *testing.T, exts ...string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		for _, e := range exts {
			if strings.HasSuffix(path, e) {
				out = append(out, path)
				break
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// yamlDocs decodes every document of a (multi-document) YAML file into
// generic values; empty documents are skipped.
func yamlDocs(t *testing.T, path string) []map[string]any {
	t.Helper()
	dec := yaml.NewDecoder(bytes.NewReader(readFile(t, path)))
	var docs []map[string]any
	for i := 0; ; i++ {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return docs
		}
		if err != nil {
			t.Fatalf("%s: document %d: %v", path, i+1, err)
		}
		if doc != nil {
			docs = append(docs, doc)
		}
	}
}

// dig walks a generic YAML/JSON value by map keys and list indexes.
func dig(v any, path ...any) any {
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, ok := v.(map[string]any)
			if !ok {
				return nil
			}
			v = m[k]
		case int:
			l, ok := v.([]any)
			if !ok || k >= len(l) {
				return nil
			}
			v = l[k]
		}
	}
	return v
}

func str(v any) string {
	s, _ := v.(string)
	return s
}

// helpFlags runs BIN ARGS... (a -h / --help invocation) and returns the
// flag names its usage lists: "-name" lines of Go's flag package and
// "--name" / "-x, --name" lines of cobra.
func helpFlags(t *testing.T, bin string, args ...string) map[string]bool {
	t.Helper()
	out, err := exec.Command(bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", bin, strings.Join(args, " "), err, out)
	}
	flags := map[string]bool{}
	goFlag := regexp.MustCompile(`^  -([a-zA-Z0-9][a-zA-Z0-9-]*)`)
	cobraFlag := regexp.MustCompile(`^\s+(?:-([a-zA-Z]), )?--([a-zA-Z0-9][a-zA-Z0-9-]*)`)
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if m := cobraFlag.FindStringSubmatch(line); m != nil {
			flags[m[2]] = true
			if m[1] != "" {
				flags[m[1]] = true
			}
			continue
		}
		if m := goFlag.FindStringSubmatch(line); m != nil {
			flags[m[1]] = true
		}
	}
	if len(flags) == 0 {
		t.Fatalf("%s %s: no flags found in:\n%s", bin, strings.Join(args, " "), out)
	}
	return flags
}

// eventually polls cond every 50ms until it holds or within passes; then it
// fails with cond's last explanation.
func eventually(t *testing.T, within time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true within %v: %s", what, within, why)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
