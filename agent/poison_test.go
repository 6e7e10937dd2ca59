package agent

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/pkg/rules"
)

// plantKey puts a key state for (domain, entries) into a's table the way
// shard.insert does, but without its check that the key can be encoded: a
// key that slipped past every validation.
func plantKey(a *Agent, domain string, entries []rules.Entry) *keyState {
	r := a.rules.Load().Match(domain, entries)
	h := a.keys.keyHash(r, domain, entries)
	sh := a.keys.shard(h)
	sh.mu.Lock()
	ks := &keyState{
		hash:    h,
		key:     string(rules.AppendKey(nil, r, domain, entries)),
		domain:  strings.Clone(domain),
		entries: append([]rules.Entry(nil), entries...),
		next:    sh.m[h],
	}
	ks.lastUse.Store(a.now())
	ks.lowWater.Store(1)
	ks.charged.Store(1) // a fallback admission to report: it is picked
	sh.m[h] = ks
	sh.mu.Unlock()
	a.enqueue(ks)
	return ks
}

// TestInvalidUTF8KeyPoisonsGateway pins the poisoned-gateway bug: one key
// that is not valid UTF-8 was admitted, rode in every batched Acquire, and
// the gRPC codec refused to encode those calls ("string field contains
// invalid UTF-8"); counted as transport failures, they opened the breaker
// for good and every key was decided from fallback. Check must refuse the
// key, and a key that slips into the table anyway must cost only itself.
func TestInvalidUTF8KeyPoisonsGateway(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a real allocator")
	}
	srv := startAllocator(t, t.TempDir())
	defer stopAllocator(t, srv)
	cfg := DefaultConfig()
	cfg.Allocators = []string{srv.GRPC}
	cfg.RefillInterval = 5 * time.Millisecond
	cfg.ScanInterval = 20 * time.Millisecond
	cfg.Logger = testLogger(t)
	a := newAgent(t, cfg)
	waitFor(t, 20*time.Second, "agent ready", a.Ready)

	good := desc("tier", "free", "route", "r", "user", "good") // 10⁹/s: checked in loops
	waitFor(t, 10*time.Second, "a lease for the good key", func() bool {
		return check(t, a, good).Source == SourceLease
	})

	for _, v := range []string{"k\xff", "k\x00", "k\r\nX: y"} {
		if _, err := a.Check(context.Background(), "test", []Descriptor{desc("api_key", v)}, 1); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Check(%q): err %v, want ErrInvalid", v, err)
		}
	}
	if k := keyOf(t, a, desc("api_key", "k\xff")); k != nil {
		t.Fatal("a refused key entered the table")
	}

	// Defence in depth: a key the encoder refuses is planted in the table
	// and enqueued with the good key.
	plantKey(a, "test", desc("api_key", "k\xff").Entries)
	waitFor(t, 10*time.Second, "the planted key refused", func() bool {
		if got := check(t, a, good); !got.Allowed {
			t.Fatalf("good key denied while the bad key was batched: %+v", got)
		}
		return dtoCounter{}.read(a.met.keysRefused) == 1
	})
	// A key first seen after the refusal is leased: the allocator is
	// still in use.
	fresh := desc("tier", "free", "route", "r", "user", "fresh")
	waitFor(t, 10*time.Second, "a lease for a fresh key", func() bool {
		return check(t, a, fresh).Source == SourceLease
	})
	if n := (dtoCounter{}).read(a.met.toOpen); n != 0 || a.breakerOpen.Load() {
		t.Fatalf("breaker opened %v times (open now: %v)", n, a.breakerOpen.Load())
	}
	if n := (dtoCounter{}).read(a.met.callsFailed); n != 0 {
		t.Fatalf("%v Acquire calls counted as transport failures", n)
	}
	if got := check(t, a, desc("closed", "c")); !got.Allowed {
		t.Fatalf("a failure_mode closed key after the refusal: %+v, want allowed", got)
	}
	if got := check(t, a, good); got.Source != SourceLease || !got.Allowed {
		t.Fatalf("good key after the refusal: %+v, want a leased admission", got)
	}
	if n := (dtoCounter{}).read(a.met.keysRefused); n != 1 {
		t.Fatalf("keys refused = %v, want 1 (the planted key, once)", n)
	}
}
