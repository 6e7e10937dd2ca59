package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/rules"
)

// TestMemoDroppedKeyNotDecidedOn: a request whose key the refill loop
// dropped (idle) is decided on the key that replaces it in the table, never
// on the dropped state the memo still points to.
func TestMemoDroppedKeyNotDecidedOn(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "m")
	check(t, s.Agent, d)
	check(t, s.Agent, d) // through the memo
	old := keyOf(t, s.Agent, d)
	if old == nil || old.spent.Load() != 2 {
		t.Fatalf("key before the drop: %+v", old)
	}
	s.step()
	s.clock.advance(s.cfg.IdleTimeout)
	s.step()
	s.clock.advance(s.cfg.ScanInterval)
	s.step()
	if keyOf(t, s.Agent, d) != nil || !old.dropped.Load() {
		t.Fatalf("idle key still tracked (dropped %v)", old.dropped.Load())
	}
	if got := check(t, s.Agent, d); !got.Allowed {
		t.Fatalf("check after the drop: %+v", got)
	}
	nk := keyOf(t, s.Agent, d)
	if nk == nil || nk == old {
		t.Fatalf("check after the drop decided on %p (dropped %p)", nk, old)
	}
	if old.spent.Load() != 2 || nk.spent.Load() != 1 {
		t.Fatalf("spent: dropped key %d (want 2), new key %d (want 1)", old.spent.Load(), nk.spent.Load())
	}
	check(t, s.Agent, d) // the memo now holds the new key
	if nk.spent.Load() != 2 || old.spent.Load() != 2 {
		t.Fatalf("spent after the memo was recorded again: new %d, dropped %d", nk.spent.Load(), old.spent.Load())
	}
}

// memoRulesA and memoRulesB are two rule sets over the same descriptors:
// nested matches, a replaces, shadow mode, unlimited and share_threshold,
// with limits small enough to deny.
const memoRulesA = `
domain: test
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 5, burst: 5}
  - key: route
    value: /a
    descriptors:
      - key: api_key
        rate_limit: {name: route_key, unit: minute, requests_per_unit: 3, burst: 3}
  - key: vip
    rate_limit: {name: vip, unit: minute, requests_per_unit: 100, replaces: [{name: per_key}]}
  - key: shadow
    shadow_mode: true
    rate_limit: {name: shadowed, unit: minute, requests_per_unit: 1}
  - key: open
    rate_limit: {unlimited: true}
  - key: group
    value: g
    share_threshold: true
    rate_limit: {name: shared, unit: minute, requests_per_unit: 4}
`

const memoRulesB = `
domain: test
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 2, burst: 2}
  - key: route
    value: /a
    descriptors:
      - key: api_key
        rate_limit: {name: route_key, unit: second, requests_per_unit: 1, burst: 1}
  - key: shadow
    rate_limit: {name: shadow_enforced, unit: minute, requests_per_unit: 2}
  - key: group
    value: g
    rate_limit: {name: not_shared, unit: minute, requests_per_unit: 1}
`

// TestPropertyMemoMatchesSlowPath: an agent with the request memo decides
// every check exactly as the same agent without it, across rule swaps,
// idle keys dropped and re-created, denials that stop the loop early and
// CheckStatuses.
func TestPropertyMemoMatchesSlowPath(t *testing.T) {
	setA := mustCompile(t, 1, memoRulesA)
	setB := mustCompile(t, 2, memoRulesB)
	pool := []Descriptor{
		desc("api_key", "k1"), desc("api_key", "k2"),
		desc("route", "/a", "api_key", "k1"), desc("route", "/a", "api_key", "k2"),
		desc("vip", "v"), desc("shadow", "s"), desc("open", "o"),
		desc("group", "g1"), desc("group", "g2"), desc("nomatch", "x"),
		// Requests validate refuses, some one byte away from a valid one:
		// a hit skips validation, so none may ever hit.
		desc("api_key", "k\xff"), desc("api_key", "k\x01"), desc("api_key", "k\u0085"),
		desc("api_\x7fkey", "k1"), desc("", "k1"), {}, desc("api_key", "k1", "", "x"),
	}
	domains := []string{"test", "test", "test", "tes\xf4", "te\tst", "", "other"}
	rapid.Check(t, func(rt *rapid.T) {
		var now int64 = 1e18
		clock := func() int64 { return now }
		mk := func(memo bool) *Agent {
			cfg := DefaultConfig()
			cfg.Rules, cfg.driven, cfg.Now = setA, true, clock
			cfg.Logger = testLogger(t)
			a, err := New(cfg)
			if err != nil {
				rt.Fatalf("New: %v", err)
			}
			if !memo {
				a.memo = nil
			}
			return a
		}
		with, without := mk(true), mk(false)
		defer with.Close(context.Background())
		defer without.Close(context.Background())
		var statuses [2][]Status
		for step := range rapid.IntRange(1, 120).Draw(rt, "steps") {
			switch rapid.IntRange(0, 9).Draw(rt, "op") {
			case 0:
				now += rapid.Int64Range(0, int64(2*DefaultConfig().IdleTimeout)).Draw(rt, "advance")
			case 1:
				for _, a := range []*Agent{with, without} {
					if err := a.refill(context.Background()); err != nil {
						rt.Fatalf("Refill: %v", err)
					}
				}
			case 2:
				s := setA
				if rapid.Bool().Draw(rt, "setB") {
					s = setB
				}
				with.setRules(s, false)
				without.setRules(s, false)
			default:
				n := rapid.IntRange(1, 3).Draw(rt, "descs")
				descs := make([]Descriptor, n)
				for i := range descs {
					descs[i] = pool[rapid.IntRange(0, len(pool)-1).Draw(rt, "desc")]
				}
				hits := uint32(rapid.IntRange(0, 2).Draw(rt, "hits"))
				withStatuses := rapid.Bool().Draw(rt, "statuses")
				domain := domains[rapid.IntRange(0, len(domains)-1).Draw(rt, "domain")]
				var got [2]Decision
				var errs [2]error
				for i, a := range []*Agent{with, without} {
					if withStatuses {
						got[i], statuses[i], errs[i] = a.CheckStatuses(context.Background(), domain, descs, hits, statuses[i])
					} else {
						got[i], errs[i] = a.Check(context.Background(), domain, descs, hits)
					}
					if errs[i] != nil && !errors.Is(errs[i], ErrInvalid) {
						rt.Fatalf("check: %v", errs[i])
					}
				}
				if fmt.Sprint(errs[0]) != fmt.Sprint(errs[1]) {
					rt.Fatalf("step %d %q %v: error with the memo %v, without %v", step, domain, descs, errs[0], errs[1])
				}
				if wantErr := validate(domain, descs); fmt.Sprint(errs[0]) != fmt.Sprint(wantErr) {
					rt.Fatalf("step %d %q %v: error %v, validate says %v", step, domain, descs, errs[0], wantErr)
				}
				if got[0] != got[1] {
					rt.Fatalf("step %d %v: with the memo %+v, without %+v", step, descs, got[0], got[1])
				}
				if withStatuses && fmt.Sprint(statuses[0]) != fmt.Sprint(statuses[1]) {
					rt.Fatalf("step %d %v: statuses with the memo %+v, without %+v", step, descs, statuses[0], statuses[1])
				}
			}
		}
		if a, b := with.keys.len(), without.keys.len(); a != b {
			rt.Fatalf("keys tracked: %d with the memo, %d without", a, b)
		}
	})
}

// TestIdentityMatches: an identity matches exactly the request it was
// made from, in memory of its own, and no other: requests drawn from few
// short strings (so that they often share words, lengths and hashes),
// arbitrary bytes and long strings included, and ones edited from it by a
// byte, by a string's boundary, by an entry moved to another descriptor,
// or by a descriptor more. So a memo hit is a request byte-identical to
// one that passed validation before (check skips it on a hit), and
// TestPropertyMemoMatchesSlowPath checks invalid requests never hit. The
// memo takes the request when it has at most stackDescs descriptors and
// at most memoBufLen bytes, each string counted with a byte more and each
// descriptor as one byte.
func TestIdentityMatches(t *testing.T) {
	str := rapid.OneOf(
		rapid.SampledFrom([]string{"", "a", "b", "ab", "ba", "aab", "abcd", "abce", "abcdefgh", "abcdefgi", "abcdefghabcdefgh", "abcdefgiabcdefgh", "abcdefghabcdefghx", "abcdefghabcdefgix",
			"\x00", "\x00\x00", "a\x00", "a\x00\x00", "\x00\x00\x00\x00", "\x00\x00\x00\x00\x00", "abcd\x00", "abcd\x00\x00\x00\x00", "abcdefgh\x00", "abcdefghhbcdefgh", "abcdefghibcdefgh"}),
		rapid.Custom(func(t *rapid.T) string { return string(rapid.SliceOfN(rapid.Byte(), 0, 40).Draw(t, "bytes")) }),
	)
	request := func(rt *rapid.T, name string) (string, []Descriptor) {
		descs := make([]Descriptor, rapid.IntRange(0, stackDescs+1).Draw(rt, name+"descs"))
		for i := range descs {
			for range rapid.IntRange(0, 4).Draw(rt, name+"entries") {
				descs[i].Entries = append(descs[i].Entries, rules.Entry{Key: str.Draw(rt, name+"key"), Value: str.Draw(rt, name+"value")})
			}
		}
		return str.Draw(rt, name+"domain"), descs
	}
	fresh := func(s string) string { return string(append([]byte(nil), s...)) }
	clone := func(domain string, descs []Descriptor) (string, []Descriptor) {
		out := make([]Descriptor, len(descs))
		for i, d := range descs {
			for _, e := range d.Entries {
				out[i].Entries = append(out[i].Entries, rules.Entry{Key: fresh(e.Key), Value: fresh(e.Value)})
			}
		}
		return fresh(domain), out
	}
	same := func(d1 string, a []Descriptor, d2 string, b []Descriptor) bool {
		if d1 != d2 || len(a) != len(b) {
			return false
		}
		for i := range a {
			if len(a[i].Entries) != len(b[i].Entries) {
				return false
			}
			for j := range a[i].Entries {
				if a[i].Entries[j] != b[i].Entries[j] {
					return false
				}
			}
		}
		return true
	}
	rapid.Check(t, func(rt *rapid.T) {
		domain, descs := request(rt, "a")
		var iw identWords
		_, ok := identHash(1, domain, descs, &iw)
		size := 1 + len(domain)
		for _, d := range descs {
			size++
			for _, e := range d.Entries {
				size += 2 + len(e.Key) + len(e.Value)
			}
		}
		if want := len(descs) <= stackDescs && size <= memoBufLen; ok != want {
			rt.Fatalf("identHash ok = %v for %d descriptors of %d bytes, want %v", ok, len(descs), size, want)
		}
		if !ok {
			return
		}
		id := newIdentity(domain, descs, &iw)
		d2, descs2 := clone(domain, descs)
		switch rapid.IntRange(0, 5).Draw(rt, "edit") {
		case 0: // the same request
		case 1: // another request
			d2, descs2 = request(rt, "b")
		case 2: // one byte of one string changed, added or removed
			strs := []*string{&d2}
			for i := range descs2 {
				for j := range descs2[i].Entries {
					strs = append(strs, &descs2[i].Entries[j].Key, &descs2[i].Entries[j].Value)
				}
			}
			p := strs[rapid.IntRange(0, len(strs)-1).Draw(rt, "string")]
			b := []byte(*p)
			switch i := rapid.IntRange(0, len(b)).Draw(rt, "at"); {
			case i == len(b) || rapid.Bool().Draw(rt, "grow"):
				b = append(b[:i:i], append([]byte{rapid.Byte().Draw(rt, "byte")}, b[i:]...)...)
			case rapid.Bool().Draw(rt, "cut"):
				b = append(b[:i:i], b[i+1:]...)
			default:
				b[i] ^= 1 << rapid.IntRange(0, 7).Draw(rt, "bit")
			}
			*p = string(b)
		case 3: // a boundary between a key and its value moved
			if len(descs2) > 0 && len(descs2[0].Entries) > 0 {
				e := &descs2[0].Entries[0]
				if len(e.Key) > 0 {
					e.Key, e.Value = e.Key[:len(e.Key)-1], e.Key[len(e.Key)-1:]+e.Value
				} else if len(e.Value) > 0 {
					e.Key, e.Value = e.Value[:1], e.Value[1:]
				}
			}
		case 4: // an entry moved to the next descriptor
			if len(descs2) > 1 && len(descs2[0].Entries) > 0 {
				last := descs2[0].Entries[len(descs2[0].Entries)-1]
				descs2[0].Entries = descs2[0].Entries[:len(descs2[0].Entries)-1]
				descs2[1].Entries = append([]rules.Entry{last}, descs2[1].Entries...)
			}
		case 5: // a descriptor more, without entries
			descs2 = append(descs2, Descriptor{})
		}
		// The memo's lookup of d2, descs2 in a slot that holds the
		// identity, whatever d2, descs2 hash to.
		m := newMemo()
		m.store(&memoEntry{hash: 5, ident: id})
		var iw2 identWords
		_, ok2 := identHash(3, d2, descs2, &iw2)
		if got, want := ok2 && m.get(5, nil, d2, descs2, &iw2) != nil, same(domain, descs, d2, descs2); got != want {
			rt.Fatalf("identity of %q %+v matches %q %+v: %v, want %v", domain, descs, d2, descs2, got, want)
		}
		if h1, ok1 := identHash(7, domain, descs, &identWords{}); same(domain, descs, d2, descs2) {
			if h2, ok2 := identHash(7, d2, descs2, &identWords{}); !ok1 || !ok2 || h1 != h2 {
				rt.Fatalf("equal requests hash to %x (%v) and %x (%v)", h1, ok1, h2, ok2)
			}
		}
	})
}

// TestIdentityEveryByte: in a request of each form, of the first form
// with strings past the first identFast, and with keys and values of
// every length up to 17 bytes, a change to any bit of any byte of any string, or a zero
// byte added to or removed from its end, makes a request the identity
// does not match.
func TestIdentityEveryByte(t *testing.T) {
	long := "0123456789abcdef0123"
	for _, n := range []int{1, 3, 4, 9} { // entries per descriptor; 4: strings past identFast of every length
		for _, l := range []int{0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17} {
			var descs []Descriptor
			for i := range 2 {
				d := Descriptor{}
				for j := range n {
					k := fmt.Sprintf("k%d%d", i, j)
					e := rules.Entry{Key: k, Value: k}
					switch {
					case i == 0 && j == 0: // 17 bytes: the second form
						e.Key, e.Value = (k + long)[:l], (long + k)[:max(l-1, 0)]
					case i == 1 && j == n-1: // past identFast when n ≥ 4
						e.Key, e.Value = (long + k)[:min(l, 16)], (k + long)[:min(l, 16)]
					}
					d.Entries = append(d.Entries, e)
				}
				descs = append(descs, d)
			}
			var iw identWords
			if _, ok := identHash(1, "dom", descs, &iw); !ok {
				if n <= 4 {
					t.Fatalf("%d entries of %d bytes: not memoable", 2*n, l)
				}
				continue // over memoBufLen
			}
			m := newMemo()
			m.store(&memoEntry{hash: 5, ident: newIdentity("dom", descs, &iw)})
			hit := func(descs []Descriptor) bool {
				var iw identWords
				_, ok := identHash(1, "dom", descs, &iw)
				return ok && m.get(5, nil, "dom", descs, &iw) != nil
			}
			if !hit(descs) {
				t.Fatalf("%d entries of %d bytes: no hit for the request itself", 2*n, l)
			}
			for i := range descs {
				for j := range descs[i].Entries {
					for _, key := range []bool{false, true} {
						edit := func(f func([]byte) []byte) []Descriptor {
							c := make([]Descriptor, len(descs))
							for x := range descs {
								c[x].Entries = append([]rules.Entry(nil), descs[x].Entries...)
							}
							e := &c[i].Entries[j]
							if key {
								e.Key = string(f([]byte(e.Key)))
							} else {
								e.Value = string(f([]byte(e.Value)))
							}
							return c
						}
						str := descs[i].Entries[j].Value
						if key {
							str = descs[i].Entries[j].Key
						}
						for b := range len(str) {
							for bit := range 8 {
								if hit(edit(func(p []byte) []byte { p[b] ^= 1 << bit; return p })) {
									t.Fatalf("entry %d.%d (key %v) of %q: bit %d of byte %d flipped, still a hit", i, j, key, str, bit, b)
								}
							}
						}
						if hit(edit(func(p []byte) []byte { return append(p, 0) })) {
							t.Fatalf("entry %d.%d (key %v) of %q: a zero byte added, still a hit", i, j, key, str)
						}
						if len(str) > 0 && hit(edit(func(p []byte) []byte { return p[:len(p)-1] })) {
							t.Fatalf("entry %d.%d (key %v) of %q: its last byte removed, still a hit", i, j, key, str)
						}
					}
				}
			}
		}
	}
}

// TestIdentHash: identHash is a function of the request's bytes
// (not of where they are), and requests one byte apart hash apart.
func TestIdentHash(t *testing.T) {
	const seed = 0x9e3779b97f4a7c15
	hash := func(domain string, descs []Descriptor) uint64 {
		h, ok := identHash(seed, domain, descs, &identWords{})
		if !ok {
			t.Fatalf("not memoable: %q %+v", domain, descs)
		}
		return h
	}
	rapid.Check(t, func(rt *rapid.T) {
		strs := rapid.SliceOfN(rapid.SliceOfN(rapid.Byte(), 0, 40), 3, 7).Draw(rt, "strings")
		build := func(edit int) (string, []Descriptor) {
			s := make([]string, len(strs))
			for i, b := range strs {
				b = append([]byte(nil), b...) // fresh memory each time
				if i == edit {
					b = append(b, 'x')
				}
				s[i] = string(b)
			}
			d := Descriptor{}
			for i := 1; i+1 < len(s); i += 2 {
				d.Entries = append(d.Entries, rules.Entry{Key: s[i], Value: s[i+1]})
			}
			return s[0], []Descriptor{d}
		}
		h := hash(build(-1))
		if h2 := hash(build(-1)); h2 != h {
			rt.Fatalf("the same request hashed to %x and %x", h, h2)
		}
		edit := rapid.IntRange(0, len(strs)-1-(len(strs)-1)%2).Draw(rt, "edit")
		if h2 := hash(build(edit)); h2 == h {
			rt.Fatalf("string %d one byte longer, same hash %x", edit, h)
		}
	})
	// The memo's slots: distinct users of one route spread like random.
	slots := map[uint64]bool{}
	for i := range memoSlots {
		h, _ := identHash(seed, "test", []Descriptor{deepDesc(i)}, &identWords{})
		slots[h&(memoSlots-1)] = true
	}
	if len(slots) < memoSlots/2 { // random: 63%
		t.Fatalf("%d requests fill %d of %d slots", memoSlots, len(slots), memoSlots)
	}
}

// BenchmarkCheckMemoMiss is a check whose request the memo does not hold
// (more distinct requests than memo slots, cycled): the slow path plus the
// memo's probe and occasional replacement.
func BenchmarkCheckMemoMiss(b *testing.B) {
	cfg := DefaultConfig()
	cfg.Rules = mustCompile(b, 1, testRules)
	now := time.Now().UnixNano()
	cfg.driven, cfg.Now = true, func() int64 { return now }
	a := newAgent(b, cfg)
	const n = 4 * memoSlots
	descs := make([][]Descriptor, n)
	for i := range descs {
		descs[i] = []Descriptor{{Entries: []rules.Entry{{Key: "tier", Value: "free"}, {Key: "route", Value: "/r"}, {Key: "user", Value: fmt.Sprint(i)}}}}
		if _, err := a.Check(context.Background(), "test", descs[i], 1); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if _, err := a.Check(context.Background(), "test", descs[i%n], 1); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// TestPropertyLeasedFastPathMatchesSlowPath: with leases from an allocator
// (where check's single-descriptor fast path applies), an agent with the
// request memo decides every check exactly as the same agent without it,
// across grants, balances drained below the request's hits, leases
// expiring and idle keys dropped.
func TestPropertyLeasedFastPathMatchesSlowPath(t *testing.T) {
	fastPathMatchesSlowPath(t, func() *steppedAgent { return newStepped(t, memoRulesA) }, []Descriptor{
		desc("api_key", "k1"), desc("api_key", "k2"),
		desc("route", "/a", "api_key", "k1"), desc("vip", "v"), desc("shadow", "s"),
		desc("open", "o"), desc("nomatch", "x"),
	}, nil)
}

// TestPropertyStaticFastPathMatchesSlowPath is the same for keys decided
// from static shares (checkStaticHit), across promotions, lapsed
// permissions, refills, and answers that change N, the longest refill an
// eligible share may take and the hot-key set.
func TestPropertyStaticFastPathMatchesSlowPath(t *testing.T) {
	pool := []Descriptor{desc("k", "a"), desc("k", "b"), desc("slow", "a"), desc("window", "w"), desc("warm", "w")}
	version := uint64(1)
	fastPathMatchesSlowPath(t, func() *steppedAgent { version = 1; return newStatic(t) }, pool, func(rt *rapid.T) func(*steppedAgent) {
		switch rapid.IntRange(0, 2).Draw(rt, "answer") {
		case 0:
			n := uint32(rapid.SampledFrom([]int{1, 2, 4, 8}).Draw(rt, "slots"))
			return func(s *steppedAgent) { s.fake.with(func(f *fakeAllocator) { f.static.Slots = n }) }
		case 1:
			ms := rapid.SampledFrom([]int64{118_000, 7_200_000}).Draw(rt, "maxRefillMs")
			return func(s *steppedAgent) { s.fake.with(func(f *fakeAllocator) { f.static.MaxRefillMs = ms }) }
		}
		d := pool[rapid.IntRange(0, len(pool)-1).Draw(rt, "hotDesc")]
		add := rapid.Bool().Draw(rt, "hotAdd")
		version++ // the allocator numbers each change of the set
		v := version
		return func(s *steppedAgent) {
			r := s.rules.Load().Match("test", d.Entries)
			if r == nil {
				return
			}
			h := []uint64{rules.KeyHash(r, "test", d.Entries)}
			s.fake.with(func(f *fakeAllocator) {
				f.static.HotVersion, f.static.HotAdded, f.static.HotRemoved = v, nil, nil
				if add {
					f.static.HotAdded = h
				} else {
					f.static.HotRemoved = h
				}
			})
		}
	})
}

// fastPathMatchesSlowPath checks, with agents mk makes, that an agent with
// the request memo decides every check of a descriptor of pool exactly as
// the same agent without it. answer, when not nil, draws a change of the
// allocators' answers, made to both.
func fastPathMatchesSlowPath(t *testing.T, mk func() *steppedAgent, pool []Descriptor, answer func(*rapid.T) func(*steppedAgent)) {
	rapid.Check(t, func(rt *rapid.T) {
		with, without := mk(), mk()
		without.memo = nil
		both := []*steppedAgent{with, without}
		for step := range rapid.IntRange(1, 80).Draw(rt, "steps") {
			op := rapid.IntRange(0, 6).Draw(rt, "op")
			if op == 6 {
				if answer != nil {
					change := answer(rt)
					for _, s := range both {
						change(s)
					}
				}
				continue
			}
			switch op {
			case 0:
				d := time.Duration(rapid.Int64Range(0, int64(2*DefaultConfig().IdleTimeout)).Draw(rt, "advance"))
				for _, s := range both {
					s.clock.advance(d)
				}
			case 1:
				for _, s := range both {
					s.step()
				}
			default:
				d := pool[rapid.IntRange(0, len(pool)-1).Draw(rt, "desc")]
				if rapid.Bool().Draw(rt, "addend") {
					d.HitsAddendSet, d.HitsAddend = true, uint32(rapid.IntRange(0, 3).Draw(rt, "addendN"))
				}
				hits := uint32(rapid.IntRange(0, 3).Draw(rt, "hits"))
				var got [2]Decision
				for i, s := range both {
					var err error
					if got[i], err = s.Check(context.Background(), "test", []Descriptor{d}, hits); err != nil {
						rt.Fatalf("check: %v", err)
					}
					// Each agent compiled its own rule set: compare rules by name.
					if got[i].Rule != nil {
						got[i].Rule = &rules.Rule{Name: got[i].Rule.Name}
					}
				}
				if (got[0].Rule == nil) != (got[1].Rule == nil) || (got[0].Rule != nil && got[0].Rule.Name != got[1].Rule.Name) {
					rt.Fatalf("step %d %+v: rules %v and %v", step, d, got[0].Rule, got[1].Rule)
				}
				got[0].Rule, got[1].Rule = nil, nil
				if got[0] != got[1] {
					rt.Fatalf("step %d %+v hits %d: with the memo %+v, without %+v", step, d, hits, got[0], got[1])
				}
			}
		}
		if a, b := with.keys.len(), without.keys.len(); a != b {
			rt.Fatalf("keys tracked: %d with the memo, %d without", a, b)
		}
	})
}

// TestIdentHashShort: on every request it takes, identHashShort answers
// what identHashAny does (the hash, the strings' words, their count,
// lengths and shape), and identHash answers what identHashAny does on
// every request.
func TestIdentHashShort(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		str := rapid.Custom(func(t *rapid.T) string {
			return string(rapid.SliceOfN(rapid.Byte(), 0, rapid.SampledFrom([]int{4, 16, 17, 40}).Draw(t, "max")).Draw(t, "bytes"))
		})
		descs := make([]Descriptor, rapid.IntRange(0, stackDescs+1).Draw(rt, "descs"))
		for i := range descs {
			for range rapid.IntRange(0, identFast/2+1).Draw(rt, "entries") {
				descs[i].Entries = append(descs[i].Entries, rules.Entry{Key: str.Draw(rt, "key"), Value: str.Draw(rt, "value")})
			}
		}
		domain := str.Draw(rt, "domain")
		seed := rapid.Uint64().Draw(rt, "seed")
		var any, short, all identWords
		ha, oka := identHashAny(seed, domain, descs, &any)
		if h, ok := identHash(seed, domain, descs, &all); h != ha || ok != oka {
			rt.Fatalf("identHash = %x, %v; identHashAny = %x, %v", h, ok, ha, oka)
		}
		hs, oks := identHashShort(seed, domain, descs, &short)
		if !oks {
			return
		}
		if !oka || hs != ha {
			rt.Fatalf("identHashShort = %x, identHashAny = %x, %v", hs, ha, oka)
		}
		if short.n != any.n || short.shape != any.shape || short.lens != any.lens || !slices.Equal(short.w[:2*short.n], any.w[:2*any.n]) {
			rt.Fatalf("words: short %d %x %x %x, any %d %x %x %x", short.n, short.shape, short.lens, short.w[:2*short.n], any.n, any.shape, any.lens, any.w[:2*any.n])
		}
	})
}
