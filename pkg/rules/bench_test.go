package rules

import (
	"fmt"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// benchSet is the example rules plus 1000 exact-valued siblings at
// each level, so map lookups are not trivially small.
func benchSet(b *testing.B) *Set {
	b.Helper()
	src := []byte(ExampleYAML)
	extra := "domain: bulk\ndescriptors:\n"
	for i := 0; i < 1000; i++ {
		extra += fmt.Sprintf("  - key: tier\n    value: t%d\n    descriptors:\n      - key: route\n        value: /r%d\n        descriptors:\n          - key: api_key\n            rate_limit: {unit: minute, requests_per_unit: 10}\n", i, i)
	}
	s, err := Compile(1, []File{{Name: "public-api.yaml", Source: src}, {Name: "bulk.yaml", Source: []byte(extra)}})
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// BenchmarkMatch3Level: the example's D2 descriptor (exact, exact,
// key-only), 0 allocs/op.
func BenchmarkMatch3Level(b *testing.B) {
	s := benchSet(b)
	d := E("tier=free", "route=/v1/search", "api_key=k_live_0123456789abcdef")
	b.ReportAllocs()
	for b.Loop() {
		if s.Match("public-api", d) == nil {
			b.Fatal("no match")
		}
	}
}

func BenchmarkMatch3LevelParallel(b *testing.B) {
	s := benchSet(b)
	d := E("tier=t500", "route=/r500", "api_key=k_live_0123456789abcdef")
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if s.Match("bulk", d) == nil {
				b.Fatal("no match")
			}
		}
	})
}

// BenchmarkMatchAll: one gateway request, three descriptors, with replaces.
func BenchmarkMatchAll(b *testing.B) {
	s := benchSet(b)
	descs := designCardDescs("premium", "/v1/search", "k_live_abc123")
	out := make([]*Rule, 0, 3)
	b.ReportAllocs()
	for b.Loop() {
		out = s.MatchAll("public-api", descs, out)
	}
}

func BenchmarkMatchWildcard(b *testing.B) {
	s, err := Compile(1, []File{{Name: "w.yaml", Source: []byte(`
domain: w
descriptors:
  - key: path
    value: /api/v1/users/*
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: path
    value: /api/*/orders*
    rate_limit: {unit: second, requests_per_unit: 1}
`)}})
	if err != nil {
		b.Fatal(err)
	}
	d := E("path=/api/v2/orders/123")
	b.ReportAllocs()
	for b.Loop() {
		if s.Match("w", d) == nil {
			b.Fatal("no match")
		}
	}
}

// BenchmarkKeyHash hashes the canonical key without building it; the
// baseline builds the key and hashes the bytes.
func BenchmarkKeyHash(b *testing.B) {
	d := E("tier=free", "route=/v1/search", "api_key=k_live_0123456789abcdef")
	b.Run("KeyHash", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = KeyHash(nil, "public-api", d)
		}
	})
	b.Run("KeyHash/escaping", func(b *testing.B) {
		d := E("tier=free", "route=/v1/search?a=b,c=d", "api_key=k:live:0123456789abcdef")
		b.ReportAllocs()
		for b.Loop() {
			_ = KeyHash(nil, "public-api", d)
		}
	})
	b.Run("baseline/AppendKey+Sum64", func(b *testing.B) {
		buf := make([]byte, 0, 256)
		b.ReportAllocs()
		for b.Loop() {
			buf = AppendKey(buf[:0], nil, "public-api", d)
			_ = xxhash.Sum64(buf)
		}
	})
	b.Run("baseline/string+Sum64String", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = xxhash.Sum64String(string(AppendKey(nil, nil, "public-api", d)))
		}
	})
}

func BenchmarkCompileExample(b *testing.B) {
	files := ExampleFiles()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Compile(1, files); err != nil {
			b.Fatal(err)
		}
	}
}
