package main

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestPackKeys: packKeys writes the bytes AppendPackedKeys writes for the
// keys' messages, for prebuilt and cold keys of both modes, any mix and
// count (as -groups' parts of a call), from 0 up.
func TestPackKeys(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, ks := range []*keySet{newKeySet(1000, grantsKey), newKeySet(1000, hotKey)} {
		for range 2000 {
			nums := make([]int, rng.IntN(40))
			for i := range nums {
				switch rng.IntN(4) {
				case 0:
					nums[i] = rng.IntN(len(ks.msgs))
				case 1:
					nums[i] = len(ks.msgs) + rng.IntN(6_000_000)
				case 2:
					nums[i] = rng.IntN(20)
				default:
					nums[i] = rng.IntN(1 << 62)
				}
			}
			prefix := []byte{7, 8}
			got := ks.packKeys(slices.Clone(prefix), nums)
			want := allotv1.AppendPackedKeys(slices.Clone(prefix), ks.keyMessages(nums))
			if !bytes.Equal(got, want) {
				t.Fatalf("keys %v: packed\n%x\nwant\n%x", nums, got, want)
			}
			if len(got)-len(prefix) > packedSize(nums) {
				t.Fatalf("keys %v: %d bytes packed, packedSize %d", nums, len(got)-len(prefix), packedSize(nums))
			}
		}
	}
}

// refKeysFor is the keys of a call as messages, built directly: the keys
// keysFor must name, in its order.
func refKeysFor(l *load, cold *int64, keyN int) ([]*allotv1.KeyAcquire, []slots.Slot, int) {
	keys := make([]*allotv1.KeyAcquire, l.o.keysPerCall)
	var sl []slots.Slot
	if l.slotOf != nil {
		sl = make([]slots.Slot, len(keys))
	}
	for k := range keys {
		switch {
		case l.o.mode == "grants":
			keyN = (keyN + 1) % l.o.keyspace
			keys[k] = &allotv1.KeyAcquire{Domain: "bench", Entries: []*allotv1.Entry{{Key: "user", Value: strconv.Itoa(keyN)}},
				Want: 5, Demand: 5}
			if sl != nil {
				sl[k] = l.slotOf(keyN)
			}
		case float64(k) < l.o.coldFraction*float64(len(keys)):
			*cold++
			i := l.o.hotKeys + int(*cold%int64(l.o.keyspace))
			keys[k] = &allotv1.KeyAcquire{Domain: "bench", Entries: []*allotv1.Entry{{Key: "user", Value: strconv.Itoa(i)}},
				Charged: 1}
			if sl != nil {
				sl[k] = l.slotOf(i)
			}
		default:
			keyN = (keyN + 1) % l.o.hotKeys
			keys[k] = &allotv1.KeyAcquire{Domain: "bench", Entries: []*allotv1.Entry{{Key: "user", Value: strconv.Itoa(keyN)}},
				Want: 5, Demand: 5, Held: 2, Charged: 3}
			if sl != nil {
				sl[k] = l.slotOf(keyN)
			}
		}
	}
	return keys, sl, keyN
}

// TestKeysFor: successive calls of keysFor, made keys, are the reference
// keys in order, with the same slots, in both modes, and split by a
// topology they go in the same parts; each part packs as its messages do.
func TestKeysFor(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bench.yaml")
	if err := os.WriteFile(path, []byte(benchRules), 0o600); err != nil {
		t.Fatal(err)
	}
	topo, err := parseTopology(&allotv1.Topology{Version: 1, Groups: []*allotv1.GroupRoute{
		{Id: 1, Slots: "0-300"}, {Id: 2, Slots: "301-700"}, {Id: 3, Slots: "701-1023"}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range []options{
		{mode: "grants", keysPerCall: 97, keyspace: 500},
		{mode: "fleet", keysPerCall: 100, keyspace: 700, hotKeys: 60, coldFraction: 0.85},
		{mode: "fleet", keysPerCall: 33, keyspace: 50, hotKeys: 7, coldFraction: 0.5},
	} {
		for _, groups := range []bool{false, true} {
			l := newLoad(o, nil)
			if groups {
				if l.slotOf, l.keySlot, err = keySlots(path, o.keyspace); err != nil {
					t.Fatal(err)
				}
			}
			var cold int64
			var nums []int
			var sl []slots.Slot
			keyN, refN := 3*7919, 3*7919
			for call := range 40 {
				var want []*allotv1.KeyAcquire
				var wantSl []slots.Slot
				want, wantSl, refN = refKeysFor(l, &cold, refN)
				nums, sl, keyN = l.keysFor(nums[:0], sl[:0], keyN)
				got := l.ks.keyMessages(nums)
				if keyN != refN || len(got) != len(want) || !slices.Equal(sl, wantSl) {
					t.Fatalf("%s groups %v call %d: keyN %d, %d keys, slots %v; want %d, %d, %v", o.mode, groups, call, keyN, len(got), sl, refN, len(want), wantSl)
				}
				for i := range got {
					if !proto.Equal(got[i], want[i]) {
						t.Fatalf("%s call %d key %d: %v, want %v", o.mode, call, i, got[i], want[i])
					}
				}
				if !groups {
					if p, w := l.ks.packKeys(nil, nums), allotv1.AppendPackedKeys(nil, want); !bytes.Equal(p, w) {
						t.Fatalf("%s call %d: packed keys differ", o.mode, call)
					}
					continue
				}
				parts, wantParts := split(topo, nums, sl), split(topo, want, wantSl)
				if len(parts) != len(wantParts) {
					t.Fatalf("%s call %d: %d parts, want %d", o.mode, call, len(parts), len(wantParts))
				}
				for j, p := range parts {
					if p.group != wantParts[j].group {
						t.Fatalf("%s call %d part %d: group %d, want %d", o.mode, call, j, p.group, wantParts[j].group)
					}
					if pk, w := l.ks.packKeys(nil, p.keys), allotv1.AppendPackedKeys(nil, wantParts[j].keys); !bytes.Equal(pk, w) {
						t.Fatalf("%s call %d part %d: packed keys differ", o.mode, call, j)
					}
				}
			}
			if got := l.cold.Load(); got != cold {
				t.Fatalf("%s: %d cold keys used, want %d", o.mode, got, cold)
			}
		}
	}
}

// BenchmarkPackKeys packs one fleet-shape call: 1000 keys, 850 of them
// cold, as -mode fleet's clients do.
func BenchmarkPackKeys(b *testing.B) {
	ks := newKeySet(10_000, hotKey)
	nums := make([]int, 1000)
	for i := range nums {
		if i < 850 {
			nums[i] = 10_000 + 4_000_000 + i
		} else {
			nums[i] = i
		}
	}
	buf := make([]byte, 0, packedSize(nums))
	b.ReportAllocs()
	for b.Loop() {
		buf = ks.packKeys(buf[:0], nums)
	}
}

// TestRandomKeyOrder: with -key-order random a call's keys are drawn from
// the key space, not walked in order.
func TestRandomKeyOrder(t *testing.T) {
	for _, o := range []options{
		{mode: "grants", keysPerCall: 1000, keyspace: 100000, keyOrder: "random"},
		{mode: "fleet", keysPerCall: 1000, keyspace: 100000, hotKeys: 10000, coldFraction: 0.5, keyOrder: "random"},
	} {
		l := newLoad(o, nil)
		nums, _, _ := l.keysFor(nil, nil, 0)
		next := 0
		for i, n := range nums {
			if n < 0 || n >= o.keyspace+o.hotKeys {
				t.Fatalf("%s key %d: number %d outside [0, %d)", o.mode, i, n, o.keyspace+o.hotKeys)
			}
			if i > 0 && n == nums[i-1]+1 {
				next++
			}
		}
		if len(nums) != o.keysPerCall || next > 10 {
			t.Fatalf("%s: %d keys, %d of them one after the one before: not drawn at random", o.mode, len(nums), next)
		}
	}
}
