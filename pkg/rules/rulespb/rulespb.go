// Package rulespb converts compiled rules to their wire form: the Limit
// message the allocator sends with every grant (KeyGrant.limit) and in
// InspectKey. It is the one conversion, so the allocator, fakes of it and
// clients agree on every field, unlimited rules included.
package rulespb

import (
	"time"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Limit returns r as the wire's Limit message, or nil for a nil rule. An
// unlimited rule has no rate: its message carries the name, path, mode
// fields and unlimited = true, and leaves requests_per_unit, unit,
// window_seconds, burst, algorithm and shards at their zero values (unit
// is never "unknown" on the wire). Each call allocates a new message.
func Limit(r *rules.Rule) *allotv1.Limit {
	if r == nil {
		return nil
	}
	l := &allotv1.Limit{
		Name:        r.Name,
		ShadowMode:  r.ShadowMode,
		Unlimited:   r.Unlimited,
		RulePath:    r.Path,
		FailureMode: r.FailureMode.String(),
		Backend:     r.Backend.String(),
		Routing:     r.Routing.String(),
	}
	if !r.Unlimited {
		l.RequestsPerUnit = r.RequestsPerUnit
		l.Unit = r.Unit.String()
		l.WindowSeconds = int64(r.Window / time.Second)
		l.Burst = r.Burst
		l.Algorithm = r.Algorithm.String()
		l.Shards = int32(r.Shards)
	}
	return l
}
