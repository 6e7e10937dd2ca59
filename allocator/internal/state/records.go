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
type keyInfo struct {
	gen     uint32
	key     string // canonical budget key
	domain  string
	rule    string // policy name of the rule the key was last granted under
	leases  []lease
	sumNeed int64 // Σ leases[i].need
	grants  rate  // tokens granted
	denies  rate  // requests denied by agents (reported)
}

// lease is one agent's lease on a key.
type lease struct {
	agent     uint32 // agentRec.num
	seq       uint64 // expiry heap entry; not persisted
	need      int64  // tokens per refresh interval the agent asked to hold (fair share input)
	held      int64  // tokens the state records the agent as holding
	grantedAt int64  // Unix ns of the latest grant
	expiry    int64  // Unix ns
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

// rate is a deterministic, integer exponentially weighted rate: v is in
// milli-units per second, decayed by τ/(τ+Δt) (a rational stand-in for
// e^(−Δt/τ)) and bumped by amount/τ on each event.
type rate struct {
	v  int64 // milli-units per second
	at int64 // Unix ns of the last update
}

const rateTauMs = 10_000 // τ = 10 s

func (r rate) valueAt(now int64) int64 {
	if r.v == 0 || now <= r.at {
		return r.v
	}
	dt := uint64(now-r.at) / 1e6 // ms
	if dt > 1<<40 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(r.v), rateTauMs)
	q, _ := bits.Div64(hi, lo, rateTauMs+dt)
	return int64(q)
}

// add records amount units at now.
func (r *rate) add(now, amount int64) {
	if amount <= 0 && r.v == 0 {
		return
	}
	if now > r.at {
		r.v = r.valueAt(now)
		r.at = now
	}
	// amount/τ in milli-units per second: amount·1000·1000/τms.
	inc := amount * (1_000_000 / rateTauMs)
	if amount > 0 && (inc < 0 || r.v > (1<<62)-inc) {
		r.v = 1 << 62
		return
	}
	r.v += inc
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
	seq    uint64
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

func (c *core) pushExpiry(hash uint64, agent uint32, expiry int64) uint64 {
	c.seq++
	heap.Push(&c.exp, expEnt{expiry: expiry, hash: hash, agent: agent, seq: c.seq})
	return c.seq
}
