package policy

import (
	"go/ast"
	"go/parser"
	"go/token"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"

	"github.com/allot/allot/pkg/breaker"
	"time"
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

// TestStaticVisit: a static key is sent only to be promoted: when a check
// found its share low, or its demand passes half the share's rate.
func TestStaticVisit(t *testing.T) {
	c := NewCore(Config{Tick: 50 * time.Millisecond, Scan: 100 * time.Millisecond, IdleTimeout: 10 * time.Second,
		Breaker: breaker.Config{Threshold: 3, Cooldown: time.Second, MaxCooldown: time.Second, Jitter: func(d time.Duration) time.Duration { return d }}})
	now := int64(1000 * time.Second)
	var k Key
	o := Obs{Spent: 3, LastUse: now, Static: true, StaticRate: 100}
	if v := c.Visit(&k, &o, now, 0.1, Alpha(0.1)); v != Stay || k.Inflight {
		t.Fatalf("active static key: %v, want Stay (no lease asked)", v)
	}
	if c.Queued(&k, &o, now) {
		t.Fatalf("a static key queued without promote was picked")
	}
	if v := c.Visit(&k, &o, now+int64(100*time.Millisecond), 0.1, Alpha(0.1)); v != Rest {
		t.Fatalf("quiet static key: %v, want Rest", v)
	}
	o.Promote = true
	if !c.Queued(&k, &o, now) || !k.Inflight {
		t.Fatalf("a static key queued for promotion was not picked")
	}
	k = Key{}
	o = Obs{Spent: 10, LastUse: now, Static: true, StaticRate: 100}
	if v := c.Visit(&k, &o, now, 0.1, Alpha(0.1)); v != Stay {
		t.Fatalf("demand %.1f of a share of 100/s: %v, want Stay", k.Demand.Rate, v)
	}
	o.Spent += 100
	if v := c.Visit(&k, &o, now+int64(100*time.Millisecond), 0.1, Alpha(0.1)); v != Promote || !k.Inflight {
		t.Fatalf("demand %.1f of a share of 100/s: %v, want Promote", k.Demand.Rate, v)
	}
	if !StaticLow(4, 10) || StaticLow(5, 10) || StaticBusy(50, 100) || !StaticBusy(51, 100) || StaticBusy(1, 0) {
		t.Fatalf("thresholds")
	}
}
