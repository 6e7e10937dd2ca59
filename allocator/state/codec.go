package state

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Compact Acquire entries. A batch of Acquire calls is replicated as one
// log entry in a byte format of its own rather than as a protobuf
// Command: one record per call, fields as varints, so that no protobuf
// message is built or parsed per key and no string is validated or
// allocated per key on the replicated path. A log entry is either a
// protobuf Command or a compact entry; the first byte tells them apart (a
// protobuf Command starts with a field tag, never 0).
//
//	entry   0x00, version (2), uvarint now (Unix ns), uvarint calls, calls × record
//	record  str agent_id, uvarint request_id, uvarint rules_version,
//	        uvarint fallback_keys, static, keys
//	static  byte (bit 0: static_shares, bit 1: hot_version follows), then
//	        uvarint hot_version with bit 1
//	keys    the call's keys in the packed form of AcquireRequest.packed_keys
//	        (allotv1.AppendPackedKeys): uvarint count, count × key, with
//	        domains and descriptor keys carried once per call
//	str     uvarint length, bytes
//
// A request that came with packed keys has them copied into its record as
// they came, once ValidateAcquire has read them whole: a record that does
// not decode would stop every replica. Records are encoded by the caller's
// goroutine (AppendAcquireRecord) and joined by the batcher
// (AppendAcquireEntry). Every replica applies an entry of any version it
// knows; a version it does not know stops it (upgrade it). A key that
// asks for its share (want_share, a region's) carries a second flags byte
// in its packed form, which a binary older than the field does not decode
// either: it stops on such an entry (docs/regions.md, Upgrading). Version
// 1 is version 2 without the static byte (its calls ask for no static
// shares); this binary writes version 2 and applies both.
const (
	compactMarker    = 0x00
	compactVersion   = 2
	compactVersionV1 = 1 // still applied

	compactStatic     = 1 // static byte: static_shares
	compactHotVersion = 2 // static byte: hot_version follows
)

// IsCompactEntry reports whether a log entry's data is a compact Acquire
// batch (else it is a protobuf Command).
func IsCompactEntry(data []byte) bool { return len(data) > 0 && data[0] == compactMarker }

// AppendAcquireRecord appends req's compact record to dst. It encodes the
// request as it is, valid or not: the state validates it when applying,
// but packed keys must have passed ValidateAcquire (they are copied, not
// decoded).
func AppendAcquireRecord(dst []byte, req *allotv1.AcquireRequest) []byte {
	dst = appendStr(dst, req.GetAgentId())
	dst = binary.AppendUvarint(dst, req.GetRequestId())
	dst = binary.AppendUvarint(dst, req.GetRulesVersion())
	dst = binary.AppendUvarint(dst, uint64(req.GetFallbackKeys()))
	var st byte
	if req.GetStaticShares() {
		st |= compactStatic
	}
	if hv := req.GetHotVersion(); hv != 0 {
		dst = binary.AppendUvarint(append(dst, st|compactHotVersion), hv)
	} else {
		dst = append(dst, st)
	}
	if p := req.GetPackedKeys(); len(p) > 0 {
		return append(dst, p...)
	}
	return allotv1.AppendPackedKeys(dst, req.GetKeys())
}

// AppendAcquireEntry appends a compact entry of the given records (each
// from AppendAcquireRecord), stamped now, to dst.
func AppendAcquireEntry(dst []byte, now int64, records [][]byte) []byte {
	dst = append(dst, compactMarker, compactVersion)
	dst = binary.AppendUvarint(dst, uint64(now))
	dst = binary.AppendUvarint(dst, uint64(len(records)))
	for _, r := range records {
		dst = append(dst, r...)
	}
	return dst
}

func appendStr(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// errCompact: a compact entry does not decode.
var errCompact = errors.New("state: compact acquire entry does not decode")

// decoder reads a compact entry. Its strings are substrings of S, which
// holds the whole entry (one copy of the entry's bytes, however many
// strings it holds).
type decoder struct {
	allotv1.Reader
}

func newDecoder(s string, p int) *decoder {
	return &decoder{allotv1.Reader{S: s, P: p, Base: errCompact}}
}

// call is one Acquire call, decoded from a compact record or converted
// from a protobuf request.
type call struct {
	agentID      string
	requestID    uint64
	rulesVersion uint64 // informational: the state does not read it
	fallback     uint32
	static       bool   // AcquireRequest.static_shares
	hotVersion   uint64 // AcquireRequest.hot_version
	keys         []keyArgs
}

// keyArgs is one key's report and request (KeyAcquire's fields).
type keyArgs struct {
	domain                                string
	ents                                  []rules.Entry
	want, held, returned, charged, denied int64
	outageCharged                         int64
	demand                                float64
	wantShare                             bool // the grant carries the agent's share (rateShare)
	promote                               bool // KeyAcquire.promote, with static_left
	staticReport                          bool // KeyAcquire.static_report, with static_left
	staticLeft                            int64
	ef, et                                int // ents' span in the decoder's entry slice
	// Set by hashKeys (hashed): the matched rule, the canonical key and
	// its hash.
	rule   *rules.Rule
	key    []byte
	h      uint64
	hashed bool
}

// record decodes the next record of an entry of the given version into
// cl, reusing cl's and ents' storage; ents holds the keys' descriptor
// entries (returned for reuse).
func (d *decoder) record(cl *call, ents []rules.Entry, version byte) []rules.Entry {
	cl.agentID = d.Str()
	cl.requestID = d.Uvarint()
	cl.rulesVersion = d.Uvarint()
	fb := d.Uvarint()
	cl.fallback = uint32(min(fb, math.MaxUint32))
	cl.static, cl.hotVersion = false, 0
	if version >= 2 {
		st := d.Byte()
		if st&^(compactStatic|compactHotVersion) != 0 {
			d.Fail()
		}
		cl.static = st&compactStatic != 0
		if st&compactHotVersion != 0 {
			if cl.hotVersion = d.Uvarint(); cl.hotVersion == 0 {
				d.Fail() // not in canonical form
			}
		}
	}
	return d.keys(cl, ents)
}

// keys decodes a call's packed keys into cl.keys, reusing its and ents'
// storage; ents holds the keys' descriptor entries (returned for reuse).
func (d *decoder) keys(cl *call, ents []rules.Entry) []rules.Entry {
	cl.keys = cl.keys[:0]
	ents = ents[:0]
	n := d.Uvarint()
	if n > uint64(d.Left()) { // a key takes at least a byte
		d.Fail()
		return ents
	}
	var dc allotv1.Dict
	for range n {
		cl.keys = append(cl.keys, keyArgs{})
		ents = d.key(&cl.keys[len(cl.keys)-1], &dc, ents)
		if d.Err != nil {
			return ents
		}
	}
	for i := range cl.keys {
		k := &cl.keys[i]
		k.ents = ents[k.ef:k.et:k.et]
	}
	return ents
}

// key decodes one packed key into k, appending its descriptor entries to
// ents (k.ef and k.et say where; k.ents is left for the caller to set).
func (d *decoder) key(k *keyArgs, dc *allotv1.Dict, ents []rules.Entry) []rules.Entry {
	var pk allotv1.PackedKey
	from := len(ents)
	ents = allotv1.ReadPackedKey(&d.Reader, dc, &pk, ents)
	*k = keyArgs{domain: pk.Domain, want: pk.Want, held: pk.Held, returned: pk.Returned, charged: pk.Charged,
		denied: pk.Denied, outageCharged: pk.OutageCharged, demand: pk.Demand, wantShare: pk.WantShare,
		promote: pk.Promote, staticReport: pk.StaticReport, staticLeft: pk.StaticLeft, ef: from, et: len(ents)}
	return ents
}

// applyCompact applies a compact entry. It returns errCompact (wrapped)
// if the entry does not decode, after applying the calls before the
// malformed one: the caller must stop (a replica that applies part of an
// entry has drifted).
func (c *core) applyCompact(s string, lastNow int64) (*AcquireBatchResult, error) {
	d := newDecoder(s, 2)
	if len(s) < 2 || s[0] != compactMarker {
		return nil, fmt.Errorf("%w: no marker", errCompact)
	}
	version := s[1]
	if version != compactVersion && version != compactVersionV1 {
		return nil, fmt.Errorf("%w: version %d is not known to this binary", ErrUnknownCommand, s[1])
	}
	now := int64(d.Uvarint())
	now = max(now, lastNow)
	n := d.Uvarint()
	if d.Err != nil || n > uint64(len(s)) {
		return nil, fmt.Errorf("%w: header", errCompact)
	}
	res := &AcquireBatchResult{
		Responses: make([]*allotv1.AcquireResponse, n),
		Errs:      make([]error, n),
	}
	cl := &c.scr.call
	for i := range int(n) {
		c.scr.ents = d.record(cl, c.scr.ents, version)
		if d.Err != nil {
			return nil, d.Err
		}
		res.Responses[i], res.Errs[i] = c.applyCall(cl, now, res)
	}
	if d.P != len(s) {
		return nil, fmt.Errorf("%w: %d trailing bytes", errCompact, len(s)-d.P)
	}
	return res, nil
}

// DecodeAcquireEntry decodes a compact entry into its stamp and the
// requests it carries (tools and tests: the state applies entries without
// building these).
func DecodeAcquireEntry(data []byte) (now int64, reqs []*allotv1.AcquireRequest, err error) {
	s := string(data)
	if len(s) < 2 || s[0] != compactMarker {
		return 0, nil, fmt.Errorf("%w: no marker", errCompact)
	}
	version := s[1]
	if version != compactVersion && version != compactVersionV1 {
		return 0, nil, fmt.Errorf("%w: version %d is not known to this binary", ErrUnknownCommand, s[1])
	}
	d := newDecoder(s, 2)
	now = int64(d.Uvarint())
	n := d.Uvarint()
	if d.Err != nil || n > uint64(len(s)) {
		return 0, nil, fmt.Errorf("%w: header", errCompact)
	}
	var cl call
	var ents []rules.Entry
	for range n {
		ents = d.record(&cl, ents, version)
		if d.Err != nil {
			return 0, nil, d.Err
		}
		req := &allotv1.AcquireRequest{AgentId: cl.agentID, RequestId: cl.requestID, RulesVersion: cl.rulesVersion,
			FallbackKeys: cl.fallback, StaticShares: cl.static, HotVersion: cl.hotVersion,
			Keys: make([]*allotv1.KeyAcquire, len(cl.keys))}
		for i, k := range cl.keys {
			ka := &allotv1.KeyAcquire{Domain: k.domain, Want: k.want, Held: k.held, Returned: k.returned,
				Charged: k.charged, OutageCharged: k.outageCharged, Denied: k.denied, Demand: k.demand, WantShare: k.wantShare,
				Promote: k.promote, StaticReport: k.staticReport, StaticLeft: k.staticLeft}
			for _, e := range k.ents {
				ka.Entries = append(ka.Entries, &allotv1.Entry{Key: e.Key, Value: e.Value})
			}
			req.Keys[i] = ka
		}
		reqs = append(reqs, req)
	}
	if d.P != len(s) {
		return 0, nil, fmt.Errorf("%w: %d trailing bytes", errCompact, len(s)-d.P)
	}
	return now, reqs, nil
}
