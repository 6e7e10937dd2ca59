package state

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The static bound's rules: tb and gcra refill their bursts within a
// second, well within the agent TTL less the static TTL; mid's takes 3 s,
// within it only while the static TTL is at most a second (a slot a
// forgotten holder leaves goes to another agent, whose shares start full).
const staticPropRules = `domain: test
descriptors:
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 20, burst: 20}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 10, burst: 8, algorithm: gcra}
  - key: mid
    rate_limit: {unit: second, requests_per_unit: 10, burst: 30}
`

// propAgent is a synthetic agent: it decides keys from its static shares
// as docs/static-shares.md says, from the answers the state gives it.
type propAgent struct {
	id        string
	static    bool // asks for static shares
	req       uint64
	slots     uint32
	maxRefill time.Duration // the answer's max_refill_ms
	retired   bool          // it calls no more (it still decides until valid)
	valid     int64         // it decides from its shares before this (send time + valid_ms)
	hv        uint64
	hot       map[uint64]bool
	buckets   map[int]bucket.State // by key index, under Share(1, slots)
	reports   map[int]int64        // keys that turned hot while decided from a share: what it held
	bucketsN  uint32               // the slots the buckets are shares of
}

type admit struct {
	at int64
	n  int64
}

// TestStaticBoundProperty: however holders decide from their shares,
// promote keys and acknowledge the hot set, and other agents lease and Check keys, through
// the real state, every key admits at most B + R·W in any window W (one
// token of rounding).
func TestStaticBoundProperty(t *testing.T) {
	for range 3 { // 300 cases: a broken transition shows in most runs
		rapid.Check(t, staticBoundCase(broadShape))
	}
}

// TestStaticMergeProperty is TestStaticBoundProperty narrowed to where a
// holder's merged share matters: one or two slots (a share is most of the
// burst), time in small steps, large Checks to drain what the bucket is
// credited. A merge that credits more than the share held (a report
// ignored, a share merged twice) breaks the bound in most runs.
func TestStaticMergeProperty(t *testing.T) {
	for range 3 {
		rapid.Check(t, staticBoundCase(mergeShape))
	}
}

// propShape bounds a property case's draws.
type propShape struct {
	maxSlots int // N is drawn from 1..maxSlots (before and after a change)
	maxDtMs  int // a time step, ms
	maxTake  int // a holder's decision from its share
	maxHits  int // an admin Check
}

var (
	broadShape = propShape{maxSlots: 4, maxDtMs: 300, maxTake: 10, maxHits: 8}
	mergeShape = propShape{maxSlots: 2, maxDtMs: 40, maxTake: 20, maxHits: 20}
)

func staticBoundCase(shape propShape) func(*rapid.T) {
	return func(t *rapid.T) {
		cfg := testConfig()
		cfg.LeaseTTL, cfg.MaxLeaseTTL, cfg.AgentTTL = 2*time.Second, 2*time.Second, 4*time.Second
		cfg.RefreshInterval = 500 * time.Millisecond
		cfg.SweepSegments = 1
		s := New(cfg)
		putRules(t, s, t0, staticPropRules)
		n := uint32(rapid.IntRange(1, shape.maxSlots).Draw(t, "slots"))
		ttl := time.Duration(rapid.IntRange(1, 8).Draw(t, "ttl250ms")) * 250 * time.Millisecond
		setStatic(t, s, t0, n, ttl)
		type keyDef struct {
			k, v string
			rule *rules.Rule
			h    uint64
		}
		var keys []keyDef
		for _, kv := range [][2]string{{"tb", "1"}, {"tb", "2"}, {"gcra", "1"}, {"mid", "1"}} {
			es := []rules.Entry{{Key: kv[0], Value: kv[1]}}
			r := s.Rules().Match("test", es)
			keys = append(keys, keyDef{kv[0], kv[1], r, rules.KeyHash(r, "test", es)})
		}
		byHash := map[uint64]int{}
		for i, k := range keys {
			byHash[k.h] = i
		}
		nAgents := rapid.IntRange(1, 5).Draw(t, "agents")
		var agents []*propAgent
		for i := range nAgents {
			agents = append(agents, &propAgent{id: fmt.Sprintf("h%d", i), static: true,
				hot: map[uint64]bool{}, buckets: map[int]bucket.State{}, reports: map[int]int64{}})
		}
		agents = append(agents, &propAgent{id: "x", hot: map[uint64]bool{}, buckets: map[int]bucket.State{}, reports: map[int]int64{}})
		admitted := make([][]admit, len(keys))
		now := t0

		call := func(a *propAgent) {
			a.req++
			req := &allotv1.AcquireRequest{AgentId: a.id, RequestId: a.req, StaticShares: a.static, HotVersion: a.hv}
			var idx []int
			for i, k := range keys {
				if left, ok := a.reports[i]; ok {
					// Reported in the call that acknowledges the version
					// that made the key hot.
					req.Keys = append(req.Keys, &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: k.k, Value: k.v}},
						StaticReport: true, StaticLeft: left})
					idx = append(idx, i)
					continue
				}
				if !rapid.Bool().Draw(t, "touch") {
					continue
				}
				want := int64(rapid.IntRange(0, 30).Draw(t, "want"))
				x := &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: k.k, Value: k.v}},
					Want: want, Demand: float64(2 * want)}
				if a.slots > 0 && now < a.valid && !a.hot[k.h] && rapid.Bool().Draw(t, "promote") {
					x.Promote = true
					if b, ok := a.buckets[i]; ok {
						sh, _ := k.rule.StaticShare(a.slots, a.maxRefill)
						x.StaticLeft = max(sh.Peek(b, now).Remaining, 0)
					} else if sh, ok := k.rule.StaticShare(a.slots, a.maxRefill); ok {
						x.StaticLeft = sh.Burst()
					}
					delete(a.buckets, i) // handed over with the call
				}
				req.Keys = append(req.Keys, x)
				idx = append(idx, i)
			}
			var resp *allotv1.AcquireResponse
			if rapid.Bool().Draw(t, "compact") {
				res, err := s.ApplyCompact(compactEntry(now, req))
				if err != nil || res.Errs[0] != nil {
					t.Fatalf("apply: %v %v", err, res.Errs)
				}
				resp = res.Responses[0]
			} else {
				res := s.Apply(acquireCmd(now, req)).(*AcquireBatchResult)
				if res.Errs[0] != nil {
					t.Fatalf("apply: %v", res.Errs[0])
				}
				resp = res.Responses[0]
			}
			gs, err := allotv1.GrantsOf(resp)
			if err != nil {
				t.Fatal(err)
			}
			for j, g := range gs {
				if g.Granted > 0 {
					admitted[idx[j]] = append(admitted[idx[j]], admit{now, g.Granted})
				}
			}
			st := resp.GetStatic()
			if !a.static {
				if st != nil {
					t.Fatalf("a static answer to a call that did not ask: %v", st)
				}
				return
			}
			if st == nil {
				t.Fatal("no static answer")
			}
			clear(a.reports)
			if st.HotReset {
				clear(a.hot)
			}
			for _, h := range st.HotAdded {
				a.hot[h] = true
			}
			for _, h := range st.HotRemoved {
				delete(a.hot, h)
			}
			// A key decided from a share that turned hot: the agent stops
			// and reports what the share holds in its next call.
			for i, b := range a.buckets {
				if k := keys[i]; a.hot[k.h] {
					if sh, ok := k.rule.StaticShare(a.bucketsN, a.maxRefill); ok {
						a.reports[i] = max(sh.Peek(b, now).Remaining, 0)
					}
					delete(a.buckets, i)
				}
			}
			a.hv = st.HotVersion
			a.slots, a.valid = st.Slots, 0
			if st.Slots > 0 {
				a.valid = now + st.ValidMs*int64(time.Millisecond)
				a.maxRefill = time.Duration(st.MaxRefillMs) * time.Millisecond
				if a.bucketsN != st.Slots {
					clear(a.buckets)
					a.bucketsN = st.Slots
				}
			}
		}

		// Actions, weighted per case (deciding from shares, calls by the
		// agent without a slot or by holders, Checks that drain the
		// state's bucket without pacing), so that keys are coordinated
		// while holders still decide them in many proportions.
		w := [6]int{}
		for i := range w {
			w[i] = rapid.IntRange(1, 10).Draw(t, "weight")
		}
		holderCalls := rapid.IntRange(1, 4).Draw(t, "holderCallsIn")
		steps := rapid.IntRange(20, 300).Draw(t, "steps")
		for range steps {
			s.mu.RLock()
			h, ok := s.st.hotTracked()
			s.mu.RUnlock()
			if !ok {
				t.Fatalf("hot key %x is not tracked", h)
			}
			act := rapid.IntRange(0, w[0]+w[1]+w[2]+w[3]+w[4]+w[5]).Draw(t, "action")
			switch {
			case act >= w[0]+w[1]+w[2]+w[3] && act < w[0]+w[1]+w[2]+w[3]+w[4]:
				// A holder leaves (it calls no more; the state forgets it
				// an agent TTL later) and a new agent comes.
				a := agents[rapid.IntRange(0, len(agents)-2).Draw(t, "leaver")]
				a.retired = true
				agents = slices.Insert(agents, len(agents)-1, &propAgent{id: fmt.Sprintf("h%d", len(agents)), static: true,
					hot: map[uint64]bool{}, buckets: map[int]bucket.State{}, reports: map[int]int64{}})
				continue
			case act >= w[0]+w[1]+w[2]+w[3]+w[4] && act < w[0]+w[1]+w[2]+w[3]+w[4]+w[5]:
				// The settings change (rarely: a sixth of this weight).
				if rapid.IntRange(0, 5).Draw(t, "change") == 0 {
					n := uint32(rapid.IntRange(1, shape.maxSlots).Draw(t, "slots2"))
					ttl := time.Duration(rapid.IntRange(1, 8).Draw(t, "ttl2")) * 250 * time.Millisecond
					setStatic(t, s, now, n, ttl)
				}
				continue
			case act < w[0]: // time passes
				now += int64(rapid.IntRange(0, shape.maxDtMs).Draw(t, "dtMs")) * int64(time.Millisecond)
			case act < w[0]+w[1]: // a holder decides a key from its share
				a := agents[rapid.IntRange(0, len(agents)-1).Draw(t, "agent")]
				i := rapid.IntRange(0, len(keys)-1).Draw(t, "key")
				k := keys[i]
				if a.slots == 0 || now >= a.valid || a.hot[k.h] {
					continue
				}
				sh, ok := k.rule.StaticShare(a.slots, a.maxRefill)
				if !ok {
					continue
				}
				b := a.buckets[i]
				if got := sh.TakeUpTo(&b, now, int64(rapid.IntRange(1, shape.maxTake).Draw(t, "n"))); got > 0 {
					admitted[i] = append(admitted[i], admit{now, got})
				}
				a.buckets[i] = b
			case act < w[0]+w[1]+w[2]: // a call
				a := agents[len(agents)-1]
				if rapid.IntRange(0, holderCalls).Draw(t, "holderCalls") == 0 {
					a = agents[rapid.IntRange(0, len(agents)-1).Draw(t, "agent")]
				}
				if a.retired {
					continue
				}
				call(a)
			case act == w[0]+w[1]+w[2]+w[3]+w[4]+w[5]: // an Expire
				s.Apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}})
			default: // an admin Check: drains the state's bucket without pacing
				i := rapid.IntRange(0, len(keys)-1).Draw(t, "key")
				hits := uint32(rapid.IntRange(1, shape.maxHits).Draw(t, "hits"))
				res := s.Apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Check{Check: &allotv1.CheckRequest{
					Domain: "test", Hits: hits, Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: keys[i].k, Value: keys[i].v}}}}}}})
				if r, ok := res.(*allotv1.CheckResponse); ok && r.OverallCode == allotv1.Code_CODE_OK {
					admitted[i] = append(admitted[i], admit{now, int64(hits)})
				}
			}
		}
		for i, k := range keys {
			checkBound(t, k.k+"="+k.v, k.rule.Limit, admitted[i])
		}
	}
}

// checkBound fails if the admissions in some window [s, e] exceed
// B + R·(e−s) by more than a token.
func checkBound(t *rapid.T, name string, l bucket.Limit, ads []admit) {
	slices.SortStableFunc(ads, func(x, y admit) int { return int(min(max(x.at-y.at, -1), 1)) })
	q, w, b := l.Quota(), int64(l.Window()), l.Burst()
	for i := range ads {
		sum := int64(0)
		for j := i; j < len(ads); j++ {
			sum += ads[j].n
			if sum*w > (b+1)*w+q*(ads[j].at-ads[i].at) {
				t.Fatalf("%s: %d admitted in [%v, %v], more than %d + %v of refill", name, sum,
					time.Duration(ads[i].at-t0), time.Duration(ads[j].at-t0), b,
					float64(q)*float64(ads[j].at-ads[i].at)/float64(w))
			}
		}
	}
}
