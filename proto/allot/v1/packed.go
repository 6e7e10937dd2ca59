package allotv1

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Packed grants: AcquireResponse.packed_grants carries an Acquire's grants
// as one byte string instead of one KeyGrant message per key, and each
// distinct Limit once (AcquireResponse.limits), so that neither the
// allocator nor the agent marshals, parses or validates a message and a
// Limit per key. A caller asks for it with AcquireRequest.packed_grants.
//
//	packed  uvarint count, count × grant
//	grant   uvarint status, uvarint key length, key bytes,
//	        varint granted, lease_ttl_ms, refresh_after_ms, remaining,
//	        reset_after_ms, retry_after_ms, held (zigzag),
//	        uvarint agents, uvarint limit (0: none; i: limits[i-1])

// errPacked: packed grants do not decode.
var errPacked = errors.New("allotv1: packed grants do not decode")

// AppendPackedGrants appends grants in the packed form to dst. limits is
// the response's limit table: a grant's Limit is looked up in it by
// pointer and appended if absent (the allocator shares one Limit message
// per rule, so the table holds one entry per distinct rule).
func AppendPackedGrants(dst []byte, limits []*Limit, grants []*KeyGrant) ([]byte, []*Limit) {
	dst = binary.AppendUvarint(dst, uint64(len(grants)))
	for _, g := range grants {
		dst = binary.AppendUvarint(dst, uint64(g.GetStatus()))
		k := g.GetKey()
		dst = binary.AppendUvarint(dst, uint64(len(k)))
		dst = append(dst, k...)
		for _, v := range [...]int64{g.GetGranted(), g.GetLeaseTtlMs(), g.GetRefreshAfterMs(), g.GetRemaining(),
			g.GetResetAfterMs(), g.GetRetryAfterMs(), g.GetHeld()} {
			dst = binary.AppendVarint(dst, v)
		}
		dst = binary.AppendUvarint(dst, uint64(g.GetAgents()))
		li := 0
		if l := g.GetLimit(); l != nil {
			for i, x := range limits {
				if x == l {
					li = i + 1
					break
				}
			}
			if li == 0 {
				limits = append(limits, l)
				li = len(limits)
			}
		}
		dst = binary.AppendUvarint(dst, uint64(li))
	}
	return dst, limits
}

// UnpackGrants decodes packed grants. The grants share one allocation, and
// their keys one string; their Limits are the messages of limits. A key is
// taken as the bytes it is, without the UTF-8 check a string field gets.
func UnpackGrants(data []byte, limits []*Limit) ([]*KeyGrant, error) {
	d := Reader{S: string(data), Base: errPacked}
	n := d.Uvarint()
	// A grant takes at least 11 bytes.
	if d.Err != nil || n > uint64(len(d.S)/11) {
		return nil, fmt.Errorf("%w: count", errPacked)
	}
	vals := make([]KeyGrant, n)
	out := make([]*KeyGrant, n)
	for i := range vals {
		g := &vals[i]
		status := d.Uvarint()
		if status > uint64(^uint32(0)>>1) {
			d.Fail()
		}
		g.Status = KeyStatus(status)
		g.Key = d.Str()
		for _, f := range [...]*int64{&g.Granted, &g.LeaseTtlMs, &g.RefreshAfterMs, &g.Remaining,
			&g.ResetAfterMs, &g.RetryAfterMs, &g.Held} {
			*f = d.Varint()
		}
		agents := d.Uvarint()
		if agents > uint64(^uint32(0)) {
			d.Fail()
		}
		g.Agents = uint32(agents)
		switch li := d.Uvarint(); {
		case li == 0:
		case li <= uint64(len(limits)):
			g.Limit = limits[li-1]
		default:
			d.Fail()
		}
		if d.Err != nil {
			return nil, fmt.Errorf("grant %d: %w", i, d.Err)
		}
		out[i] = g
	}
	if d.P != len(d.S) {
		return nil, fmt.Errorf("%w: %d trailing bytes", errPacked, d.Left())
	}
	return out, nil
}

// GrantsOf returns r's grants, unpacking them if they came packed.
func GrantsOf(r *AcquireResponse) ([]*KeyGrant, error) {
	if p := r.GetPackedGrants(); len(p) > 0 {
		return UnpackGrants(p, r.GetLimits())
	}
	return r.GetGrants(), nil
}
