package layers

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/allot/allot"

// root is the module's directory.
func root(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

var rowRE = regexp.MustCompile("^\\|\\s*`([^`]+)`\\s*\\|\\s*(\\d+)\\s*\\|")

// layerTable parses the table of docs/architecture.md whose header starts
// "| package | layer |": package path (relative to the module) to layer.
func layerTable(t *testing.T, md []byte) map[string]int {
	t.Helper()
	layers := map[string]int{}
	in := false
	sc := bufio.NewScanner(bytes.NewReader(md))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(strings.ReplaceAll(line, " ", ""), "|package|layer|"):
			in = true
		case in && strings.HasPrefix(line, "|---"):
		case in && strings.HasPrefix(line, "|"):
			m := rowRE.FindStringSubmatch(line)
			if m == nil {
				t.Fatalf("docs/architecture.md:%d: want | `package` | layer | ...: %q", n, line)
			}
			if _, dup := layers[m[1]]; dup {
				t.Errorf("docs/architecture.md:%d: %s listed twice", n, m[1])
			}
			layers[m[1]], _ = strconv.Atoi(m[2])
		case in:
			return layers
		}
	}
	if len(layers) == 0 {
		t.Fatal("docs/architecture.md has no | package | layer | table")
	}
	return layers
}

type goPackage struct {
	ImportPath                         string
	Imports, TestImports, XTestImports []string
}

// packages lists the module's packages with go list.
func packages(t *testing.T, dir string) []goPackage {
	t.Helper()
	cmd := exec.Command("go", "list", "-e", "-json=ImportPath,Imports,TestImports,XTestImports", "./...")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var pkgs []goPackage
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p goPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs
}

// rel returns the module-relative path of an import path of the module,
// or "" for any other import.
func rel(path string) string {
	if rest, ok := strings.CutPrefix(path, module+"/"); ok {
		return rest
	}
	return ""
}

// side is "allocator" or "agent" for the packages of those two trees.
func side(p string) string {
	for _, s := range []string{"allocator", "agent"} {
		if p == s || strings.HasPrefix(p, s+"/") {
			return s
		}
	}
	return ""
}

func TestLayers(t *testing.T) {
	dir := root(t)
	md, err := os.ReadFile(filepath.Join(dir, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	layers := layerTable(t, md)
	pkgs := packages(t, dir)
	seen := map[string]bool{}
	for _, p := range pkgs {
		name := rel(p.ImportPath)
		seen[name] = true
		layer, ok := layers[name]
		if !ok {
			t.Errorf("%s is not in docs/architecture.md's layer table", name)
			continue
		}
		for _, imp := range p.Imports {
			dep := rel(imp)
			if dep == "" {
				continue
			}
			if l, ok := layers[dep]; ok && l >= layer {
				t.Errorf("%s (layer %d) imports %s (layer %d): a package imports only lower layers", name, layer, dep, l)
			}
		}
		all := append(append(append([]string(nil), p.Imports...), p.TestImports...), p.XTestImports...)
		for _, imp := range all {
			dep := rel(imp)
			if dep == "" {
				continue
			}
			if strings.HasPrefix(dep, "cmd/") && dep != name {
				t.Errorf("%s imports %s: nothing imports cmd/", name, dep)
			}
			if a, b := side(name), side(dep); a != "" && b != "" && a != b {
				t.Errorf("%s imports %s: allocator and agent never import each other", name, dep)
			}
		}
	}
	for name := range layers {
		if !seen[name] {
			t.Errorf("docs/architecture.md's layer table lists %s, which is not a package", name)
		}
	}
}

func TestNoSymlinks(t *testing.T) {
	dir := root(t)
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == ".git" {
			return filepath.SkipDir
		}
		if d.Type()&fs.ModeSymlink != 0 {
			r, _ := filepath.Rel(dir, path)
			t.Errorf("%s is a symlink: the tree has none (module zips drop them)", r)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
