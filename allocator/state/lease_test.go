package state

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"pgregory.net/rapid"

	"github.com/allot/allot/pkg/bucket"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Invariant (b): a retried request id gets the recorded answer and changes
// nothing; an older id is stale.
func TestIdempotentRetry(t *testing.T) {
	s := newTestState(t)
	first := mustAcquire(t, s, at(0), "a", 7, ka("tb", "x", 4, 0, 0, 0), ka("nope", "x", 1, 0, 0, 0))
	before := persist(t, s)
	// The retry arrives later (the agent timed out and resent it).
	again := mustAcquire(t, s, at(0), "a", 7, ka("tb", "x", 4, 0, 0, 0), ka("nope", "x", 1, 0, 0, 0))
	if !proto.Equal(first, again) {
		t.Fatalf("replay = %v, want %v", again, first)
	}
	if after := persist(t, s); !bytes.Equal(before, after) {
		t.Fatalf("replay changed the snapshot")
	}
	// A replay is answered from the record even at a later time.
	later := mustAcquire(t, s, at(5*time.Second), "a", 7)
	if !proto.Equal(first, later) {
		t.Fatalf("late replay = %v, want the recorded %v", later, first)
	}
	if _, err := acquire(s, at(5*time.Second), "a", 6, ka("tb", "x", 4, 0, 0, 0)); !errors.Is(err, ErrStaleRequest) {
		t.Fatalf("Acquire(id 6 after 7) = %v, want ErrStaleRequest", err)
	}
	// A release reusing the acquire's id is stale, not a replay.
	if _, err := release(s, at(5*time.Second), "a", 7, true); !errors.Is(err, ErrStaleRequest) {
		t.Fatalf("Release(id 7 used by an acquire) = %v, want ErrStaleRequest", err)
	}
	// Release replays too.
	r1, err := release(s, at(6*time.Second), "a", 8, false, ka("tb", "x", 0, 0, 4, 0))
	if err != nil || r1.Returned != 4 || r1.LeasesEnded != 1 {
		t.Fatalf("Release = %v, %v; want returned 4, 1 lease ended", r1, err)
	}
	r2, err := release(s, at(7*time.Second), "a", 8, false, ka("tb", "x", 0, 0, 4, 0))
	if err != nil || !proto.Equal(r1, r2) {
		t.Fatalf("Release replay = %v, %v; want %v", r2, err, r1)
	}
	if p := s.st.tab.at(s.st.tab.find(hashOf(s, "tb", "x"))).st; s.Rules().Match("test", toEntries(ka("tb", "x", 0, 0, 0, 0).Entries)).Limit.Peek(p, at(6*time.Second)).Remaining != 10 {
		t.Fatalf("tokens not credited exactly once")
	}
}

func hashOf(s *State, k, v string) uint64 {
	es := toEntries(ka(k, v, 0, 0, 0, 0).Entries)
	return keyHash(s.Rules(), "test", es)
}

// Invariant (c): leases end after their TTL; their tokens are not
// credited back; agents are forgotten after AgentTTL.
func TestLeaseExpiry(t *testing.T) {
	s := newTestState(t)
	// Busy key: demand 10/s, holding 10 → spend time 1 s → TTL = LeaseTTL.
	g := mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 10, 0, 0, 0)).Grants[0]
	if g.Granted != 10 || g.LeaseTtlMs != 10_000 {
		t.Fatalf("grant = %v, want 10 tokens for 10s", g)
	}
	// Cold key: no demand → MaxLeaseTTL.
	g = mustAcquire(t, s, at(0), "b", 1, &allotv1.KeyAcquire{Domain: "test",
		Entries: []*allotv1.Entry{{Key: "tb", Value: "y"}}, Want: 2}).Grants[0]
	if g.LeaseTtlMs != 60_000 {
		t.Fatalf("cold grant TTL = %d ms, want 60000", g.LeaseTtlMs)
	}
	expire(s, at(10*time.Second-1))
	if st := s.Stats(); st.Leases != 2 {
		t.Fatalf("leases before expiry = %d, want 2", st.Leases)
	}
	expire(s, at(10*time.Second))
	if st := s.Stats(); st.Leases != 1 {
		t.Fatalf("leases after the busy TTL = %d, want 1", st.Leases)
	}
	// The expired lease's 10 tokens are not credited: the bucket holds what
	// it refilled since t=0 (full again after 1 s), never more than burst.
	res := s.ListAgents(at(10 * time.Second))
	if len(res.Agents) != 2 || res.Agents[0].KeysHeld != 0 || res.Agents[0].TokensHeld != 0 {
		t.Fatalf("agents = %v, want a with nothing held", res.Agents)
	}
	// A renewed lease outlives its first TTL.
	mustAcquire(t, s, at(50*time.Second), "b", 2, &allotv1.KeyAcquire{Domain: "test",
		Entries: []*allotv1.Entry{{Key: "tb", Value: "y"}}, Want: 0, Held: 2})
	expire(s, at(61*time.Second))
	if st := s.Stats(); st.Leases != 1 {
		t.Fatalf("renewed lease ended at its first expiry")
	}
	expire(s, at(110*time.Second))
	if st := s.Stats(); st.Leases != 0 {
		t.Fatalf("renewed lease still live after its TTL")
	}
	// Agents: a last seen at 0, b at 50 s; AgentTTL is 2 min.
	expire(s, at(120*time.Second))
	if res := s.ListAgents(at(120 * time.Second)); len(res.Agents) != 1 || res.Agents[0].AgentId != "b" {
		t.Fatalf("agents after a's TTL = %v, want only b", res.Agents)
	}
	expire(s, at(170*time.Second))
	if st := s.Stats(); st.Agents != 0 {
		t.Fatalf("agents after b's TTL = %d, want 0", st.Agents)
	}
	if err := s.consistency(); err != nil {
		t.Fatal(err)
	}
}

// A forgotten agent that comes back starts a fresh record: its old leases
// ended, its request ids are accepted again from any value.
func TestForgottenAgentLeasesEnd(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(0), "a", 5, ka("tb", "x", 3, 0, 0, 0))
	s.Apply(&allotv1.Command{NowUnixNanos: at(3 * time.Minute), Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}})
	if st := s.Stats(); st.Agents != 0 || st.Leases != 0 {
		t.Fatalf("stats = %+v, want the agent and its lease gone", st)
	}
	mustAcquire(t, s, at(3*time.Minute), "a", 1, ka("tb", "x", 3, 0, 0, 0))
}

// Fairness: 10 agents with equal demand on a key over its limit each get
// R/N per refresh interval (within one token); skewed demand gets max-min
// shares.
func TestFairShareEqual(t *testing.T) {
	s := newTestState(t)
	const n = 10
	agents := make([]string, n)
	for i := range agents {
		agents[i] = string(rune('a' + i))
	}
	// big: 100/s, burst 100, so capacity per 1 s interval is 100 and each
	// agent's fair share is 10. Every agent wants 50 per interval.
	got := make([]int64, n)
	ids := make([]uint64, n)
	held := make([]int64, n)
	const rounds = 30
	for round := range rounds {
		now := at(time.Duration(round) * time.Second)
		for i, a := range agents {
			// Rotate who asks first, as a refill loop would interleave.
			_ = i
			j := (i + round) % n
			a = agents[j]
			ids[j]++
			g := mustAcquire(t, s, now, a, ids[j], &allotv1.KeyAcquire{Domain: "test",
				Entries: []*allotv1.Entry{{Key: "big", Value: "x"}}, Want: 50, Held: 0, Demand: 50}).Grants[0]
			if round >= 2 {
				got[j] += g.Granted
			}
			held[j] = g.Held
			if round > 0 && g.Held > 11 {
				t.Fatalf("round %d: agent %s holds %d, above its fair share 10", round, a, g.Held)
			}
		}
	}
	for i, v := range got {
		per := float64(v) / (rounds - 2)
		if math.Abs(per-10) > 1 {
			t.Errorf("agent %d got %.2f tokens per interval, want 10 ± 1", i, per)
		}
	}
}

func TestFairShareSkewed(t *testing.T) {
	// Water-filling: capacity 20, needs 1, 2, 10, 10, 30 → 1, 2, 6, 6, 5
	// (ceil shares: 20/5=4 → 1; 19/4=5 → 2; 17/3=6 → 6, 11/2=6 → 6; 5).
	needs := []needEnt{{need: 10, agent: 3}, {need: 1, agent: 1}, {need: 30, agent: 5}, {need: 2, agent: 2}, {need: 10, agent: 4}}
	want := map[uint32]int64{1: 1, 2: 2, 3: 6, 4: 6, 5: 5}
	var sum int64
	for agent, w := range want {
		cp := append([]needEnt(nil), needs...)
		if got := fairShare(cp, 20, agent); got != w {
			t.Errorf("fairShare(agent %d) = %d, want %d", agent, got, w)
		}
		sum += w
	}
	if sum > 20 {
		t.Errorf("shares sum to %d > capacity 20", sum)
	}

	// Through Apply: big (capacity 100/interval), agents wanting 5, 20, 200.
	s := newTestState(t)
	wants := map[string]int64{"a": 5, "b": 20, "c": 200}
	// Register every agent's need first (the key is contended from then on).
	id := uint64(1)
	for round := range 5 {
		now := at(time.Duration(round) * time.Second)
		for _, a := range []string{"a", "b", "c"} {
			g := mustAcquire(t, s, now, a, id, &allotv1.KeyAcquire{Domain: "test",
				Entries: []*allotv1.Entry{{Key: "big", Value: "x"}}, Want: wants[a], Demand: float64(wants[a])}).Grants[0]
			if round >= 2 {
				want := map[string]int64{"a": 5, "b": 20, "c": 75}[a]
				if g.Granted != want {
					t.Errorf("round %d: %s granted %d, want %d", round, a, g.Granted, want)
				}
			}
		}
		id++
	}
}

// Bad input is ErrInvalid and changes nothing.
func TestBadInput(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 1, 0, 0, 0))
	before := persist(t, s)
	long := strings.Repeat("v", maxKeyBytes)
	many := make([]*allotv1.KeyAcquire, maxKeys+1)
	for i := range many {
		many[i] = ka("tb", "x", 1, 0, 0, 0)
	}
	cases := []struct {
		name string
		req  *allotv1.AcquireRequest
	}{
		{"key over 4 KiB", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{ka("tb", long, 1, 0, 0, 0)}}},
		{"over 1000 keys", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: many}},
		{"negative want", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{ka("tb", "x", -1, 0, 0, 0)}}},
		{"absurd want", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{ka("tb", "x", 1e12+1, 0, 0, 0)}}},
		{"negative returned", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{ka("tb", "x", 0, 0, -5, 0)}}},
		{"absurd charged", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{ka("tb", "x", 0, 0, 0, math.MaxInt64)}}},
		{"NaN demand", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{{Domain: "test", Demand: math.NaN()}}}},
		{"infinite demand", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{{Domain: "test", Demand: math.Inf(1)}}}},
		{"empty agent", &allotv1.AcquireRequest{RequestId: 2}},
		{"agent over 256 B", &allotv1.AcquireRequest{AgentId: strings.Repeat("a", 257), RequestId: 2}},
		{"request id 0", &allotv1.AcquireRequest{AgentId: "a"}},
		{"empty domain", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{{}}}},
		{"nil key", &allotv1.AcquireRequest{AgentId: "a", RequestId: 2, Keys: []*allotv1.KeyAcquire{nil}}},
	}
	for _, tc := range cases {
		res := s.Apply(acquireCmd(at(time.Second), tc.req)).(*AcquireBatchResult)
		if !errors.Is(res.Errs[0], ErrInvalid) || res.Responses[0] != nil {
			t.Errorf("%s: err = %v, want ErrInvalid", tc.name, res.Errs[0])
		}
		if err := ValidateAcquire(tc.req); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: ValidateAcquire = %v, want ErrInvalid", tc.name, err)
		}
	}
	if after := persist(t, s); !bytes.Equal(before, after) {
		t.Fatalf("invalid requests changed the state")
	}
	// A valid request in the same batch as an invalid one still applies.
	res := s.Apply(acquireCmd(at(time.Second), cases[0].req,
		&allotv1.AcquireRequest{AgentId: "b", RequestId: 1, Keys: []*allotv1.KeyAcquire{ka("tb", "x", 1, 0, 0, 0)}})).(*AcquireBatchResult)
	if res.Errs[0] == nil || res.Errs[1] != nil || res.Responses[1].Grants[0].Granted != 1 {
		t.Fatalf("mixed batch = %v / %v", res.Errs, res.Responses)
	}
	if err := s.Apply(&allotv1.Command{NowUnixNanos: at(2 * time.Second)}); !errors.Is(err.(error), ErrUnknownCommand) {
		t.Fatalf("empty command = %v, want ErrUnknownCommand", err)
	}
	if res := s.Apply(&allotv1.Command{NowUnixNanos: at(2 * time.Second), IgnoreIfUnknown: true}); res != nil {
		t.Fatalf("ignorable unknown command = %v, want nil", res)
	}
	if err, _ := s.Apply(nil).(error); !errors.Is(err, ErrInvalid) {
		t.Fatalf("nil command = %v", err)
	}
}

// Returns cannot create tokens: only what the agent is recorded to hold is
// credited, and only up to the burst.
func TestReturnsCannotCreateTokens(t *testing.T) {
	s := newTestState(t)
	g := mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 4, 0, 0, 0)).Grants[0]
	if g.Granted != 4 || g.Remaining != 6 {
		t.Fatalf("grant = %v", g)
	}
	// The agent claims to return 100 tokens: only its 4 are credited.
	g = mustAcquire(t, s, at(0), "a", 2, ka("tb", "x", 0, 0, 100, 0)).Grants[0]
	if g.Remaining != 10 || g.Held != 0 || g.Agents != 0 {
		t.Fatalf("after over-return: %v, want remaining 10, no lease", g)
	}
	// Holding 6, the agent claims to keep 2 and return 5 (7 > 6): only the
	// 4 beyond what it keeps are credited.
	mustAcquire(t, s, at(0), "a", 3, ka("tb", "x", 6, 0, 0, 0))
	g = mustAcquire(t, s, at(0), "a", 4, ka("tb", "x", 0, 2, 5, 0)).Grants[0]
	if g.Held != 2 || g.Remaining != 8 {
		t.Fatalf("inconsistent return: %v, want held 2, 4 credited (remaining 8)", g)
	}
	// Reporting a smaller holding (it spent 1) drops the record to it.
	g = mustAcquire(t, s, at(0), "a", 5, ka("tb", "x", 0, 1, 0, 0)).Grants[0]
	if g.Held != 1 || g.Remaining != 8 {
		t.Fatalf("after spending: %v, want held 1, remaining 8", g)
	}
}

// Charged tokens are debited, into bounded debt, and a key in debt is
// EXHAUSTED with the time until one token is back.
func TestChargedDebt(t *testing.T) {
	s := newTestState(t)
	g := mustAcquire(t, s, at(0), "a", 1, ka("tb", "x", 0, 0, 0, 15)).Grants[0]
	if g.Remaining != -5 || g.Agents != 0 {
		t.Fatalf("after charging 15 of 10: %v, want remaining -5, no lease", g)
	}
	g = mustAcquire(t, s, at(0), "a", 2, ka("tb", "x", 1, 0, 0, 1000)).Grants[0]
	if g.Status != allotv1.KeyStatus_KEY_STATUS_EXHAUSTED || g.Remaining != -10 || g.RetryAfterMs != 1100 {
		t.Fatalf("deep debt: %v, want EXHAUSTED at the -burst floor, retry 1.1s", g)
	}
}

func TestRulesVersionsAndCAS(t *testing.T) {
	s := New(testConfig())
	if s.Rules() != nil || s.Stats().RulesVersion != 0 {
		t.Fatalf("fresh state has rules")
	}
	put := func(req *allotv1.PutRulesRequest) (*allotv1.PutRulesResponse, error) {
		res := s.Apply(&allotv1.Command{NowUnixNanos: at(0), Cmd: &allotv1.Command_PutRules{PutRules: req}})
		if err, ok := res.(error); ok {
			return nil, err
		}
		return res.(*allotv1.PutRulesResponse), nil
	}
	other := []byte("domain: other\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
	r, err := put(&allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(testRules)}}})
	if err != nil || r.Version != 1 {
		t.Fatalf("put 1 = %v, %v", r, err)
	}
	r, err = put(&allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "other.yaml", Yaml: other}}, ExpectedVersion: 1})
	if err != nil || r.Version != 2 || strings.Join(r.Domains, ",") != "other,test" {
		t.Fatalf("put 2 (adds a domain) = %v, %v", r, err)
	}
	if _, err = put(&allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "o.yaml", Yaml: other}}, ExpectedVersion: 1}); !errors.Is(err, ErrFailedPrecondition) {
		t.Fatalf("stale CAS = %v, want ErrFailedPrecondition", err)
	}
	r, err = put(&allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "o.yaml", Yaml: other}}, ReplaceAll: true, DryRun: true})
	if err != nil || r.Version != 2 || strings.Join(r.Domains, ",") != "other" || s.Rules().Version() != 2 || len(s.Rules().Domains()) != 2 {
		t.Fatalf("dry run = %v, %v; rules now v%d %v", r, err, s.Rules().Version(), s.Rules().Domains())
	}
	bad := []byte("domain: test\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, bogus: 2}\n")
	if _, err = put(&allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "bad.yaml", Yaml: bad}}}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "bad.yaml:4") {
		t.Fatalf("bad file = %v, want ErrInvalid with bad.yaml:4", err)
	}
	if s.Rules().Version() != 2 {
		t.Fatalf("a bad put changed the version")
	}
	r, err = put(&allotv1.PutRulesRequest{Files: []*allotv1.RuleFile{{Name: "o.yaml", Yaml: other}}, ReplaceAll: true})
	if err != nil || r.Version != 3 || strings.Join(s.Rules().Domains(), ",") != "other" {
		t.Fatalf("replace_all = %v, %v", r, err)
	}
	if rs := s.RuleSet(); rs.Version != 3 || len(rs.Files) != 1 || rs.Files[0].Domain != "other" {
		t.Fatalf("RuleSet = %v", rs)
	}
}

// A rule whose limit changes carries its keys' balances over, capped at
// the new capacity; a rule that only moves keeps them. Regression: the key
// used to restart from a full bucket, so tightening a limit during an
// incident handed every key a fresh burst.
func TestRuleChangeCarriesBalance(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(0), "a", 1, ka("big", "x", 50, 0, 0, 0), ka("tb", "x", 10, 0, 0, 0), ka("tb", "y", 2, 0, 0, 0))
	putRules(t, s, at(0), testRulesAlt) // big unchanged, tb 20/s burst 5
	r := mustAcquire(t, s, at(0), "a", 2, ka("big", "x", 0, 50, 0, 0), ka("tb", "x", 0, 10, 0, 0), ka("tb", "y", 0, 2, 0, 0))
	if r.Grants[0].Remaining != 50 {
		t.Errorf("big kept? remaining %d, want 50", r.Grants[0].Remaining)
	}
	if r.Grants[1].Remaining != 0 {
		t.Errorf("tb=x (spent) after tightening: remaining %d, want 0 (no fresh burst)", r.Grants[1].Remaining)
	}
	if r.Grants[2].Remaining != 5 {
		t.Errorf("tb=y (8 of 10 left) after tightening to burst 5: remaining %d, want 5", r.Grants[2].Remaining)
	}
	// 100 ms later at the new rate (20/s): 2 tokens on the spent key.
	r = mustAcquire(t, s, at(100*time.Millisecond), "a", 3, ka("tb", "x", 0, 10, 0, 0))
	if r.Grants[0].Remaining != 2 {
		t.Errorf("tb=x 100 ms later at 20/s: remaining %d, want 2", r.Grants[0].Remaining)
	}
	// Loosening back to burst 10 keeps what was spent spent.
	putRules(t, s, at(100*time.Millisecond), testRules)
	r = mustAcquire(t, s, at(100*time.Millisecond), "a", 4, ka("tb", "x", 0, 10, 0, 0))
	if r.Grants[0].Remaining != 2 {
		t.Errorf("tb=x after loosening: remaining %d, want 2", r.Grants[0].Remaining)
	}
	if err := s.consistency(); err != nil {
		t.Fatal(err)
	}
	expire(s, at(time.Hour))
	for range testConfig().SweepSegments {
		expire(s, at(time.Hour))
	}
	if st := s.Stats(); st.Keys != 0 || len(s.st.lims.idx) != 0 {
		t.Fatalf("after a full sweep: %+v, %d limits", st, len(s.st.lims.idx))
	}
}

func TestCheck(t *testing.T) {
	s := newTestState(t)
	check := func(hits uint32, descs ...[2]string) *allotv1.CheckResponse {
		req := &allotv1.CheckRequest{Domain: "test", Hits: hits}
		for _, d := range descs {
			req.Descriptors = append(req.Descriptors, &allotv1.Descriptor{Entries: []*allotv1.Entry{{Key: d[0], Value: d[1]}}})
		}
		res := s.Apply(&allotv1.Command{NowUnixNanos: at(0), Cmd: &allotv1.Command_Check{Check: req}})
		resp, ok := res.(*allotv1.CheckResponse)
		if !ok {
			t.Fatalf("Check: %v", res)
		}
		return resp
	}
	r := check(0, [2]string{"tb", "x"}, [2]string{"nope", "x"}, [2]string{"free", "x"})
	if r.OverallCode != allotv1.Code_CODE_OK || r.Statuses[0].Remaining != 9 || r.Statuses[1].Matched || !r.Statuses[2].Matched {
		t.Fatalf("check = %v", r)
	}
	// 9 left on tb=x; asking 5 on tb=x and 5 on fw=x twice: the second time
	// tb=x is short, so fw=x's 5 are given back.
	check(5, [2]string{"tb", "x"}, [2]string{"fw", "x"})
	r = check(5, [2]string{"fw", "x"}, [2]string{"tb", "x"})
	if r.OverallCode != allotv1.Code_CODE_OVER_LIMIT || r.Statuses[1].Code != allotv1.Code_CODE_OVER_LIMIT || r.Statuses[1].RetryAfterMs != 100 {
		t.Fatalf("check over limit = %v", r)
	}
	r = check(0, [2]string{"fw", "x"})
	if r.Statuses[0].Remaining != -1+1 && r.Statuses[0].Remaining != 4 {
		t.Fatalf("fw after a refunded check: remaining %d, want 4", r.Statuses[0].Remaining)
	}
	if _, ok := s.Apply(&allotv1.Command{NowUnixNanos: at(0), Cmd: &allotv1.Command_Check{Check: &allotv1.CheckRequest{Domain: "test"}}}).(error); !ok {
		t.Fatalf("check without descriptors accepted")
	}
}

func TestMembers(t *testing.T) {
	s := newTestState(t)
	up := func(id, addr string, remove bool) {
		if err, _ := s.Apply(&allotv1.Command{NowUnixNanos: at(0), Cmd: &allotv1.Command_Member{Member: &allotv1.MemberCommand{
			Member: &allotv1.Member{Id: id, GrpcAddr: addr}, Remove: remove}}}).(error); err != nil {
			t.Fatal(err)
		}
	}
	up("n2", "b", false)
	up("n1", "a", false)
	up("n1", "c", false)
	m := s.Members()
	if len(m) != 2 || m[0].Id != "n1" || m[0].GrpcAddr != "c" || m[1].Id != "n2" {
		t.Fatalf("members = %v", m)
	}
	up("n2", "", true)
	if m = s.Members(); len(m) != 1 {
		t.Fatalf("members after remove = %v", m)
	}
	if err, _ := s.Apply(&allotv1.Command{Cmd: &allotv1.Command_Member{Member: &allotv1.MemberCommand{}}}).(error); !errors.Is(err, ErrInvalid) {
		t.Fatalf("member without id = %v", err)
	}
}

// The leader's clock stepping back mints nothing: command time is made
// monotone.
func TestClockStepBack(t *testing.T) {
	s := newTestState(t)
	mustAcquire(t, s, at(10*time.Second), "a", 1, ka("tb", "x", 10, 0, 0, 0))
	g := mustAcquire(t, s, at(0), "a", 2, ka("tb", "x", 10, 10, 0, 0)).Grants[0]
	if g.Granted != 0 {
		t.Fatalf("clock stepped back 10 s and %d tokens were granted", g.Granted)
	}
	if s.Stats().LastApplied != at(10*time.Second) {
		t.Fatalf("last applied time went backwards")
	}
}

// Persist runs outside the lock while Apply keeps mutating the state (run
// with -race): the snapshot must see only its captured state.
func TestSnapshotConcurrentApply(t *testing.T) {
	s := newTestState(t)
	var keys []*allotv1.KeyAcquire
	for i := range 5000 {
		keys = append(keys, ka("big", fmt.Sprint("k", i), 1, 0, 0, 0))
	}
	for i := range 5 {
		mustAcquire(t, s, at(0), "a", uint64(i+1), keys[i*1000:(i+1)*1000]...)
	}
	want := persist(t, s)
	snap, err := s.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan []byte)
	go func() {
		var buf bytes.Buffer
		if err := snap.Persist(&buf); err != nil {
			t.Error(err)
		}
		done <- buf.Bytes()
	}()
	for i := range 20 {
		mustAcquire(t, s, at(time.Duration(i)*time.Second), "b", uint64(i+1), keys[i*100:(i+1)*100]...)
		expire(s, at(time.Duration(i)*time.Minute))
		s.TopKeys(nil, at(0))
	}
	got := <-done
	snap.Release()
	if !bytes.Equal(got, want) {
		t.Fatalf("snapshot persisted concurrently with Apply differs from the captured state")
	}
}

// carryOver keeps the balance across any change of limit, algorithm
// included: min(remaining under the old limit, the new capacity), debt
// kept down to the new limit's floor; a key leaving deny-all starts full.
func TestPropertyCarryOver(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		lim := func(label string) bucket.Limit {
			alg := bucket.Algorithm(rapid.IntRange(0, 3).Draw(t, label+"alg"))
			quota := rapid.Int64Range(1, 1000).Draw(t, label+"quota")
			window := time.Duration(rapid.IntRange(1, 3600).Draw(t, label+"window_s")) * time.Second
			burst := rapid.Int64Range(1, 2000).Draw(t, label+"burst")
			if alg == bucket.SlidingWindow || alg == bucket.FixedWindow {
				burst = quota
			}
			l, err := bucket.NewLimit(alg, quota, window, burst)
			if err != nil {
				t.Fatalf("NewLimit: %v", err)
			}
			return l
		}
		from, to := lim("from_"), lim("to_")
		now := at(time.Duration(rapid.Int64Range(0, int64(time.Hour)).Draw(t, "now")))
		var st bucket.State
		if n := rapid.Int64Range(0, 3000).Draw(t, "spent"); n > 0 {
			from.Debit(&st, now, n)
		}
		rem := from.Peek(st, now).Remaining
		capacity := to.Peek(bucket.State{}, now).Remaining
		got := to.Peek(carryOver(from, st, to, now), now).Remaining
		// The debt floor of the new limit: −burst, or a count of 2·quota.
		floor := capacity - 2*max(to.Burst(), to.Quota())
		if to.Algorithm() == bucket.TokenBucket || to.Algorithm() == bucket.GCRA {
			floor = -to.Burst()
		}
		if want := max(min(rem, capacity), floor); got != want {
			t.Fatalf("%v → %v: remaining %d before, %d after, want %d (capacity %d, floor %d)", from, to, rem, got, want, capacity, floor)
		}
	})
	deny, err := bucket.DenyAll(time.Second)
	if err != nil {
		t.Fatal(err)
	}
	to, _ := bucket.NewLimit(bucket.TokenBucket, 10, time.Second, 10)
	if got := to.Peek(carryOver(deny, bucket.State{}, to, at(0)), at(0)).Remaining; got != 10 {
		t.Fatalf("leaving deny-all: remaining %d, want 10 (full)", got)
	}
}
