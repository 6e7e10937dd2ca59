package state

import (
	"container/heap"
	"math/bits"
	"sort"
)

// keyInfo is what the state keeps for a key with live leases, beyond its
// slot: the canonical key (for the admin API), its leases and its recent
// grant and deny rates. A key with no live lease has no keyInfo.
//
// keyInfos are copy-on-write: a record whose gen is older than the core's
// generation is shared with a live snapshot and is cloned before a write
// (core.mutInfo).
//
// The domain and the rule's name are not stored: the read APIs derive them
// from the key (rules.ParseKey and a match), which keeps a leased key's
// overhead down.
type keyInfo struct {
	gen     uint32
	key     string // canonical budget key
	leases  []lease
	sumNeed int64 // Σ leases[i].need
	rates   rates // recent grants (tokens) and agent-reported denials (requests)
}

// lease is one agent's lease on a key (48 bytes).
type lease struct {
	agent uint32 // agentRec.num
	// seq identifies the lease's expiry heap entry; not persisted. It may
	// wrap: a stale entry that collides only costs a re-check of expiry.
	seq       uint32
	need      int64 // tokens per refresh interval the agent asked to hold (fair share input)
	held      int64 // tokens the state records the agent as holding
	grantedAt int64 // Unix ns of the latest grant
	expiry    int64 // Unix ns
	demand    float64
}

func (k *keyInfo) clone() *keyInfo {
	c := *k
	c.leases = append([]lease(nil), k.leases...)
	return &c
}

// leaseIdx returns the position of agent's lease in k.leases (sorted by
// agent number) and whether it exists.
func (k *keyInfo) leaseIdx(agent uint32) (int, bool) {
	i := sort.Search(len(k.leases), func(i int) bool { return k.leases[i].agent >= agent })
	return i, i < len(k.leases) && k.leases[i].agent == agent
}

// agentRec is one agent incarnation. Copy-on-write like keyInfo.
type agentRec struct {
	gen          uint32
	id           string
	num          uint32
	lastReq      uint64
	lastKind     uint8  // kindAcquire or kindRelease
	lastResp     []byte // the recorded response, deterministic protobuf; never mutated
	lastContact  int64  // Unix ns
	fallbackKeys uint32
	keysHeld     uint32 // live leases
	tokensHeld   int64  // Σ held over its leases
}

const (
	kindNone uint8 = iota
	kindAcquire
	kindRelease
)

// mutInfo returns h's keyInfo for writing, cloning it if a snapshot shares
// it.
func (c *core) mutInfo(h uint64) *keyInfo {
	k := c.infos[h]
	if k != nil && c.cow && k.gen != c.gen {
		k = k.clone()
		k.gen = c.gen
		c.infos[h] = k
	}
	return k
}

// mutAgent returns the agent for writing, cloning it if a snapshot shares
// it.
func (c *core) mutAgent(a *agentRec) *agentRec {
	if c.cow && a.gen != c.gen {
		cp := *a
		cp.gen = c.gen
		c.agents[a.id] = &cp
		c.byNum[a.num] = &cp
		return &cp
	}
	return a
}

// rates are a key's recent grant and deny rates: deterministic, integer
// exponentially weighted rates in milli-units per second, decayed by
// τ/(τ+Δt) (a rational stand-in for e^(−Δt/τ)) and bumped by amount/τ on
// each event. Both decay from one timestamp.
type rates struct {
	grant, deny int64 // milli-units per second as of at
	at          int64 // Unix ns of the last update
}

const rateTauMs = 10_000 // τ = 10 s

// decay returns v decayed from the rates' timestamp to now.
func (r *rates) decay(v, now int64) int64 {
	if v == 0 || now <= r.at {
		return v
	}
	dt := uint64(now-r.at) / 1e6 // ms
	if dt > 1<<40 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(v), rateTauMs)
	q, _ := bits.Div64(hi, lo, rateTauMs+dt)
	return int64(q)
}

// valueAt returns the grant and deny rates at now.
func (r *rates) valueAt(now int64) (grant, deny int64) {
	return r.decay(r.grant, now), r.decay(r.deny, now)
}

// add records granted tokens and denied requests at now.
func (r *rates) add(now, granted, denied int64) {
	if granted <= 0 && denied <= 0 && r.grant == 0 && r.deny == 0 {
		return
	}
	if now > r.at {
		r.grant, r.deny = r.valueAt(now)
		r.at = now
	}
	r.grant = bump(r.grant, granted)
	r.deny = bump(r.deny, denied)
}

// bump adds amount/τ (in milli-units per second) to v, saturating.
func bump(v, amount int64) int64 {
	if amount <= 0 {
		return v
	}
	inc := amount * (1_000_000 / rateTauMs) // amount ≤ 1e12: no overflow
	if v > (1<<62)-inc {
		return 1 << 62
	}
	return v + inc
}

// perSecond converts a milli-rate to units per second for the admin API.
func perSecond(milli int64) float64 { return float64(milli) / 1000 }

// expiryHeap orders lease expiries. Each live lease has one entry (matching
// its seq); an entry whose lease ended or was renewed is dropped or re-queued
// when it reaches the top. The heap is derived state and not persisted.
type expiryHeap []expEnt

type expEnt struct {
	expiry int64
	hash   uint64
	agent  uint32
	seq    uint32
}

func (h expiryHeap) Len() int { return len(h) }
func (h expiryHeap) Less(i, j int) bool {
	a, b := &h[i], &h[j]
	if a.expiry != b.expiry {
		return a.expiry < b.expiry
	}
	if a.hash != b.hash {
		return a.hash < b.hash
	}
	if a.agent != b.agent {
		return a.agent < b.agent
	}
	return a.seq < b.seq
}
func (h expiryHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)   { *h = append(*h, x.(expEnt)) }
func (h *expiryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

func (c *core) pushExpiry(hash uint64, agent uint32, expiry int64) uint32 {
	c.seq++
	heap.Push(&c.exp, expEnt{expiry: expiry, hash: hash, agent: agent, seq: c.seq})
	return c.seq
}
