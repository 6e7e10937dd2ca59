package policy

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of the testdata scripts")

// A script is a sequence of blocks:
//
//	command key=value ...
//	----
//	expected output
//	<blank line>
//
// Lines starting with # are comments. runScript runs each block's command
// through do and compares its output with the expected one (or, with
// -rewrite, writes the output back into the file).
func runScript(t *testing.T, path string, do func(t *testing.T, cmd string, args map[string]string) string) {
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

// scripts runs every testdata file matching glob.
func scripts(t *testing.T, glob string, do func(t *testing.T, cmd string, args map[string]string) string) {
	files, err := filepath.Glob(filepath.Join("testdata", glob))
	if err != nil || len(files) == 0 {
		t.Fatalf("no scripts match %s (%v)", glob, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) { runScript(t, f, do) })
	}
}

func argF(t *testing.T, args map[string]string, k string) float64 {
	t.Helper()
	v, ok := args[k]
	if !ok {
		return 0
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		t.Fatalf("%s=%s: %v", k, v, err)
	}
	return f
}

func argI(t *testing.T, args map[string]string, k string) int64 {
	t.Helper()
	v, ok := args[k]
	if !ok {
		return 0
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		t.Fatalf("%s=%s: %v", k, v, err)
	}
	return n
}

func argD(t *testing.T, args map[string]string, k string, def time.Duration) time.Duration {
	t.Helper()
	v, ok := args[k]
	if !ok {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s=%s: %v", k, v, err)
	}
	return d
}

// TestArithmetic runs testdata/arith-*: the stateless functions.
//
//	want d=<tokens/s> [tick=50ms] [latency=<s>]      → Want
//	lowwater d=<tokens/s> [tick=50ms] [latency=<s>]  → LowWater
//	fell d=<tokens/s> delta=<tokens> [dt=<s>]        → Fell
//	excess bal=<tokens> target=<tokens>              → Excess
//	firstuse d= charged= spent= balance=             → FirstUse
//	thin quota= window= n=                           → ThinShare
//	margin ttl=                                      → LeaseMargin
//	pace [exhausted] [short] rpu= window= [burst=] agents= refresh= retry= [scan=100ms] → Pace
func TestArithmetic(t *testing.T) {
	scripts(t, "arith-*", func(t *testing.T, cmd string, args map[string]string) string {
		tick, lat := argD(t, args, "tick", 50*time.Millisecond), argF(t, args, "latency")
		switch cmd {
		case "want":
			return fmt.Sprint(Want(argF(t, args, "d"), tick, lat))
		case "lowwater":
			return fmt.Sprint(LowWater(argF(t, args, "d"), tick, lat))
		case "fell":
			dt := 0.1
			if _, ok := args["dt"]; ok {
				dt = argF(t, args, "dt")
			}
			return fmt.Sprint(Fell(argF(t, args, "d"), argI(t, args, "delta"), dt))
		case "excess":
			return fmt.Sprint(Excess(argI(t, args, "bal"), argI(t, args, "target")))
		case "firstuse":
			return fmt.Sprint(FirstUse(argF(t, args, "d"), argI(t, args, "charged"), argI(t, args, "spent"), argI(t, args, "balance")))
		case "thin":
			return fmt.Sprint(ThinShare(argI(t, args, "quota"), argD(t, args, "window", 0), uint32(argI(t, args, "n"))))
		case "margin":
			return fmt.Sprint(LeaseMargin(argD(t, args, "ttl", 0)))
		case "pace":
			_, ex := args["exhausted"]
			_, short := args["short"]
			p, ok := Pace(Grant{
				Exhausted: ex, Short: short,
				RequestsPerUnit: uint32(argI(t, args, "rpu")), WindowSeconds: argI(t, args, "window"),
				Burst: argI(t, args, "burst"), Agents: uint32(argI(t, args, "agents")),
				RefreshAfter: argD(t, args, "refresh", 0), RetryAfter: argD(t, args, "retry", 0),
			}, argD(t, args, "scan", 100*time.Millisecond))
			if !ok {
				return "not paced"
			}
			return "paced " + p.String()
		}
		t.Fatalf("unknown command %q", cmd)
		return ""
	})
}

// TestDemand runs testdata/demand-*: one key's estimate, scan by scan.
//
//	reset                                  a new key, no scan yet (time 0)
//	spend n=<tokens>                       the key admits n tokens
//	deny                                   the key denies a request (until the next report)
//	report                                 the key is reported: denials are forgotten
//	scan [advance=100ms]                   advance the clock, then scan: prints rate, and "fell" when it fell
//	decay [advance=100ms]                  a scan that finds nothing spent, through Decay
//	of [advance=0]                         advance the clock, then print Of and Want
func TestDemand(t *testing.T) {
	var (
		d             Demand
		now, lastScan int64
		spent         int64
		denied        bool
	)
	scripts(t, "demand-*", func(t *testing.T, cmd string, args map[string]string) string {
		switch cmd {
		case "reset":
			d, now, lastScan, spent, denied = Demand{}, 0, 0, 0, false
			return "ok"
		case "spend":
			spent += argI(t, args, "n")
			return fmt.Sprintf("spent %d", spent)
		case "deny":
			denied = true
			return "denied"
		case "report":
			denied = false
			return "reported"
		case "scan", "decay":
			now += int64(argD(t, args, "advance", 100*time.Millisecond))
			var dt float64
			if lastScan != 0 && now > lastScan {
				dt = float64(now-lastScan) / float64(time.Second)
			}
			lastScan = now
			fell := false
			if cmd == "scan" {
				fell = d.Scan(now, spent, dt, Alpha(dt), !denied)
			} else {
				d.Decay(Alpha(dt))
			}
			s := fmt.Sprintf("t=%v rate=%.4g", time.Duration(now), d.Rate)
			if fell {
				s += " fell"
			}
			return s
		case "of":
			now += int64(argD(t, args, "advance", 0))
			r := d.Of(now, spent, lastScan)
			return fmt.Sprintf("demand=%.4g want=%d", r, max(Want(r, 50*time.Millisecond, 0), 1))
		}
		t.Fatalf("unknown command %q", cmd)
		return ""
	})
}
