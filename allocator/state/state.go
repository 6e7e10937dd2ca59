package state

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Sentinel errors. The service maps them to gRPC codes; test with errors.Is.
var (
	// ErrInvalid: the request is malformed or out of bounds (InvalidArgument).
	ErrInvalid = errors.New("state: invalid request")
	// ErrStaleRequest: the request id is older than the agent's last one, or
	// reuses the last id for a different call (FailedPrecondition / Aborted).
	ErrStaleRequest = errors.New("state: stale request id")
	// ErrUnknownAgent: an admin query names an agent the state does not know
	// (NotFound).
	ErrUnknownAgent = errors.New("state: unknown agent")
	// ErrFailedPrecondition: a conditional PutRules saw another version
	// (FailedPrecondition).
	ErrFailedPrecondition = errors.New("state: failed precondition")
	// ErrUnknownCommand: the command type is not known to this binary and is
	// not flagged ignore_if_unknown. The raft adapter must stop the node on
	// it: a replica that skips a command it does not understand drifts.
	ErrUnknownCommand = errors.New("state: unknown command")
	// ErrCorruptSnapshot: Restore was given bytes that are not a complete,
	// consistent snapshot. The state is left unchanged.
	ErrCorruptSnapshot = errors.New("state: corrupt snapshot")
)

// Config holds the lease policy parameters. Every replica must use the same
// values: they decide grants.
type Config struct {
	// LeaseTTL is the lease lifetime of a busy or contended key (default
	// 10s). Cold keys get longer leases, up to MaxLeaseTTL.
	LeaseTTL time.Duration
	// MaxLeaseTTL bounds the lease of a cold key (default 60s; at least
	// LeaseTTL).
	MaxLeaseTTL time.Duration
	// RefreshInterval is the period a grant is sized for: an agent's grant
	// covers its demand for one refresh interval (default 1s).
	RefreshInterval time.Duration
	// AgentTTL: an agent not heard from for this long is forgotten at the
	// next Expire and its leases end (default 2m; at least MaxLeaseTTL).
	AgentTTL time.Duration
	// SweepSegments: each Expire checks 1/SweepSegments of the hash space
	// for full, lease-less keys to drop (default 256: at 5M keys
	// an Expire checks ~20k keys, ~1.3 ms, and a full pass takes 256
	// Expires; a power of two).
	SweepSegments int
	// PackedGrants: Acquire answers, the recorded ones included, carry
	// their grants packed (AcquireResponse.packed_grants and limits,
	// proto/allot/v1/packed.go) instead of one KeyGrant message per key,
	// so that a replica builds no message per key and the allocator sends
	// agents the grants as applied. Read them with allotv1.GrantsOf.
	// Replicas of one cluster share the setting.
	PackedGrants bool
	// Regional: this cluster is a region of a global cluster, and sub-grants
	// its keys under scope: global rules only from what it holds of them
	// (upstream.go). Every replica must use the same value.
	Regional bool
}

// DefaultConfig returns the defaults documented on Config.
func DefaultConfig() Config {
	return Config{
		LeaseTTL:        10 * time.Second,
		MaxLeaseTTL:     60 * time.Second,
		RefreshInterval: time.Second,
		AgentTTL:        2 * time.Minute,
		SweepSegments:   256,
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	switch {
	case c.RefreshInterval < time.Millisecond:
		return fmt.Errorf("state: RefreshInterval %v must be ≥ 1ms", c.RefreshInterval)
	case c.LeaseTTL < c.RefreshInterval:
		return fmt.Errorf("state: LeaseTTL %v must be ≥ RefreshInterval %v", c.LeaseTTL, c.RefreshInterval)
	case c.MaxLeaseTTL < c.LeaseTTL:
		return fmt.Errorf("state: MaxLeaseTTL %v must be ≥ LeaseTTL %v", c.MaxLeaseTTL, c.LeaseTTL)
	case c.AgentTTL < c.MaxLeaseTTL:
		return fmt.Errorf("state: AgentTTL %v must be ≥ MaxLeaseTTL %v", c.AgentTTL, c.MaxLeaseTTL)
	case c.SweepSegments < 1 || c.SweepSegments > 1<<16 || c.SweepSegments&(c.SweepSegments-1) != 0:
		return fmt.Errorf("state: SweepSegments %d must be a power of two in [1, 65536]", c.SweepSegments)
	}
	return nil
}

// withDefaults fills zero fields from DefaultConfig.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.LeaseTTL == 0 {
		c.LeaseTTL = d.LeaseTTL
	}
	if c.MaxLeaseTTL == 0 {
		c.MaxLeaseTTL = max(d.MaxLeaseTTL, c.LeaseTTL)
	}
	if c.RefreshInterval == 0 {
		c.RefreshInterval = min(d.RefreshInterval, c.LeaseTTL)
	}
	if c.AgentTTL == 0 {
		c.AgentTTL = max(d.AgentTTL, c.MaxLeaseTTL)
	}
	if c.SweepSegments == 0 {
		c.SweepSegments = d.SweepSegments
	}
	return c
}

// Stats is a cheap summary for metrics and ClusterStatus.
type Stats struct {
	Keys         uint64 // tracked keys (limiter states)
	Leases       uint64 // live leases
	Agents       uint32 // known agents (forgotten after AgentTTL)
	RulesVersion uint64
	LastApplied  int64 // the last applied command time, Unix nanoseconds
	// ExpireBacklog is how many expiry-wheel entries (leased keys with a
	// lease due) the last Expire left for the next one because its
	// MaxEntries budget ran out or its LastUnit stopped it. Not replicated
	// state: 0 after a restore.
	ExpireBacklog uint64
	// Static shares (static.go): the keys in the hot-key set, the slots
	// held, and the transitions that began less than a static TTL ago.
	HotKeys           uint64
	StaticSlotsHeld   uint32
	StaticTransitions uint64
}

// AcquireBatchResult is Apply's result for an AcquireBatch: one entry per
// request, in order. Exactly one of Responses[i] and Errs[i] is non-nil.
type AcquireBatchResult struct {
	Responses []*allotv1.AcquireResponse
	Errs      []error
	// Granted, Returned and Charged sum the tokens granted, handed back
	// and charged over the batch's applied calls (metrics).
	Granted, Returned, Charged int64
}

// State is the allocator's replicated state. See the package doc.
type State struct {
	cfg Config

	// mu guards every field below. Apply and Restore hold it for writing,
	// the read APIs for reading.
	mu sync.RWMutex
	st *core

	// live counts unreleased Snapshots; while > 0, mutations copy shared
	// chunks and records first (copy-on-write).
	live int
}

// core is the whole replicated state. Restore builds a fresh core and swaps
// it in.
type core struct {
	cfg Config

	now          int64 // last applied command time (monotone), Unix ns
	rules        *rules.Set
	rulesUpdated int64 // Unix ms of the last PutRules
	limitMsgs    []*allotv1.Limit

	lims limits
	tab  table
	// The leased keys' entries (rates, leases, key) live in the arena, named
	// by their slots' links; tpls interns their key templates and codec
	// holds the few escaped leases (entry.go).
	ar    arena
	tpls  templates
	codec leaseCodec
	// old is the arena a compaction is emptying (nil when none);
	// compactFrom is its hash cursor (leases.go).
	old           *arena
	compactFrom   uint64
	compactBudget int   // compactBudget; tests lower it
	compactAt     int64 // the time of the last compaction step (compactQuota)
	compactAlways bool  // tests: compact whenever none is running
	// agents by id; byNum indexes the same records by their number.
	agents    map[string]*agentRec
	byNum     map[uint32]*agentRec
	nextAgent uint32
	members   map[string]*allotv1.Member
	leases    uint64 // live lease count
	sweepSeg  uint32 // next Expire sweep segment
	// expireLeft is the due wheel entries the last Expire left (a metric:
	// derived, not snapshotted, never read by a decision).
	expireLeft int

	wheel wheel // lease expiry index; not persisted: rebuilt on Restore

	// modes is each slot's mode (slots.go); nil: every slot served.
	// Replaced, never mutated, so snapshots may share it.
	modes *slotModes
	// slotFence is the highest fence of the slot entries applied
	// (slotentry.go); 0: none.
	slotFence uint64

	// The regional ledger (upstream.go): pools by key hash, and the last
	// upstream call.
	pools map[uint64]*pool
	up    upLedger

	// gen is the copy-on-write generation: records and chunks stamped with
	// an older generation are shared with a live snapshot.
	gen uint32
	cow bool // a snapshot is live: copy before writing shared records
	scr scratch

	// shares holds the share each lease granted with want_share was
	// last issued, milli-tokens/s (shares.go); nil until one is. Last,
	// so that the fields the grants read keep their places.
	shares map[extKey]int64
	// static is the static shares' state (static.go); nil: off.
	static *staticState
}

// scratch holds reusable buffers for Apply (serialised by the lock).
type scratch struct {
	entries []rules.Entry
	descs   [][]rules.Entry
	matched []*rules.Rule
	key     []byte
	needs   []needEnt
	e       entry
	tpl     []byte
	val     []byte
	call    call
	ents    []rules.Entry
	ends    []int
	keys    []byte
	packed  []byte           // an Acquire's packed grants, as built
	shrunk  []byte           // storeShrunk's entry, encoded aside
	limits  []*allotv1.Limit // and their limit table
	grant   allotv1.KeyGrant // the grant being packed
	hashes  []uint64         // a call's key hashes, for table.touch
	hkeys   []byte           // and its canonical keys (keyArgs.key)
}

// New returns an empty State. Zero fields of cfg take their defaults; an
// invalid cfg is clamped by New (call Config.Validate to reject it instead).
func New(cfg Config) *State {
	cfg = cfg.withDefaults()
	if cfg.Validate() != nil {
		cfg = clampConfig(cfg)
	}
	return &State{cfg: cfg, st: newCore(cfg)}
}

func clampConfig(c Config) Config {
	c.RefreshInterval = max(c.RefreshInterval, time.Millisecond)
	c.LeaseTTL = max(c.LeaseTTL, c.RefreshInterval)
	c.MaxLeaseTTL = max(c.MaxLeaseTTL, c.LeaseTTL)
	c.AgentTTL = max(c.AgentTTL, c.MaxLeaseTTL)
	if c.SweepSegments < 1 || c.SweepSegments > 1<<16 || c.SweepSegments&(c.SweepSegments-1) != 0 {
		c.SweepSegments = DefaultConfig().SweepSegments
	}
	return c
}

func newCore(cfg Config) *core {
	c := &core{
		cfg:       cfg,
		codec:     leaseCodec{unit: expUnitFor(cfg)},
		agents:    make(map[string]*agentRec),
		byNum:     make(map[uint32]*agentRec),
		members:   make(map[string]*allotv1.Member),
		nextAgent: 1,
	}
	c.lims.init()
	c.tab.init(minTableCap)
	c.ar.init(0)
	c.compactBudget = compactBudget
	c.tpls.init()
	c.wheel.init()
	return c
}

// Config returns the configuration in effect (defaults filled in).
func (s *State) Config() Config { return s.cfg }

// Apply applies one committed command at time max(cmd.NowUnixNanos, the
// last applied time) and returns its result:
//
//	acquire   → *AcquireBatchResult
//	release   → *allotv1.ReleaseResponse or error
//	put_rules → *allotv1.PutRulesResponse or error
//	check     → *allotv1.CheckResponse or error
//	expire    → nil
//	member    → nil or error
//	static    → nil or error
//
// An unknown command type returns nil when cmd.IgnoreIfUnknown, else an
// error wrapping ErrUnknownCommand. A nil cmd is ErrInvalid.
func (s *State) Apply(cmd *allotv1.Command) any {
	if cmd == nil {
		return fmt.Errorf("%w: nil command", ErrInvalid)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.st
	c.cow = s.live > 0
	c.tab.grown = false
	now := max(cmd.GetNowUnixNanos(), c.now)
	switch x := cmd.GetCmd().(type) {
	case *allotv1.Command_Acquire:
		return c.applyAcquireBatch(x.Acquire, now)
	case *allotv1.Command_Release:
		resp, err := c.applyRelease(x.Release, now)
		if err != nil {
			return err
		}
		return resp
	case *allotv1.Command_PutRules:
		resp, err := c.applyPutRules(x.PutRules, now)
		if err != nil {
			return err
		}
		return resp
	case *allotv1.Command_Expire:
		c.applyExpire(x.Expire, now)
		return nil
	case *allotv1.Command_Member:
		return c.applyMember(x.Member, now)
	case *allotv1.Command_Check:
		resp, err := c.applyCheck(x.Check, now)
		if err != nil {
			return err
		}
		return resp
	case *allotv1.Command_Static:
		return c.applyStatic(x.Static, now)
	}
	if cmd.GetIgnoreIfUnknown() {
		return nil
	}
	return fmt.Errorf("%w: %T", ErrUnknownCommand, cmd.GetCmd())
}

// ApplyCompact applies a compact Acquire entry (see IsCompactEntry) at
// time max(its stamp, the last applied time) and returns its
// *AcquireBatchResult, or an error: one wrapping ErrUnknownCommand for a
// version this binary does not know, another for an entry that does not
// decode (after applying the calls before the malformed one). On an error
// the raft adapter must stop the node.
func (s *State) ApplyCompact(data []byte) (*AcquireBatchResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.st
	c.cow = s.live > 0
	c.tab.grown = false
	// One copy of the entry: the calls' strings are its substrings.
	return c.applyCompact(string(data), c.now)
}

// Rules returns the current rule set (nil before the first PutRules; a nil
// *rules.Set matches nothing).
func (s *State) Rules() *rules.Set {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.st.rules
}

// RuleSet returns the current rules in wire form, for WatchRules/GetRules.
func (s *State) RuleSet() *allotv1.RuleSet {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.st.ruleSetMsg()
}

func (c *core) ruleSetMsg() *allotv1.RuleSet {
	rs := &allotv1.RuleSet{Version: c.rulesVersion(), UpdatedUnixMs: c.rulesUpdated}
	if c.rules != nil {
		for _, f := range c.rules.Files() {
			rs.Files = append(rs.Files, &allotv1.RuleFile{Name: f.Name, Domain: f.Domain, Yaml: f.Source})
		}
	}
	return rs
}

func (c *core) rulesVersion() uint64 {
	if c.rules == nil {
		return 0
	}
	return c.rules.Version()
}

// Stats returns counters for metrics and ClusterStatus.
func (s *State) Stats() Stats {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	st := Stats{
		Keys:          uint64(c.tab.n),
		Leases:        c.leases,
		Agents:        uint32(len(c.agents)),
		RulesVersion:  c.rulesVersion(),
		LastApplied:   c.now,
		ExpireBacklog: uint64(c.expireLeft),
	}
	if ss := c.static; ss != nil {
		st.HotKeys = uint64(len(ss.hot))
		st.StaticSlotsHeld = uint32(len(ss.holders))
		st.StaticTransitions = uint64(ss.transitions(c.now))
	}
	return st
}

// Members returns the recorded cluster members, sorted by id. The messages
// are copies.
func (s *State) Members() []*allotv1.Member {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*allotv1.Member, 0, len(s.st.members))
	for _, m := range s.st.members {
		out = append(out, cloneMember(m))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out
}

func cloneMember(m *allotv1.Member) *allotv1.Member {
	return &allotv1.Member{Id: m.Id, RaftAddr: m.RaftAddr, GrpcAddr: m.GrpcAddr, HttpAddr: m.HttpAddr,
		Role: m.Role, Suffrage: m.Suffrage}
}

func (c *core) applyMember(mc *allotv1.MemberCommand, now int64) error {
	m := mc.GetMember()
	if m == nil || m.Id == "" {
		return fmt.Errorf("%w: member command without a member id", ErrInvalid)
	}
	if len(m.Id) > maxAgentID || len(m.RaftAddr)+len(m.GrpcAddr)+len(m.HttpAddr)+len(m.Role)+len(m.Suffrage) > maxKeyBytes {
		return fmt.Errorf("%w: member fields too long", ErrInvalid)
	}
	c.now = now
	if mc.GetRemove() {
		delete(c.members, m.Id)
		return nil
	}
	// Members are replaced, never mutated, so snapshots may share them.
	c.members[m.Id] = cloneMember(m)
	return nil
}

// ms converts a duration to whole milliseconds, rounding up (a client told
// to wait must not come back early).
func ms(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	n := int64(d / time.Millisecond)
	if d%time.Millisecond != 0 {
		n++
	}
	return n
}
