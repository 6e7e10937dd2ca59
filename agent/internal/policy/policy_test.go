package policy

import (
	"go/ast"
	"go/parser"
	"go/token"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"
)

// TestDemandFellIgnoresNoise: a steady Poisson key never reads as a fall,
// whatever its rate, over many scans (the demand would flap and every flap
// costs a call).
func TestDemandFellIgnoresNoise(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	const dt = 0.1 // one scan
	for _, rate := range []float64{1, 10, 100, 400, 1000, 4000} {
		for scan := range 3000 {
			// Count a Poisson process's arrivals over dt.
			n, at := int64(0), rng.ExpFloat64()/rate
			for at < dt {
				n++
				at += rng.ExpFloat64() / rate
			}
			if Fell(rate, n, dt) {
				t.Fatalf("rate %v/s, scan %d: %d tokens in %v s read as a fall", rate, scan, n, dt)
			}
		}
	}
}

// TestPure: the package reads no clock, starts no goroutine and takes no
// lock or atomic, so that the refill loop, the simulator and the scripts
// drive the same deterministic core.
func TestPure(t *testing.T) {
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, im := range f.Imports {
			switch p := strings.Trim(im.Path.Value, `"`); p {
			case "sync", "sync/atomic", "math/rand", "math/rand/v2", "os", "net":
				t.Errorf("%s imports %s", fset.Position(im.Pos()), p)
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.GoStmt:
				t.Errorf("%s: a go statement", fset.Position(n.Pos()))
			case *ast.SelectorExpr:
				if x, ok := n.X.(*ast.Ident); ok && x.Name == "time" {
					switch n.Sel.Name {
					case "Now", "Since", "Until", "Sleep", "After", "AfterFunc", "NewTimer", "NewTicker", "Tick":
						t.Errorf("%s: time.%s", fset.Position(n.Pos()), n.Sel.Name)
					}
				}
			}
			return true
		})
	}
}
