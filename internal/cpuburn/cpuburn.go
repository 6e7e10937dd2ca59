// Package cpuburn spins goroutines to saturate a process's CPU, for the
// measurement "with the allocator's CPU saturated, the gateways keep serving
// from their leases" (bench/gateway -burn, bench/load -burn).
package cpuburn

import (
	"sync"
	"sync/atomic"
)

// Burner is a set of spinning goroutines; Stop ends them and waits.
type Burner struct {
	quit chan struct{}
	wg   sync.WaitGroup
	once sync.Once
}

// Start starts n spinning goroutines (none for n ≤ 0).
func Start(n int) *Burner {
	b := &Burner{quit: make(chan struct{})}
	for range n {
		b.wg.Add(1)
		go func() {
			defer b.wg.Done()
			x := uint64(1)
			for {
				select {
				case <-b.quit:
					sink.Store(x)
					return
				default:
				}
				for range 100_000 {
					x = x*6364136223846793005 + 1442695040888963407
				}
			}
		}()
	}
	return b
}

// sink keeps the spin loop's result alive.
var sink atomic.Uint64

// Stop ends the goroutines and waits for them; safe to call twice.
func (b *Burner) Stop() {
	b.once.Do(func() { close(b.quit) })
	b.wg.Wait()
}
