package state

import (
	"fmt"
	"math/bits"

	"google.golang.org/protobuf/proto"
)

var marshalDet = proto.MarshalOptions{Deterministic: true}

// response returns the recorded response's deterministic encoding (nil
// with none). It only reads the record, so a snapshot may call it while
// Apply runs.
func (a *agentRec) response() ([]byte, error) {
	if a.lastMsg == nil {
		return a.lastResp, nil
	}
	return marshalDet.Marshal(a.lastMsg)
}

// recorded sets m to a copy of the recorded response.
func (a *agentRec) recorded(m proto.Message) error {
	if a.lastMsg != nil {
		proto.Merge(m, a.lastMsg)
		return nil
	}
	if err := proto.Unmarshal(a.lastResp, m); err != nil {
		return fmt.Errorf("state: recorded response of agent %q: %w", a.id, err)
	}
	return nil
}

// agentRec is one agent incarnation. agentRecs are copy-on-write: a record
// whose gen is older than the core's generation is shared with a live
// snapshot and is cloned before a write (mutAgent).
type agentRec struct {
	gen      uint32
	id       string
	num      uint32
	lastReq  uint64
	lastKind uint8 // kindAcquire or kindRelease
	// The recorded response: lastMsg as built (never modified), or
	// lastResp, its deterministic encoding (after a restore); see response.
	lastMsg      proto.Message
	lastResp     []byte
	lastContact  int64 // Unix ns
	fallbackKeys uint32
	keysHeld     uint32 // live leases
	tokensHeld   int64  // Σ held over its leases
}

const (
	kindNone uint8 = iota
	kindAcquire
	kindRelease
)

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

// Rates: a key's recent grant and deny rates are deterministic, integer
// exponentially weighted rates in milli-units per second, decayed by
// τ/(τ+Δt) (a rational stand-in for e^(−Δt/τ)) and bumped by amount/τ on
// each event. Both decay from the key's entry base (entry.ratesAt).
const rateTauMs = 10_000 // τ = 10 s

// decayRate returns v decayed from at to now (Unix ns).
func decayRate(v, at, now int64) int64 {
	if v == 0 || now <= at {
		return v
	}
	dt := uint64(now-at) / 1e6 // ms
	if dt > 1<<40 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(v), rateTauMs)
	q, _ := bits.Div64(hi, lo, rateTauMs+dt)
	return int64(q)
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
