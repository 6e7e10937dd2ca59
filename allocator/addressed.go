package allocator

import (
	"context"

	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// acquireAddressed serves an Acquire addressed to a data group
// (AcquireRequest.group) that this node hosts and that serves every key of
// the call, as a single-group cluster serves every call: the request goes
// whole, its keys packed or not, to the group's batcher on this node when
// it leads the group, else to the group's leader in one forwarded hop.
// Nothing is unpacked into messages or rebuilt on the way; the node only
// reads each key to check its slot's owner in its slot map (the group's
// state machine refuses the keys of slots it does not own too, once the
// move driver has told it its slots: settleOwned).
// The answer carries the topology when the caller's is older than this
// node's or a key was answered MOVED (a slot frozen by a move the slot
// map does not show yet).
//
// It reports false, having done nothing, for a call it does not take: one
// with no group, for a group this node hosts no replica of, or with a key
// that the group does not serve (acquireRouted answers those).
func (s *Server) acquireAddressed(ctx context.Context, req *allotv1.AcquireRequest) (resp *allotv1.AcquireResponse, path string, ok bool, err error) {
	if req.GetGroup() == 0 {
		return nil, "", false, nil
	}
	id := slots.GroupID(req.GetGroup())
	g := s.dataGroup(id)
	if g == nil {
		return nil, "", false, nil
	}
	rt := s.router()
	if !rt.ok {
		return nil, "", true, errNoGroups
	}
	if !rt.servesAll(id, req) {
		return nil, "", false, nil
	}
	resp, path, err = s.acquireOn(ctx, g.node.raft, g.batcher, func(ctx context.Context) error {
		return s.waitRulesIn(ctx, g, s.rulesVersion())
	}, req)
	if err != nil {
		return nil, path, true, s.groupLeaderErr(err, g)
	}
	if resp.GetTopology() == nil && (req.GetTopologyVersion() < rt.m.Version() || allotv1.HasStatus(resp, allotv1.KeyStatus_KEY_STATUS_MOVED)) {
		resp.Topology = s.topology()
	}
	return resp, path, true, nil
}

// servesAll reports whether group g serves every key of req, packed or
// not, under the router's rule set and slot map: none is another group's
// or between groups. Packed keys are read in place, each key's domain and
// entries as substrings of the call's bytes; keys that do not decode
// report false.
func (rt *router) servesAll(g slots.GroupID, req *allotv1.AcquireRequest) bool {
	serves := func(h uint64) bool {
		owner, between := rt.owner(h)
		return owner == g && !between
	}
	p := req.GetPackedKeys()
	if len(p) == 0 {
		for _, k := range req.GetKeys() {
			if h, _, _ := rt.keyOf(k.GetDomain(), k.GetEntries()); !serves(h) {
				return false
			}
		}
		return true
	}
	d := allotv1.Reader{S: string(p)}
	n := d.Uvarint()
	var dc allotv1.Dict
	var k allotv1.PackedKey
	var buf [4]rules.Entry
	for range n {
		ents := allotv1.ReadPackedKey(&d, &dc, &k, buf[:0])
		if d.Err != nil {
			return false
		}
		var r *rules.Rule
		if rt.set != nil {
			r = rt.set.Match(k.Domain, ents)
		}
		if !serves(rules.KeyHash(r, k.Domain, ents)) {
			return false
		}
	}
	return d.Err == nil
}
