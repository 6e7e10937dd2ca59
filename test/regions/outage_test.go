package regions

import (
	"testing"
	"time"

	"github.com/allot/allot/internal/testproc"
)

// TestGlobalClusterDown: fullWorld at 60 requests/s a region (1.8 R); every
// node of the global cluster is killed (kill -9) for 6 s, then restarted on
// its data dir. Every region behaves as cut off (docs/regions.md, "The
// global cluster down"):
//
//   - each region reports itself cut off, and admits over the outage at
//     most its fallback share S_r (its share at the last grant) times the
//     outage, plus what it held, a tick and the debt its gateways ran up
//     meanwhile (the same bound as a partition);
//   - across regions the total admitted from the start stays within
//     B + R·t plus the regions' fallback debt and overdue minting before
//     the outage, plus Σ S_r over the outage and its detection;
//   - no gateway answers anything but 200 or 429, and every region is
//     granted again once the global cluster is back.
func TestGlobalClusterDown(t *testing.T) {
	const perRegion = 60.0
	w, load, _ := loadedFullWorld(t, perRegion)
	start := load.start

	// The regions' fallback debt and overdue minting before the outage
	// (checkPrefixes).
	connected := 0.0
	debtBefore := make([]int64, len(w.regions))
	for i, r := range w.regions {
		k := heldKey(t, r)
		connected += float64(k.GetDebt() + k.GetMinted())
		debtBefore[i] = k.GetDebt()
	}
	downAt := time.Now()
	for _, n := range w.global.Nodes {
		n.Proc.Kill()
	}
	testproc.Eventually(t, 30*time.Second, "6 s with the global cluster down", func() bool { return time.Since(downAt) > 6*time.Second })
	shares := make([]float64, len(w.regions))
	received := make([]int64, len(w.regions))
	debtRun := make([]int64, len(w.regions)) // run up during the outage
	for i, r := range w.regions {
		k := heldKey(t, r)
		if !k.GetCutOff() {
			t.Errorf("%s not reported cut off with the global cluster down: %+v", r.name, k)
		}
		shares[i] = k.GetFallbackRate()
		received[i] = k.GetReceived()
		debtRun[i] = max(0, k.GetDebt()-debtBefore[i])
		t.Logf("%s during the outage: fallback %.1f/s, minted %d, available %d, debt %d", r.name, k.GetFallbackRate(), k.GetMinted(), k.GetAvailable(), k.GetDebt())
	}
	upAt := time.Now()
	for _, n := range w.global.Nodes {
		n.Proc.Start(t)
	}
	w.global.Leader(t, 30*time.Second)
	for i, r := range w.regions {
		testproc.Eventually(t, 30*time.Second, r.name+" granted again after the global cluster's restart", func() bool {
			st := regionStatus(t, r)
			if st == nil {
				return false
			}
			keys := st.GetUpstream().GetKeys()
			return len(keys) > 0 && keys[0].GetReceived() > received[i]
		})
	}
	t.Logf("every region granted again %v after the restart", time.Since(upAt).Round(10*time.Millisecond))
	tallies := load.tallies(t)
	w.checkNoErrors(tallies)

	slot := 100 * time.Millisecond
	at := func(t time.Time) int { return int(t.Sub(start) / slot) }
	end := tallies[0].slots()
	outSecs := upAt.Sub(downAt).Seconds()
	// Each region: its share over the outage, plus what it held (at most
	// its lead, 1.5 s of its demand), a tick, and the debt its gateways'
	// fallback buckets ran up meanwhile (regions.md).
	sumShare := 0.0
	for i, r := range w.regions {
		adm, off := tallies[i].sum(at(downAt), at(upAt))
		bound := shares[i]*outSecs + perRegion*1.5 + 1 + float64(debtRun[i])
		t.Logf("outage %.1f s: %s admitted %d of %d (bound %.0f: share %.1f/s)", outSecs, r.name, adm, off, bound, shares[i])
		if float64(adm) > bound {
			t.Errorf("%s admitted %d with the global cluster down, bound %.0f", r.name, adm, bound)
		}
		sumShare += shares[i]
	}
	t.Logf("the regions' fallback shares sum to %.2f/s (R = %.0f/s)", sumShare, rate)
	if sumShare > rate*1.01 {
		t.Errorf("the regions' fallback shares sum to %.1f/s, over R = %.0f/s", sumShare, rate)
	}
	// Across regions, from the start: B + R·t, plus Σ S_r over the outage
	// and its detection once it began.
	extra := sumShare * (outSecs + 0.5)
	checkPrefixes(t, tallies, slot, end, connected, at(downAt), extra)
}
