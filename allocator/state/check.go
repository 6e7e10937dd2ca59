package state

import (
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// applyCheck runs one authoritative check-and-take (the admin Check): every
// descriptor is matched (with replaces), and each lease-backed match takes
// hits tokens (0 means 1) from the key's global state with AllowN. Any
// non-shadow denial makes the request OVER_LIMIT and gives back the tokens
// its other descriptors took. Unlimited rules and rules on another backend
// (redis, local) are reported OK: the allocator holds no budget for them.
func (c *core) applyCheck(req *allotv1.CheckRequest, now int64) (*allotv1.CheckResponse, error) {
	if err := validateCheck(req); err != nil {
		return nil, err
	}
	c.now = now
	c.staticTick(now)
	descs := c.scr.descs[:0]
	for _, d := range req.Descriptors {
		es := make([]rules.Entry, len(d.Entries))
		for i, e := range d.Entries {
			es[i] = rules.Entry{Key: e.Key, Value: e.Value}
		}
		descs = append(descs, es)
	}
	c.scr.descs = descs[:0]
	matched := c.rules.MatchAll(req.Domain, descs, c.scr.matched[:0])
	c.scr.matched = matched[:0]
	if err := c.checkServed(req.Domain, descs, matched); err != nil {
		return nil, err
	}
	hits := int64(req.Hits)
	if hits == 0 {
		hits = 1
	}
	type taken struct {
		h   uint64
		lim bucket.Limit
	}
	var took []taken
	resp := &allotv1.CheckResponse{OverallCode: allotv1.Code_CODE_OK}
	for i, d := range descs {
		r := matched[i]
		ds := &allotv1.DescriptorStatus{Code: allotv1.Code_CODE_OK,
			Key: string(rules.AppendKey(nil, r, req.Domain, d))}
		resp.Statuses = append(resp.Statuses, ds)
		if r == nil {
			continue
		}
		ds.Matched = true
		ds.Limit = c.limitMsgs[r.ID]
		if r.Unlimited || r.Backend != rules.BackendLease {
			continue
		}
		h := rules.KeyHash(r, req.Domain, d)
		idx, lim := -1, r.Limit
		if c.static != nil {
			idx, lim = c.staticSlot(r, h, lim, 0, false, 0, now)
		}
		if idx < 0 {
			idx = c.slotFor(h, lim, now)
		}
		s := c.tab.mut(c, idx)
		res := lim.AllowN(&s.st, now, hits)
		ds.Remaining = res.Remaining
		ds.ResetAfterMs = ms(res.ResetAfter)
		if res.Allowed {
			took = append(took, taken{h, lim})
			continue
		}
		ds.RetryAfterMs = ms(res.RetryAfter)
		if r.ShadowMode {
			ds.Shadow = true
			continue
		}
		ds.Code = allotv1.Code_CODE_OVER_LIMIT
		resp.OverallCode = allotv1.Code_CODE_OVER_LIMIT
	}
	if resp.OverallCode == allotv1.Code_CODE_OVER_LIMIT {
		for j := len(took) - 1; j >= 0; j-- {
			if idx := c.tab.find(took[j].h); idx >= 0 {
				took[j].lim.GiveBack(&c.tab.mut(c, idx).st, now, hits)
			}
		}
	}
	return resp, nil
}
