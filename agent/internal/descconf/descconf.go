// Package descconf validates and compiles the descriptors section that the
// HTTP middleware's and the gRPC interceptors' configurations share: a list
// of descriptors, each a list of entries, under a domain, with a bound on
// the bytes of one extracted value. The entries themselves (where a value
// comes from) are each edge's own, compiled by the function it passes.
package descconf

import (
	"errors"
	"fmt"
)

// Bounds are the limits of a descriptors section.
type Bounds struct {
	MaxDescriptors  int // descriptors in a config
	MaxEntries      int // entries in one descriptor
	DefaultMaxValue int // bytes of one value when the config says 0
}

// Compiled is a validated descriptors section.
type Compiled[S any] struct {
	Descs    [][]S // each descriptor's compiled entries
	Total    int   // entries in all
	MaxValue int   // the bound on one value's bytes (the default applied)
}

// Compile validates a descriptors section and compiles each entry with
// compile. Errors start with pkg (the calling package's name) and name the
// field: max_value_bytes, domain, descriptors[i] or descriptors[i][j].
func Compile[D ~[]E, E, S any](pkg string, b Bounds, domain string, maxValue int, descs []D, compile func(E) (S, error)) (Compiled[S], error) {
	c := Compiled[S]{MaxValue: maxValue}
	if c.MaxValue == 0 {
		c.MaxValue = b.DefaultMaxValue
	}
	if c.MaxValue < 0 {
		return c, errors.New(pkg + ": max_value_bytes must be ≥ 0")
	}
	if len(descs) > b.MaxDescriptors {
		return c, fmt.Errorf("%s: descriptors: %d configured, at most %d", pkg, len(descs), b.MaxDescriptors)
	}
	if len(descs) > 0 && domain == "" {
		return c, errors.New(pkg + ": domain: must be set when descriptors are configured")
	}
	for i, d := range descs {
		if len(d) == 0 || len(d) > b.MaxEntries {
			return c, fmt.Errorf("%s: descriptors[%d]: needs 1 to %d entries, has %d", pkg, i, b.MaxEntries, len(d))
		}
		specs := make([]S, len(d))
		for j, e := range d {
			s, err := compile(e)
			if err != nil {
				return c, fmt.Errorf("%s: descriptors[%d][%d]: %v", pkg, i, j, err)
			}
			specs[j] = s
		}
		c.Descs = append(c.Descs, specs)
		c.Total += len(specs)
	}
	return c, nil
}
