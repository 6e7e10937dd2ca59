package main

import (
	"math/rand/v2"
	"time"
)

// netModel is the modelled data-centre network between agents and
// allocator nodes: a one-way latency distribution, an extra hop for a
// follower forwarding to the leader, independent message loss, and
// partitions (a black hole: messages vanish, the sender learns nothing until
// its own timeout).
type netModel struct {
	rng    *rand.Rand
	oneWay logNormal // agent ↔ node
	hop    logNormal // node ↔ node
	loss   float64   // probability that one message is lost
	cuts   []partition
	// replyCuts lose only the answers to agents (the call was applied).
	replyCuts []partition
}

// partition cuts agents [from, to) off from every allocator node during
// [start, end).
type partition struct {
	from, to   int
	start, end int64
}

func newNetModel(r *rand.Rand) *netModel {
	return &netModel{
		rng:    r,
		oneWay: newLogNormal(250*time.Microsecond, 1500*time.Microsecond),
		hop:    newLogNormal(200*time.Microsecond, 1*time.Millisecond),
	}
}

// cut reports whether agent is partitioned from the allocators at t.
func (n *netModel) cut(agent int, t int64) bool {
	for _, p := range n.cuts {
		if agent >= p.from && agent < p.to && t >= p.start && t < p.end {
			return true
		}
	}
	return false
}

// send samples one agent ↔ node message sent at t: its delay, and whether
// it arrives (not lost, not partitioned at send time).
func (n *netModel) send(agent int, t int64) (int64, bool) {
	d := n.oneWay.sample(n.rng)
	if n.loss > 0 && n.rng.Float64() < n.loss {
		return d, false
	}
	return d, !n.cut(agent, t)
}

// reply is send for an answer to agent: replyCuts apply too.
func (n *netModel) reply(agent int, t int64) (int64, bool) {
	d, ok := n.send(agent, t)
	for _, p := range n.replyCuts {
		if agent >= p.from && agent < p.to && t >= p.start && t < p.end {
			ok = false
		}
	}
	return d, ok
}

func (n *netModel) forward() int64 { return n.hop.sample(n.rng) }
