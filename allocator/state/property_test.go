package state

import (
	"bytes"
	"fmt"
	"math/big"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The random history generator shared by the property tests.

var (
	propAgents = []string{"a", "b", "c", "d"}
	// propKeys are the keys whose grants invariant (a) bounds (token bucket
	// and GCRA limits).
	propKeys = [][2]string{{"tb", "x"}, {"tb", "y"}, {"gcra", "x"}, {"slow", "x"}, {"big", "x"}}
	// moreKeys add windows and non-leased statuses to the determinism test.
	moreKeys = [][2]string{{"fw", "x"}, {"free", "x"}, {"redis", "x"}, {"nope", "x"}}
)

// testRulesAlt changes tb's limit and drops gcra, for PutRules mid-history.
const testRulesAlt = `domain: test
descriptors:
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 20, burst: 5}
  - key: slow
    rate_limit: {name: slow, unit: minute, requests_per_unit: 30, burst: 10}
  - key: big
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
  - key: fw
    rate_limit: {unit: second, requests_per_unit: 5, algorithm: fixed_window}
`

type genCtx struct {
	now    int64
	nextID map[string]uint64            // next request id per agent
	last   map[string]*allotv1.Command  // last acquire/release command per agent (for replays)
	held   map[string]map[[2]string]int // last reported held per agent and key
	keys   [][2]string
	admin  bool // also PutRules, members, checks
}

func newGenCtx(keys [][2]string, admin bool) *genCtx {
	g := &genCtx{now: at(0), nextID: map[string]uint64{}, last: map[string]*allotv1.Command{},
		held: map[string]map[[2]string]int{}, keys: keys, admin: admin}
	for _, a := range propAgents {
		g.nextID[a] = 1
		g.held[a] = map[[2]string]int{}
	}
	return g
}

// stepMeta describes a generated command for the checker.
type stepMeta struct {
	replay bool // an Acquire/Release command replaying an agent's last call
}

func (g *genCtx) keyAcquire(t *rapid.T, agent string, k [2]string) *allotv1.KeyAcquire {
	h := g.held[agent][k]
	want := rapid.IntRange(0, 15).Draw(t, "want")
	reported := rapid.IntRange(0, h).Draw(t, "held")
	returned := 0
	if rapid.IntRange(0, 3).Draw(t, "doReturn") == 0 {
		returned = rapid.IntRange(0, reported+3).Draw(t, "returned")
	}
	charged := 0
	if rapid.IntRange(0, 4).Draw(t, "doCharge") == 0 {
		charged = rapid.IntRange(1, 5).Draw(t, "charged")
	}
	return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: k[0], Value: k[1]}},
		Want: int64(want), Held: int64(reported), Returned: int64(returned), Charged: int64(charged),
		Demand: float64(rapid.IntRange(0, 30).Draw(t, "demand")), Denied: int64(rapid.IntRange(0, 2).Draw(t, "denied"))}
}

// step draws one command.
func (g *genCtx) step(t *rapid.T) (*allotv1.Command, stepMeta) {
	g.now += int64(rapid.IntRange(0, 1500).Draw(t, "dtMs")) * int64(time.Millisecond)
	op := rapid.IntRange(0, 19).Draw(t, "op")
	switch {
	case op < 11: // acquire batch from 1-2 distinct agents
		perm := rapid.Permutation(propAgents).Draw(t, "agents")
		n := rapid.IntRange(1, 2).Draw(t, "batch")
		var reqs []*allotv1.AcquireRequest
		for _, agent := range perm[:n] {
			keys := rapid.SliceOfNDistinct(rapid.SampledFrom(g.keys), 1, 3, func(k [2]string) string { return k[0] + k[1] }).Draw(t, "keys")
			req := &allotv1.AcquireRequest{AgentId: agent, RequestId: g.nextID[agent]}
			for _, k := range keys {
				req.Keys = append(req.Keys, g.keyAcquire(t, agent, k))
			}
			g.nextID[agent]++
			reqs = append(reqs, req)
		}
		cmd := acquireCmd(g.now, reqs...)
		for _, r := range reqs {
			g.last[r.AgentId] = acquireCmd(0, r)
		}
		return cmd, stepMeta{}
	case op < 12: // replay an agent's last call
		agent := rapid.SampledFrom(propAgents).Draw(t, "agent")
		if last := g.last[agent]; last != nil {
			cmd := proto.Clone(last).(*allotv1.Command)
			cmd.NowUnixNanos = g.now
			return cmd, stepMeta{replay: true}
		}
		return &allotv1.Command{NowUnixNanos: g.now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}}, stepMeta{}
	case op < 14: // release
		agent := rapid.SampledFrom(propAgents).Draw(t, "agent")
		req := &allotv1.ReleaseRequest{AgentId: agent, RequestId: g.nextID[agent]}
		g.nextID[agent]++
		if rapid.Bool().Draw(t, "all") {
			req.All = true
		} else {
			k := rapid.SampledFrom(g.keys).Draw(t, "key")
			ka := g.keyAcquire(t, agent, k)
			ka.Returned, ka.Held = ka.Held, 0
			req.Keys = append(req.Keys, ka)
		}
		cmd := &allotv1.Command{NowUnixNanos: g.now, Cmd: &allotv1.Command_Release{Release: req}}
		g.last[agent] = cmd
		return cmd, stepMeta{}
	case op < 17:
		return &allotv1.Command{NowUnixNanos: g.now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}}, stepMeta{}
	case op < 18 && g.admin:
		yaml := testRules
		if rapid.Bool().Draw(t, "alt") {
			yaml = testRulesAlt
		}
		return &allotv1.Command{NowUnixNanos: g.now, Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
			Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(yaml)}}, ReplaceAll: true}}}, stepMeta{}
	case op < 19 && g.admin:
		id := rapid.SampledFrom([]string{"n1", "n2"}).Draw(t, "member")
		return &allotv1.Command{NowUnixNanos: g.now, Cmd: &allotv1.Command_Member{Member: &allotv1.MemberCommand{
			Member: &allotv1.Member{Id: id, RaftAddr: "127.0.0.1:1", GrpcAddr: fmt.Sprint(g.now)}, Remove: rapid.Bool().Draw(t, "remove")}}}, stepMeta{}
	default:
		k := rapid.SampledFrom(g.keys).Draw(t, "key")
		return &allotv1.Command{NowUnixNanos: g.now, Cmd: &allotv1.Command_Check{Check: &allotv1.CheckRequest{
			Domain: "test", Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: k[0], Value: k[1]}}}},
			Hits: uint32(rapid.IntRange(0, 3).Draw(t, "hits"))}}}, stepMeta{}
	}
}

// observe updates the generator's view of what each agent holds from a
// command's result.
func (g *genCtx) observe(cmd *allotv1.Command, res any) {
	switch x := cmd.Cmd.(type) {
	case *allotv1.Command_Acquire:
		br := res.(*AcquireBatchResult)
		for i, req := range x.Acquire.Requests {
			if br.Errs[i] != nil {
				continue
			}
			for j, k := range req.Keys {
				g.held[req.AgentId][[2]string{k.Entries[0].Key, k.Entries[0].Value}] = int(br.Responses[i].Grants[j].Held)
			}
		}
	case *allotv1.Command_Release:
		if x.Release.All {
			g.held[x.Release.AgentId] = map[[2]string]int{}
		}
		for _, k := range x.Release.Keys {
			delete(g.held[x.Release.AgentId], [2]string{k.Entries[0].Key, k.Entries[0].Value})
		}
	}
}

// keyEvent is one change to a key's budget seen by invariant (a).
type keyEvent struct {
	t                 int64
	granted, credited int64
}

// leaseHeld returns the state's record of agent's holding on the key.
func (s *State) leaseHeld(agent string, domain string, entries []rules.Entry) int64 {
	c := s.st
	a := c.agents[agent]
	r := c.rules.Match(domain, entries)
	if a == nil || r == nil {
		return 0
	}
	e, ok := c.leasedEntry(rules.KeyHash(r, domain, entries))
	if !ok {
		return 0
	}
	if j, ok := e.find(a.num); ok {
		return e.leases[j].held
	}
	return 0
}

func toEntries(es []*allotv1.Entry) []rules.Entry {
	out := make([]rules.Entry, len(es))
	for i, e := range es {
		out[i] = rules.Entry{Key: e.Key, Value: e.Value}
	}
	return out
}

// TestPropertyNothingGrantedTwice is invariant (a): for every key and every
// interval [t1, t2] of a random history of many agents' Acquire (want,
// held, returned, charged), Release, Expire, Check and time steps,
//
//	Σ granted in [t1,t2] ≤ burst + R·(t2−t1) + Σ credited returns in [t1,t2]
//
// for the token bucket and GCRA limits; recorded holdings are never
// negative and never exceed the agent's grants minus its credited returns;
// and replays grant nothing.
func TestPropertyNothingGrantedTwice(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := newTestState(t)
		s.st.compactAlways, s.st.compactBudget = true, 2
		g := newGenCtx(propKeys, false)
		events := map[string][]keyEvent{}      // by canonical key
		net := map[[2]string]int64{}           // Σ granted − Σ credited per agent+key
		lastResp := map[string]proto.Message{} // per agent, for replays
		steps := rapid.IntRange(1, 120).Draw(t, "steps")
		for range steps {
			cmd, meta := g.step(t)
			// Pre-state holdings, to compute credited returns.
			type pre struct {
				agent, key string
				held       int64 // recorded before the call
				kept       int64 // reported held
				returned   int64
			}
			var pres []pre
			collect := func(agent string, keys []*allotv1.KeyAcquire) {
				for _, k := range keys {
					es := toEntries(k.Entries)
					pres = append(pres, pre{agent, string(rules.AppendKey(nil, s.Rules().Match("test", es), "test", es)),
						s.leaseHeld(agent, "test", es), k.Held, k.Returned})
				}
			}
			switch x := cmd.Cmd.(type) {
			case *allotv1.Command_Acquire:
				for _, r := range x.Acquire.Requests {
					collect(r.AgentId, r.Keys)
				}
			case *allotv1.Command_Release:
				collect(x.Release.AgentId, x.Release.Keys)
			}
			var res any
			if rapid.Bool().Draw(t, "compact") {
				res = applyCompactly(s, cmd)
			} else {
				res = s.Apply(cmd)
			}
			if err := s.consistency(); err != nil {
				t.Fatalf("after %v: %v", cmd, err)
			}
			switch x := cmd.Cmd.(type) {
			case *allotv1.Command_Acquire:
				br := res.(*AcquireBatchResult)
				p := 0
				for i, r := range x.Acquire.Requests {
					if br.Errs[i] != nil {
						t.Fatalf("acquire %v: %v", r, br.Errs[i])
					}
					if meta.replay {
						if !proto.Equal(br.Responses[i], lastResp[r.AgentId]) {
							t.Fatalf("replay of %s/%d: %v, want %v", r.AgentId, r.RequestId, br.Responses[i], lastResp[r.AgentId])
						}
						p += len(r.Keys)
						continue
					}
					lastResp[r.AgentId] = br.Responses[i]
					for j, gr := range br.Responses[i].Grants {
						pr := pres[p]
						p++
						credited := min(pr.returned, max(0, pr.held-pr.kept))
						if gr.Held < 0 {
							t.Fatalf("negative held %d", gr.Held)
						}
						if gr.Status != allotv1.KeyStatus_KEY_STATUS_OK && gr.Status != allotv1.KeyStatus_KEY_STATUS_EXHAUSTED {
							continue
						}
						k := [2]string{r.AgentId, gr.Key}
						net[k] += gr.Granted - credited
						if gr.Held > net[k] {
							t.Fatalf("%s holds %d on %s, more than granted − returned = %d (key %d)", r.AgentId, gr.Held, gr.Key, net[k], j)
						}
						events[gr.Key] = append(events[gr.Key], keyEvent{cmd.NowUnixNanos, gr.Granted, credited})
					}
				}
			case *allotv1.Command_Release:
				if meta.replay {
					break
				}
				rr, ok := res.(*allotv1.ReleaseResponse)
				if !ok {
					t.Fatalf("release %v: %v", x.Release, res)
				}
				var credited int64
				for _, pr := range pres {
					c := min(pr.returned, max(0, pr.held-pr.kept))
					credited += c
					net[[2]string{x.Release.AgentId, pr.key}] -= c
					events[pr.key] = append(events[pr.key], keyEvent{cmd.NowUnixNanos, 0, c})
				}
				if rr.Returned != credited {
					t.Fatalf("release returned %d, want %d", rr.Returned, credited)
				}
			}
			g.observe(cmd, res)
		}
		checkGrantBound(t, s, events)
	})
}

// checkGrantBound checks Σ granted ≤ burst + R·Δt + Σ credited over every
// interval of every key's events, in exact integer arithmetic:
// granted·W ≤ burst·W + quota·Δt + credited·W.
func checkGrantBound(t *rapid.T, s *State, events map[string][]keyEvent) {
	for key, evs := range events {
		domain, es, err := rules.ParseKey(key)
		if err != nil {
			t.Fatalf("ParseKey(%q): %v", key, err)
		}
		r := s.Rules().Match(domain, es)
		l := r.Limit
		w := big.NewInt(int64(l.Window()))
		for i := range evs {
			var granted, credited int64
			for j := i; j < len(evs); j++ {
				granted += evs[j].granted
				credited += evs[j].credited
				if j+1 < len(evs) && evs[j+1].t == evs[j].t {
					continue // an interval ends after every event of its instant
				}
				lhs := new(big.Int).Mul(big.NewInt(granted), w)
				rhs := new(big.Int).Mul(big.NewInt(l.Burst()+credited), w)
				rhs.Add(rhs, new(big.Int).Mul(big.NewInt(l.Quota()), big.NewInt(evs[j].t-evs[i].t)))
				if lhs.Cmp(rhs) > 0 {
					t.Fatalf("key %s: %d granted in [%d, %d] ms with %d credited: more than burst %d + %d per %v",
						key, granted, (evs[i].t-t0)/1e6, (evs[j].t-t0)/1e6, credited, l.Burst(), l.Quota(), l.Window())
				}
			}
		}
	}
}

// TestPropertyDeterministic: two States fed the same random history
// (acquires, replays, releases, expiries, rule changes, members, checks)
// produce byte-identical snapshots, though one compacts its arena at every
// Expire; a third restored from a mid-history
// snapshot and fed the rest ends identical too; and a snapshot taken
// mid-history persists the state as of its capture even though the state
// changed after it (copy-on-write). b is fed its Acquire batches as
// compact entries, a as protobuf Commands: the two encodings must not be
// observable either.
func TestPropertyDeterministic(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		keys := append(append([][2]string(nil), propKeys...), moreKeys...)
		g := newGenCtx(keys, true)
		steps := rapid.IntRange(1, 100).Draw(t, "steps")
		cut := rapid.IntRange(0, steps).Draw(t, "cut")
		a, b := newTestState(t), newTestState(t)
		// a compacts its arena all the time, an entry per Expire; b only
		// when it needs to. Compaction must not be observable.
		a.st.compactAlways, a.st.compactBudget = true, 1
		var c *State
		var snap Snapshot
		var atCut []byte
		for i := range steps {
			if i == cut {
				atCut = persist(t, b)
				c = New(testConfig())
				if err := c.Restore(bytes.NewReader(atCut)); err != nil {
					t.Fatalf("Restore: %v", err)
				}
				var err error
				if snap, err = a.Snapshot(); err != nil {
					t.Fatalf("%v", err)
				}
			}
			cmd, _ := g.step(t)
			ra := a.Apply(cmd)
			rb := applyCompactly(b, proto.Clone(cmd).(*allotv1.Command))
			if c != nil {
				c.Apply(proto.Clone(cmd).(*allotv1.Command))
			}
			if fmt.Sprint(ra) != fmt.Sprint(rb) {
				t.Fatalf("step %d: results differ: %v vs %v", i, ra, rb)
			}
			if err := a.consistency(); err != nil {
				t.Fatalf("step %d (%v): %v", i, cmd, err)
			}
			g.observe(cmd, ra)
		}
		pa, pb := persist(t, a), persist(t, b)
		if !bytes.Equal(pa, pb) {
			t.Fatalf("snapshots of identical histories differ")
		}
		if c != nil {
			if err := c.consistency(); err != nil {
				t.Fatalf("restored: %v", err)
			}
			if pc := persist(t, c); !bytes.Equal(pa, pc) {
				t.Fatalf("state restored at step %d and replayed differs", cut)
			}
			var buf bytes.Buffer
			if err := snap.Persist(&buf); err != nil {
				t.Fatalf("%v", err)
			}
			snap.Release()
			if !bytes.Equal(buf.Bytes(), atCut) {
				t.Fatalf("snapshot taken at step %d changed after later commands", cut)
			}
		}
	})
}
