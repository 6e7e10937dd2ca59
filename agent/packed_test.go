package agent

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestPackedKeys: the agent sends its keys packed once an answer says the
// allocator reads them; when an allocator that does not read them answers
// a packed call (it applied a call without keys), the agent sends the same
// keys again unpacked under a new request id, and keeps sending unpacked.
func TestPackedKeys(t *testing.T) {
	s := newStepped(t)
	f := s.fake
	set := func(reads bool) {
		f.mu.Lock()
		f.readsPacked = reads
		f.mu.Unlock()
	}
	counts := func() (calls, packed int) {
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.acquires), f.packedCalls
	}
	set(true)
	sendOne := func(v string) {
		t.Helper()
		check(t, s.Agent, desc("api_key", v))
		s.step()
		req := f.lastAcquire()
		if req == nil || len(req.Keys) != 1 || req.Keys[0].Entries[0].Value != v || req.Keys[0].Charged != 1 {
			t.Fatalf("key %s: last Acquire %v, want that key with its charge", v, req)
		}
	}
	sendOne("k1")
	if c, p := counts(); c != 1 || p != 0 {
		t.Fatalf("first call: %d calls, %d packed; want 1 unpacked (nothing learned yet)", c, p)
	}
	sendOne("k2")
	if c, p := counts(); c != 2 || p != 1 {
		t.Fatalf("second call: %d calls, %d packed; want it packed", c, p)
	}
	if rem := f.bucketRemaining(t, "test:api_key=k2"); rem >= 49 {
		t.Fatalf("k2's charge and grant did not reach the bucket: %d left", rem)
	}
	set(false)
	before := f.lastAcquire().RequestId
	sendOne("k3")
	c, p := counts()
	if c != 4 || p != 1 {
		t.Fatalf("after the allocator stopped reading packed keys: %d calls, %d packed; want the packed one and its unpacked resend", c, p)
	}
	f.mu.Lock()
	ignored, resent := f.acquires[2], f.acquires[3]
	f.mu.Unlock()
	if len(ignored.Keys) != 0 || resent.RequestId != ignored.RequestId+1 || ignored.RequestId != before+1 {
		t.Fatalf("ids %d (%d keys seen), %d after %d; want the resend under the next id", ignored.RequestId, len(ignored.Keys), resent.RequestId, before)
	}
	if rem := f.bucketRemaining(t, "test:api_key=k3"); rem >= 49 {
		t.Fatalf("k3's charge and grant did not reach the bucket: %d left", rem)
	}
	sendOne("k4")
	if _, p := counts(); p != 1 {
		t.Fatalf("the agent went on packing keys for an allocator that does not read them")
	}
}

// TestWireCopiesEveryField: a request sent with its keys packed carries
// every other field of the request as built.
func TestWireCopiesEveryField(t *testing.T) {
	a := &Agent{}
	a.rf.packedKeys = true
	req := &allotv1.AcquireRequest{Keys: []*allotv1.KeyAcquire{{Domain: "d", Want: 1}}}
	m := req.ProtoReflect()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		f := fields.Get(i)
		switch {
		case f.Name() == "keys" || f.Name() == "packed_keys":
		case f.Kind() == protoreflect.BoolKind:
			m.Set(f, protoreflect.ValueOfBool(true))
		case f.Kind() == protoreflect.StringKind:
			m.Set(f, protoreflect.ValueOfString("x"))
		case f.Kind() == protoreflect.Uint32Kind:
			m.Set(f, protoreflect.ValueOfUint32(uint32(i+1)))
		case f.Kind() == protoreflect.Uint64Kind:
			m.Set(f, protoreflect.ValueOfUint64(uint64(i+1)))
		default:
			t.Fatalf("AcquireRequest.%s: a field of a kind this test does not set", f.Name())
		}
	}
	w := a.wire(req)
	if len(w.PackedKeys) == 0 || len(w.Keys) != 0 {
		t.Fatalf("wire = %v; want the keys packed", w)
	}
	want := proto.Clone(req).(*allotv1.AcquireRequest)
	want.Keys, want.PackedKeys = nil, w.PackedKeys
	if !proto.Equal(w, want) {
		t.Fatalf("wire = %v\nwant %v", w, want)
	}
}
