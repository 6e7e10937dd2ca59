package main

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestSplitByTopology: the load splits a call's keys by the group the
// topology names for their slots (the canonical key's, as agents compute
// it), in group order and key order within a group, and a topology that
// leaves a slot without an owner or gives one two is rejected.
func TestSplitByTopology(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bench.yaml")
	if err := os.WriteFile(path, []byte(benchRules), 0o600); err != nil {
		t.Fatal(err)
	}
	slotOf, table, err := keySlots(path, 200)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range table {
		if want := slots.OfKey("bench:user=" + strconv.Itoa(i)); s != want || slotOf(i) != want {
			t.Fatalf("key %d: slot %d (table) %d (func), want %d", i, s, slotOf(i), want)
		}
	}
	topo, err := parseTopology(&allotv1.Topology{Version: 3, Groups: []*allotv1.GroupRoute{
		{Id: 2, Slots: "512-1023", LeaderAddr: "b:1"}, {Id: 1, Slots: "0-511", LeaderAddr: "a:1"}}})
	if err != nil {
		t.Fatal(err)
	}
	if topo.version != 3 || topo.leader[1] != "a:1" || topo.leader[2] != "b:1" {
		t.Fatalf("topology %+v", topo)
	}
	keys := make([]*allotv1.KeyAcquire, len(table))
	for i := range keys {
		keys[i] = &allotv1.KeyAcquire{Domain: "bench", Entries: []*allotv1.Entry{{Key: "user", Value: strconv.Itoa(i)}}}
	}
	parts := split(topo, keys, table)
	if len(parts) != 2 || parts[0].group != 1 || parts[1].group != 2 || len(parts[0].keys)+len(parts[1].keys) != len(keys) {
		t.Fatalf("parts: %d, want groups 1 then 2 holding every key", len(parts))
	}
	at := map[*allotv1.KeyAcquire]int{}
	for i, k := range keys {
		at[k] = i
	}
	for _, p := range parts {
		prev := -1
		for _, k := range p.keys {
			i := at[k]
			if g := slots.GroupID(1 + table[i]/512); g != p.group || i <= prev {
				t.Fatalf("key %d (slot %d) in group %d's part after key %d", i, table[i], p.group, prev)
			}
			prev = i
		}
	}
	for _, bad := range []string{"0-510", "0-512"} {
		if _, err := parseTopology(&allotv1.Topology{Version: 1, Groups: []*allotv1.GroupRoute{{Id: 1, Slots: bad}, {Id: 2, Slots: "512-1023"}}}); err == nil {
			t.Errorf("slots %q and 512-1023: parsed, want an error", bad)
		}
	}
}
