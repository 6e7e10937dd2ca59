package stripe

import (
	"sync"
	"testing"
	"unsafe"
)

func TestIndexInRange(t *testing.T) {
	seen := map[int]bool{}
	for h := uintptr(0); h < 1<<20; h += 8 << 10 { // aligned stack-like addresses
		i := Index(h)
		if i < 0 || i >= N {
			t.Fatalf("Index(%#x) = %d", h, i)
		}
		seen[i] = true
	}
	if len(seen) < N/2 {
		t.Errorf("aligned addresses spread over %d stripes of %d", len(seen), N)
	}
}

func TestCountersSumConcurrent(t *testing.T) {
	c := New(3)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			var v byte
			hint := uintptr(unsafe.Pointer(&v))
			for range 1000 {
				c.Add(hint, g%3, 1)
			}
			c.Add(hint, 2, 5)
		})
	}
	wg.Wait()
	want := [3]uint64{3000, 3000, 2000 + 8*5}
	for i, w := range want {
		if got := c.Sum(i); got != w {
			t.Errorf("Sum(%d) = %d, want %d", i, got, w)
		}
	}
	if c.Len() != 3 {
		t.Errorf("Len() = %d", c.Len())
	}
}

func TestAddReturnsStripeValue(t *testing.T) {
	c := New(1)
	for k := uint64(1); k <= 3; k++ {
		if got := c.Add(42, 0, 1); got != k {
			t.Fatalf("step %d: Add = %d, want %d", k, got, k)
		}
	}
}

func BenchmarkAddParallel(b *testing.B) {
	c := New(6)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		var v byte
		hint := uintptr(unsafe.Pointer(&v))
		for pb.Next() {
			c.Add(hint, 1, 1)
		}
	})
}
