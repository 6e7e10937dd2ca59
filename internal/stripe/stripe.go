// Package stripe is a striped counter: a set of counters kept once per
// stripe and summed when read, so that goroutines on different cores
// increment different cache lines. The agent's decision counters and the
// HTTP middleware's request counters use it.
//
// A caller picks its stripe with a hint, the address of a variable on its
// own stack (uintptr(unsafe.Pointer(&v))): stable for a goroutine,
// different between goroutines, and free to compute.
package stripe

import "sync/atomic"

// N is the number of stripes.
const N = 16

// lineWords is the stride unit: 128 bytes (two cache lines, as adjacent
// line prefetchers pair them) of uint64s.
const lineWords = 16

// Index maps a hint to a stripe in [0, N). The address is hashed
// (Fibonacci hashing, the top 4 bits) because stacks are power-of-two
// sized and aligned, so its low bits repeat.
func Index(hint uintptr) int { return int((uint64(hint) * 0x9E3779B97F4A7C15) >> (64 - 4)) }

// Counters is n counters, striped. Its methods are safe for concurrent
// use; the zero value has no counters (use New).
type Counters struct {
	v      []atomic.Uint64 // stripe s, counter i: v[s*stride+i]
	n      int
	stride int
}

// New returns n counters at zero. Each stripe starts on its own 128-byte
// boundary within the allocation.
func New(n int) *Counters {
	stride := (n + lineWords - 1) / lineWords * lineWords
	return &Counters{v: make([]atomic.Uint64, N*stride), n: n, stride: stride}
}

// Add adds delta to counter i on hint's stripe and returns that stripe's
// new value of the counter (for sampling one event in 2^k).
func (c *Counters) Add(hint uintptr, i int, delta uint64) uint64 {
	return c.v[Index(hint)*c.stride+i].Add(delta)
}

// Sum returns counter i summed over the stripes. It is not a snapshot:
// increments racing with it may or may not be counted.
func (c *Counters) Sum(i int) uint64 {
	var s uint64
	for off := i; off < len(c.v); off += c.stride {
		s += c.v[off].Load()
	}
	return s
}

// Len returns the number of counters.
func (c *Counters) Len() int { return c.n }
