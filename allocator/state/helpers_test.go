package state

import (
	"bytes"
	"os"
	"time"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// tb is what the helpers need from *testing.T and *rapid.T.
type tb interface {
	Helper()
	Fatalf(format string, args ...any)
}

// t0 is the tests' epoch (2025-01-01T00:00:00Z).
const t0 = int64(1735689600) * int64(time.Second)

func at(d time.Duration) int64 { return t0 + int64(d) }

// testRules is the rule set of most tests (domain "test"):
//
//	tb=<v>    10/s, burst 10, token bucket
//	gcra=<v>  10/s, burst 10, gcra
//	slow=<v>  30/minute, burst 10 (the example rules)
//	big=<v>   100/s, burst 100
//	free=<v>  unlimited
//	redis=<v> redis backend
//	fw=<v>    fixed window 5/s
const testRules = `domain: test
descriptors:
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 10, burst: 10, algorithm: gcra}
  - key: slow
    rate_limit: {name: slow, unit: minute, requests_per_unit: 30, burst: 10}
  - key: big
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
  - key: free
    rate_limit: {unlimited: true}
  - key: redis
    rate_limit: {unit: second, requests_per_unit: 10, backend: redis}
  - key: fw
    rate_limit: {unit: second, requests_per_unit: 5, algorithm: fixed_window}
`

func testConfig() Config {
	c := DefaultConfig()
	c.LeaseTTL = 10 * time.Second
	c.MaxLeaseTTL = 60 * time.Second
	c.RefreshInterval = time.Second
	c.AgentTTL = 2 * time.Minute
	c.SweepSegments = 4
	return c
}

func newTestState(t tb) *State {
	t.Helper()
	s := New(testConfig())
	putRules(t, s, t0, testRules)
	return s
}

func putRules(t tb, s *State, now int64, yaml string) *allotv1.PutRulesResponse {
	t.Helper()
	res := s.Apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
		Files: []*allotv1.RuleFile{{Name: "test.yaml", Yaml: []byte(yaml)}}, ReplaceAll: true}}})
	if err, ok := res.(error); ok {
		t.Fatalf("PutRules: %v", err)
	}
	return res.(*allotv1.PutRulesResponse)
}

// ka builds a KeyAcquire for domain "test" with one entry.
func ka(k, v string, want, held, returned, charged int64) *allotv1.KeyAcquire {
	return &allotv1.KeyAcquire{Domain: "test", Entries: []*allotv1.Entry{{Key: k, Value: v}},
		Want: want, Held: held, Returned: returned, Charged: charged, Demand: float64(want)}
}

func acquireCmd(now int64, reqs ...*allotv1.AcquireRequest) *allotv1.Command {
	return &allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{Requests: reqs}}}
}

// acquire applies one AcquireRequest and returns its response or error.
func acquire(s *State, now int64, agent string, id uint64, keys ...*allotv1.KeyAcquire) (*allotv1.AcquireResponse, error) {
	res := s.Apply(acquireCmd(now, &allotv1.AcquireRequest{AgentId: agent, RequestId: id, Keys: keys})).(*AcquireBatchResult)
	return res.Responses[0], res.Errs[0]
}

func mustAcquire(t tb, s *State, now int64, agent string, id uint64, keys ...*allotv1.KeyAcquire) *allotv1.AcquireResponse {
	t.Helper()
	resp, err := acquire(s, now, agent, id, keys...)
	if err != nil {
		t.Fatalf("Acquire(%s, %d): %v", agent, id, err)
	}
	return resp
}

func expire(s *State, now int64) {
	s.Apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}})
}

func release(s *State, now int64, agent string, id uint64, all bool, keys ...*allotv1.KeyAcquire) (*allotv1.ReleaseResponse, error) {
	res := s.Apply(&allotv1.Command{NowUnixNanos: now, Cmd: &allotv1.Command_Release{Release: &allotv1.ReleaseRequest{
		AgentId: agent, RequestId: id, Keys: keys, All: all}}})
	if err, ok := res.(error); ok {
		return nil, err
	}
	return res.(*allotv1.ReleaseResponse), nil
}

// persist returns the snapshot bytes of s.
func persist(t tb, s *State) []byte {
	t.Helper()
	snap, err := s.Snapshot()
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	defer snap.Release()
	var b bytes.Buffer
	if err := snap.Persist(&b); err != nil {
		t.Fatalf("Persist: %v", err)
	}
	return b.Bytes()
}

// restoreFixture returns a state restored from testdata/name, the
// snapshot file and the restored state.
func restoreFixture(t tb, name string) ([]byte, *State) {
	t.Helper()
	b, err := os.ReadFile("testdata/" + name)
	if err != nil {
		t.Fatalf("%v", err)
	}
	s := New(testConfig())
	if err := s.Restore(bytes.NewReader(b)); err != nil {
		t.Fatalf("Restore(%s): %v", name, err)
	}
	return b, s
}

// leasedEntry returns the entry of key h, decoded; false when h is not
// tracked or holds no entry.
func (c *core) leasedEntry(h uint64) (entry, bool) {
	var e entry
	i := c.tab.find(h)
	if i < 0 || c.tab.at(i).link == 0 {
		return e, false
	}
	c.loadEntry(&e, h, c.tab.at(i).link)
	return e, true
}

func keyHash(set *rules.Set, domain string, es []rules.Entry) uint64 {
	return rules.KeyHash(set.Match(domain, es), domain, es)
}

// applyCompactly applies cmd as a replica does when the leader writes
// compact entries: an Acquire batch as a compact entry, any other command
// as it is.
func applyCompactly(s *State, cmd *allotv1.Command) any {
	ab := cmd.GetAcquire()
	if ab == nil {
		return s.Apply(cmd)
	}
	res, err := s.ApplyCompact(compactEntry(cmd.GetNowUnixNanos(), ab.GetRequests()...))
	if err != nil {
		return err
	}
	return res
}

// compactEntry encodes reqs as one compact entry stamped now.
func compactEntry(now int64, reqs ...*allotv1.AcquireRequest) []byte {
	recs := make([][]byte, len(reqs))
	for i, r := range reqs {
		recs[i] = AppendAcquireRecord(nil, r)
	}
	return AppendAcquireEntry(nil, now, recs)
}
