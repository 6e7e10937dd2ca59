package rules

import allotv1 "github.com/allot/allot/proto/allot/v1"

// Proto returns the rule as the wire's Limit message (KeyGrant.limit,
// InspectKey, Envoy's current_limit). It returns nil for a nil rule. Each
// call allocates a new message.
func (r *Rule) Proto() *allotv1.Limit {
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
		l.WindowSeconds = int64(r.Window.Seconds())
		l.Burst = r.Burst
		l.Algorithm = r.Algorithm.String()
		l.Shards = int32(r.Shards)
	}
	return l
}
