package allotv1

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// Packed grants: AcquireResponse.packed_grants carries an Acquire's grants
// as one byte string instead of one KeyGrant message per key, and each
// distinct Limit once (AcquireResponse.limits), so that neither the
// allocator nor the agent marshals, parses or validates a message and a
// Limit per key. A caller asks for it with AcquireRequest.packed_grants.
//
//	packed  uvarint count, count × grant
//	grant   uvarint status (with bit 32 set: the grant carries a share),
//	        uvarint key length, key bytes,
//	        varint granted, lease_ttl_ms, refresh_after_ms, remaining,
//	        reset_after_ms, retry_after_ms, held (zigzag),
//	        uvarint agents, uvarint limit (0: none; i: limits[i-1]),
//	        then, with bit 32 of status, share (float64 bits, little endian)
//
// A grant carries a share only when its key asked for one
// (KeyAcquire.want_share); a decoder that does not know bit 32 rejects
// such a grant as not decoding rather than misreading it.

// packedShare: bit 32 of a packed grant's status, set when a share
// follows the grant's limit index.
const packedShare = 1 << 32

// errPacked: packed grants do not decode.
var errPacked = errors.New("allotv1: packed grants do not decode")

// AppendPackedGrants appends grants in the packed form to dst. limits is
// the response's limit table: a grant's Limit is looked up in it by
// pointer and appended if absent (the allocator shares one Limit message
// per rule, so the table holds one entry per distinct rule).
func AppendPackedGrants(dst []byte, limits []*Limit, grants []*KeyGrant) ([]byte, []*Limit) {
	dst = binary.AppendUvarint(dst, uint64(len(grants)))
	for _, g := range grants {
		dst, limits = AppendPackedGrant(dst, limits, g.GetKey(), g)
	}
	return dst, limits
}

// AppendPackedGrant appends one grant's record to dst, as
// AppendPackedGrants does after the count, with key in place of g's Key
// (so that a caller holding the key as bytes need not make it a string).
func AppendPackedGrant[K string | []byte](dst []byte, limits []*Limit, key K, g *KeyGrant) ([]byte, []*Limit) {
	status := uint64(uint32(g.GetStatus()))
	if g.Share != nil {
		status |= packedShare
	}
	dst = binary.AppendUvarint(dst, status)
	dst = binary.AppendUvarint(dst, uint64(len(key)))
	dst = append(dst, key...)
	for _, v := range [...]int64{g.GetGranted(), g.GetLeaseTtlMs(), g.GetRefreshAfterMs(), g.GetRemaining(),
		g.GetResetAfterMs(), g.GetRetryAfterMs(), g.GetHeld()} {
		dst = binary.AppendVarint(dst, v)
	}
	dst = binary.AppendUvarint(dst, uint64(g.GetAgents()))
	li := 0
	if l := g.GetLimit(); l != nil {
		for i, x := range limits {
			if x == l {
				li = i + 1
				break
			}
		}
		if li == 0 {
			limits = append(limits, l)
			li = len(limits)
		}
	}
	dst = binary.AppendUvarint(dst, uint64(li))
	if g.Share != nil {
		dst = binary.LittleEndian.AppendUint64(dst, math.Float64bits(*g.Share))
	}
	return dst, limits
}

// UnpackGrants decodes packed grants. The grants share one allocation, and
// their keys one string; their Limits are the messages of limits. A key is
// taken as the bytes it is, without the UTF-8 check a string field gets.
func UnpackGrants(data []byte, limits []*Limit) ([]*KeyGrant, error) {
	d := Reader{S: string(data), Base: errPacked}
	n, err := grantCount(&d)
	if err != nil {
		return nil, err
	}
	vals := make([]KeyGrant, n)
	out := make([]*KeyGrant, n)
	var shares []float64 // one allocation for the grants' shares, if any
	for i := range vals {
		g := &vals[i]
		if share, ok := readGrant(&d, g, limits); ok {
			if shares == nil {
				shares = make([]float64, 0, len(vals)-i)
			}
			shares = append(shares, share)
			g.Share = &shares[len(shares)-1]
		}
		if d.Err != nil {
			return nil, fmt.Errorf("grant %d: %w", i, d.Err)
		}
		out[i] = g
	}
	if d.P != len(d.S) {
		return nil, fmt.Errorf("%w: %d trailing bytes", errPacked, d.Left())
	}
	return out, nil
}

// grantCount reads packed grants' count, refusing one the bytes cannot
// hold: a grant takes at least 11 bytes.
func grantCount(d *Reader) (uint64, error) {
	n := d.Uvarint()
	if d.Err != nil || n > uint64(len(d.S)/11) {
		return 0, fmt.Errorf("%w: count", errPacked)
	}
	return n, nil
}

// readGrant reads one packed grant's record into g, all but its Share, and
// returns the share the record carries, if it carries one. A malformed
// record fails d.
func readGrant(d *Reader, g *KeyGrant, limits []*Limit) (share float64, hasShare bool) {
	status := d.Uvarint()
	hasShare = status&packedShare != 0
	if status &^= packedShare; status > uint64(^uint32(0)>>1) {
		d.Fail()
	}
	g.Status = KeyStatus(status)
	g.Key = d.Str()
	for _, f := range [...]*int64{&g.Granted, &g.LeaseTtlMs, &g.RefreshAfterMs, &g.Remaining,
		&g.ResetAfterMs, &g.RetryAfterMs, &g.Held} {
		*f = d.Varint()
	}
	agents := d.Uvarint()
	if agents > uint64(^uint32(0)) {
		d.Fail()
	}
	g.Agents = uint32(agents)
	switch li := d.Uvarint(); {
	case li == 0:
		g.Limit = nil
	case li <= uint64(len(limits)):
		g.Limit = limits[li-1]
	default:
		d.Fail()
	}
	if hasShare {
		share = math.Float64frombits(d.Fixed64())
	}
	return share, hasShare
}

// GrantTotals returns how many of r's grants, packed or not, have status
// OK and the tokens those grant. Packed grants are read as UnpackGrants
// reads them, and refused as it refuses them, without a message per grant.
func GrantTotals(r *AcquireResponse) (ok int, granted int64, err error) {
	p := r.GetPackedGrants()
	if len(p) == 0 {
		for _, g := range r.GetGrants() {
			if g.GetStatus() == KeyStatus_KEY_STATUS_OK {
				ok++
				granted += g.GetGranted()
			}
		}
		return ok, granted, nil
	}
	limits := r.GetLimits()
	d := Reader{S: string(p), Base: errPacked}
	n, err := grantCount(&d)
	if err != nil {
		return 0, 0, err
	}
	var g KeyGrant
	for i := range n {
		readGrant(&d, &g, limits)
		if d.Err != nil {
			return 0, 0, fmt.Errorf("grant %d: %w", i, d.Err)
		}
		if g.Status == KeyStatus_KEY_STATUS_OK {
			ok++
			granted += g.Granted
		}
	}
	if d.P != len(d.S) {
		return 0, 0, fmt.Errorf("%w: %d trailing bytes", errPacked, d.Left())
	}
	return ok, granted, nil
}

// GrantsOf returns r's grants, unpacking them if they came packed.
func GrantsOf(r *AcquireResponse) ([]*KeyGrant, error) {
	if p := r.GetPackedGrants(); len(p) > 0 {
		return UnpackGrants(p, r.GetLimits())
	}
	return r.GetGrants(), nil
}

// HasStatus reports whether any of r's grants, packed or not, has status
// st, without unpacking them. Packed grants are read only as far as they
// decode: a grant past a malformed one is not seen.
func HasStatus(r *AcquireResponse, st KeyStatus) bool {
	p := r.GetPackedGrants()
	if len(p) == 0 {
		for _, g := range r.GetGrants() {
			if g.GetStatus() == st {
				return true
			}
		}
		return false
	}
	next := func() (uint64, bool) {
		v, k := binary.Uvarint(p)
		if k <= 0 {
			return 0, false
		}
		p = p[k:]
		return v, true
	}
	n, ok := next()
	for i := uint64(0); ok && i < n; i++ {
		var s, klen uint64
		if s, ok = next(); !ok {
			return false
		}
		hasShare := s&packedShare != 0
		if st >= 0 && s&^packedShare == uint64(st) {
			return true
		}
		if klen, ok = next(); !ok || klen > uint64(len(p)) {
			return false
		}
		p = p[klen:]
		// The seven int64 fields, agents and the limit index.
		for range 9 {
			if _, ok = next(); !ok {
				return false
			}
		}
		if hasShare {
			if len(p) < 8 {
				return false
			}
			p = p[8:]
		}
	}
	return false
}

// Packed keys: AcquireRequest.packed_keys carries an Acquire's keys as one
// byte string instead of one KeyAcquire message per key, so that the
// allocator neither parses a message nor validates a string per key, and
// copies the keys into its replicated log entry as they came. Domains and
// descriptor keys repeat across a call's keys: each is carried once, in a
// dictionary of the call's first PackedDict distinct ones.
//
//	packed  uvarint count, count × key
//	key     dstr domain, uvarint entries, entries × (dstr key, str value),
//	        flags, then the fields whose flag is set, in flag order:
//	        want, held, returned, charged, denied (zigzag varints, flags
//	        bits 0-4), demand (float64 bits, little endian, bit 5),
//	        outage_charged (zigzag varint, bit 6); with bit 7, a second
//	        flags byte follows the first, whose bit 0 is want_share (no
//	        field), bit 1 promote and bit 2 static_report, either with
//	        static_left (zigzag varint) after outage_charged
//	str     uvarint length, bytes
//	dstr    uvarint 0 then str (a new string, appended to the dictionary
//	        while it holds fewer than PackedDict), or uvarint i (the
//	        dictionary's i-th string, from 1)
//
// Every string is valid UTF-8, as a string field's would be; the
// allocator rejects a request whose packed keys break the format, the
// bounds of bounds.go or UTF-8 with InvalidArgument.
const PackedDict = 8

// Key field flags of packed keys.
const (
	PackedWant = 1 << iota
	PackedHeld
	PackedReturned
	PackedCharged
	PackedDenied
	PackedDemand
	PackedOutage
	PackedMore // a second flags byte follows
)

// Key flags of packed keys' second flags byte.
const (
	PackedWantShare = 1 << iota
	PackedPromote
	PackedStaticReport
	packedFlags2 = PackedStaticReport<<1 - 1 // every flag
)

// AppendPackedKeys appends keys in the packed form to dst. It encodes the
// keys as they are, valid or not (KeysValidUTF8 tells whether the
// allocator will read them).
func AppendPackedKeys(dst []byte, keys []*KeyAcquire) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(keys)))
	var d packedDict
	for _, k := range keys {
		dst = d.append(dst, k.GetDomain())
		dst = binary.AppendUvarint(dst, uint64(len(k.GetEntries())))
		for _, e := range k.GetEntries() {
			dst = d.append(dst, e.GetKey())
			dst = appendStr(dst, e.GetValue())
		}
		dst = AppendPackedKeyFields(dst, k)
	}
	return dst
}

// PackedKeysWriter writes keys in the packed form one part at a time, as
// AppendPackedKeys does, for a caller that has a key's parts but no
// KeyAcquire message for it: Start with the count, then for each key
// Head, one Entry or EntryBytes for each of its entries, and Fields. B is
// the bytes written so far (dst and the keys); the writer does not check
// that the parts come in that order or that count keys follow.
type PackedKeysWriter struct {
	B []byte
	d packedDict
}

// Start begins n keys after dst.
func (w *PackedKeysWriter) Start(dst []byte, n int) {
	w.B = binary.AppendUvarint(dst, uint64(n))
	w.d = packedDict{}
}

// Head writes a key's domain and how many entries follow.
func (w *PackedKeysWriter) Head(domain string, entries int) {
	w.B = binary.AppendUvarint(w.d.append(w.B, domain), uint64(entries))
}

// Entry writes one descriptor entry of the key.
func (w *PackedKeysWriter) Entry(key, value string) {
	w.B = appendStr(w.d.append(w.B, key), value)
}

// EntryBytes is Entry with the value as bytes.
func (w *PackedKeysWriter) EntryBytes(key string, value []byte) {
	w.B = append(binary.AppendUvarint(w.d.append(w.B, key), uint64(len(value))), value...)
}

// Fields writes the key's flags and amounts, taken from k (its domain
// and entries are not read).
func (w *PackedKeysWriter) Fields(k *KeyAcquire) { w.B = AppendPackedKeyFields(w.B, k) }

// FieldsPacked writes a key's flags and amounts as AppendPackedKeyFields
// packed them, for a caller that sends many keys with the same fields.
func (w *PackedKeysWriter) FieldsPacked(fields []byte) { w.B = append(w.B, fields...) }

// packedDict is the strings of packed keys' dictionary so far.
type packedDict struct {
	s [PackedDict]string
	n int
}

// append appends a dictionary string: the index of an earlier one
// (1-based), or 0 and the string, which then joins the dictionary if it
// has room.
func (d *packedDict) append(dst []byte, s string) []byte {
	for i := range d.n {
		if d.s[i] == s {
			return binary.AppendUvarint(dst, uint64(i+1))
		}
	}
	dst = appendStr(append(dst, 0), s)
	if d.n < PackedDict {
		d.s[d.n] = s
		d.n++
	}
	return dst
}

// AppendPackedKeyFields appends k's flags and amounts in the packed form:
// what follows a key's entries (its domain and entries are not read).
func AppendPackedKeyFields(dst []byte, k *KeyAcquire) []byte {
	fi := len(dst)
	dst = append(dst, 0)
	var flags, flags2 byte
	if k.GetWantShare() {
		flags2 |= PackedWantShare
	}
	if k.GetPromote() {
		flags2 |= PackedPromote
	}
	if k.GetStaticReport() {
		flags2 |= PackedStaticReport
	}
	if flags2 != 0 {
		flags |= PackedMore
		dst = append(dst, flags2)
	}
	for i, v := range [...]int64{k.GetWant(), k.GetHeld(), k.GetReturned(), k.GetCharged(), k.GetDenied()} {
		if v != 0 {
			flags |= 1 << i
			dst = binary.AppendVarint(dst, v)
		}
	}
	if d := k.GetDemand(); d != 0 || math.Signbit(d) {
		flags |= PackedDemand
		dst = binary.LittleEndian.AppendUint64(dst, math.Float64bits(d))
	}
	if v := k.GetOutageCharged(); v != 0 {
		flags |= PackedOutage
		dst = binary.AppendVarint(dst, v)
	}
	if k.GetPromote() || k.GetStaticReport() {
		dst = binary.AppendVarint(dst, k.GetStaticLeft())
	}
	dst[fi] = flags
	return dst
}

// KeysValidUTF8 reports whether every string of keys is valid UTF-8, as
// the allocator requires of packed keys (and protobuf of string fields).
func KeysValidUTF8(keys []*KeyAcquire) bool {
	for _, k := range keys {
		if !utf8.ValidString(k.GetDomain()) {
			return false
		}
		for _, e := range k.GetEntries() {
			if !utf8.ValidString(e.GetKey()) || !utf8.ValidString(e.GetValue()) {
				return false
			}
		}
	}
	return true
}

func appendStr(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// KeyCount returns how many keys x carries, packed or not (a malformed
// packed count reads as 0).
func (x *AcquireRequest) KeyCount() int {
	if p := x.GetPackedKeys(); len(p) > 0 {
		n, k := binary.Uvarint(p)
		if k <= 0 || n > uint64(len(p)) {
			return 0
		}
		return int(n)
	}
	return len(x.GetKeys())
}

// PackedKey is one key of packed keys as ReadPackedKey reads it; Domain is
// a substring of the Reader's S.
type PackedKey struct {
	Domain                                               string
	Want, Held, Returned, Charged, Denied, OutageCharged int64
	Demand                                               float64
	WantShare, Promote, StaticReport                     bool
	StaticLeft                                           int64
}

// Dict is the dictionary of one call's packed keys: a zero Dict starts a
// call.
type Dict struct {
	s [PackedDict]string
	n int
}

// dstr reads a dictionary string.
func (d *Reader) dstr(dc *Dict) string {
	i := d.Uvarint()
	switch {
	case i == 0:
		s := d.Str()
		if dc.n < len(dc.s) {
			dc.s[dc.n] = s
			dc.n++
		}
		return s
	case i <= uint64(dc.n):
		return dc.s[i-1]
	}
	d.Fail()
	return ""
}

// ReadPackedKey reads the next key of packed keys into k (every field
// set) and appends its descriptor entries to ents; its strings are
// substrings of d.S, so it allocates nothing beyond ents' growth. A key
// that does not decode sets d.Err. The count before the keys is read with
// d.Uvarint.
func ReadPackedKey[E ~struct{ Key, Value string }](d *Reader, dc *Dict, k *PackedKey, ents []E) []E {
	*k = PackedKey{Domain: d.dstr(dc)}
	ne := d.Uvarint()
	if ne > uint64(d.Left()) { // an entry takes at least 2 bytes
		d.Fail()
	}
	if d.Err != nil {
		return ents
	}
	for range ne {
		key := d.dstr(dc)
		ents = append(ents, E{Key: key, Value: d.Str()})
	}
	flags := d.Byte()
	if flags&PackedMore != 0 {
		flags2 := d.Byte()
		if flags2&^packedFlags2 != 0 {
			d.Fail()
		}
		k.WantShare = flags2&PackedWantShare != 0
		k.Promote = flags2&PackedPromote != 0
		k.StaticReport = flags2&PackedStaticReport != 0
	}
	for i, f := range [...]*int64{&k.Want, &k.Held, &k.Returned, &k.Charged, &k.Denied} {
		if flags&(1<<i) != 0 {
			*f = d.Varint()
		}
	}
	if flags&PackedDemand != 0 {
		k.Demand = math.Float64frombits(d.Fixed64())
	}
	if flags&PackedOutage != 0 {
		k.OutageCharged = d.Varint()
	}
	if k.Promote || k.StaticReport {
		k.StaticLeft = d.Varint()
	}
	return ents
}

// errPackedKeys: packed keys do not decode.
var errPackedKeys = errors.New("allotv1: packed keys do not decode")

// UnpackKeys decodes packed keys into messages (tools and tests: the
// allocator reads them with ReadPackedKey, without building messages).
func UnpackKeys(data []byte) ([]*KeyAcquire, error) {
	d := Reader{S: string(data), Base: errPackedKeys}
	n := d.Uvarint()
	if d.Err != nil || n > uint64(d.Left()) {
		return nil, fmt.Errorf("%w: count", errPackedKeys)
	}
	out := make([]*KeyAcquire, n)
	var dc Dict
	var ents []struct{ Key, Value string }
	for i := range out {
		var k PackedKey
		ents = ReadPackedKey(&d, &dc, &k, ents[:0])
		if d.Err != nil {
			return nil, fmt.Errorf("key %d: %w", i, d.Err)
		}
		ka := &KeyAcquire{Domain: k.Domain, Want: k.Want, Held: k.Held, Returned: k.Returned, Charged: k.Charged,
			Denied: k.Denied, OutageCharged: k.OutageCharged, Demand: k.Demand, WantShare: k.WantShare,
			Promote: k.Promote, StaticLeft: k.StaticLeft, StaticReport: k.StaticReport}
		for _, e := range ents {
			ka.Entries = append(ka.Entries, &Entry{Key: e.Key, Value: e.Value})
		}
		out[i] = ka
	}
	if d.P != len(d.S) {
		return nil, fmt.Errorf("%w: %d trailing bytes", errPackedKeys, d.Left())
	}
	return out, nil
}
