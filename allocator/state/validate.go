package state

import (
	"errors"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/allot/allot/pkg/rules"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Input bounds, the protocol's (proto/allot/v1/bounds.go). Everything
// beyond them is ErrInvalid, so no request can make Apply allocate without
// bound or overflow its arithmetic.
const (
	maxAgentID  = allotv1.MaxIDBytes
	maxKeys     = allotv1.MaxKeysPerCall
	maxKeyBytes = allotv1.MaxKeyBytes
	maxAmount   = allotv1.MaxAmount
	maxRuleYAML = allotv1.MaxRulesBytes
	maxRuleFile = allotv1.MaxRuleFiles
)

// ValidateAcquire checks an AcquireRequest against the protocol's bounds:
// agent_id 1..256 bytes, request_id ≥ 1, at most 1000 keys, each with a
// domain, domain + entries at most 4 KiB, 0 ≤ want, held, returned,
// charged, outage_charged, denied, static_left ≤ 1e12 and a finite demand
// in [0, 1e12]. Errors wrap
// ErrInvalid.
//
// Packed keys (packed_keys) are read whole with the same bounds, and each
// of their strings must be valid UTF-8; a request sets keys or packed_keys,
// not both. A request that passes has a compact record every replica
// decodes (AppendAcquireRecord copies packed keys as they are).
func ValidateAcquire(req *allotv1.AcquireRequest) error {
	if req == nil {
		return fmt.Errorf("%w: nil acquire request", ErrInvalid)
	}
	if p := req.PackedKeys; len(p) > 0 {
		if len(req.Keys) > 0 {
			return fmt.Errorf("%w: both keys and packed_keys are set", ErrInvalid)
		}
		return validatePacked(req.AgentId, req.RequestId, string(p))
	}
	return validateCall(req.AgentId, req.RequestId, req.Keys)
}

// validatePacked checks a call whose keys came packed (p), reading every
// key without keeping it: packedValid passes a valid call, and only a call
// it refuses is read again by packedCause to name the cause.
func validatePacked(agentID string, requestID uint64, p string) error {
	d := allotv1.Reader{S: p, Base: errPacked}
	n := d.Uvarint()
	if d.Err != nil || n > uint64(len(p)) {
		return fmt.Errorf("%w: packed_keys: count", ErrInvalid)
	}
	if err := checkCall(agentID, requestID, int(n)); err != nil {
		return err
	}
	if packedValid(p, d.P, int(n)) {
		return nil
	}
	return packedCause(p, d.P, int(n))
}

// packedCause checks the n packed keys of p from offset at and nothing
// after them key by key, as the state reads them (decoder.key), and
// returns the first key's cause of refusal, or nil.
func packedCause(p string, at, n int) error {
	d := decoder{allotv1.Reader{S: p, P: at, Base: errPacked}}
	var dc allotv1.Dict
	var buf [4]rules.Entry
	for i := range n {
		var k keyArgs
		ents := d.key(&k, &dc, buf[:0])
		if d.Err != nil {
			return fmt.Errorf("%w: packed_keys: key %d: %s", ErrInvalid, i, d.Err)
		}
		k.ents = ents
		err := checkKey(&k)
		if err == nil && !validUTF8(&k) {
			err = errors.New("a string is not valid UTF-8")
		}
		if err != nil {
			return fmt.Errorf("%w: keys[%d]: %s", ErrInvalid, i, err)
		}
	}
	if d.P != len(p) {
		return fmt.Errorf("%w: packed_keys: %d trailing bytes", ErrInvalid, d.Left())
	}
	return nil
}

// packedValid reports whether the n packed keys of p from offset at and
// nothing after them pass packedCause's checks: it reads them as
// ReadPackedKey does but keeps only what the bounds need (strings'
// lengths; a dictionary string's UTF-8 is checked once, as it enters the
// dictionary, not at every use), and names no cause. It never accepts what
// packedCause refuses (FuzzPackedKeys checks); it may refuse what
// packedCause accepts (a flag it does not know), which then decides.
func packedValid(p string, at, n int) bool {
	d := allotv1.Reader{S: p, P: at, Base: errPacked}
	var dict [allotv1.PackedDict]int // the dictionary's string lengths
	nd := 0
	ok := true
	dstr := func() int {
		i := d.Uvarint()
		switch {
		case i == 0:
			s := d.Str()
			ok = ok && validString(s)
			if nd < len(dict) {
				dict[nd] = len(s)
				nd++
			}
			return len(s)
		case i <= uint64(nd):
			return dict[i-1]
		}
		ok = false
		return 0
	}
	amount := func(v int64) { ok = ok && uint64(v) <= maxAmount }
	for range n {
		dl := dstr()
		ne := d.Uvarint()
		if ne > uint64(d.Left()) || dl == 0 {
			return false
		}
		size := dl
		for range ne {
			size += dstr() + 2
			v := d.Str()
			ok = ok && validString(v)
			size += len(v)
		}
		flags := d.Byte()
		promote := false
		if flags&allotv1.PackedMore != 0 {
			f2 := d.Byte()
			if f2&^(allotv1.PackedWantShare|allotv1.PackedPromote|allotv1.PackedStaticReport) != 0 {
				return false
			}
			promote = f2&(allotv1.PackedPromote|allotv1.PackedStaticReport) != 0 // static_left follows
		}
		for f := byte(allotv1.PackedWant); f <= allotv1.PackedDenied; f <<= 1 {
			if flags&f != 0 {
				amount(d.Varint())
			}
		}
		if flags&allotv1.PackedDemand != 0 {
			v := math.Float64frombits(d.Fixed64())
			ok = ok && v >= 0 && v <= maxAmount // false for NaN
		}
		if flags&allotv1.PackedOutage != 0 {
			amount(d.Varint())
		}
		if promote {
			amount(d.Varint())
		}
		if !ok || d.Err != nil || size > maxKeyBytes {
			return false
		}
	}
	return d.P == len(p)
}

// validString is utf8.ValidString; an all-ASCII string, the common short
// one, is passed by a plain byte loop.
func validString(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return utf8.ValidString(s[i:])
		}
	}
	return true
}

// errPacked: packed keys do not decode.
var errPacked = errors.New("malformed")

// validUTF8 reports whether the strings of a decoded key are valid UTF-8.
func validUTF8(k *keyArgs) bool {
	if !utf8.ValidString(k.domain) {
		return false
	}
	for _, e := range k.ents {
		if !utf8.ValidString(e.Key) || !utf8.ValidString(e.Value) {
			return false
		}
	}
	return true
}

// ValidateRelease checks a ReleaseRequest with the same bounds as
// ValidateAcquire.
func ValidateRelease(req *allotv1.ReleaseRequest) error {
	if req == nil {
		return fmt.Errorf("%w: nil release request", ErrInvalid)
	}
	return validateCall(req.AgentId, req.RequestId, req.Keys)
}

func validateCall(agentID string, requestID uint64, keys []*allotv1.KeyAcquire) error {
	if err := checkCall(agentID, requestID, len(keys)); err != nil {
		return err
	}
	for i, k := range keys {
		if err := validateKey(k); err != nil {
			return fmt.Errorf("%w: keys[%d]: %s", ErrInvalid, i, err)
		}
	}
	return nil
}

// validateArgs checks a decoded call as validateCall checks a request.
func validateArgs(cl *call) error {
	if err := checkCall(cl.agentID, cl.requestID, len(cl.keys)); err != nil {
		return err
	}
	for i := range cl.keys {
		if err := checkKey(&cl.keys[i]); err != nil {
			return fmt.Errorf("%w: keys[%d]: %s", ErrInvalid, i, err)
		}
	}
	return nil
}

// checkKey checks a decoded key as validateKey checks a wire key.
func checkKey(k *keyArgs) error {
	n := 0
	for _, e := range k.ents {
		n += len(e.Key) + len(e.Value) + 2
	}
	if err := checkDescriptorLen(k.domain, n); err != nil {
		return err
	}
	return checkAmounts(k.want, k.held, k.returned, k.charged, k.outageCharged, k.denied, k.staticLeft, k.demand)
}

func checkCall(agentID string, requestID uint64, keys int) error {
	switch {
	case agentID == "":
		return fmt.Errorf("%w: empty agent_id", ErrInvalid)
	case len(agentID) > maxAgentID:
		return fmt.Errorf("%w: agent_id is %d bytes, at most %d", ErrInvalid, len(agentID), maxAgentID)
	case requestID == 0:
		return fmt.Errorf("%w: request_id must be ≥ 1", ErrInvalid)
	case keys > maxKeys:
		return fmt.Errorf("%w: %d keys, at most %d", ErrInvalid, keys, maxKeys)
	}
	return nil
}

func validateKey(k *allotv1.KeyAcquire) error {
	if k == nil {
		return fmt.Errorf("nil key")
	}
	if err := validateDescriptor(k.Domain, k.Entries); err != nil {
		return err
	}
	return checkAmounts(k.Want, k.Held, k.Returned, k.Charged, k.OutageCharged, k.Denied, k.StaticLeft, k.Demand)
}

func checkAmounts(want, held, returned, charged, outageCharged, denied, staticLeft int64, demand float64) error {
	for _, f := range [...]struct {
		name string
		v    int64
	}{{"want", want}, {"held", held}, {"returned", returned}, {"charged", charged}, {"outage_charged", outageCharged},
		{"denied", denied}, {"static_left", staticLeft}} {
		if f.v < 0 || f.v > maxAmount {
			return fmt.Errorf("%s %d out of range [0, 1e12]", f.name, f.v)
		}
	}
	if math.IsNaN(demand) || demand < 0 || demand > maxAmount {
		return fmt.Errorf("demand %v out of range [0, 1e12]", demand)
	}
	return nil
}

func validateDescriptor(domain string, entries []*allotv1.Entry) error {
	for _, e := range entries {
		if e == nil {
			return fmt.Errorf("nil entry")
		}
	}
	n := 0
	for _, e := range entries {
		n += len(e.Key) + len(e.Value) + 2
	}
	return checkDescriptorLen(domain, n)
}

// checkDescriptorLen checks a descriptor's domain and the length of its
// entries (n: Σ key + value + 2).
func checkDescriptorLen(domain string, n int) error {
	if domain == "" {
		return fmt.Errorf("empty domain")
	}
	if n += len(domain); n > maxKeyBytes {
		return fmt.Errorf("key is longer than %d bytes", maxKeyBytes)
	}
	return nil
}

func validateCheck(req *allotv1.CheckRequest) error {
	if req == nil {
		return fmt.Errorf("%w: nil check request", ErrInvalid)
	}
	if len(req.Descriptors) == 0 {
		return fmt.Errorf("%w: no descriptors", ErrInvalid)
	}
	if len(req.Descriptors) > maxKeys {
		return fmt.Errorf("%w: %d descriptors, at most %d", ErrInvalid, len(req.Descriptors), maxKeys)
	}
	for i, d := range req.Descriptors {
		if d == nil {
			return fmt.Errorf("%w: descriptors[%d]: nil", ErrInvalid, i)
		}
		if err := validateDescriptor(req.Domain, d.Entries); err != nil {
			return fmt.Errorf("%w: descriptors[%d]: %s", ErrInvalid, i, err)
		}
	}
	return nil
}
