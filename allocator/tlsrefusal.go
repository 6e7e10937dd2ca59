package allocator

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/pkg/tlsconfig"
)

// tlsRefusal returns the TLS alert with which the allocator at addr
// refuses this node's client certificate, or nil when it does not (or
// cannot be reached): probeRefusal with this node's client TLS.
func (s *Server) tlsRefusal(ctx context.Context, addr string) error {
	if s.tls == nil {
		return nil
	}
	return probeRefusal(ctx, s.tls.Client("", tlsconfig.RoleAllocator), addr)
}

// probeRefusal returns the TLS alert with which the server at addr
// refuses the client certificate of cfg, or nil. With TLS 1.3 a server
// checks the client's certificate after sending its own handshake
// messages, so a refusal reaches the client only as an alert on its first
// read, and a gRPC call on that connection usually fails with a bare
// "broken pipe" or "connection reset". probeRefusal makes one handshake of
// its own, within a second, and reads the server's first answer (a gRPC
// server speaks first, with its HTTP/2 settings).
func probeRefusal(ctx context.Context, cfg *tls.Config, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	d := tls.Dialer{Config: cfg}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err == nil {
		defer conn.Close()
		if dl, ok := ctx.Deadline(); ok {
			_ = conn.SetReadDeadline(dl)
		}
		_, err = conn.Read(make([]byte, 1))
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "remote error" {
		return err
	}
	return nil
}

// refusedError names the refusal in front of the call's error (which
// names the address).
func refusedError(alert, err error) error {
	return fmt.Errorf("allocator: this node's client certificate was refused (%v): the global cluster's -tls-ca must verify this node's -tls-cert, an allocator certificate: %w",
		alert, err)
}

// explainRefusal is err, the failure of a call to a global allocator at
// addr, named as a refusal of this node's certificate when tlsRefusal
// finds one.
func (s *Server) explainRefusal(ctx context.Context, addr string, err error) error {
	if !maybeRefused(err) {
		return err
	}
	if alert := s.tlsRefusal(ctx, addr); alert != nil {
		return refusedError(alert, err)
	}
	return err
}

// maybeRefused reports whether err can be a refusal of the client's
// certificate after the handshake: an Unavailable call whose connection
// was made (a failed dial or a handshake the client refused is not one,
// and its error already says why).
func maybeRefused(err error) bool {
	if status.Code(err) != codes.Unavailable {
		return false
	}
	msg := err.Error()
	return !strings.Contains(msg, "while dialing") && !strings.Contains(msg, "authentication handshake failed")
}

// refusals remembers per global allocator the refusal of this node's
// certificate that a probe (tlsRefusal) found, until a call there
// succeeds, so that every failed call reports it while an address is
// probed at most every refusalProbeEvery. The zero value is ready.
type refusals struct {
	mu     sync.Mutex // guards found and probed
	found  map[string]error
	probed map[string]time.Time
}

const refusalProbeEvery = 10 * time.Second

// explain returns err, the failure of a call to addr, named as a refusal
// of this node's certificate when one was found there.
func (r *refusals) explain(ctx context.Context, s *Server, addr string, err error) error {
	if s.tls == nil || !maybeRefused(err) {
		return err
	}
	r.mu.Lock()
	found, due := r.found[addr], time.Since(r.probed[addr]) >= refusalProbeEvery
	if due {
		if r.probed == nil {
			r.probed = map[string]time.Time{}
		}
		r.probed[addr] = time.Now()
	}
	r.mu.Unlock()
	if due {
		found = s.tlsRefusal(ctx, addr)
		r.mu.Lock()
		if r.found == nil {
			r.found = map[string]error{}
		}
		r.found[addr] = found
		r.mu.Unlock()
	}
	if found != nil {
		return refusedError(found, err)
	}
	return err
}

// ok forgets a refusal at addr: a call there succeeded.
func (r *refusals) ok(addr string) {
	r.mu.Lock()
	delete(r.found, addr)
	r.mu.Unlock()
}
