package allocator

import (
	"bytes"
	"math"
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/allocator/state"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const fuzzRules = `domain: f
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 10, burst: 20}
  - key: g
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: gcra}
  - key: w
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_window}
  - key: blocked
    rate_limit: {unit: minute, requests_per_unit: 0}
`

// FuzzFSMApply feeds arbitrary log entries to the FSM, the way a buggy or
// malicious leader could. Entries that do not decode, or carry an unknown
// command, panic by design (drifting replicas are worse than a crash, tested
// in unit_test.go) and are skipped here; everything else must apply without
// panicking, and the state must still snapshot and restore byte-identically.
// Each entry is applied to a state with static shares off and to one with
// them on (docs/static-shares.md).
func FuzzFSMApply(f *testing.F) {
	seed := func(c *allotv1.Command) {
		b, err := proto.Marshal(c)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	ka := func(k, v string, want, held, ret, charged int64) *allotv1.KeyAcquire {
		return &allotv1.KeyAcquire{Domain: "f", Entries: []*allotv1.Entry{{Key: k, Value: v}},
			Want: want, Held: held, Returned: ret, Charged: charged, Demand: float64(want)}
	}
	t0 := fuzzT0
	seed(&allotv1.Command{NowUnixNanos: t0, Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{Requests: []*allotv1.AcquireRequest{
		{AgentId: "a", RequestId: 1, Keys: []*allotv1.KeyAcquire{ka("k", "x", 5, 0, 0, 1), ka("g", "y", 3, 0, 0, 0), ka("blocked", "z", 1, 0, 0, 0)}},
		{AgentId: "b", RequestId: 1, Keys: []*allotv1.KeyAcquire{ka("w", "x", 50, 2, 1, 0)}}}}}})
	seed(&allotv1.Command{NowUnixNanos: t0 + 1e9, Cmd: &allotv1.Command_Release{Release: &allotv1.ReleaseRequest{AgentId: "a", RequestId: 2, All: true}}})
	seed(&allotv1.Command{NowUnixNanos: t0 + 2e9, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{}}})
	for _, last := range []int64{-1, (t0/1e9 + 1) << 6, math.MaxInt64} { // budgeted, unbudgeted
		seed(&allotv1.Command{NowUnixNanos: t0 + 12e9, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{MaxEntries: 2, LastUnit: last}}})
		seed(&allotv1.Command{NowUnixNanos: t0 + 12e9, Cmd: &allotv1.Command_Expire{Expire: &allotv1.ExpireCommand{LastUnit: last}}})
	}
	seed(&allotv1.Command{NowUnixNanos: t0, Cmd: &allotv1.Command_Check{Check: &allotv1.CheckRequest{Domain: "f", Hits: 2,
		Descriptors: []*allotv1.Descriptor{{Entries: []*allotv1.Entry{{Key: "k", Value: "x"}}}}}}})
	seed(&allotv1.Command{NowUnixNanos: t0, Cmd: &allotv1.Command_Member{Member: &allotv1.MemberCommand{Member: &allotv1.Member{Id: "n2", GrpcAddr: "127.0.0.1:1"}}}})
	seed(&allotv1.Command{NowUnixNanos: t0, Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{ReplaceAll: true,
		Files: []*allotv1.RuleFile{{Name: "bad.yaml", Yaml: []byte("domain: f\ndescriptors: [{key: k, rate_limit: {unit: parsec}}]")}}}}})
	// Static shares: a call that asks for them, promotes one key and
	// reports another; a change of the settings.
	promote, report := ka("k", "p", 2, 0, 0, 0), ka("g", "r", 0, 0, 0, 0)
	promote.Promote, promote.StaticLeft = true, 3
	report.StaticReport, report.StaticLeft = true, 1
	seed(&allotv1.Command{NowUnixNanos: t0, Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{Requests: []*allotv1.AcquireRequest{
		{AgentId: "a", RequestId: 1, StaticShares: true, HotVersion: 7, Keys: []*allotv1.KeyAcquire{promote, report, ka("k", "x", 1, 0, 0, 0)}}}}}})
	seed(&allotv1.Command{NowUnixNanos: t0, Cmd: &allotv1.Command_Static{Static: &allotv1.StaticCommand{Slots: 3, TtlMs: 1500}}})

	f.Fuzz(func(t *testing.T, data []byte) {
		cmd := new(allotv1.Command)
		if proto.Unmarshal(data, cmd) != nil || cmd.Cmd == nil {
			return // panics by design
		}
		if _, meta := cmd.Cmd.(*allotv1.Command_Meta); meta {
			return // the meta group's command: a data group panics on it by design, as on an unknown one
		}
		for _, static := range []bool{false, true} {
			fuzzApply(t, data, static)
		}
	})
}

// fuzzT0 is the seeds' time, and that of the leases fuzzApply grants first.
const fuzzT0 = int64(1_800_000_000_000_000_000)

// fuzzApply applies the fuzzed entry data twice to a fresh state with the
// fuzz rules (and, with static, static shares on: 4 slots, 2 s) and a few
// leases granted at fuzzT0 (so that an Expire has wheel entries to take),
// and checks that the state snapshots and restores byte-identically.
func fuzzApply(t *testing.T, data []byte, static bool) {
	st := state.New(state.DefaultConfig())
	m := &fsm{st: st}
	put, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: 1, Cmd: &allotv1.Command_PutRules{PutRules: &allotv1.PutRulesRequest{
		ReplaceAll: true, Files: []*allotv1.RuleFile{{Name: "f.yaml", Yaml: []byte(fuzzRules)}}}}})
	if res, ok := m.Apply(&raft.Log{Type: raft.LogCommand, Index: 1, Data: put}).(error); ok {
		t.Fatalf("rules: %v", res)
	}
	next := uint64(2)
	if static {
		on, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: 1, Cmd: &allotv1.Command_Static{Static: &allotv1.StaticCommand{Slots: 4, TtlMs: 2000}}})
		if res, ok := m.Apply(&raft.Log{Type: raft.LogCommand, Index: next, Data: on}).(error); ok {
			t.Fatalf("static shares: %v", res)
		}
		next++
	}
	lease, _ := proto.Marshal(&allotv1.Command{NowUnixNanos: fuzzT0, Cmd: &allotv1.Command_Acquire{Acquire: &allotv1.AcquireBatch{Requests: []*allotv1.AcquireRequest{
		{AgentId: "fuzz-lessee", RequestId: 1, Keys: []*allotv1.KeyAcquire{
			{Domain: "f", Entries: []*allotv1.Entry{{Key: "k", Value: "l1"}}, Want: 2, Demand: 2},
			{Domain: "f", Entries: []*allotv1.Entry{{Key: "g", Value: "l2"}}, Want: 1, Demand: 1}}}}}}})
	m.Apply(&raft.Log{Type: raft.LogCommand, Index: next, Data: lease})
	next++
	// Twice: the second application exercises replays and stale ids.
	for i := next; i < next+2; i++ {
		m.Apply(&raft.Log{Type: raft.LogCommand, Index: i, Data: data})
	}
	a := snapshotBytes(t, st, "")
	st2 := state.New(state.DefaultConfig())
	if err := st2.Restore(bytes.NewReader(a)); err != nil {
		t.Fatalf("Restore of a fresh snapshot: %v", err)
	}
	b := snapshotBytes(t, st2, " after Restore")
	if !bytes.Equal(a, b) {
		t.Fatalf("snapshot after Restore differs (%d vs %d bytes)", len(a), len(b))
	}
}

// snapshotBytes returns st's snapshot as Persist writes it; when names the
// step in failures.
func snapshotBytes(t *testing.T, st *state.State, when string) []byte {
	t.Helper()
	snap, err := st.Snapshot()
	if err != nil {
		t.Fatalf("Snapshot%s: %v", when, err)
	}
	defer snap.Release()
	var buf bytes.Buffer
	if err := snap.Persist(&buf); err != nil {
		t.Fatalf("Persist%s: %v", when, err)
	}
	return buf.Bytes()
}
