package state

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestLeaseChurnNeedsNoCompaction: under steady lease churn (agents come
// back to keys at random, so leases are added and expire all the time and
// entries grow and shrink by a lease or two), once the leases per key have
// settled, the arena's free space stays under the compaction trigger (half
// the live bytes), so no compaction starts. A shrinking entry moves into a
// free block of its new size when there is one, which frees its whole old
// block for an entry of that size; shrunk in place, it would leave a tail
// too short for any entry, which only a compaction takes back.
func TestLeaseChurnNeedsNoCompaction(t *testing.T) {
	const (
		keys, agents   = 3000, 16
		callsPerTick   = 12 // ten ticks a second, 50 keys a call: 6,000 grants a second
		keysPerCall    = 50
		warm, measured = 30, 20 // seconds
	)
	s := newTestState(t) // LeaseTTL 10s: an agent back within it renews, later re-adds
	c := s.st
	rng := rand.New(rand.NewPCG(1, 2))
	ids := make([]uint64, agents)
	kas := make([]*allotv1.KeyAcquire, keysPerCall)
	for i := range kas {
		kas[i] = ka("big", "", 5, 0, 0, 0)
	}
	now := at(0)
	started, compacting := 0, 0
	for sec := range warm + measured {
		for range 10 {
			for range callsPerTick {
				a := rng.IntN(agents)
				ids[a]++
				for _, k := range kas {
					k.Entries[0].Value = strconv.Itoa(rng.IntN(keys))
				}
				mustAcquire(t, s, now, "agent-"+strconv.Itoa(a), ids[a], kas...)
				now += int64(100*time.Millisecond) / callsPerTick
			}
			was := c.old != nil
			expire(s, now)
			if sec >= warm {
				if c.old != nil && !was {
					started++
				}
				if c.old != nil {
					compacting++
				}
			}
		}
	}
	if c.ar.live < 8*arenaPageSize {
		t.Fatalf("arena holds %d bytes of entries: too few for a compaction to start", c.ar.live)
	}
	t.Logf("after %d s: %d leases, arena live %d B, free %d B; compactions started in the last %d s: %d",
		warm+measured, s.Stats().Leases, c.ar.live, c.ar.idle, measured, started)
	if started > 0 || compacting > 0 {
		t.Errorf("%d compactions started under steady churn, one running at %d of the %d Expires: free space is not reused (arena live %d B, free %d B)",
			started, compacting, measured*10, c.ar.live, c.ar.idle)
	}
	if err := s.consistency(); err != nil {
		t.Fatal(err)
	}
}
