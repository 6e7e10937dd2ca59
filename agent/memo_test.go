package agent

import (
	"context"
	"errors"
	"fmt"
	"reflect"
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

// decodeIdent is appendIdent's inverse: a left inverse proves the
// encoding injective.
func decodeIdent(t *rapid.T, b []byte) (string, []Descriptor) {
	next := func() string {
		if len(b) == 0 {
			t.Fatalf("identity ends early")
		}
		n := int(b[0])
		if len(b) < 1+n {
			t.Fatalf("identity ends inside a string")
		}
		s := string(b[1 : 1+n])
		b = b[1+n:]
		return s
	}
	domain := next()
	var descs []Descriptor
	for len(b) > 0 {
		n := int(b[0])
		b = b[1:]
		d := Descriptor{Entries: []rules.Entry{}}
		for range n {
			k := next()
			d.Entries = append(d.Entries, rules.Entry{Key: k, Value: next()})
		}
		descs = append(descs, d)
	}
	return domain, descs
}

// TestIdentInjective: every request the memo accepts, arbitrary bytes
// included, decodes back from its identity unchanged, so two requests with
// equal identities are byte-identical: a memo hit is a request that passed
// validation before (check skips it on a hit), and TestPropertyMemoMatchesSlowPath
// checks invalid requests never hit.
func TestIdentInjective(t *testing.T) {
	bytesStr := rapid.Custom(func(t *rapid.T) string {
		return string(rapid.SliceOfN(rapid.Byte(), 0, 90).Draw(t, "bytes"))
	})
	rapid.Check(t, func(rt *rapid.T) {
		domain := bytesStr.Draw(rt, "domain")
		descs := make([]Descriptor, rapid.IntRange(0, stackDescs+1).Draw(rt, "descs"))
		for i := range descs {
			descs[i].Entries = []rules.Entry{}
			for range rapid.IntRange(0, 4).Draw(rt, "entries") {
				descs[i].Entries = append(descs[i].Entries, rules.Entry{Key: bytesStr.Draw(rt, "key"), Value: bytesStr.Draw(rt, "value")})
			}
		}
		var buf [memoBufLen]byte
		ident, _, ok := appendIdent(buf[:0], 1, domain, descs)
		size := 1 + len(domain)
		for _, d := range descs {
			size++
			for _, e := range d.Entries {
				size += 2 + len(e.Key) + len(e.Value)
			}
		}
		if want := len(descs) <= stackDescs && size <= memoBufLen; ok != want {
			rt.Fatalf("appendIdent ok = %v for %d descriptors of %d bytes, want %v", ok, len(descs), size, want)
		}
		if !ok {
			return
		}
		gotDomain, gotDescs := decodeIdent(rt, ident)
		if len(descs) == 0 {
			descs = nil
		}
		if gotDomain != domain || !reflect.DeepEqual(gotDescs, descs) {
			rt.Fatalf("decoded %q %+v, want %q %+v", gotDomain, gotDescs, domain, descs)
		}
	})
}

// TestIdentHash: appendIdent's hash is a function of the request's bytes
// (not of where they are), and requests one byte apart hash apart.
func TestIdentHash(t *testing.T) {
	const seed = 0x9e3779b97f4a7c15
	hash := func(domain string, descs []Descriptor) uint64 {
		var buf [memoBufLen]byte
		_, h, ok := appendIdent(buf[:0], seed, domain, descs)
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
		var buf [memoBufLen]byte
		_, h, _ := appendIdent(buf[:0], seed, "test", []Descriptor{deepDesc(i)})
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
	pool := []Descriptor{
		desc("api_key", "k1"), desc("api_key", "k2"),
		desc("route", "/a", "api_key", "k1"), desc("vip", "v"), desc("shadow", "s"),
		desc("open", "o"), desc("nomatch", "x"),
	}
	rapid.Check(t, func(rt *rapid.T) {
		with, without := newStepped(t, memoRulesA), newStepped(t, memoRulesA)
		without.memo = nil
		both := []*steppedAgent{with, without}
		for step := range rapid.IntRange(1, 80).Draw(rt, "steps") {
			switch rapid.IntRange(0, 5).Draw(rt, "op") {
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
