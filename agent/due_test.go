package agent

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const dueRules = `
domain: test
descriptors:
  - key: k
    rate_limit:
      unit: second
      requests_per_unit: 20
      burst: 20
  - key: big
    rate_limit:
      unit: second
      requests_per_unit: 100000
      burst: 100000
  - key: loc
    rate_limit:
      unit: second
      requests_per_unit: 5
      backend: local
`

// dueRun drives a Manual agent through a seeded workload of keys that are
// hot, sparse, bursty and abandoned, with short leases and idle timeouts,
// and returns every Acquire it sent, every decision it made and the keys
// its scans visited. With alwaysAwake every scan visits every key.
func dueRun(t *testing.T, seed uint64, alwaysAwake bool) ([]*allotv1.AcquireRequest, []string, int) {
	clock := newFakeClock()
	fake := newFake(t, clock.now, dueRules)
	fake.ttl, fake.refresh = 2*time.Second, time.Second
	cfg := drivenConfig(t, "due", clock, &directClient{f: fake}, dueRules)
	cfg.IdleTimeout = 20 * time.Second
	cfg.Rand = rand.New(rand.NewPCG(seed, seed))
	a := newAgent(t, cfg)
	a.rf.alwaysAwake = alwaysAwake
	rng := rand.New(rand.NewPCG(seed, 99))
	const keys = 60
	rate := make([]float64, keys) // checks per 10 ms step
	var out []string
	visits := 0
	for step := range 4000 {
		if step%1000 == 0 {
			for i := range rate {
				switch rng.IntN(4) {
				case 0:
					rate[i] = 0 // abandoned
				case 1:
					rate[i] = 0.005 // sparse
				case 2:
					rate[i] = 0.1
				default:
					rate[i] = 0.5 // at or over its limit
				}
			}
		}
		for i := range keys {
			if rng.Float64() >= rate[i] {
				continue
			}
			name, hits := "k", uint32(1)
			switch i % 7 {
			case 0:
				name = "loc"
			case 1:
				name, hits = "big", 40 // a demand that reads a fall when it stops
			}
			d, err := a.Check(context.Background(), "test", []Descriptor{desc(name, fmt.Sprint(i))}, hits)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, fmt.Sprintf("%d %s%d %v %v", step, name, i, d.Allowed, d.Source))
		}
		clock.advance(10 * time.Millisecond)
		if step%5 == 0 && rng.IntN(8) != 0 { // now and then a late scan
			if err := a.refill(context.Background()); err != nil {
				t.Fatal(err)
			}
			visits += len(a.rf.awake)
		}
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	return append([]*allotv1.AcquireRequest(nil), fake.acquires...), out, visits
}

// TestSleepingKeysChangeNothing: an agent whose scans visit only the keys
// that need it sends exactly the Acquire calls, and makes exactly the
// decisions, of one whose scans visit every key.
func TestSleepingKeysChangeNothing(t *testing.T) {
	for seed := range uint64(3) {
		wantReqs, wantDec, allVisits := dueRun(t, seed, true)
		gotReqs, gotDec, visits := dueRun(t, seed, false)
		if len(gotDec) != len(wantDec) {
			t.Fatalf("seed %d: %d decisions, want %d", seed, len(gotDec), len(wantDec))
		}
		for i := range wantDec {
			if gotDec[i] != wantDec[i] {
				t.Fatalf("seed %d: decision %d: %s, want %s", seed, i, gotDec[i], wantDec[i])
			}
		}
		if len(gotReqs) != len(wantReqs) {
			t.Fatalf("seed %d: %d Acquire calls, want %d", seed, len(gotReqs), len(wantReqs))
		}
		for i := range wantReqs {
			if !proto.Equal(gotReqs[i], wantReqs[i]) {
				t.Fatalf("seed %d: Acquire %d:\n got %v\nwant %v", seed, i, gotReqs[i], wantReqs[i])
			}
		}
		if len(wantReqs) < 50 || len(wantDec) < 1000 {
			t.Fatalf("seed %d: %d calls, %d decisions: the workload is too thin to compare", seed, len(wantReqs), len(wantDec))
		}
		if 3*visits > 2*allVisits {
			t.Fatalf("seed %d: scans visited %d keys, %d with every key awake: too few slept", seed, visits, allVisits)
		}
		t.Logf("seed %d: %d calls, %d decisions; keys visited %d, %d with every key awake", seed, len(wantReqs), len(wantDec), visits, allVisits)
	}
}

// TestIdleKeysSleep: keys checked once and then left alone stop being
// visited once their demand has decayed and nothing is owed or due, a
// check wakes one, and a sleeping key is still forgotten at its idle
// timeout.
func TestIdleKeysSleep(t *testing.T) {
	clock := newFakeClock()
	fake := newFake(t, clock.now, dueRules)
	cfg := drivenConfig(t, "", clock, &directClient{f: fake}, dueRules)
	cfg.IdleTimeout = 30 * time.Second
	a := newAgent(t, cfg)
	refill := func() {
		t.Helper()
		if err := a.refill(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	const n = 500
	for i := range n {
		check(t, a, desc("k", fmt.Sprint(i)))
	}
	refill()
	if len(a.rf.awake) != n {
		t.Fatalf("awake after first sight: %d, want %d", len(a.rf.awake), n)
	}
	for range 200 { // 10 s
		clock.advance(50 * time.Millisecond)
		refill()
	}
	if len(a.rf.awake) != 0 || len(a.rf.due) != n {
		t.Fatalf("after 10 s idle: %d awake, %d sleeping; want 0 and %d", len(a.rf.awake), len(a.rf.due), n)
	}
	check(t, a, desc("k", "7"))
	clock.advance(50 * time.Millisecond)
	refill()
	if len(a.rf.awake) != 1 || len(a.rf.due) != n-1 {
		t.Fatalf("after one check: %d awake, %d sleeping; want 1 and %d", len(a.rf.awake), len(a.rf.due), n-1)
	}
	for range 600 { // 30 s: past the idle timeout
		clock.advance(50 * time.Millisecond)
		refill()
	}
	if got := a.keys.len(); got != 0 {
		t.Fatalf("keys in the table after the idle timeout: %d, want 0", got)
	}
	if len(a.rf.awake) != 0 || len(a.rf.due) != 0 || a.rf.tracked != 0 {
		t.Fatalf("after the idle timeout: %d awake, %d sleeping, %d tracked", len(a.rf.awake), len(a.rf.due), a.rf.tracked)
	}
}
