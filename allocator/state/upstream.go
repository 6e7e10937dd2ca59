package state

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"time"

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
//     granted tokens only if the grant answers the pending send;
//   - a new leader finds an unanswered send pending and makes the same
//     call again, with the same request id: the global cluster answers a
//     repeated request id with its recorded answer, so a grant made to the
//     previous leader reaches the pools once.
//
// Invariant: the tokens a region sub-grants from a pool, less those
// returned to it, never exceed what the pool received from the global
// cluster plus what it minted, less what it handed back. Tokens gateways
// admit from their own fallback buckets and charge are taken from the
// pool too, into debt when it holds too few; a debt is paid first out of
// what the pool receives next, so over any span the region admits what
// it received and minted plus its debt at the end of the span.
//
// Upstream entries are compact log entries of their own:
//
//	entry  0x01, version (1), uvarint now (Unix ns), op, op's fields
//	send   op 1: uvarint seq, str request (an encoded AcquireRequest),
//	       uvarint n, n × (fixed64 key hash, varint returned, varint charged)
//	grant  op 2: uvarint seq, uvarint n, n × (fixed64 key hash, varint granted,
//	       fixed64 share as float64 bits)
//	mint   op 3: uvarint n, n × (fixed64 key hash, varint minted)
const (
	upstreamMarker  = 0x01
	upstreamVersion = 1

	opSend  = 1
	opGrant = 2
	opMint  = 3
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
// rounding of gateways' asks, not a run of fallback admissions).
func (p *pool) retry(capacity int64) time.Duration {
	if p.owed > 0 && p.debt > max(capacity/10, 1) {
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
}

// credit adds n tokens to the pool, paying its debt first.
func (p *pool) credit(n int64) {
	if n <= 0 {
		return
	}
	paid := min(n, p.debt)
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
}

// UpstreamMint is fallback tokens minted for one key while cut off.
type UpstreamMint struct {
	Hash   uint64
	Minted int64
}

func appendUpHeader(dst []byte, now int64, op byte) []byte {
	dst = append(dst, upstreamMarker, upstreamVersion)
	dst = binary.AppendUvarint(dst, uint64(now))
	return append(dst, op)
}

// AppendUpstreamSend appends a send entry: the call with request id seq,
// encoded as req, handing back and charging what keys say.
func AppendUpstreamSend(dst []byte, now int64, seq uint64, req []byte, keys []UpstreamReturn) []byte {
	dst = appendUpHeader(dst, now, opSend)
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

// AppendUpstreamGrant appends a grant entry answering the send seq.
func AppendUpstreamGrant(dst []byte, now int64, seq uint64, keys []UpstreamGrant) []byte {
	dst = appendUpHeader(dst, now, opGrant)
	dst = binary.AppendUvarint(dst, seq)
	dst = binary.AppendUvarint(dst, uint64(len(keys)))
	for _, k := range keys {
		dst = binary.LittleEndian.AppendUint64(dst, k.Hash)
		dst = binary.AppendVarint(dst, k.Granted)
		dst = binary.LittleEndian.AppendUint64(dst, math.Float64bits(k.Share))
	}
	return dst
}

// AppendUpstreamMint appends a mint entry.
func AppendUpstreamMint(dst []byte, now int64, keys []UpstreamMint) []byte {
	dst = appendUpHeader(dst, now, opMint)
	dst = binary.AppendUvarint(dst, uint64(len(keys)))
	for _, k := range keys {
		dst = binary.LittleEndian.AppendUint64(dst, k.Hash)
		dst = binary.AppendVarint(dst, k.Minted)
	}
	return dst
}

// errUpstream: an upstream entry does not decode.
var errUpstream = errors.New("state: upstream entry does not decode")

// UpstreamResult is ApplyUpstream's result.
type UpstreamResult struct {
	// Applied is false for a grant that does not answer the pending send
	// (it changed nothing).
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
}

func (c *core) applyUpstream(s string) (UpstreamResult, error) {
	if len(s) < 3 || s[0] != upstreamMarker {
		return UpstreamResult{}, fmt.Errorf("%w: no marker", errUpstream)
	}
	if s[1] != upstreamVersion {
		return UpstreamResult{}, fmt.Errorf("%w: upstream entry version %d is not known to this binary", ErrUnknownCommand, s[1])
	}
	d := &allotv1.Reader{S: s, P: 2, Base: errUpstream}
	now := max(int64(d.Uvarint()), c.now)
	op := d.Byte()
	var seq uint64
	var req string
	if op == opSend || op == opGrant {
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
		case opMint:
			k.a = d.Varint()
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
				r := min(max(k.a, 0), p.avail)
				p.avail -= r
				p.returned += r
				p.owed -= min(max(k.b, 0), p.owed)
			}
		}
	case opGrant:
		if c.up.pending == "" || seq != c.up.seq {
			return UpstreamResult{}, nil
		}
		c.up.pending = ""
		for _, k := range keys {
			if p := c.pools[k.hash]; p != nil && k.a > 0 {
				p.credit(k.a)
				p.received = sat(p.received, k.a)
				if k.fshare >= 0 && !math.IsInf(k.fshare, 0) {
					p.share = k.fshare
				}
			}
		}
	case opMint:
		for _, k := range keys {
			if p := c.pools[k.hash]; p != nil && k.a > 0 {
				p.credit(k.a)
				p.minted = sat(p.minted, k.a)
				p.owed = sat(p.owed, k.a)
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
// a pool, at most what the pool holds (the region's copy of a global rule
// still bounds the region; the global cluster's grants bound the pool).
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
		out = append(out, Pool{Hash: h, Key: p.key, Domain: p.domain, Entries: p.ents, Available: p.avail,
			Demand: c.demandOf(&e, h, now), Share: p.share, Received: p.received, Returned: p.returned,
			Minted: p.minted, Owed: p.owed, Debt: p.debt})
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
	return Pool{Hash: h, Key: p.key, Domain: p.domain, Entries: p.ents, Available: p.avail,
		Demand: c.demandOf(&e, h, now), Share: p.share, Received: p.received, Returned: p.returned,
		Minted: p.minted, Owed: p.owed, Debt: p.debt}, true
}

// demandOf sums the demand of the key's unexpired leases (read lock held).
func (c *core) demandOf(e *entry, h uint64, now int64) float64 {
	i := c.tab.find(h)
	if i < 0 || c.tab.at(i).link == 0 {
		return 0
	}
	c.loadEntry(e, h, c.tab.at(i).link)
	d := 0.0
	for _, l := range e.leases {
		if l.expiry > now {
			d += float64(l.demand)
		}
	}
	return d
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
// order (nil when there is none).
func (c *core) encodeLedger() []byte {
	if len(c.pools) == 0 && c.up.seq == 0 {
		return nil
	}
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
	}
	return b
}

// decodeLedger restores the regional ledger from a snapshot.
func (c *core) decodeLedger(b []byte) error {
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
		if d.Err != nil {
			return corrupt("regional ledger pool")
		}
		if (i > 0 && h <= prev) || p.avail < 0 || p.owed < 0 || p.debt < 0 || (p.debt > 0 && p.avail > 0) {
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
