package rules

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzCompile: any input either compiles to a consistent Set or fails with a
// *Error; it never panics.
func FuzzCompile(f *testing.F) {
	f.Add([]byte(ExampleYAML))
	if paths, _ := filepath.Glob("testdata/*.yaml"); len(paths) > 0 {
		for _, p := range paths {
			if b, err := os.ReadFile(p); err == nil {
				f.Add(b)
			}
		}
	}
	f.Add([]byte("domain: d\ndescriptors:\n  - key: a\n    value: x*y*\n    share_threshold: true\n    rate_limit: {unit: SECOND, requests_per_unit: 3, burst: 2, algorithm: gcra}\n"))
	f.Add([]byte("domain: d\ndescriptors:\n  - key: a\n    rate_limit: &l {unit: minute, requests_per_unit: 1}\n  - key: b\n    rate_limit:\n      <<: *l\n"))
	f.Add([]byte("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, replaces: [{name: x}]}\n"))
	f.Add([]byte(scopeYAML))
	f.Add([]byte(scopeJSON))
	f.Add([]byte("domain: d\nscope: global\nglobal_fallback: static\nstatic_fraction: {a: 0.5, '*': 1}\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, scope: regional}\n"))
	f.Add([]byte("<<: &a {<<: *a}\n"))
	f.Add([]byte("domain: d\ndescriptors:\n  - &a {key: k, <<: *a}\n"))
	f.Fuzz(func(t *testing.T, src []byte) {
		s, err := Compile(1, []File{{Name: "fuzz.yaml", Source: src}})
		if err != nil {
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("error %v is %T, want *Error", err, err)
			}
			if s != nil {
				t.Fatal("non-nil Set with an error")
			}
			return
		}
		if len(s.Domains()) != 1 || len(s.Files()) != 1 || s.Files()[0].Domain != s.Domains()[0] {
			t.Fatalf("Domains=%v Files=%v", s.Domains(), s.Files())
		}
		domain := s.Domains()[0]
		for i, r := range s.Rules() {
			if r.ID != i || r.Domain != domain || r.Depth != len(r.levels) || r.Depth < 1 {
				t.Fatalf("rule %d inconsistent: %+v", i, r)
			}
			if r.Unlimited != r.Limit.IsZero() {
				t.Fatalf("rule %d: Unlimited=%v but Limit.IsZero()=%v", i, r.Unlimited, r.Limit.IsZero())
			}
			if r.Scope > ScopeGlobal || (r.Scope != ScopeGlobal && (r.GlobalFallback != FallbackFairShare || r.StaticFractions != nil)) ||
				(r.GlobalFallback == FallbackStatic) != (len(r.StaticFractions) > 0) || (r.Unlimited && r.Scope != ScopeRegional) ||
				(r.Scope == ScopeGlobal && r.Backend != BackendLease) {
				t.Fatalf("rule %d: inconsistent scope %v fallback %v fractions %v backend %v", i, r.Scope, r.GlobalFallback, r.StaticFractions, r.Backend)
			}
			for j, fr := range r.StaticFractions {
				if !(fr.Fraction > 0 && fr.Fraction <= 1) || fr.Region == "" || (j > 0 && r.StaticFractions[j-1].Region >= fr.Region) {
					t.Fatalf("rule %d: bad static fractions %v", i, r.StaticFractions)
				}
			}
			if r.DenyAll && (r.Unlimited || r.RequestsPerUnit != 0 || r.Window <= 0) {
				t.Fatalf("rule %d deny-all with bad parameters: %+v", i, r)
			}
			if !r.Unlimited && !r.DenyAll && (r.Burst < 1 || r.RequestsPerUnit < 1 || r.Window <= 0 || r.Shards < 1) {
				t.Fatalf("rule %d limited with bad parameters: %+v", i, r)
			}
			// A descriptor built from the rule's own path (wildcards
			// instantiated by their pattern text) must match a rule of the
			// same depth, and hashing must agree with AppendKey.
			d := make([]Entry, len(r.levels))
			for j, l := range r.levels {
				d[j] = Entry{Key: l.key, Value: l.value}
			}
			m := s.Match(domain, d)
			if m == nil || m.Depth != r.Depth {
				t.Fatalf("rule %d (%s) not reachable by its own path: got %v", i, r.Path, m)
			}
			if KeyHash(m, domain, d) != KeyHash(m, domain, d) {
				t.Fatal("KeyHash not deterministic")
			}
			_, _ = s.MatchTrace(domain, d)
			_ = s.MatchAll(domain, [][]Entry{d, d}, nil)
		}
	})
}
