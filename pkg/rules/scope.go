package rules

import (
	"fmt"
	"math"
	"sort"

	"go.yaml.in/yaml/v3"
)

// scoping is the scope, global_fallback and static_fraction of one level
// (the domain, or a rate_limit over its domain's), with the keys they were
// read from for error lines (nil when not given).
type scoping struct {
	scope                        Scope
	fallback                     GlobalFallback
	fractions                    []RegionFraction
	scopeAt, fallbackAt, fractAt *yaml.Node
}

// scoping reads the scope fields of fs over the defaults def (the domain's,
// for a rate_limit). A field given at this level replaces the default; an
// inherited field that the level's own fields make inapplicable is dropped
// (a rule with scope: regional in a global domain keeps no fallback, one
// with global_fallback: fair_share no fractions).
func (c *compiler) scoping(fs map[string]field, def scoping) (scoping, error) {
	sc := def
	if kv, ok := fs["scope"]; ok {
		s, err := c.str(kv)
		if err != nil {
			return sc, err
		}
		if sc.scope, err = ParseScope(s); err != nil {
			return sc, c.errf(kv.val, "scope", "unknown scope '%s' (want regional or global)", s)
		}
		sc.scopeAt = kv.key
		if sc.scope != ScopeGlobal {
			sc.fallback, sc.fallbackAt, sc.fractions, sc.fractAt = FallbackFairShare, nil, nil, nil
		}
	}
	if kv, ok := fs["global_fallback"]; ok {
		s, err := c.str(kv)
		if err != nil {
			return sc, err
		}
		if sc.fallback, err = ParseGlobalFallback(s); err != nil {
			return sc, c.errf(kv.val, "global_fallback", "unknown global_fallback '%s' (want fair_share or static)", s)
		}
		sc.fallbackAt = kv.key
		if sc.fallback != FallbackStatic {
			sc.fractions, sc.fractAt = nil, nil
		}
	}
	if kv, ok := fs["static_fraction"]; ok {
		fr, err := c.fractions(kv)
		if err != nil {
			return sc, err
		}
		sc.fractions, sc.fractAt = fr, kv.key
	}
	return sc, nil
}

// checkScoping validates one level's combination of fields: its own and
// the inherited ones.
func (c *compiler) checkScoping(sc scoping) error {
	if sc.fallbackAt != nil && sc.scope != ScopeGlobal {
		return c.errf(sc.fallbackAt, "global_fallback", "global_fallback applies only with scope: global")
	}
	if sc.fractAt != nil && sc.scope != ScopeGlobal {
		return c.errf(sc.fractAt, "static_fraction", "static_fraction applies only with scope: global")
	}
	if sc.fractAt != nil && sc.fallback != FallbackStatic {
		return c.errf(sc.fractAt, "static_fraction", "static_fraction applies only with global_fallback: static")
	}
	if sc.fallback == FallbackStatic && sc.fractAt == nil {
		return c.errf(sc.fallbackAt, "global_fallback", "global_fallback: static needs static_fraction (a fraction in (0, 1], or one per region)")
	}
	return nil
}

// applyScoping validates the rule's scope fields and sets them on r.
func (c *compiler) applyScoping(r *Rule, sc scoping, fs map[string]field) error {
	if err := c.checkScoping(sc); err != nil {
		return err
	}
	if sc.scope == ScopeGlobal && r.Backend != BackendLease {
		key, at := "scope", sc.scopeAt
		if kv, ok := fs["backend"]; ok {
			key, at = "backend", kv.key
		}
		where := ""
		if _, own := fs["scope"]; !own {
			where = " (the domain has scope: global; give this rule scope: regional)"
		}
		return c.errf(at, key, "scope: global needs backend lease, got backend %s%s", r.Backend, where)
	}
	r.Scope = sc.scope
	if sc.scope == ScopeGlobal {
		r.GlobalFallback = sc.fallback
		r.StaticFractions = sc.fractions
		if sum := fractionSum(sc.fractions); sum > 1+1e-9 {
			c.warnings = append(c.warnings, fmt.Sprintf("%s:%d: static_fraction of the named regions sums to %.3g > 1: regions cut off at once may admit more than the rule's rate", c.file, sc.fractAt.Line, sum))
		}
	}
	return nil
}

func fractionSum(fr []RegionFraction) float64 {
	sum := 0.0
	for _, f := range fr {
		if f.Region != AnyRegion {
			sum += f.Fraction
		}
	}
	return sum
}

// fractions reads static_fraction: a number (every region's fraction) or a
// mapping of region name to number, where the region "*" stands for every
// region not named.
func (c *compiler) fractions(f field) ([]RegionFraction, error) {
	v := f.val
	switch v.Kind {
	case yaml.ScalarNode:
		x, err := c.fraction(f)
		if err != nil {
			return nil, err
		}
		return []RegionFraction{{Region: AnyRegion, Fraction: x}}, nil
	case yaml.MappingNode:
		var out []RegionFraction
		for i := 0; i+1 < len(v.Content); i += 2 {
			k := c.resolve(v.Content[i])
			val := c.resolve(v.Content[i+1])
			if k == nil || val == nil {
				return nil, c.errf(v, f.name, "config error, document too large or has a dangling alias")
			}
			if k.Kind != yaml.ScalarNode || k.ShortTag() == "!!null" || k.Value == "" {
				return nil, c.errf(k, f.name, "static_fraction: a region name must be a non-empty string, not %s", nodeText(k))
			}
			if !ValidText(k.Value) || len(k.Value) > 256 {
				return nil, c.errf(k, f.name, "static_fraction: region name %q has control characters or is longer than 256 bytes", k.Value)
			}
			for _, o := range out {
				if o.Region == k.Value {
					return nil, c.errf(k, f.name, "static_fraction: region '%s' is given twice", k.Value)
				}
			}
			x, err := c.fraction(field{name: f.name, key: k, val: val})
			if err != nil {
				return nil, err
			}
			out = append(out, RegionFraction{Region: k.Value, Fraction: x})
		}
		if len(out) == 0 {
			return nil, c.errf(v, f.name, "static_fraction: the mapping names no region")
		}
		sort.Slice(out, func(i, j int) bool { return out[i].Region < out[j].Region })
		return out, nil
	}
	return nil, c.errf(v, f.name, "static_fraction must be a number in (0, 1] or a mapping of region to number, not %s", nodeText(v))
}

// fraction reads one number in (0, 1].
func (c *compiler) fraction(f field) (float64, error) {
	v := f.val
	if v.Kind == yaml.ScalarNode && (v.ShortTag() == "!!float" || v.ShortTag() == "!!int") {
		var x float64
		if err := v.Decode(&x); err == nil && !math.IsNaN(x) {
			if x > 0 && x <= 1 {
				return x, nil
			}
			return 0, c.errf(v, f.name, "static_fraction must be in (0, 1], got %s", v.Value)
		}
	}
	return 0, c.errf(v, f.name, "static_fraction must be a number in (0, 1], not %s", nodeText(v))
}
