package agent

import (
	"hash/maphash"
	"math"
	"math/bits"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

const numShards = 256 // power of two

// keyTable maps budget keys to their state. It is sharded by a 64-bit hash
// of the key (see keyHash), each shard an RWMutex-protected map, so checks
// on different keys rarely touch the same lock.
//
// A check holds its shard's read lock while it decides on the key, and the
// refill loop removes an idle key only under the write lock, after checking
// under that lock that nothing is owed: so no check ever charges a key that
// has already been dropped. The request memo's fast path for a leased key
// takes no lock; remove and it see each other through the key's atomics
// (see remove).
type keyTable struct {
	shards [numShards]shard
	seed   maphash.Seed
}

type shard struct {
	mu sync.RWMutex
	m  map[uint64]*keyState // guarded by mu; collisions chain through keyState.next
	_  [64 - 32]byte        // keep neighbouring shards' locks off one cache line
}

func newKeyTable() *keyTable {
	t := &keyTable{seed: maphash.MakeSeed()}
	for i := range t.shards {
		t.shards[i].m = make(map[uint64]*keyState)
	}
	return t
}

func (t *keyTable) shard(h uint64) *shard { return &t.shards[h&(numShards-1)] }

// keyHash identifies a budget key inside this agent. The canonical key
// "domain:k1=v1,…" is an injective function of (domain, entries) except
// under share_threshold, where many values share one budget. So for rules
// without share_threshold the agent hashes the domain and entries directly
// with the runtime's AES hash (maphash; BenchmarkKeyHash compares it with
// rendering the canonical key and hashing it with rules.KeyHash; the table
// is private to this process, so the hash need not be deterministic), and
// identity is checked by comparing domain and entries. For share_threshold rules it
// uses rules.KeyHash and compares rendered keys.
func (t *keyTable) keyHash(r *rules.Rule, domain string, entries []rules.Entry) uint64 {
	if r.ShareThreshold {
		return rules.KeyHash(r, domain, entries)
	}
	// One hash over the strings joined in a stack buffer (the join need
	// not be injective: identity is checked by comparing entries).
	var buf [hashBufLen]byte
	b := append(buf[:0], domain...)
	for i := range entries {
		if len(b)+len(entries[i].Key)+len(entries[i].Value)+2 > len(buf) {
			return t.keyHashLong(domain, entries)
		}
		b = append(b, 0xff)
		b = append(b, entries[i].Key...)
		b = append(b, 0xfe)
		b = append(b, entries[i].Value...)
	}
	return maphash.Bytes(t.seed, b)
}

// hashBufLen covers typical descriptors; longer ones hash string by string.
const hashBufLen = 160

// keyHashLong hashes each string and folds the hashes together.
//
//go:noinline
func (t *keyTable) keyHashLong(domain string, entries []rules.Entry) uint64 {
	h := maphash.String(t.seed, domain)
	for i := range entries {
		h = mix(h, maphash.String(t.seed, entries[i].Key))
		h = mix(h, maphash.String(t.seed, entries[i].Value))
	}
	return h
}

// mix folds x into h (both already uniformly distributed).
func mix(h, x uint64) uint64 {
	return bits.RotateLeft64((h^x)*0x9E3779B97F4A7C15, 29) ^ x
}

// keyState is one budget key's state at this agent.
//
// It has three owners: the fields written on the check path are atomics
// (the refill loop reads them into a policy.Obs, and publishes the ones
// marked so from the refill policy's answers); the fallback bucket is
// guarded by mu; keyLoop (the refill policy's policy.Key, and where the key
// sleeps) belongs to the refill loop.
type keyState struct {
	// Written by checks.
	balance atomic.Int64 // unspent leased tokens (valid while now < expiry)
	charged atomic.Int64 // fallback-admitted tokens not yet reported
	outage  atomic.Int64 // fallback-admitted tokens while the breaker was open, not yet reported (outage_charged)
	spent   atomic.Int64 // cumulative tokens admitted (lease or fallback); for demand
	denied  atomic.Int64 // cumulative requests denied; reported as deltas
	lastUse atomic.Int64 // coarse time of the latest check
	queued  atomic.Bool  // sitting in the refill queue (set by checks, cleared by the loop)
	fbUsed  atomic.Bool  // decided by the fallback since the previous scan
	// dormant: the refill loop visits the key only at its next deadline
	// until a check wakes it (Agent.wake, see due.go); set by the loop,
	// read by every check. A new key starts dormant, so its first check
	// hands it to the loop.
	dormant atomic.Bool

	// Written by the refill loop (what policy.Core decided), read by checks.
	expiry      atomic.Int64 // the lease's end, Unix nanos; 0 = no lease
	deniedUntil atomic.Int64 // a dry lease denies until this, Unix nanos (EXHAUSTED, or the share is spent: see pace)
	lowWater    atomic.Int64 // refill when the balance drops below this
	remaining   atomic.Int64 // global remaining at the latest grant
	resetAt     atomic.Int64 // global bucket full again at, Unix nanos
	notLeased   atomic.Bool  // the allocator does not lease this key (NO_RULE, UNLIMITED, NOT_LEASED)
	local       atomic.Bool  // decided locally by design (local/redis backend, standalone): never sent
	leased      atomic.Bool  // the allocator has answered for this key at least once
	dropped     atomic.Bool  // removed from the table (set under the shard's write lock): the request memo must not use it

	// Immutable after creation.
	hash    uint64
	key     string // canonical budget key
	domain  string
	entries []rules.Entry // copied from the first request
	next    *keyState     // hash-collision chain; guarded by the shard lock
	// unsendable: key is not valid UTF-8, so it can never be encoded into
	// an Acquire; it is decided by its fallback bucket (see policy.Key.Refused).
	unsendable bool
	// Static shares (static.go): staticable keys (of a static-eligible
	// rule when first seen) have their allocator hash in ahash and are
	// indexed by it, chained through snext (guarded by staticShares.mu).
	staticable bool
	ahash      uint64
	snext      *keyState
	smode      atomic.Uint32 // staticOff, staticOn, … (changed under mu, but for keyLoop's reads)
	sOwe       atomic.Bool   // owe (below), for reads without mu
	sRate      atomic.Uint64 // float64 bits: the static share's rate, tokens/s (policy.Obs.StaticRate)

	mu       sync.Mutex   // guards the fields below
	fbRule   *rules.Rule  // the rule fbLimit was derived from
	fbN      uint32       // the N fbLimit was derived from
	fbLimit  bucket.Limit // fallback (R/N) or local (R) limit
	fbState  bucket.State
	fbRebase bool  // a grant asked to lower fbState to fbAvail tokens at fbAt
	fbAvail  int64 // this agent's share of the global remaining at the grant
	fbAt     int64 // policy.Lease.RebaseAt: the answer's arrival, or a paced key's end of denial
	// shared: the latest answer said another agent holds a lease on the
	// key, so a promise could only be kept on credit (promise.go).
	shared  bool
	promise promise // the latest denial's Retry-After (promise.go)
	// fbStatic: the fallback fields hold the key's static share
	// (fbN = slots); sHot: its allocator hash is in the hot-key set.
	fbStatic bool
	sHot     bool
	fbRefill time.Duration // rules.RefillTime(fbLimit) when bindShare set fbLimit (read only then: fbStatic, fbRule a leased rule, fbN the slots)
	// owe: the key stopped static decisions with its share still this
	// agent's alone (the permission lapsed, the rule is no longer
	// eligible, or a promotion was not applied) and the allocator has not
	// been told what it holds: oweLim and oweSt are the share as the
	// agent last took from it (or as a promotion's build read it: what
	// the key admitted after that was charged), and the key's next call
	// is a promotion with static_left its level then, refilled since
	// (staticPlan), or, if the key turns hot first, a report (markHot).
	// sOwe mirrors owe for the refill loop's lock-free check.
	owe    bool
	oweLim bucket.Limit
	oweSt  bucket.State

	// Owned by the refill loop (and by Close once it has stopped): no
	// synchronisation.
	keyLoop
}

// keyLoop is the part of a key's state that only the refill loop reads
// and writes: the refill policy's state of the key (policy.Key: its demand
// estimate, what it last reported, its pacing and holds) and where it
// sleeps (see due.go).
type keyLoop struct {
	policy.Key
	awake       bool    // in refiller.awake: visited by every scan
	asleep      bool    // in refiller.due and/or refiller.hot
	tracked     bool    // counted in refiller.tracked
	dueIdx      int32   // index in refiller.due plus one; 0: not there
	hotIdx      int32   // index in refiller.hot plus one; 0: not there
	dueAt       int64   // the deadline it sleeps until
	sleptSeq    uint64  // the scan that put it to sleep
	sleptDemand float64 // its demand then
	sWait       bool    // left the hot-key set: static again once it holds no lease and nothing is pending
}

// obs reads what the check path and the answers published of ks.
func (ks *keyState) obs() policy.Obs {
	o := policy.Obs{
		Spent:       ks.spent.Load(),
		Denied:      ks.denied.Load(),
		Charged:     ks.charged.Load(),
		Outage:      ks.outage.Load(),
		Balance:     ks.balance.Load(),
		LastUse:     ks.lastUse.Load(),
		Expiry:      ks.expiry.Load(),
		DeniedUntil: ks.deniedUntil.Load(),
		LowWater:    ks.lowWater.Load(),
		Leased:      ks.leased.Load(),
		NotLeased:   ks.notLeased.Load(),
		Local:       ks.local.Load(),
		Queued:      ks.queued.Load(),
	}
	if m := ks.smode.Load(); m != staticOff {
		o.Static, o.Promote = true, m == staticPromote
		o.StaticRate = math.Float64frombits(ks.sRate.Load())
		o.StaticFullAt = ks.shareFullAt(o.LastUse)
	} else if ks.sOwe.Load() {
		o.StaticFullAt = ks.oweFullAt(o.LastUse)
	}
	return o
}

// unchanged reports whether the check path has left ks as o, read by a
// scan, says (see Agent.sleep): the fields checks write.
func (ks *keyState) unchanged(o *policy.Obs) bool {
	return ks.spent.Load() == o.Spent && ks.denied.Load() == o.Denied && ks.charged.Load() == o.Charged &&
		ks.balance.Load() == o.Balance && ks.lastUse.Load() == o.LastUse && ks.local.Load() == o.Local
}

// sameKey reports whether the request (domain, entries) under rule r is this
// key: equal domain and entries, or, under share_threshold (many values
// share one budget), equal canonical keys.
func (ks *keyState) sameKey(r *rules.Rule, domain string, entries []rules.Entry) bool {
	if ks.domain == domain && entriesEqual(ks.entries, entries) {
		return true
	}
	return r.ShareThreshold && ks.sameRenderedKey(r, domain, entries)
}

// sameRenderedKey is sameKey's slow path, kept out of line so the common
// path does not pay for zeroing the buffer.
//
//go:noinline
func (ks *keyState) sameRenderedKey(r *rules.Rule, domain string, entries []rules.Entry) bool {
	var buf [keyBufLen]byte
	return string(rules.AppendKey(buf[:0], r, domain, entries)) == ks.key
}

func entriesEqual(a, b []rules.Entry) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Key != b[i].Key || a[i].Value != b[i].Value {
			return false
		}
	}
	return true
}

// lookupRLocked finds the key under sh's read lock, which the caller holds.
func (sh *shard) lookupRLocked(h uint64, r *rules.Rule, domain string, entries []rules.Entry) *keyState {
	for ks := sh.m[h]; ks != nil; ks = ks.next {
		if ks.sameKey(r, domain, entries) {
			return ks
		}
	}
	return nil
}

// insert adds the key if it is still missing and returns its state. It takes
// the write lock; the caller holds no lock on sh. created reports whether a
// new state was made.
//
// ss, when not nil, makes the key static-eligible (see staticShares.add)
// before it is published.
func (sh *shard) insert(h uint64, r *rules.Rule, domain string, entries []rules.Entry, now int64, ss *staticShares) (ks *keyState, created bool) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if ks := sh.lookupRLocked(h, r, domain, entries); ks != nil {
		return ks, false
	}
	// Own the strings: a caller may have built its entries over reused
	// memory (unsafe []byte→string conversions are common in gateways).
	ks = &keyState{
		hash:    h,
		key:     string(rules.AppendKey(nil, r, domain, entries)),
		domain:  strings.Clone(domain),
		entries: make([]rules.Entry, len(entries)),
		next:    sh.m[h],
	}
	for i, e := range entries {
		ks.entries[i] = rules.Entry{Key: strings.Clone(e.Key), Value: strings.Clone(e.Value)}
	}
	if !utf8.ValidString(ks.key) {
		// Check admits only rules.ValidText; should a key slip through,
		// it never enters a batch, where it would fail every key's call.
		ks.unsendable = true
		ks.HoldUntil = policy.RefusedForever
	}
	ks.lastUse.Store(now)
	ks.lowWater.Store(1)
	ks.dormant.Store(true)
	if ss != nil && !ks.unsendable {
		ks.staticable = true
		ks.ahash = rules.KeyHash(r, domain, entries)
		ss.add(ks)
	}
	sh.m[h] = ks
	return ks, true
}

// remove unlinks ks if keep(ks) is false under the write lock. It reports
// whether ks was removed.
//
// A check through the request memo (Agent.spendLive) spends from a key
// without the lock: it changes the key's counters and then reads
// dropped. So remove sets dropped and then reads the counters again: if a
// check changed them meanwhile (or keep changed its mind), the key stays
// and dropped is cleared; a check that saw dropped set has given its
// tokens back and decides under the read lock, which waits for this one.
func (sh *shard) remove(ks *keyState, keep func(*keyState) bool) bool {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	o := ks.obs()
	if keep(ks) {
		return false
	}
	ks.dropped.Store(true)
	if !ks.unchanged(&o) || keep(ks) {
		ks.dropped.Store(false)
		return false
	}
	return unlink(sh.m, ks.hash, ks, func(ks *keyState) **keyState { return &ks.next })
}

// unlink removes ks from the chain at m[h], linked through next(ks), and
// reports whether it was there.
func unlink(m map[uint64]*keyState, h uint64, ks *keyState, next func(*keyState) **keyState) bool {
	var prev *keyState
	for cur := m[h]; cur != nil; prev, cur = cur, *next(cur) {
		if cur != ks {
			continue
		}
		switch {
		case prev != nil:
			*next(prev) = *next(cur)
		case *next(cur) != nil:
			m[h] = *next(cur)
		default:
			delete(m, h)
		}
		return true
	}
	return false
}

// snapshot appends every key of sh to dst under the read lock.
func (sh *shard) snapshot(dst []*keyState) []*keyState {
	sh.mu.RLock()
	for _, ks := range sh.m {
		for ; ks != nil; ks = ks.next {
			dst = append(dst, ks)
		}
	}
	sh.mu.RUnlock()
	return dst
}

func (t *keyTable) len() int {
	n := 0
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.RLock()
		for _, ks := range sh.m {
			for ; ks != nil; ks = ks.next {
				n++
			}
		}
		sh.mu.RUnlock()
	}
	return n
}
