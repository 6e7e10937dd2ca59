package state

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// The regional ledger. On a regional cluster (Config.Regional), a key
// under a scope: global rule is sub-granted to gateways only from its pool:
// the tokens the region leased from the global cluster or, while it is cut
// off from it, minted at its fallback share. The ledger records, through
// committed upstream entries, what the region holds of each global key and
// the region's last upstream call, so that a new regional leader neither
// loses what the region holds nor has a grant counted twice:
//
//   - the leader commits a send before it makes an upstream call (the call's
//     request id is the ledger's next sequence number, and the tokens it
//     hands back leave the pools then);
//   - it commits a grant when the call is answered: the pools take the
//     granted tokens only if the grant answers the pending send, and the
//     outage charge of a key the global cluster did not serve (MOVED) is
//     owed again, as after a fail;
//   - a new leader finds an unanswered send pending and makes the same
//     call again, with the same request id: the global cluster answers a
//     repeated request id with its recorded answer, so a grant made to the
//     previous leader reaches the pools once;
//   - it commits a fail when a call is given up (it failed, or it was not
//     answered): the outage charges the send took out of the pools are
//     owed again, for a later call to report, and the send is no longer
//     pending;
//   - it commits a forget for pools of keys that are idle (upstream.Key.Idle)
//     and hold nothing, owe nothing and are owed nothing: such a pool is
//     dropped unless one of its gateways holds an unexpired lease, and a
//     gateway that uses the key again starts an empty one.
//
// Invariant: the tokens a region sub-grants from a pool, less those
// returned to it, never exceed what the pool received from the global
// cluster plus what it minted, less what it handed back. Tokens gateways
// admit from their own fallback buckets and charge are taken from the
// pool too, into debt when it holds too few, and so are the tokens a send
// hands back; a debt is paid first out of
// what the pool receives next (a mint may keep part of what it mints for
// the gateways, see UpstreamMint.Keep, and pay the debt with the rest), so
// over any span the region admits what it received and minted plus its
// debt at the end of the span.
//
// Upstream entries are compact log entries of their own:
//
//	entry  0x01, version (1 or 2), uvarint now (Unix ns), op, op's fields
//	send   op 1: uvarint seq, str request (an encoded AcquireRequest),
//	       uvarint n, n × (fixed64 key hash, varint returned, varint charged)
//	grant  op 2: uvarint seq, uvarint n, n × (fixed64 key hash, varint granted,
//	       fixed64 share as float64 bits[, global limit][, varint owed again])
//	mint   op 3: uvarint n, n × (fixed64 key hash, varint minted[, varint keep])
//	forget op 4 (version 3): uvarint n, n × fixed64 key hash
//	fail   op 5 (version 3): uvarint seq, uvarint n, n × (fixed64 key hash,
//	       varint charged)
//	global limit (grants of version 2 on): byte 0 (none) or 1, then byte
//	       unit, byte algorithm, uvarint requests_per_unit, varint burst,
//	       uvarint the global cluster's rules version
//	owed again (grants of version 4 only): of the send's outage charge
//	       for the key, what is owed again (UpstreamGrant.Owed)
//
// Grants are written as version 2 (they carry the global cluster's limit
// of each key), or as version 4 when a key's outage charge is owed again
// (the global cluster did not serve the key); mints as version 1 unless a key keeps part of its mint
// from the debt (then version 2, with keep); sends, forgets and fails as
// version 3. A send of version 3 hands back all it says: what a pool no
// longer holds when it applies (its gateways were granted it after the
// leader read the pool, and the global cluster credits it all the same)
// becomes the pool's debt, repaid out of what it receives next; one of
// an earlier version hands back at most what the pool holds. A node
// stops at an entry of a version it does not know with an "upgrade this
// node" error, so a regional cluster is upgraded followers first.
const (
	upstreamMarker    = 0x01
	upstreamVersion   = 1
	upstreamVersionV2 = 2 // grants carry the global limit; mints what they keep
	upstreamVersionV3 = 3 // forgets and fails; a send's return beyond the pool is its debt
	upstreamVersionV4 = 4 // grants that owe a key's outage charge again

	opSend   = 1
	opGrant  = 2
	opMint   = 3
	opForget = 4
	opFail   = 5
)

// poolRefresh: a gateway whose want a pool cut comes back after at most
// this, when the regional leader's next refill (or mint) may have landed.
// poolDebtRefresh replaces it while the region is cut off (it minted
// tokens it has not reported upstream yet) and the pool is in debt: its
// gateways' fallback buckets admitted beyond what the region held (each
// time a gateway's denial ends before its next answer, its fallback
// decides), and a cut-off region repays a debt only out of its fallback
// share; a longer denial keeps those fallback admissions rare. A connected
// region repays it from its next grant.
const (
	poolRefresh     = 50 * time.Millisecond
	poolDebtRefresh = 500 * time.Millisecond
)

// poolExhausted is the answer to a want a spent pool cut to nothing: the
// key is exhausted in this region until the regional leader's next refill
// (or mint), so the gateway denies rather than deciding on its own.
func poolExhausted(p *pool, capacity int64) (allotv1.KeyStatus, time.Duration) {
	return allotv1.KeyStatus_KEY_STATUS_EXHAUSTED, p.retry(capacity)
}

// retry is how long a gateway whose want the pool cut waits: the long
// wait once the debt of a cut-off region exceeds a tenth of the key's
// capacity per refresh interval (a debt of a few tokens is the ordinary
// rounding of gateways' asks, not a run of fallback admissions), unless
// the region's last mint kept part of itself for the gateways: its pool
// then receives tokens for them every tick, and a gateway away for 500 ms
// would leave them unspent.
func (p *pool) retry(capacity int64) time.Duration {
	if p.owed > 0 && p.debt > max(capacity/10, 1) && !p.keeping {
		return poolDebtRefresh
	}
	return poolRefresh
}

// pool is what a region holds of one global key.
type pool struct {
	key    string // canonical
	domain string
	ents   []rules.Entry
	avail  int64   // tokens held and not sub-granted
	share  float64 // tokens/s: the fair share the leader computed at the last grant
	// Totals.
	received, returned, minted int64
	// owed: minted tokens not yet reported upstream as outage_charged.
	owed int64
	// debt: tokens gateways admitted from their fallback buckets and
	// charged beyond what the pool held; paid first out of what the pool
	// receives next.
	debt int64
	// shortAt: the time of the last command whose want the pool cut (0:
	// none since this state was built). A hint for the regional leader's
	// policy (a region short of tokens sub-grants less than its demand,
	// which is no fall of demand); it changes no answer and is not in
	// snapshots.
	shortAt int64
	// keeping: the last mint kept part of itself from the debt for the
	// gateways (no grant since). A hint for the retry of a cut want, like
	// shortAt not in snapshots: a restored pool waits the long wait until
	// the next mint.
	keeping bool
	// global: the global cluster's limit of the key as its last recorded
	// answer carried it (nil until one did). It is the limit in force in
	// the region (limitIn): lim is it compiled, valid when limOK.
	global *GlobalLimit
	lim    bucket.Limit
	limOK  bool
	// msg: the wire Limit of the limit in force for msgRule (the region's
	// rule the message's name and path come from); built on the write
	// path only.
	msg     *allotv1.Limit
	msgRule *rules.Rule
}

// GlobalLimit is the global cluster's limit of a global key, as its answer
// to the region carried it.
type GlobalLimit struct {
	RequestsPerUnit uint32
	Unit            rules.Unit
	Burst           int64
	Algorithm       bucket.Algorithm
	RulesVersion    uint64 // the global cluster's rules version at that answer
}

// GlobalLimitOf returns the global limit a grant's Limit message carries,
// with the answer's rules version; false when it carries none this binary
// can apply (no message, unlimited, an unknown unit or algorithm).
func GlobalLimitOf(l *allotv1.Limit, rulesVersion uint64) (GlobalLimit, bool) {
	if l == nil || l.GetUnlimited() {
		return GlobalLimit{}, false
	}
	u, err := rules.ParseUnit(l.GetUnit())
	if err != nil {
		return GlobalLimit{}, false
	}
	alg := bucket.TokenBucket
	if l.GetAlgorithm() != "" {
		if alg, err = bucket.ParseAlgorithm(l.GetAlgorithm()); err != nil {
			return GlobalLimit{}, false
		}
	}
	g := GlobalLimit{RequestsPerUnit: l.GetRequestsPerUnit(), Unit: u, Burst: l.GetBurst(), Algorithm: alg, RulesVersion: rulesVersion}
	if _, err := g.limit(); err != nil {
		return GlobalLimit{}, false
	}
	return g, true
}

// limit compiles g.
func (g GlobalLimit) limit() (bucket.Limit, error) {
	return bucket.NewLimit(g.Algorithm, int64(g.RequestsPerUnit), g.Unit.Duration(), g.Burst)
}

// Same reports whether r (the region's copy of the rule) has g's rate,
// window, burst and algorithm.
func (g GlobalLimit) Same(r *rules.Rule) bool {
	return r != nil && !r.Unlimited && r.RequestsPerUnit == g.RequestsPerUnit && r.Window == g.Unit.Duration() &&
		(r.DenyAll && g.RequestsPerUnit == 0 || r.Burst == g.Burst && r.Algorithm == g.Algorithm)
}

// setGlobal records the global cluster's limit of the key (nil: none).
func (p *pool) setGlobal(g *GlobalLimit) {
	p.global, p.limOK, p.msg, p.msgRule = g, false, nil, nil
	if g != nil {
		l, err := g.limit()
		p.lim, p.limOK = l, err == nil
	}
}

// limitIn returns the limit in force for a key under rule with pool p
// (nil: none) and its wire message: on a regional cluster the global
// cluster's limit of a scope: global key, once an answer recorded it, in
// both directions (a region's copy tighter than the global one does not
// bound the region, a looser one does not widen it); otherwise the rule's.
// Called on the write path (it caches the message in the pool).
func (c *core) limitIn(rule *rules.Rule, p *pool) (bucket.Limit, *allotv1.Limit) {
	if p == nil || !p.limOK {
		return rule.Limit, c.limitMsgs[rule.ID]
	}
	if p.msgRule != rule || p.msg == nil {
		p.msg, p.msgRule = p.global.Msg(c.limitMsgs[rule.ID]), rule
	}
	return p.lim, p.msg
}

// limitChanged reports whether the tracked key h is under another limit
// than l.
func (c *core) limitChanged(h uint64, l bucket.Limit) bool {
	i := c.tab.find(h)
	return i >= 0 && c.lims.ents[c.tab.at(i).lim].key != keyOf(l)
}

// Msg returns the region's rule's message base with g's rate, window,
// burst and algorithm.
func (g *GlobalLimit) Msg(base *allotv1.Limit) *allotv1.Limit {
	m := proto.Clone(base).(*allotv1.Limit)
	m.RequestsPerUnit, m.Unit, m.WindowSeconds = g.RequestsPerUnit, g.Unit.String(), g.Unit.Seconds()
	m.Burst, m.Algorithm = g.Burst, g.Algorithm.String()
	return m
}

// credit adds n tokens to the pool, paying its debt first.
func (p *pool) credit(n int64) {
	p.creditKeeping(n, 0)
}

// creditKeeping adds n tokens to the pool: keep of them (at most n) are
// held for the gateways whatever the pool owes, the rest pays its debt
// first. A pool then holds tokens and a debt at once; the debt is paid
// out of what it receives next.
func (p *pool) creditKeeping(n, keep int64) {
	if n <= 0 {
		return
	}
	keep = min(max(keep, 0), n)
	paid := min(n-keep, p.debt)
	p.debt -= paid
	p.avail = sat(p.avail, n-paid)
}

// charge takes n tokens gateways admitted without a lease; what the pool
// does not hold becomes its debt.
func (p *pool) charge(n int64) {
	if n <= 0 {
		return
	}
	t := min(n, p.avail)
	p.avail -= t
	p.debt = sat(p.debt, n-t)
}

// upLedger is the region's upstream call record.
type upLedger struct {
	seq     uint64 // the last send's sequence number (its request id)
	pending string // the last send's encoded request while unanswered ("" none)
}

// IsUpstreamEntry reports whether a log entry's data is an upstream entry.
func IsUpstreamEntry(data []byte) bool { return len(data) > 0 && data[0] == upstreamMarker }

// UpstreamReturn is one key of an upstream send: what the call hands back
// and reports as charged.
type UpstreamReturn struct {
	Hash     uint64
	Returned int64 // tokens handed back upstream
	Charged  int64 // minted tokens reported as outage_charged
}

// UpstreamGrant is one key of an answered call.
type UpstreamGrant struct {
	Hash    uint64
	Granted int64
	Share   float64 // tokens/s, the fair share at this grant
	// Limit: the global cluster's limit of the key as the answer carried
	// it (nil: the answer carried none; what the pool recorded stays).
	Limit *GlobalLimit
	// Owed: of what the send reported of the key as outage_charged, the
	// tokens owed again: the global cluster answered the key without
	// serving it (KEY_STATUS_MOVED: a multi-group global cluster moving
	// its slot), so it charged nothing, and a later call reports them.
	Owed int64
}

// UpstreamMint is fallback tokens minted for one key while cut off (or
// while its call is overdue).
type UpstreamMint struct {
	Hash   uint64
	Minted int64
	// Keep: of Minted, the tokens held for the gateways even while the
	// pool is in debt (0: all of it pays the debt first). See
	// upstream.Key.Keep.
	Keep int64
}

func appendUpHeaderV(dst []byte, now int64, op, v byte) []byte {
	dst = append(dst, upstreamMarker, v)
	dst = binary.AppendUvarint(dst, uint64(now))
	return append(dst, op)
}

// AppendUpstreamSend appends a send entry: the call with request id seq,
// encoded as req, handing back and charging what keys say. What it hands
// back beyond what a pool holds when it applies becomes the pool's debt.
func AppendUpstreamSend(dst []byte, now int64, seq uint64, req []byte, keys []UpstreamReturn) []byte {
	dst = appendUpHeaderV(dst, now, opSend, upstreamVersionV3)
	dst = binary.AppendUvarint(dst, seq)
	dst = binary.AppendUvarint(dst, uint64(len(req)))
	dst = append(dst, req...)
	dst = binary.AppendUvarint(dst, uint64(len(keys)))
	for _, k := range keys {
		dst = binary.LittleEndian.AppendUint64(dst, k.Hash)
		dst = binary.AppendVarint(dst, k.Returned)
		dst = binary.AppendVarint(dst, k.Charged)
	}
	return dst
}

// AppendUpstreamGrant appends a grant entry answering the send seq. It is
// written as version 2 unless a key's outage charge is owed again (then
// version 4, with each key's UpstreamGrant.Owed).
func AppendUpstreamGrant(dst []byte, now int64, seq uint64, keys []UpstreamGrant) []byte {
	v := byte(upstreamVersionV2)
	for _, k := range keys {
		if k.Owed != 0 {
			v = upstreamVersionV4
		}
	}
	dst = appendUpHeaderV(dst, now, opGrant, v)
	dst = binary.AppendUvarint(dst, seq)
	dst = binary.AppendUvarint(dst, uint64(len(keys)))
	for _, k := range keys {
		dst = binary.LittleEndian.AppendUint64(dst, k.Hash)
		dst = binary.AppendVarint(dst, k.Granted)
		dst = binary.LittleEndian.AppendUint64(dst, math.Float64bits(k.Share))
		dst = appendGlobalLimit(dst, k.Limit)
		if v == upstreamVersionV4 {
			dst = binary.AppendVarint(dst, k.Owed)
		}
	}
	return dst
}

// appendGlobalLimit appends a global limit (a grant's, a pool's in the
// ledger): byte 0 for none, or 1 and its fields.
func appendGlobalLimit(dst []byte, g *GlobalLimit) []byte {
	if g == nil {
		return append(dst, 0)
	}
	dst = append(dst, 1, byte(g.Unit), byte(g.Algorithm))
	dst = binary.AppendUvarint(dst, uint64(g.RequestsPerUnit))
	dst = binary.AppendVarint(dst, g.Burst)
	return binary.AppendUvarint(dst, g.RulesVersion)
}

// readGlobalLimit reads what appendGlobalLimit wrote. A limit that does
// not compile is an error of d's.
func readGlobalLimit(d *allotv1.Reader) *GlobalLimit {
	switch d.Byte() {
	case 0:
		return nil
	case 1:
	default:
		d.Fail()
		return nil
	}
	g := &GlobalLimit{Unit: rules.Unit(d.Byte()), Algorithm: bucket.Algorithm(d.Byte())}
	rpu := d.Uvarint()
	g.Burst = d.Varint()
	g.RulesVersion = d.Uvarint()
	if d.Err != nil {
		return nil
	}
	g.RequestsPerUnit = uint32(rpu)
	if rpu > math.MaxUint32 || g.Unit.Seconds() == 0 {
		d.Fail()
		return nil
	}
	if _, err := g.limit(); err != nil {
		d.Fail()
		return nil
	}
	return g
}

// AppendUpstreamMint appends a mint entry.
// It is written as version 1 unless a key keeps part of its mint.
func AppendUpstreamMint(dst []byte, now int64, keys []UpstreamMint) []byte {
	v := byte(upstreamVersion)
	for _, k := range keys {
		if k.Keep != 0 {
			v = upstreamVersionV2
		}
	}
	dst = appendUpHeaderV(dst, now, opMint, v)
	dst = binary.AppendUvarint(dst, uint64(len(keys)))
	for _, k := range keys {
		dst = binary.LittleEndian.AppendUint64(dst, k.Hash)
		dst = binary.AppendVarint(dst, k.Minted)
		if v == upstreamVersionV2 {
			dst = binary.AppendVarint(dst, k.Keep)
		}
	}
	return dst
}

// AppendUpstreamForget appends a forget entry: the pools of keys (by
// hash) that are dropped if, when it applies, they hold nothing, owe
// nothing, are owed nothing and no gateway holds an unexpired lease of
// the key.
func AppendUpstreamForget(dst []byte, now int64, hashes []uint64) []byte {
	dst = appendUpHeaderV(dst, now, opForget, upstreamVersionV3)
	dst = binary.AppendUvarint(dst, uint64(len(hashes)))
	for _, h := range hashes {
		dst = binary.LittleEndian.AppendUint64(dst, h)
	}
	return dst
}

// AppendUpstreamFail appends a fail entry: the send seq is given up, and
// what it reported of each key as outage_charged (UpstreamReturn.Charged)
// is owed again. The tokens it handed back stay handed back: the global
// cluster may have applied the call.
func AppendUpstreamFail(dst []byte, now int64, seq uint64, keys []UpstreamReturn) []byte {
	dst = appendUpHeaderV(dst, now, opFail, upstreamVersionV3)
	dst = binary.AppendUvarint(dst, seq)
	dst = binary.AppendUvarint(dst, uint64(len(keys)))
	for _, k := range keys {
		dst = binary.LittleEndian.AppendUint64(dst, k.Hash)
		dst = binary.AppendVarint(dst, k.Charged)
	}
	return dst
}

// errUpstream: an upstream entry does not decode.
var errUpstream = errors.New("state: upstream entry does not decode")

// UpstreamResult is ApplyUpstream's result.
type UpstreamResult struct {
	// Applied is false for a grant or a fail that does not answer the
	// pending send, and a send older than the last (it changed nothing).
	Applied bool
}

// ApplyUpstream applies an upstream entry (see IsUpstreamEntry). An error
// wraps ErrUnknownCommand for a version this binary does not know; any
// other error is an entry that does not decode, and changed nothing. On
// an error the raft adapter must stop the node.
func (s *State) ApplyUpstream(data []byte) (UpstreamResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.applyUpstream(string(data))
}

type upKey struct {
	hash   uint64
	a, b   int64
	fshare float64
	glim   *GlobalLimit
}

func (c *core) applyUpstream(s string) (UpstreamResult, error) {
	if len(s) < 3 || s[0] != upstreamMarker {
		return UpstreamResult{}, fmt.Errorf("%w: no marker", errUpstream)
	}
	if s[1] < upstreamVersion || s[1] > upstreamVersionV4 {
		return UpstreamResult{}, fmt.Errorf("%w: upstream entry version %d is not known to this binary", ErrUnknownCommand, s[1])
	}
	v2, v3, v4 := s[1] >= upstreamVersionV2, s[1] >= upstreamVersionV3, s[1] >= upstreamVersionV4
	d := &allotv1.Reader{S: s, P: 2, Base: errUpstream}
	now := max(int64(d.Uvarint()), c.now)
	op := d.Byte()
	if ((op == opForget || op == opFail) && !v3) || (v4 && op != opGrant) {
		return UpstreamResult{}, fmt.Errorf("%w: op %d in a version %d entry", errUpstream, op, s[1])
	}
	var seq uint64
	var req string
	if op == opSend || op == opGrant || op == opFail {
		seq = d.Uvarint()
	}
	if op == opSend {
		req = d.Str()
	}
	n := d.Uvarint()
	if d.Err != nil || n > uint64(len(s)) {
		return UpstreamResult{}, fmt.Errorf("%w: header", errUpstream)
	}
	// Decode everything before changing anything.
	keys := make([]upKey, n)
	for i := range keys {
		k := &keys[i]
		k.hash = d.Fixed64()
		switch op {
		case opSend:
			k.a, k.b = d.Varint(), d.Varint()
		case opGrant:
			k.a = d.Varint()
			k.fshare = math.Float64frombits(d.Fixed64())
			if v2 {
				k.glim = readGlobalLimit(d)
			}
			if v4 {
				k.b = d.Varint()
			}
		case opMint:
			k.a = d.Varint()
			if v2 {
				k.b = d.Varint()
			}
		case opForget:
		case opFail:
			k.b = d.Varint()
		default:
			return UpstreamResult{}, fmt.Errorf("%w: unknown op %d", errUpstream, op)
		}
	}
	if d.Err != nil {
		return UpstreamResult{}, fmt.Errorf("%w: %v", errUpstream, d.Err)
	}
	if d.P != len(s) {
		return UpstreamResult{}, fmt.Errorf("%w: %d trailing bytes", errUpstream, len(s)-d.P)
	}
	c.now = now
	switch op {
	case opSend:
		if seq <= c.up.seq {
			return UpstreamResult{}, nil // a send from a deposed leader's term
		}
		c.up.seq, c.up.pending = seq, req
		for _, k := range keys {
			if p := c.pools[k.hash]; p != nil {
				r := max(k.a, 0)
				if !v3 {
					r = min(r, p.avail)
				}
				p.charge(r)
				p.returned = sat(p.returned, r)
				p.owed -= min(max(k.b, 0), p.owed)
			}
		}
	case opGrant:
		if c.up.pending == "" || seq != c.up.seq {
			return UpstreamResult{}, nil
		}
		c.up.pending = ""
		for _, k := range keys {
			p := c.pools[k.hash]
			if p == nil {
				continue
			}
			p.keeping = false
			if k.glim != nil {
				p.setGlobal(k.glim)
			}
			if k.a > 0 {
				p.credit(k.a)
				p.received = sat(p.received, k.a)
				if k.fshare >= 0 && !math.IsInf(k.fshare, 0) {
					p.share = k.fshare
				}
			}
			if k.b > 0 {
				p.owed = sat(p.owed, k.b)
			}
		}
	case opMint:
		for _, k := range keys {
			if p := c.pools[k.hash]; p != nil && k.a > 0 {
				p.creditKeeping(k.a, k.b)
				p.keeping = k.b > 0
				p.minted = sat(p.minted, k.a)
				p.owed = sat(p.owed, k.a)
			}
		}
	case opFail:
		if c.up.pending == "" || seq != c.up.seq {
			return UpstreamResult{}, nil
		}
		c.up.pending = ""
		for _, k := range keys {
			if p := c.pools[k.hash]; p != nil && k.b > 0 {
				p.owed = sat(p.owed, k.b)
			}
		}
	case opForget:
		var e entry
		for _, k := range keys {
			if p := c.pools[k.hash]; p != nil && p.avail == 0 && p.owed == 0 && p.debt == 0 {
				if n, _ := c.liveLeases(&e, k.hash, now); n == 0 {
					delete(c.pools, k.hash)
				}
			}
		}
	}
	return UpstreamResult{Applied: true}, nil
}

func sat(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// poolFor returns the pool of the key (canonical key in c.scr.key, hash h)
// under rule, creating it, or nil when the key is not sub-granted from a
// pool: the cluster is not regional, or the rule is not scope: global.
func (c *core) poolFor(rule *rules.Rule, h uint64, domain string, ents []rules.Entry) *pool {
	if !c.cfg.Regional || rule.Scope != rules.ScopeGlobal {
		return nil
	}
	if p := c.pools[h]; p != nil {
		return p
	}
	if c.pools == nil {
		c.pools = make(map[uint64]*pool)
	}
	p := &pool{key: string(c.scr.key), domain: strings.Clone(domain), ents: make([]rules.Entry, len(ents))}
	for i, e := range ents {
		p.ents[i] = rules.Entry{Key: strings.Clone(e.Key), Value: strings.Clone(e.Value)}
	}
	c.pools[h] = p
	return p
}

// takeFrom grants up to n tokens of a key from its bucket and, when it has
// a pool, at most what the pool holds. The bucket is under the limit in
// force (limitIn): once the global cluster's answer recorded its limit,
// that limit, so the pool (what the global cluster granted) decides.
func takeFrom(p *pool, lim bucket.Limit, st *bucket.State, now, n int64) int64 {
	if p != nil {
		n = min(n, p.avail)
	}
	n = lim.TakeUpTo(st, now, n)
	if p != nil {
		p.avail -= n
	}
	return n
}

// take removes up to n tokens from the pool (tokens a gateway's fallback
// admitted while the regional cluster was unreachable: paid from what the
// pool holds, never into debt, as the key's bucket pays them).
func (p *pool) take(n int64) {
	p.avail -= min(max(n, 0), p.avail)
}

// Pool is what a region holds of one global key, for the regional
// leader's upstream runner and for inspection.
type Pool struct {
	Hash    uint64
	Key     string
	Domain  string
	Entries []rules.Entry
	// Available: tokens held and not sub-granted.
	Available int64
	// Demand: the sum of the demand the key's live leases report, tokens/s.
	Demand float64
	// Share: the fair share at the last grant, tokens/s.
	Share                      float64
	Received, Returned, Minted int64
	// Owed: minted tokens not yet reported upstream.
	Owed int64
	// Debt: tokens gateways admitted from their fallback beyond what the
	// pool held, paid out of what it receives next.
	Debt int64
	// ShortAt: when the pool last cut a gateway's want (Unix ns; 0: not
	// since this node's state was built or restored).
	ShortAt int64
	// Global: the global cluster's limit of the key as its last recorded
	// answer carried it (nil until one did); the limit in force in the
	// region from then on.
	Global *GlobalLimit
	// Leases: the key's unexpired gateway leases.
	Leases int
}

// Pools returns the region's pools in key hash order (none unless
// Config.Regional), with each key's demand at now.
func (s *State) Pools(now int64) []Pool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	out := make([]Pool, 0, len(c.pools))
	var e entry
	for h, p := range c.pools {
		out = append(out, p.view(c, &e, h, now))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Hash < out[j].Hash })
	return out
}

// PoolOf returns the pool of the key with hash h, if any.
func (s *State) PoolOf(h uint64, now int64) (Pool, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	p := c.pools[h]
	if p == nil {
		return Pool{}, false
	}
	var e entry
	return p.view(c, &e, h, now), true
}

// view is p as a Pool (read lock held).
func (p *pool) view(c *core, e *entry, h uint64, now int64) Pool {
	n, d := c.liveLeases(e, h, now)
	return Pool{Hash: h, Key: p.key, Domain: p.domain, Entries: p.ents, Available: p.avail,
		Demand: d, Share: p.share, Received: p.received, Returned: p.returned,
		Minted: p.minted, Owed: p.owed, Debt: p.debt, Global: p.global, ShortAt: p.shortAt, Leases: n}
}

// liveLeases counts the key's unexpired leases and sums their demand
// (read lock held).
func (c *core) liveLeases(e *entry, h uint64, now int64) (n int, demand float64) {
	i := c.tab.find(h)
	if i < 0 || c.tab.at(i).link == 0 {
		return 0, 0
	}
	c.loadEntry(e, h, c.tab.at(i).link)
	for _, l := range e.leases {
		if l.expiry > now {
			n++
			demand += float64(l.demand)
		}
	}
	return n, demand
}

// PendingUpstream returns the last upstream send's sequence number and,
// while it is unanswered, its encoded request.
func (s *State) PendingUpstream() (seq uint64, req []byte) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.st.up.pending != "" {
		req = []byte(s.st.up.pending)
	}
	return s.st.up.seq, req
}

// encodeLedger encodes the regional ledger for a snapshot, in key hash
// order (nil when there is none), whether it is in format 2: each pool
// followed by its global limit (appendGlobalLimit), and whether a pool
// holds tokens and a debt at once (then it is in format 2). Format 1,
// with no limits, is written while no pool has recorded one.
func (c *core) encodeLedger() ([]byte, bool, bool) {
	if len(c.pools) == 0 && c.up.seq == 0 {
		return nil, false, false
	}
	limits, keep := false, false
	for _, p := range c.pools {
		limits = limits || p.global != nil
		keep = keep || (p.avail > 0 && p.debt > 0)
	}
	limits = limits || keep
	hs := make([]uint64, 0, len(c.pools))
	for h := range c.pools {
		hs = append(hs, h)
	}
	sort.Slice(hs, func(i, j int) bool { return hs[i] < hs[j] })
	b := binary.AppendUvarint(nil, c.up.seq)
	b = appendStr(b, c.up.pending)
	b = binary.AppendUvarint(b, uint64(len(hs)))
	for _, h := range hs {
		p := c.pools[h]
		b = binary.LittleEndian.AppendUint64(b, h)
		b = appendStr(b, p.key)
		b = appendStr(b, p.domain)
		b = binary.AppendUvarint(b, uint64(len(p.ents)))
		for _, e := range p.ents {
			b = appendStr(b, e.Key)
			b = appendStr(b, e.Value)
		}
		for _, v := range [...]int64{p.avail, p.received, p.returned, p.minted, p.owed, p.debt} {
			b = binary.AppendVarint(b, v)
		}
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(p.share))
		if limits {
			b = appendGlobalLimit(b, p.global)
		}
	}
	return b, limits, keep
}

// decodeLedger restores the regional ledger from a snapshot, in format 2
// (each pool with its global limit) when limits; a pool may hold tokens
// and a debt at once only when keep.
func (c *core) decodeLedger(b []byte, limits, keep bool) error {
	d := &allotv1.Reader{S: string(b), Base: ErrCorruptSnapshot}
	c.up.seq = d.Uvarint()
	c.up.pending = d.Str()
	n := d.Uvarint()
	if d.Err != nil || n > uint64(len(b)) {
		return corrupt("regional ledger header")
	}
	c.pools = make(map[uint64]*pool, n)
	var prev uint64
	for i := range n {
		h := d.Fixed64()
		p := &pool{key: d.Str(), domain: d.Str()}
		ne := d.Uvarint()
		if d.Err != nil || ne > uint64(len(b)) {
			return corrupt("regional ledger pool")
		}
		p.ents = make([]rules.Entry, ne)
		for j := range p.ents {
			p.ents[j] = rules.Entry{Key: d.Str(), Value: d.Str()}
		}
		p.avail, p.received, p.returned, p.minted, p.owed, p.debt = d.Varint(), d.Varint(), d.Varint(), d.Varint(), d.Varint(), d.Varint()
		p.share = math.Float64frombits(d.Fixed64())
		if limits {
			p.setGlobal(readGlobalLimit(d))
		}
		if d.Err != nil {
			return corrupt("regional ledger pool")
		}
		if (i > 0 && h <= prev) || p.avail < 0 || p.owed < 0 || p.debt < 0 || (!keep && p.debt > 0 && p.avail > 0) {
			return corrupt("regional ledger pool %016x", h)
		}
		prev = h
		c.pools[h] = p
	}
	if d.P != len(d.S) {
		return corrupt("regional ledger: %d trailing bytes", len(d.S)-d.P)
	}
	return nil
}
