package proxybuf

import "testing"

// TestPool: buffers are Size long, a short one is not kept, and a kept one
// comes back without allocating.
func TestPool(t *testing.T) {
	var p Pool
	b := p.Get()
	if len(b) != Size {
		t.Fatalf("Get: %d bytes, want %d", len(b), Size)
	}
	p.Put(make([]byte, 10)) // dropped
	if allocs := testing.AllocsPerRun(100, func() { p.Put(p.Get()) }); allocs > 0 {
		t.Fatalf("Get+Put: %v allocations, want 0", allocs)
	}
}
