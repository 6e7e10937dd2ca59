package policy

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/allot/allot/internal/scripttest"
)

// scripts runs every testdata file matching glob through do (see
// internal/scripttest for the format; -rewrite rewrites the answers).
func scripts(t *testing.T, glob string, do func(t *testing.T, cmd string, args map[string]string) string) {
	scripttest.Files(t, glob, func() scripttest.Do { return do })
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
