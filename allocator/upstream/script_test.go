package upstream

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/allot/allot/internal/scripttest"
	"github.com/allot/allot/pkg/rules"
)

// TestScripts runs testdata/* (see internal/scripttest for the format;
// -rewrite rewrites the answers). Times (t=) are durations since the
// script's start; the key's clock never runs backwards.
//
//	key [rtt=150ms] [tick=100ms] [horizon=1s] [timeout=1s] [overdue=250ms] [backoff=1s] [window=4s] [idle=10s] rate=<tokens/s> [burst=] [static=<fraction>]
//	                                              a new key (static: global_fallback static)
//	tick t= demand=<tokens/s>                     → the call made, or "no call"
//	grant t= id= n=<tokens> [refresh=<dur>] [share=<tokens/s>]
//	                                              the global cluster answers (share: the fair
//	                                              share it computed; none from an older one)
//	fail t= id=                                   the call failed
//	cap t= want=                                  → what a gateway's want is capped at
//	short t=                                      the regional state cut a gateway's want
//	sub t= want=                                  → tokens sub-granted to a gateway
//	subret t= n=                                  a gateway hands tokens back
//	release t=                                    → the final call
//	resume avail= share= owed=                    a new leader's start from the regional state
//	sync t= avail=                                the regional state's balance, read back
//	mint t= [debt=]                               → fallback tokens minted for the regional state
//	                                              (and, with the pool's debt, how many it keeps from it)
//
// Every command but key prints the key's status after it.
func TestScripts(t *testing.T) {
	scripttest.Files(t, "*", func() scripttest.Do {
		var k *Key
		return func(t *testing.T, cmd string, args map[string]string) string {
			if cmd != "key" && k == nil {
				t.Fatalf("%s before key", cmd)
			}
			return do(t, &k, cmd, args)
		}
	})
}

func do(t *testing.T, kp **Key, cmd string, args map[string]string) string {
	t.Helper()
	f := func(name string) float64 {
		v, ok := args[name]
		if !ok {
			return 0
		}
		x, err := strconv.ParseFloat(v, 64)
		if err != nil {
			t.Fatalf("%s=%s: %v", name, v, err)
		}
		return x
	}
	i := func(name string) int64 { return int64(f(name)) }
	d := func(name string) time.Duration {
		v, ok := args[name]
		if !ok {
			return 0
		}
		x, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("%s=%s: %v", name, v, err)
		}
		return x
	}
	now := epoch + int64(d("t"))
	if cmd == "key" {
		cfg := Config{RTT: d("rtt"), Tick: d("tick"), Horizon: d("horizon"), CallTimeout: d("timeout"),
			OverdueMin: d("overdue"), RetryBackoff: d("backoff"), ShareWindow: d("window"), IdleAfter: d("idle")}
		r := Rule{Rate: f("rate"), Burst: i("burst")}
		if _, ok := args["static"]; ok {
			r.Fallback, r.Fraction = rules.FallbackStatic, f("static")
		}
		k, err := NewKey(cfg, r)
		if err != nil {
			return err.Error()
		}
		*kp = k
		return fmt.Sprintf("low watermark at 100/s: %d, target %d", k.LowWater(100), k.Target(100))
	}
	k := *kp
	var res string
	switch cmd {
	case "tick":
		r, ok := k.Tick(now, f("demand"))
		res = "no call"
		if ok {
			res = fmtRequest(r)
		}
	case "grant":
		res = "ok"
		_, hasShare := args["share"]
		g := Grant{ID: uint64(i("id")), Granted: i("n"), RefreshAfter: d("refresh"), Share: f("share"), HasShare: hasShare}
		if err := k.Granted(now, g); err != nil {
			res = err.Error()
		}
	case "fail":
		res = "ok"
		if err := k.Failed(now, uint64(i("id"))); err != nil {
			res = err.Error()
		}
	case "cap":
		res = fmt.Sprintf("capped at %d", k.Cap(now, i("want")))
	case "short":
		k.Short(now)
		res = "ok"
	case "sub":
		res = fmt.Sprintf("sub-granted %d", k.SubGrant(now, i("want")))
	case "subret":
		k.SubReturn(now, i("n"))
		res = "ok"
	case "release":
		res = fmtRequest(k.Release(now))
	case "resume":
		k.Resume(i("avail"), f("share"), i("owed"))
		res = "ok"
	case "sync":
		k.Sync(now, i("avail"))
		res = "ok"
	case "mint":
		n := k.Mint(now)
		res = fmt.Sprintf("minted %d", n)
		if _, ok := args["debt"]; ok {
			res += fmt.Sprintf(", keeps %d from the debt of %d", k.Keep(now, n, i("debt")), i("debt"))
		}
	default:
		t.Fatalf("unknown command %q", cmd)
	}
	return res + "\n" + fmtStatus(k.Status())
}

// epoch is the scripts' time 0.
const epoch = int64(1_700_000_000) * 1e9

func fmtRequest(r Request) string {
	s := fmt.Sprintf("call id=%d want=%d held=%d returned=%d demand=%.4g", r.ID, r.Want, r.Held, r.Returned, r.Demand)
	if r.OutageCharged != 0 {
		s += fmt.Sprintf(" outage_charged=%d", r.OutageCharged)
	}
	if r.Final {
		s += " final"
	}
	return s
}

func fmtStatus(s Status) string {
	state := "new"
	switch {
	case s.CutOff:
		state = fmt.Sprintf("cut off since %v", time.Duration(s.CutSince-epoch))
	case s.Connected:
		state = "connected"
	}
	if s.InFlight {
		state += ", call in flight"
	}
	if s.Overdue {
		state += ", overdue"
	}
	return fmt.Sprintf("  avail=%d owed=%d fallback=%d demand=%.4g/s share=%.4g/s falls-to=%.4g/s [%s] received=%d returned=%d minted=%d",
		s.Available, s.Owed, s.Fallback, s.Demand, s.Share, s.FallbackRt, state, s.Received, s.Returned, s.Minted)
}
