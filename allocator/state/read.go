package state

import (
	"container/heap"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const (
	defaultPageSize = 100
	maxPageSize     = allotv1.MaxPageSize
	defaultTopKeys  = 20
	maxTopKeys      = allotv1.MaxPageSize
)

// ListLeases lists live leases in key-hash order, then by agent, filtered by
// key (canonical), agent and domain. Pages are at most 1000 leases (default
// 100); next_page_token is opaque and stable across calls. An unknown agent
// filter is ErrUnknownAgent; a bad page token or page size is ErrInvalid.
func (s *State) ListLeases(req *allotv1.ListLeasesRequest, nowNanos int64) (*allotv1.ListLeasesResponse, error) {
	if req == nil {
		req = &allotv1.ListLeasesRequest{}
	}
	size := int(req.PageSize)
	switch {
	case size < 0:
		return nil, fmt.Errorf("%w: negative page_size", ErrInvalid)
	case size == 0:
		size = defaultPageSize
	case size > maxPageSize:
		size = maxPageSize
	}
	fromHash, fromAgent, err := parsePageToken(req.PageToken)
	if err != nil {
		return nil, err
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	var agentNum uint32
	if req.AgentId != "" {
		a := c.agents[req.AgentId]
		if a == nil {
			return nil, fmt.Errorf("%w: %q", ErrUnknownAgent, req.AgentId)
		}
		agentNum = a.num
	}
	resp := &allotv1.ListLeasesResponse{NowUnixMs: nowNanos / 1e6}
	prefix := domainPrefix(req.Domain)
	var (
		e  entry
		kb []byte
	)
	ps := c.pageSets()
	// emit appends the matching leases of h's entry after the token; it
	// reports false when the page is full (and sets the next token).
	emit := func(h uint64, link uint32, wantKey string) bool {
		if !decodeEntry(&ps, &c.codec, link, h, &e) || !strings.HasPrefix(c.tpls.strs[e.tpl], prefix) {
			return true
		}
		kb = c.keyOf(kb[:0], &e)
		if wantKey != "" && string(kb) != wantKey {
			return true
		}
		var d keyDesc
		for i := range e.leases {
			l := &e.leases[i]
			if agentNum != 0 && l.agent != agentNum {
				continue
			}
			if h == fromHash && l.agent < fromAgent {
				continue
			}
			if len(resp.Leases) == size {
				resp.NextPageToken = pageToken(h, l.agent)
				return false
			}
			if d.key == "" {
				d = c.describe(string(kb))
			}
			resp.Leases = append(resp.Leases, c.leaseMsg(l, d, nowNanos))
		}
		return true
	}
	if req.Key != "" {
		h := xxhash.Sum64String(req.Key)
		if i := c.tab.find(h); i >= 0 && c.tab.at(i).link != 0 && h >= fromHash {
			emit(h, c.tab.at(i).link, req.Key)
		}
		return resp, nil
	}
	t := &c.tab
	for i := t.lowerBound(fromHash); i < t.size; i++ {
		sl := t.at(i)
		if sl.lim == 0 || sl.link == 0 {
			continue
		}
		if !emit(sl.hash, sl.link, "") {
			break
		}
	}
	return resp, nil
}

// pageToken encodes the first lease of the next page: "hash.agent" in hex.
func pageToken(h uint64, agent uint32) string {
	return fmt.Sprintf("%016x.%x", h, agent)
}

func parsePageToken(tok string) (uint64, uint32, error) {
	if tok == "" {
		return 0, 0, nil
	}
	hs, as, ok := strings.Cut(tok, ".")
	h, err1 := strconv.ParseUint(hs, 16, 64)
	a, err2 := strconv.ParseUint(as, 16, 32)
	if !ok || len(hs) != 16 || err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("%w: bad page_token %q", ErrInvalid, tok)
	}
	return h, uint32(a), nil
}

// domainPrefix returns the canonical key prefix of a domain ("" for none).
func domainPrefix(domain string) string {
	if domain == "" {
		return ""
	}
	return string(rules.AppendKey(nil, nil, domain, nil))
}

// keyDesc is what the read APIs derive from a canonical key.
type keyDesc struct {
	key, domain, rule string
}

// describe parses a stored canonical key and names its current rule.
func (c *core) describe(key string) keyDesc {
	d := keyDesc{key: key}
	domain, entries, err := rules.ParseKey(key)
	if err != nil {
		return d
	}
	d.domain = domain
	if r := c.rules.Match(domain, entries); r != nil {
		d.rule = r.Name
	}
	return d
}

func (c *core) leaseMsg(l *lease, d keyDesc, now int64) *allotv1.Lease {
	m := &allotv1.Lease{
		Key:           d.key,
		Domain:        d.domain,
		Tokens:        l.held,
		GrantedUnixMs: l.grantedAt,
		ExpiresInMs:   max(0, (l.expiry-now)/1e6),
		Demand:        float64(l.demand),
		Rule:          d.rule,
	}
	if a := c.byNum[l.agent]; a != nil {
		m.AgentId = a.id
	}
	return m
}

// InspectKey explains one key: the rule it matches and why, its global
// tokens now, its leases and recent rates. The key is given canonically
// (key) or as domain + entries. A malformed key is ErrInvalid.
func (s *State) InspectKey(req *allotv1.InspectKeyRequest, nowNanos int64) (*allotv1.InspectKeyResponse, error) {
	if req == nil {
		return nil, fmt.Errorf("%w: nil inspect request", ErrInvalid)
	}
	var (
		domain  string
		entries []rules.Entry
	)
	if req.Key != "" {
		if len(req.Key) > 3*maxKeyBytes {
			return nil, fmt.Errorf("%w: key longer than %d bytes", ErrInvalid, 3*maxKeyBytes)
		}
		d, es, err := rules.ParseKey(req.Key)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		domain, entries = d, es
	} else {
		if err := validateDescriptor(req.Domain, req.Entries); err != nil {
			return nil, fmt.Errorf("%w: %s", ErrInvalid, err)
		}
		domain = req.Domain
		for _, e := range req.Entries {
			entries = append(entries, rules.Entry{Key: e.Key, Value: e.Value})
		}
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	rule, trace := c.rules.MatchTrace(domain, entries)
	resp := &allotv1.InspectKeyResponse{
		Key:        string(rules.AppendKey(nil, rule, domain, entries)),
		Matched:    rule != nil,
		MatchTrace: trace,
		NowUnixMs:  nowNanos / 1e6,
	}
	if rule == nil {
		return resp, nil
	}
	resp.Limit = c.limitMsgs[rule.ID]
	resp.Shards = int32(rule.Shards)
	resp.RedisPromoted = rule.Backend == rules.BackendRedis
	if rule.Unlimited || rule.Backend != rules.BackendLease {
		return resp, nil
	}
	h := rules.KeyHash(rule, domain, entries)
	lim := rule.Limit
	if pl := c.pools[h]; pl != nil && pl.limOK && c.cfg.Regional && rule.Scope == rules.ScopeGlobal {
		// The limit in force: the global cluster's (limitIn).
		lim, resp.Limit = pl.lim, pl.global.Msg(resp.Limit)
	}
	if pl := c.pools[h]; pl == nil {
		c.inspectStatic(resp, rule, h, nowNanos)
	}
	var st bucket.State
	if i := c.tab.find(h); i >= 0 {
		resp.Tracked = true
		if sl := c.tab.at(i); sl.lim == c.lims.lookup(lim) {
			st = sl.st
		} else if tl, ts, ok := c.transBucket(sl, h, nowNanos); ok {
			lim, st = tl, ts // under shares of its limit (static shares)
		}
	}
	p := lim.Peek(st, nowNanos)
	resp.Tokens = p.Remaining
	resp.FullInMs = ms(p.ResetAfter)
	var e entry
	ps := c.pageSets()
	if i := c.tab.find(h); i >= 0 && c.tab.at(i).link != 0 && decodeEntry(&ps, &c.codec, c.tab.at(i).link, h, &e) {
		d := keyDesc{key: string(c.keyOf(nil, &e)), domain: domain, rule: rule.Name}
		for i := range e.leases {
			resp.Leases = append(resp.Leases, c.leaseMsg(&e.leases[i], d, nowNanos))
		}
		gr, dr := e.ratesAt(nowNanos)
		resp.GrantRate, resp.DenyRate = perSecond(gr), perSecond(dr)
	}
	return resp, nil
}

// ListAgents lists the known agents, sorted by id.
func (s *State) ListAgents(nowNanos int64) *allotv1.ListAgentsResponse {
	s.mu.RLock()
	defer s.mu.RUnlock()
	resp := &allotv1.ListAgentsResponse{NowUnixMs: nowNanos / 1e6}
	for _, a := range s.st.agents {
		resp.Agents = append(resp.Agents, &allotv1.AgentInfo{
			AgentId:           a.id,
			LastContactUnixMs: a.lastContact / 1e6,
			KeysHeld:          a.keysHeld,
			TokensHeld:        a.tokensHeld,
			FallbackKeys:      a.fallbackKeys,
			LastRequestId:     a.lastReq,
		})
		if ss := s.st.static; ss != nil {
			if hd := ss.holders[a.num]; hd != nil {
				ag := resp.Agents[len(resp.Agents)-1]
				ag.StaticSlot, ag.HotVersionAcked = true, hd.eff()
			}
		}
	}
	sort.Slice(resp.Agents, func(i, j int) bool { return resp.Agents[i].AgentId < resp.Agents[j].AgentId })
	return resp
}

// TopKeys returns the leased keys with the highest recent grant rate
// (order "grant", the default) or deny rate ("deny"), at most limit
// (default 20, at most 1000), optionally in one domain. Ties go to the
// smaller key.
func (s *State) TopKeys(req *allotv1.TopKeysRequest, nowNanos int64) *allotv1.TopKeysResponse {
	if req == nil {
		req = &allotv1.TopKeysRequest{}
	}
	limit := int(req.Limit)
	if limit <= 0 {
		limit = defaultTopKeys
	}
	limit = min(limit, maxTopKeys)
	byDeny := req.Order == "deny"
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := s.st
	top := &topHeap{}
	prefix := domainPrefix(req.Domain)
	var (
		e  entry
		kb []byte
	)
	t := &c.tab
	ps := c.pageSets()
	for i := 0; i < t.size; i++ {
		sl := t.at(i)
		if sl.link == 0 {
			continue
		}
		b, ok := ps.head(sl.link)
		if !ok {
			continue
		}
		n, _, _, ok := parseHeader(b, &e)
		if !ok || !strings.HasPrefix(c.tpls.strs[e.tpl], prefix) {
			continue
		}
		te := topEnt{idx: i, agents: uint32(n)}
		te.grant, te.deny = e.ratesAt(nowNanos)
		te.score = te.grant
		if byDeny {
			te.score = te.deny
		}
		full := top.Len() >= limit
		if full && te.score < (*top)[0].score {
			continue
		}
		kb = c.keyOf(kb[:0], &e)
		if full && te.score == (*top)[0].score && string(kb) >= (*top)[0].key {
			continue
		}
		te.key = string(kb)
		if !full {
			heap.Push(top, te)
		} else {
			(*top)[0] = te
			heap.Fix(top, 0)
		}
	}
	out := make([]topEnt, top.Len())
	for i := len(out) - 1; i >= 0; i-- {
		out[i] = heap.Pop(top).(topEnt)
	}
	resp := &allotv1.TopKeysResponse{NowUnixMs: nowNanos / 1e6}
	for _, te := range out {
		sl := t.at(te.idx)
		resp.Keys = append(resp.Keys, &allotv1.KeyRate{
			Key:       te.key,
			GrantRate: perSecond(te.grant),
			DenyRate:  perSecond(te.deny),
			Agents:    te.agents,
			Rule:      c.describe(te.key).rule,
			Tokens:    c.lims.get(sl.lim).Peek(sl.st, nowNanos).Remaining,
		})
	}
	return resp
}

type topEnt struct {
	idx                int // slot
	key                string
	agents             uint32
	score, grant, deny int64
}

// topHeap is a min-heap of the best entries so far: the root is the worst.
type topHeap []topEnt

func (t topHeap) better(a, b topEnt) bool {
	if a.score != b.score {
		return a.score > b.score
	}
	return a.key < b.key
}
func (t topHeap) Len() int           { return len(t) }
func (t topHeap) Less(i, j int) bool { return t.better(t[j], t[i]) }
func (t topHeap) Swap(i, j int)      { t[i], t[j] = t[j], t[i] }
func (t *topHeap) Push(x any)        { *t = append(*t, x.(topEnt)) }
func (t *topHeap) Pop() any {
	old := *t
	e := old[len(old)-1]
	*t = old[:len(old)-1]
	return e
}
