package state

import (
	"cmp"
	"slices"

	"github.com/allot/allot/pkg/rules"
)

// Issued shares. A grant that asks for its share (want_share: a region at
// the global cluster) is answered its rate share (rateShare), and a region
// cut off from the global cluster falls back to the share of its last
// grant. Each grant computes the share from the demands the leases report
// at that instant, so shares issued at different grants, with the demands
// moved in between, could sum to more than the rate. The state therefore
// records the share each live lease was last issued, and caps a new share
// at the rate less the shares the key's other unexpired leases were
// issued (never below 0): at every instant the shares of the key's
// unexpired leases sum to at most its rate. A region whose share shrinks
// gets the smaller share at its next grant; one whose share grows gets
// the room the others gave up at its own next grant.
//
// The shares live in a side map, core.shares, keyed like the escaped
// leases (extKey): only leases granted with want_share have a record, so
// ordinary leases cost nothing. A record ends with its lease (dropLease),
// and a lease renewed without want_share loses it (it was issued none).
// A record of shareUnknown is a lease whose share the state does not
// know: one restored from a snapshot that predates the records, or moved
// in from another group; it counts as the whole rate until its next grant
// records its share or it ends, the one choice that keeps the bound
// whatever that lease was issued.

// shareUnknown records a lease whose issued share is not known; it counts
// as the whole rate.
const shareUnknown = -1

// issueShare returns the share (milli-tokens/s) answered to agent's grant
// on key h, whose entry is e (with the agent's lease as after the grant),
// at rate rate, and records it: rateShare capped at what the key's other
// unexpired leases leave of the rate. kept: the agent holds a lease after
// the grant; a call that leaves it without one is answered 0, as no
// lease would count what it was issued.
func (c *core) issueShare(e *entry, h uint64, agent uint32, demand float32, rate, now int64, kept bool) int64 {
	if !kept {
		return 0
	}
	sh := c.rateShare(e.leases, agent, demand, rate, now)
	if len(c.shares) > 0 {
		left := rate
		for i := range e.leases {
			l := &e.leases[i]
			if l.agent == agent || l.expiry <= now {
				continue
			}
			s, ok := c.shares[extKey{h, l.agent}]
			if !ok {
				continue
			}
			if s == shareUnknown {
				s = rate
			}
			if left -= min(s, left); left == 0 {
				break
			}
		}
		sh = min(sh, left)
	}
	sh = max(sh, 0)
	if c.shares == nil {
		c.shares = make(map[extKey]int64)
	}
	c.shares[extKey{h, agent}] = sh
	return sh
}

// mayShare reports whether any key may hold leases granted with
// want_share: this is not a regional cluster, and it has a scope: global
// rule (a global cluster). It decides whether sharedKey need be asked.
func (c *core) mayShare() bool {
	if c.cfg.Regional {
		return false
	}
	for _, r := range c.rules.Rules() {
		if r.Scope == rules.ScopeGlobal {
			return true
		}
	}
	return false
}

// sharedKey reports whether key (canonical) may hold leases granted with
// want_share, when mayShare: the key is under a scope: global rule.
func (c *core) sharedKey(key string) bool {
	domain, ents, err := rules.ParseKey(key)
	if err != nil {
		return false
	}
	r := c.rules.Match(domain, ents)
	return r != nil && r.Scope == rules.ScopeGlobal
}

// markUnknown records every lease of key h (entry e) as of unknown share.
func (c *core) markUnknown(e *entry, h uint64) {
	if c.shares == nil {
		c.shares = make(map[extKey]int64)
	}
	for i := range e.leases {
		c.shares[extKey{h, e.leases[i].agent}] = shareUnknown
	}
}

// shareRec is one issued share, for the snapshot.
type shareRec struct {
	extKey
	share int64
}

// sortedShares returns the records of m in (hash, agent) order.
func sortedShares(m map[extKey]int64) []shareRec {
	out := make([]shareRec, 0, len(m))
	for k, s := range m {
		out = append(out, shareRec{k, s})
	}
	slices.SortFunc(out, func(a, b shareRec) int {
		return cmp.Or(cmp.Compare(a.hash, b.hash), cmp.Compare(a.agent, b.agent))
	})
	return out
}
