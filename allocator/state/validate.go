package state

import (
	"fmt"
	"math"

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
// charged, denied ≤ 1e12 and a finite demand in [0, 1e12]. Errors wrap
// ErrInvalid.
func ValidateAcquire(req *allotv1.AcquireRequest) error {
	if req == nil {
		return fmt.Errorf("%w: nil acquire request", ErrInvalid)
	}
	return validateCall(req.AgentId, req.RequestId, req.Keys)
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
		k := &cl.keys[i]
		n := 0
		for _, e := range k.ents {
			n += len(e.Key) + len(e.Value) + 2
		}
		err := checkDescriptorLen(k.domain, n)
		if err == nil {
			err = checkAmounts(k.want, k.held, k.returned, k.charged, k.outageCharged, k.denied, k.demand)
		}
		if err != nil {
			return fmt.Errorf("%w: keys[%d]: %s", ErrInvalid, i, err)
		}
	}
	return nil
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
	return checkAmounts(k.Want, k.Held, k.Returned, k.Charged, k.OutageCharged, k.Denied, k.Demand)
}

func checkAmounts(want, held, returned, charged, outageCharged, denied int64, demand float64) error {
	for _, f := range [...]struct {
		name string
		v    int64
	}{{"want", want}, {"held", held}, {"returned", returned}, {"charged", charged}, {"outage_charged", outageCharged}, {"denied", denied}} {
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
