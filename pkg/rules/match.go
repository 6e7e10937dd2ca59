package rules

import (
	"fmt"
	"strings"
)

// Set is a compiled, immutable rule set: every domain's descriptor tree plus
// the rules. A Set is safe for concurrent use; swap sets atomically to
// reload. A nil *Set is valid and matches nothing.
type Set struct {
	version     uint64
	files       []File
	domainNames []string // sorted
	domains     map[string]*domainTree
	rules       []*Rule
	nameIDs     map[string]int32 // explicit rule names → dense ids, for replaces
	warnings    []string
}

// domainTree is one domain's compiled descriptors.
type domainTree struct {
	root map[string]*keyGroup // first level, by entry key
}

// keyGroup holds the descriptors of one level that share a key, in match
// precedence: exact value, then wildcards in load order, then key-only.
type keyGroup struct {
	exact   map[string]*node
	wild    []*node
	keyOnly *node
}

// node is one descriptor.
type node struct {
	lvl      level
	w        wildcard
	rule     *Rule                // nil: no rate_limit at this descriptor
	children map[string]*keyGroup // nil: no nested descriptors
}

func (g *keyGroup) lookup(v string) *node {
	if n := g.exact[v]; n != nil {
		return n
	}
	for _, n := range g.wild {
		if n.w.match(v) {
			return n
		}
	}
	return g.keyOnly
}

// wildcard is a value pattern in which '*' matches zero or more bytes,
// anywhere, any number of times.
type wildcard struct {
	parts []string // pattern split at '*'; len ≥ 2 for a wildcard
}

func compileWildcard(p string) wildcard { return wildcard{parts: strings.Split(p, "*")} }

// match reports whether v matches. A greedy leftmost scan is exact for
// patterns whose only metacharacter is '*'. No allocation.
func (w wildcard) match(v string) bool {
	p := w.parts
	if len(p) < 2 {
		return len(p) == 1 && p[0] == v
	}
	pre, suf := p[0], p[len(p)-1]
	if len(v) < len(pre)+len(suf) || !strings.HasPrefix(v, pre) || !strings.HasSuffix(v, suf) {
		return false
	}
	mid := v[len(pre) : len(v)-len(suf)]
	for _, part := range p[1 : len(p)-1] {
		i := strings.Index(mid, part)
		if i < 0 {
			return false
		}
		mid = mid[i+len(part):]
	}
	return true
}

// Version returns the version given to Compile.
func (s *Set) Version() uint64 {
	if s == nil {
		return 0
	}
	return s.version
}

// Files returns the compiled files with their Domain filled in, in input
// order. The slice is shared: do not modify it.
func (s *Set) Files() []File {
	if s == nil {
		return nil
	}
	return s.files
}

// Domains returns the domains, sorted. The slice is shared: do not modify it.
func (s *Set) Domains() []string {
	if s == nil {
		return nil
	}
	return s.domainNames
}

// Rules returns every rule; Rules()[i].ID == i. The slice is shared: do not
// modify it.
func (s *Set) Rules() []*Rule {
	if s == nil {
		return nil
	}
	return s.rules
}

// Warnings returns non-fatal findings of Compile (a replaces naming no rule,
// share_threshold without a wildcard, ...), as "file:line: message".
func (s *Set) Warnings() []string {
	if s == nil {
		return nil
	}
	return s.warnings
}

// HasDomain reports whether the set has rules for domain.
func (s *Set) HasDomain(domain string) bool {
	if s == nil {
		return false
	}
	_, ok := s.domains[domain]
	return ok
}

// Match returns the rule for one request descriptor, or nil when none
// applies. Matching is Envoy's, one level at a time: an exact key and value
// wins, else the first wildcard value that matches in load order, else the
// key-only descriptor. A rule applies only when the descriptor has exactly
// as many entries as the rule's depth. Match does not allocate.
func (s *Set) Match(domain string, entries []Entry) *Rule {
	if s == nil || len(entries) == 0 {
		return nil
	}
	d := s.domains[domain]
	if d == nil {
		return nil
	}
	groups := d.root
	for i := range entries {
		g := groups[entries[i].Key]
		if g == nil {
			return nil
		}
		n := g.lookup(entries[i].Value)
		if n == nil {
			return nil
		}
		if i == len(entries)-1 {
			return n.rule
		}
		if n.children == nil {
			return nil
		}
		groups = n.children
	}
	return nil
}

// MatchTrace is Match with an explanation: one line per level walked, then
// one line for the outcome. It allocates; it is meant for inspection tools.
func (s *Set) MatchTrace(domain string, entries []Entry) (*Rule, []string) {
	var lines []string
	if s == nil {
		return nil, append(lines, "no rules loaded")
	}
	d := s.domains[domain]
	if d == nil {
		return nil, append(lines, fmt.Sprintf("domain %q: unknown domain (no rules: unlimited)", domain))
	}
	if len(entries) == 0 {
		return nil, append(lines, "empty descriptor: no rule")
	}
	groups := d.root
	for i, e := range entries {
		depth := i + 1
		ev := e.Key + "=" + e.Value
		g := groups[e.Key]
		if g == nil {
			lines = append(lines, fmt.Sprintf("%s: no descriptor with key %q at depth %d", ev, e.Key, depth))
			return nil, append(lines, fmt.Sprintf("no rule at depth %d", depth))
		}
		n := g.lookup(e.Value)
		if n == nil {
			lines = append(lines, fmt.Sprintf("%s: no descriptor matches value %q at depth %d (no exact, wildcard or key-only %q)", ev, e.Value, depth, e.Key))
			return nil, append(lines, fmt.Sprintf("no rule at depth %d", depth))
		}
		switch n.lvl.kind {
		case matchExact:
			lines = append(lines, ev+": exact value match")
		case matchWildcard:
			how := "each value has its own budget"
			if n.lvl.share {
				how = "share_threshold: all matching values share one budget"
			}
			lines = append(lines, fmt.Sprintf("%s: wildcard match %q (%s)", ev, n.lvl.value, how))
		default:
			lines = append(lines, ev+": key-only match (each value has its own budget)")
		}
		last := i == len(entries)-1
		if last {
			if n.rule == nil {
				return nil, append(lines, fmt.Sprintf("no rate_limit at depth %d: no rule (unlimited)", depth))
			}
			return n.rule, append(lines, "rule "+describe(n.rule))
		}
		if n.rule != nil {
			lines = append(lines, fmt.Sprintf("  (rule %q at depth %d skipped: the descriptor has %d entries)", n.rule.Name, depth, len(entries)))
		}
		if n.children == nil {
			return nil, append(lines, fmt.Sprintf("no rule at depth %d: the descriptor has %d entries but the matched path ends at depth %d", len(entries), len(entries), depth))
		}
		groups = n.children
	}
	return nil, lines
}

// describe renders a rule for MatchTrace.
func describe(r *Rule) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%q (%s:%d, path %s): ", r.Name, r.File, r.Line, r.Path)
	if r.Unlimited {
		b.WriteString("unlimited")
	} else {
		unit := r.Unit.String()
		if r.UnitMultiplier > 1 {
			unit = fmt.Sprintf("%d %ss", r.UnitMultiplier, unit)
		}
		fmt.Fprintf(&b, "%d per %s, burst %d, %s, backend %s, failure_mode %s",
			r.RequestsPerUnit, unit, r.Burst, r.Algorithm, r.Backend, r.FailureMode)
	}
	if r.ShadowMode {
		b.WriteString(", shadow mode (never denies)")
	}
	if len(r.Replaces) > 0 {
		fmt.Fprintf(&b, ", replaces %s", strings.Join(r.Replaces, ","))
	}
	return b.String()
}

// MatchAll matches every descriptor of one request and applies `replaces`:
// a rule whose name is listed in the replaces of another matched rule
// (shadow or not) is dropped. It returns out[:0] extended with one entry per
// descriptor (nil when no rule applies or the rule was replaced). It does
// not allocate when out has capacity len(descs) and len(descs) ≤ 64.
func (s *Set) MatchAll(domain string, descs [][]Entry, out []*Rule) []*Rule {
	out = out[:0]
	anyReplaces := false
	for _, d := range descs {
		r := s.Match(domain, d)
		if r != nil && len(r.replacesIDs) > 0 {
			anyReplaces = true
		}
		out = append(out, r)
	}
	if !anyReplaces {
		return out
	}
	// Decide every drop against the original matches before clearing any,
	// as Envoy does: a replaced rule's own replaces still count.
	var small [64]bool
	drop := small[:0]
	if len(out) <= len(small) {
		drop = small[:len(out)]
	} else {
		drop = make([]bool, len(out))
	}
	for i, r := range out {
		if r == nil || r.nameID < 0 {
			continue
		}
		for j, o := range out {
			if j == i || o == nil {
				continue
			}
			if o.replacesID(r.nameID) {
				drop[i] = true
				break
			}
		}
	}
	for i := range out {
		if drop[i] {
			out[i] = nil
		}
	}
	return out
}

func (r *Rule) replacesID(id int32) bool {
	for _, x := range r.replacesIDs {
		if x == id {
			return true
		}
	}
	return false
}

// resolveReplaces assigns dense ids to explicit names so MatchAll compares
// integers.
func (s *Set) resolveReplaces() {
	for _, r := range s.rules {
		if r.HasName {
			id, ok := s.nameIDs[r.Name]
			if !ok {
				id = int32(len(s.nameIDs))
				s.nameIDs[r.Name] = id
			}
			r.nameID = id
		}
	}
	for _, r := range s.rules {
		for _, n := range r.Replaces {
			if id, ok := s.nameIDs[n]; ok {
				r.replacesIDs = append(r.replacesIDs, id)
			}
		}
	}
}
