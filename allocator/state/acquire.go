package state

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

func (c *core) applyAcquireBatch(b *allotv1.AcquireBatch, now int64) *AcquireBatchResult {
	reqs := b.GetRequests()
	res := &AcquireBatchResult{
		Responses: make([]*allotv1.AcquireResponse, len(reqs)),
		Errs:      make([]error, len(reqs)),
	}
	for i, req := range reqs {
		res.Responses[i], res.Errs[i] = c.applyAcquire(req, now, res)
	}
	return res
}

// checkSeq applies the idempotency rule: the same request id as the agent's
// last call returns the recorded answer (replay true), a smaller one is
// stale.
func checkSeq(ag *agentRec, id uint64, kind uint8) (replay bool, err error) {
	if ag == nil || id > ag.lastReq {
		return false, nil
	}
	if id < ag.lastReq {
		return false, fmt.Errorf("%w: request_id %d < last %d of agent %q", ErrStaleRequest, id, ag.lastReq, ag.id)
	}
	if ag.lastKind != kind {
		return false, fmt.Errorf("%w: request_id %d of agent %q was used by another call", ErrStaleRequest, id, ag.id)
	}
	return true, nil
}

// applyAcquire applies a protobuf Acquire request (res, when not nil,
// sums its amounts).
func (c *core) applyAcquire(req *allotv1.AcquireRequest, now int64, res *AcquireBatchResult) (*allotv1.AcquireResponse, error) {
	if err := ValidateAcquire(req); err != nil {
		return nil, err
	}
	cl := &c.scr.call
	cl.agentID, cl.requestID, cl.fallback = req.AgentId, req.RequestId, req.FallbackKeys
	cl.static, cl.hotVersion = req.StaticShares, req.HotVersion
	if p := req.PackedKeys; len(p) > 0 {
		d := newDecoder(string(p), 0) // validated: it decodes
		c.scr.ents = d.keys(cl, c.scr.ents)
	} else {
		cl.keys, c.scr.ents = c.args(cl.keys[:0], c.scr.ents[:0], req.Keys)
	}
	return c.applyCall(cl, now, res)
}

// args converts wire keys into keys, with their entries in ents.
func (c *core) args(keys []keyArgs, ents []rules.Entry, ks []*allotv1.KeyAcquire) ([]keyArgs, []rules.Entry) {
	for _, k := range ks {
		from := len(ents)
		for _, e := range k.Entries {
			ents = append(ents, rules.Entry{Key: e.GetKey(), Value: e.GetValue()})
		}
		keys = append(keys, keyArgs{domain: k.Domain, want: k.Want, held: k.Held, returned: k.Returned,
			charged: k.Charged, outageCharged: k.OutageCharged, denied: k.Denied, demand: k.Demand, wantShare: k.WantShare,
			promote: k.Promote, staticReport: k.StaticReport, staticLeft: k.StaticLeft, ef: from, et: len(ents)})
	}
	for i := range keys {
		k := &keys[i]
		k.ents = ents[k.ef:k.et:k.et]
	}
	return keys, ents
}

// applyCall applies one Acquire call (res, when not nil, sums its
// amounts).
func (c *core) applyCall(cl *call, now int64, res *AcquireBatchResult) (*allotv1.AcquireResponse, error) {
	if err := validateArgs(cl); err != nil {
		return nil, err
	}
	ag := c.agents[cl.agentID]
	if replay, err := checkSeq(ag, cl.requestID, kindAcquire); err != nil {
		return nil, err
	} else if replay {
		resp := new(allotv1.AcquireResponse)
		if err := ag.recorded(resp); err != nil {
			return nil, err
		}
		return resp, nil
	}
	c.now = now
	ag = c.touchAgent(ag, cl.agentID, now)
	ag.fallbackKeys = cl.fallback
	if c.static != nil {
		c.staticTick(now)
		if c.static != nil && cl.static {
			c.static.staticAck(ag.num, cl.hotVersion, now)
		}
		if c.static != nil {
			c.staticReports(cl.keys, ag.num)
		}
	}
	var resp *allotv1.AcquireResponse
	if c.cfg.PackedGrants {
		resp = c.packedGrants(cl, ag, now, res)
	} else {
		resp = c.grantMsgs(cl, ag, now, res)
	}
	if c.static != nil && cl.static {
		resp.Static = c.staticAnswer(ag.num, cl.hotVersion)
	}
	resp.LiveAgents = uint32(len(c.agents))
	resp.RulesVersion = c.rulesVersion()
	resp.NowUnixMs = now / 1e6
	c.record(ag, cl.requestID, kindAcquire, resp)
	return resp, nil
}

// packedGrants applies cl's keys and returns the answer with their grants
// packed (Config.PackedGrants): two allocations per call, none per key.
func (c *core) packedGrants(cl *call, ag *agentRec, now int64, res *AcquireBatchResult) *allotv1.AcquireResponse {
	buf := binary.AppendUvarint(c.scr.packed[:0], uint64(len(cl.keys)))
	limits := c.scr.limits[:0]
	g := &c.scr.grant
	hs := c.hashKeys(cl.keys)
	for i := range cl.keys {
		c.touchKeys(hs, i)
		k := &cl.keys[i]
		*g = allotv1.KeyGrant{}
		c.key(g, ag, k, now, false)
		buf, limits = allotv1.AppendPackedGrant(buf, limits, c.scr.key, g)
		if res != nil {
			res.Granted += g.Granted
			res.Returned += k.returned
			res.Charged += k.charged
		}
	}
	resp := &allotv1.AcquireResponse{PackedGrants: bytes.Clone(buf), Limits: slices.Clone(limits)}
	clear(limits) // the scratch keeps no Limit alive
	c.scr.packed, c.scr.limits = buf, limits
	return resp
}

// touchAhead is how many keys' memory touchKeys reads at once: enough
// for their cache misses to overlap, few enough that what they bring
// stays in the cache until the keys are applied. touchMinSlots is the
// table capacity (256 KiB of slots) below which touchKeys reads nothing:
// a table that small stays in a core's own cache, and reading ahead
// would only repeat the lookups. A larger one does not stay cached while
// the node serves: the replicas, the gRPC and Raft buffers and whatever
// else runs on the machine share the last-level cache, so even a 4 MiB
// table (100,000 keys) misses on most lookups (see performance.md's
// read-ahead row).
const (
	touchAhead      = 32
	touchMinSlots   = 1 << 13
	touchValueBytes = 32
	touchEntryMax   = 1024
)

// hashKeys matches a call's keys to their rules and builds and hashes
// their canonical keys, for key (ka.rule, ka.key, ka.h) and touchKeys
// (the hashes it returns).
func (c *core) hashKeys(keys []keyArgs) []uint64 {
	hs, kb := c.scr.hashes[:0], c.scr.hkeys[:0]
	for i := range keys {
		k := &keys[i]
		k.rule = c.rules.Match(k.domain, k.ents)
		from := len(kb)
		kb = rules.AppendKey(kb, k.rule, k.domain, k.ents)
		k.key = kb[from:len(kb):len(kb)] // stays valid if kb moves
		k.h, k.hashed = xxhash.Sum64(k.key), true
		hs = append(hs, k.h)
	}
	c.scr.hashes, c.scr.hkeys = hs, kb
	return hs
}

// touchKeys reads the memory the keys of hs[i:] will use, their table
// slots and the leased ones' entries (touchEntry), for the next
// touchAhead keys when i is a multiple of it. A key's own lookups miss
// the cache one after another; these reads are independent, so their
// misses overlap. It changes nothing.
func (c *core) touchKeys(hs []uint64, i int) {
	if i%touchAhead != 0 || c.tab.capa < touchMinSlots {
		return
	}
	hs = hs[i:min(i+touchAhead, len(hs))]
	c.tab.touch(hs)
	var x byte
	for _, h := range hs {
		if j, ok := c.tab.search(h); ok {
			if l := c.tab.at(j).link; l != 0 {
				x += touchEntry(c.arenaOf(l).pages, l)
			}
		}
	}
	c.tab.sink += uint32(x)
}

// touchEntry reads every cache line of the entry at l in pages (of l's
// arena), and returns a byte of it. An entry spans several lines (22
// bytes a lease), and decoding it reads them all; reading only its first
// line would leave the others to miss one after another in
// decodeLeases. The lease count in the entry's first word sizes it, with
// touchValueBytes for the key's values (their length is not read: it may
// lie in a line not yet fetched), up to touchEntryMax bytes. A page is
// one allocation of over 16 KiB, which the Go allocator places at a
// multiple of 64 bytes (its size classes there are multiples of 64, and
// larger ones take whole memory pages), so the offsets that are multiples
// of 64 start its cache lines. A free block is read as harmlessly.
func touchEntry(pages [][]byte, l uint32) byte {
	p, off := linkPage(l), linkOff(l)
	if p >= len(pages) || off+minBlock > len(pages[p]) {
		return 0
	}
	pg := pages[p]
	w := binary.LittleEndian.Uint64(pg[off:])
	end := min(off+entryFixed+touchValueBytes+int(w>>50&127)*leaseBytes, off+touchEntryMax, len(pg))
	x := byte(w)
	for o := (off | 63) + 1; o < end; o += 64 {
		x += pg[o]
	}
	return x
}

// grantMsgs applies cl's keys and returns the answer with a KeyGrant
// message per key.
func (c *core) grantMsgs(cl *call, ag *agentRec, now int64, res *AcquireBatchResult) *allotv1.AcquireResponse {
	// The grants and their keys are allocated once per call: one slice of
	// messages, one string holding every key.
	grants := make([]allotv1.KeyGrant, len(cl.keys))
	resp := &allotv1.AcquireResponse{Grants: make([]*allotv1.KeyGrant, len(cl.keys))}
	ends := c.scr.ends[:0]
	keys := c.scr.keys[:0]
	hs := c.hashKeys(cl.keys)
	for i := range cl.keys {
		c.touchKeys(hs, i)
		k := &cl.keys[i]
		g := &grants[i]
		resp.Grants[i] = g
		c.key(g, ag, k, now, false)
		keys = append(keys, c.scr.key...)
		ends = append(ends, len(keys))
		if res != nil {
			res.Granted += g.Granted
			res.Returned += k.returned
			res.Charged += k.charged
		}
	}
	all, from := string(keys), 0
	for i, to := range ends {
		grants[i].Key = all[from:to]
		from = to
	}
	c.scr.ends, c.scr.keys = ends, keys
	return resp
}

func (c *core) applyRelease(req *allotv1.ReleaseRequest, now int64) (*allotv1.ReleaseResponse, error) {
	if err := ValidateRelease(req); err != nil {
		return nil, err
	}
	ag := c.agents[req.AgentId]
	if replay, err := checkSeq(ag, req.RequestId, kindRelease); err != nil {
		return nil, err
	} else if replay {
		resp := new(allotv1.ReleaseResponse)
		if err := ag.recorded(resp); err != nil {
			return nil, err
		}
		return resp, nil
	}
	c.now = now
	ag = c.touchAgent(ag, req.AgentId, now)
	c.staticTick(now)
	resp := &allotv1.ReleaseResponse{}
	var keys []keyArgs
	keys, c.scr.ents = c.args(c.scr.call.keys[:0], c.scr.ents[:0], req.Keys)
	c.scr.call.keys = keys
	var g allotv1.KeyGrant
	for i := range keys {
		credited, ended := c.key(&g, ag, &keys[i], now, true)
		resp.Returned += credited
		if ended {
			resp.LeasesEnded++
		}
	}
	if req.All {
		resp.LeasesEnded += c.endAgentLeases(ag.num)
	}
	c.record(ag, req.RequestId, kindRelease, resp)
	return resp, nil
}

// touchAgent returns the agent's record for writing, creating it if needed,
// and stamps its last contact.
func (c *core) touchAgent(ag *agentRec, id string, now int64) *agentRec {
	if ag == nil {
		for c.nextAgent == 0 || c.byNum[c.nextAgent] != nil { // after wrapping
			c.nextAgent++
		}
		id = strings.Clone(id) // it may be a substring of a whole log entry
		ag = &agentRec{gen: c.gen, id: id, num: c.nextAgent}
		c.nextAgent++
		c.agents[id] = ag
		c.byNum[ag.num] = ag
	} else {
		ag = c.mutAgent(ag)
	}
	ag.lastContact = now
	return ag
}

// record stores the agent's last request id and its answer. The answer
// is kept as built, not encoded: it is never modified after this (the
// service copies a response before setting fields on it), and it is
// encoded only when a snapshot is written (agentRec.response).
func (c *core) record(ag *agentRec, id uint64, kind uint8, resp proto.Message) {
	ag = c.mutAgent(ag)
	ag.lastReq, ag.lastKind, ag.lastMsg, ag.lastResp = id, kind, resp, nil
}

// slotFor returns the table index of h under limit l at now, creating the
// key (a zero, full state) if needed. A key whose rule's limit changed
// carries its balance over (see carryOver).
func (c *core) slotFor(h uint64, l bucket.Limit, now int64) int {
	i, found := c.tab.search(h)
	// The common case, a tracked key under the limit it had, takes no
	// reference and no map lookup.
	if found && c.lims.ents[c.tab.at(i).lim].key == keyOf(l) {
		return i
	}
	li := c.lims.ref(l)
	if !found {
		return c.tab.insertAt(c, h, li, i) // one probe: search's
	}
	if old := c.tab.at(i).lim; old != li {
		s := c.tab.mut(c, i)
		s.st = carryOver(c.lims.ents[old].lim, s.st, l, now)
		s.lim = li
		c.lims.unref(old)
	} else {
		c.lims.unref(li)
	}
	return i
}

// carryOver returns the state under the new limit to of a key whose state
// under its old limit from is st: the tokens available now carry over,
// capped at to's capacity, and so does a debt. Tightening a limit therefore
// never hands out a fresh burst, and loosening it keeps what was spent
// spent (the key refills at the new rate). A key leaving a deny-all limit
// (requests_per_unit: 0) starts full: it had no balance.
func carryOver(from bucket.Limit, st bucket.State, to bucket.Limit, now int64) bucket.State {
	if from.DeniesAll() {
		return bucket.State{}
	}
	rem := from.Peek(st, now).Remaining
	var ns bucket.State
	if capacity := to.Peek(ns, now).Remaining; rem < capacity {
		to.Debit(&ns, now, capacity-rem)
	}
	return ns
}

// key applies one key of an Acquire (release=false) or a Release
// (release=true: want is ignored and the lease ends). It returns the grant,
// the tokens credited back and whether a lease ended.
func (c *core) key(g *allotv1.KeyGrant, ag *agentRec, ka *keyArgs, now int64, release bool) (credited int64, ended bool) {
	ents := ka.ents
	rule, h := ka.rule, ka.h // hashKeys' if ka.hashed
	if ka.hashed {
		c.scr.key = append(c.scr.key[:0], ka.key...)
	} else {
		rule = c.rules.Match(ka.domain, ents)
		c.scr.key = rules.AppendKey(c.scr.key[:0], rule, ka.domain, ents)
		h = xxhash.Sum64(c.scr.key) // == rules.KeyHash(rule, ka.Domain, ents)
	}
	e := &c.scr.e
	if !c.serves(h) {
		g.Status = allotv1.KeyStatus_KEY_STATUS_MOVED // frozen or gone: slots.go
		return 0, false
	}

	if rule == nil || rule.Unlimited || rule.Backend != rules.BackendLease {
		switch {
		case rule == nil:
			g.Status = allotv1.KeyStatus_KEY_STATUS_NO_RULE
		case rule.Unlimited:
			g.Status = allotv1.KeyStatus_KEY_STATUS_UNLIMITED
		default:
			g.Status = allotv1.KeyStatus_KEY_STATUS_NOT_LEASED
		}
		if rule != nil {
			g.Limit = c.limitMsgs[rule.ID]
		}
		g.LeaseTtlMs = ms(c.cfg.MaxLeaseTTL)
		g.RefreshAfterMs = g.LeaseTtlMs
		// A lease left from an earlier rule ends: the key is not leased now.
		if idx := c.tab.find(h); idx >= 0 && c.tab.at(idx).link != 0 {
			c.loadEntry(e, h, c.tab.at(idx).link)
			if i, ok := e.find(ag.num); ok {
				oldMin := e.minSec()
				c.dropLease(e, i, h)
				c.storeEntry(h, idx, e, oldMin, false)
				ended = true
			}
		}
		return 0, ended
	}

	pool := c.poolFor(rule, h, ka.domain, ents)
	lim, limMsg := c.limitIn(rule, pool)
	fresh := pool != nil && c.limitChanged(h, lim)
	idx := -1
	if c.static != nil && pool == nil {
		idx, lim = c.staticSlot(rule, h, lim, ag.num, ka.promote, ka.staticLeft, now)
	}
	if idx < 0 {
		idx = c.slotFor(h, lim, now)
	}
	if fresh {
		// A pool's key whose limit in force changed (the region's copy
		// to the global cluster's limit, or the global one changed)
		// starts full under the new one rather than carrying its balance
		// over: what the region sub-grants is bounded by the pool, which
		// holds only what the global cluster granted from its own bucket.
		c.tab.mut(c, idx).st = bucket.State{}
	}
	st := c.tab.at(idx).st
	leased := c.tab.at(idx).link != 0
	if leased {
		c.loadEntry(e, h, c.tab.at(idx).link)
	} else {
		e.leases = e.leases[:0]
	}
	oldMin := e.minSec()
	li, have := e.find(ag.num)
	var old lease
	if have {
		old = e.leases[li]
	}
	// A new lease needs room in the arena (8 GiB of entries); without it
	// the agent is granted nothing and keeps deciding locally.
	canLease := have
	if !have && !release && ka.want > 0 {
		tpl, vlen := e.tpl, len(e.value)
		if !leased {
			tpl, vlen = c.splitNew(c.scr.key)
		}
		canLease = c.ar.canAlloc(entrySize(len(e.leases)+1, tpl, vlen))
	}

	// (1) returned: the agent keeps ka.held and hands back ka.returned. Only
	// what the record says it holds beyond what it keeps is credited, so a
	// return can never create tokens; then the report caps the record (the
	// agent spent the rest).
	held := old.held
	if r := min(ka.returned, max(0, held-ka.held)); r > 0 {
		lim.GiveBack(&st, now, r)
		held -= r
		credited = r
		if pool != nil {
			pool.credit(r)
		}
	}
	held = min(held, ka.held)
	// (2) charged: tokens admitted without a lease.
	if ka.charged > 0 {
		lim.Debit(&st, now, ka.charged)
	}
	// (2b) outage_charged: tokens the agent's fallback bucket admitted while
	// the allocator was unreachable. The bucket refilled meanwhile (its
	// state is as of the last command that touched the key); they are taken
	// from what it holds, never into debt, so they pay for that refill and
	// the key still refills at its rate once the allocator is back.
	if ka.outageCharged > 0 {
		lim.TakeUpTo(&st, now, ka.outageCharged)
	}
	if pool != nil {
		pool.charge(ka.charged)
		pool.take(ka.outageCharged)
	}
	// (3) want: size, cap at the fair share and the window's allowance,
	// take what the bucket has.
	capacity, refill := c.lims.sizes(c.tab.at(idx).lim, c.cfg.RefreshInterval) // lim's
	want := int64(0)
	if !release && canLease {
		want = min(ka.want, capacity)
	}
	need := min(capacity, held+want)
	var granted, used int64
	contended, poolShort := false, false
	demand := roundDemand(ka.demand)
	if want > 0 {
		var agentCap int64
		agentCap, contended = c.agentCap(e.leases, ag.num, need, capacity)
		// Grant pacing: at most the allowance per refresh window, however
		// little the agent reports holding.
		f := c.cfg.RefreshInterval
		used = usedInWindow(&old, now/1e6, f)
		allow, reserved := c.allowance(e.leases, ag.num, claimOf(want, demand, f, capacity), used, capacity, refill, now)
		left := allow - used
		avail := lim.Peek(st, now).Remaining
		if reserved > 0 && left > 0 {
			left = fromBucket(avail, left, reserved, lim.Peek(bucket.State{}, now).Remaining, refill)
		}
		// Burst: tokens the bucket holds beyond one window's refill (and
		// beyond what is reserved for the others' allowances) are not
		// anybody's share of the refill; they go by need, under the hold
		// cap. A flooder can take such an excess once, not every window:
		// while the claims use the refill the bucket holds no excess.
		// Without this, a second agent on a slow key (10 a day, burst 10)
		// got one token a window out of a bucket holding four.
		left = max(left, 0) + max(0, avail-max(refill, reserved))
		ask := min(want, agentCap-held, left)
		if pool != nil && ask > pool.avail {
			ask, poolShort = pool.avail, true
			pool.shortAt = now
		}
		if ask > 0 {
			granted = takeFrom(pool, lim, &st, now, ask)
			held += granted
		}
	}
	c.tab.mut(c, idx).st = st

	p := lim.Peek(st, now)
	g.Status = allotv1.KeyStatus_KEY_STATUS_OK
	g.Granted = granted
	g.Remaining = p.Remaining
	if pool != nil {
		g.Remaining = min(g.Remaining, pool.avail)
	}
	g.ResetAfterMs = ms(p.ResetAfter)
	g.Limit = limMsg
	var retry time.Duration
	if want > 0 && granted == 0 && p.Remaining < 1 {
		g.Status = allotv1.KeyStatus_KEY_STATUS_EXHAUSTED
		retry = max(p.RetryAfter, time.Millisecond)
		g.RetryAfterMs = ms(retry)
	} else if want > 0 && granted == 0 && poolShort {
		g.Status, retry = poolExhausted(pool, capacity)
		g.RetryAfterMs = ms(retry)
	}

	kept := !release && canLease && (want > 0 || held > 0)
	if kept {
		ttl, refresh := c.leaseTiming(contended, held, ka.demand)
		if retry > 0 {
			refresh = min(retry, ttl)
		}
		if poolShort {
			refresh = min(refresh, pool.retry(capacity))
		}
		nl := lease{agent: ag.num, need: need, held: held, win: old.win, grantedAt: old.grantedAt,
			expiry: now + int64(ttl), demand: demand, ext: old.ext}
		if granted > 0 {
			nl.grantedAt, nl.win = now/1e6, used+granted
		}
		if !leased {
			c.newEntry(e)
			leased = true
		}
		if have {
			ag = c.mutAgent(ag)
			ag.tokensHeld += nl.held - old.held
			e.leases[li] = nl
		} else {
			c.addLease(e, li, nl)
		}
		g.LeaseTtlMs = ms(ttl)
		g.RefreshAfterMs = ms(refresh)
		g.Held = held
		if !ka.wantShare && len(c.shares) > 0 {
			delete(c.shares, extKey{h, ag.num}) // this grant issued no share
		}
	} else {
		if have {
			c.dropLease(e, li, h)
			ended = true
		}
		g.RefreshAfterMs = ms(c.cfg.MaxLeaseTTL)
		if retry > 0 {
			g.RefreshAfterMs = ms(retry)
		}
	}
	if ka.wantShare && !release {
		g.Share = proto.Float64(float64(c.issueShare(e, h, ag.num, demand, rateMilli(lim), now, kept)) / milli)
	}
	if !leased {
		return credited, ended
	}
	if len(e.leases) > 0 {
		e.addRates(now, granted, ka.denied)
		e.base = clampBase(now)
		g.Agents = uint32(len(e.leases))
	}
	c.storeEntry(h, idx, e, oldMin, false)
	return credited, ended
}

// endAgentLeases ends every lease of the agent, except on keys in frozen
// slots, and returns how many. It
// scans the leased keys in table order (agents end all their leases only
// on shutdown or when forgotten).
func (c *core) endAgentLeases(num uint32) uint32 {
	ag := c.byNum[num]
	if ag == nil || ag.keysHeld == 0 {
		return 0
	}
	var n uint32
	e := &c.scr.e
	t := &c.tab
	for i := 0; i < t.size; i++ {
		s := t.at(i)
		if s.link == 0 || c.frozen(s.hash) {
			continue // a frozen key's leases move with it (slots.go)
		}
		c.loadEntry(e, s.hash, s.link)
		if li, ok := e.find(num); ok {
			oldMin := e.minSec()
			c.dropLease(e, li, s.hash)
			c.storeEntry(s.hash, i, e, oldMin, false)
			n++
			if c.byNum[num].keysHeld == 0 {
				break
			}
		}
	}
	return n
}
