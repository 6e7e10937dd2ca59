// Package proxybuf is the copy-buffer pool of allot's reverse proxy
// (cmd/gateway, and bench/gateway, which measures that proxy).
package proxybuf

import "sync"

// Size is the size of the buffers the proxy copies bodies with: what
// httputil.ReverseProxy allocates per request without a BufferPool.
const Size = 32 << 10

// Pool is an httputil.BufferPool of Size buffers. Without it every proxied
// request allocates (and clears) 32 KiB, which made allocation and GC the
// largest CPU cost of a request through the gateway. The zero Pool is
// ready to use.
type Pool struct{ p sync.Pool }

// Get returns a buffer of Size bytes.
func (b *Pool) Get() []byte {
	if a, ok := b.p.Get().(*[Size]byte); ok {
		return a[:]
	}
	return make([]byte, Size)
}

// Put keeps full-size buffers only; holding the array pointer (not a slice)
// keeps Put allocation-free.
func (b *Pool) Put(buf []byte) {
	if cap(buf) >= Size {
		b.p.Put((*[Size]byte)(buf[:Size]))
	}
}
