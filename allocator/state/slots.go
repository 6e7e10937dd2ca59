package state

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	"github.com/allot/allot/pkg/slots"
)

// Slots. In a cluster of several Raft groups each group's State serves the
// keys of the slots (pkg/slots: the low ten bits of the key's hash) its
// group owns. A State serves every slot until told otherwise, so a cluster
// of one group never sees any of this; in a cluster of several, the move
// driver freezes and then drops the slots a group serves that the slot
// map gives to another group, so that each group serves its own only. Each slot of a State is in one of
// three modes:
//
//	served  Acquire and Release apply to its keys as usual.
//	frozen  the State keeps its keys' bucket state and leases exactly as
//	        they were at the freeze, for Export: Acquire answers its keys
//	        KEY_STATUS_MOVED (nothing granted, returned or charged),
//	        Release skips them (their returned tokens are not credited:
//	        the agent's lease moves with the key and ends by expiry at the
//	        new owner, so at worst tokens are wasted, never admitted twice),
//	        Release all and a forgotten agent leave their leases alone (an
//	        agent holding one is not forgotten until the slot is dropped or
//	        thawed), Expire neither ends their leases nor sweeps them.
//	gone    not this group's: its keys are answered KEY_STATUS_MOVED and
//	        none is tracked.
//
// A slot move runs (allocator/meta has the phases):
//
//	source  Freeze(ranges)        served → frozen, at its log index i
//	source  Export(ranges)        the frozen keys' state, read after i
//	target  Import(bytes, owned)  gone → served, with the keys installed
//	meta    Commit                the map names the target
//	source  Drop(ranges)          frozen → gone, the keys freed
//
// and Thaw(ranges) (frozen → served) undoes a Freeze when a move is aborted
// before the target imported. Disown(ranges) (served → gone, for slots
// with no key) sets up a group that does not own every slot.
//
// No token is granted twice: the source's state for the slots is final
// from its freeze entry on (no command changes it), the target installs
// exactly that state, bucket and leases, and serves none of the slots
// before it does; a key is therefore served by one State at a time, and
// the pair grants what one group that paused the slots for the move would
// have (the property tests check this, key by key).
//
// While a slot is frozen or not yet imported, agents decide its keys from
// their leases and fallback buckets. Over a move that lasts D, the tokens
// agents admit for a key beyond what the global bucket gives are bounded
// by Σ held (the leases at the freeze: already debited from the bucket,
// and carried over) plus, per agent, its fallback bucket's ⌈B/N⌉ + D·R/N
// (docs/leases.md), which its agent reports as charged to the new owner
// once the move is done.
//
// Each operation is a Raft command: a slot entry (IsSlotEntry,
// AppendSlotEntry, State.ApplySlotEntry), applied in log order. A
// snapshot carries the slots' modes.

// slotMode is a slot's mode (see Slots).
type slotMode uint8

const (
	slotServed slotMode = iota
	slotFrozen
	slotGone
)

func (m slotMode) String() string {
	switch m {
	case slotServed:
		return "served"
	case slotFrozen:
		return "frozen"
	}
	return "gone"
}

// slotModes holds every slot's mode; a nil *slotModes serves every slot.
type slotModes [slots.Count]slotMode

// Sentinel errors of the slot operations.
var (
	// ErrSlotRefused: a slot operation does not apply to the slots' modes
	// (freezing a slot that is not served, importing keys the State already
	// tracks, ...). Nothing changed.
	ErrSlotRefused = errors.New("state: slot operation refused")
	// ErrMoved: a Check names a key whose slot this State does not serve
	// (frozen, or another group's). Nothing changed; the caller retries at
	// the slot's owner.
	ErrMoved = errors.New("state: the key's slot is not served here")
	// ErrBadExport: Import was given bytes that are not a whole, consistent
	// export. Nothing changed.
	ErrBadExport = errors.New("state: bad slot export")
)

// serves reports whether the key of hash h is served (not frozen, not
// gone).
func (c *core) serves(h uint64) bool { return c.modes == nil || c.modes[slots.Of(h)] == slotServed }

// checkServed refuses (ErrMoved) a Check with a lease-backed key in a
// slot this State does not serve, before anything is taken.
func (c *core) checkServed(domain string, descs [][]rules.Entry, matched []*rules.Rule) error {
	if c.modes == nil {
		return nil
	}
	for i, r := range matched {
		if r == nil || r.Unlimited || r.Backend != rules.BackendLease {
			continue
		}
		if h := rules.KeyHash(r, domain, descs[i]); !c.serves(h) {
			return fmt.Errorf("%w: slot %d is %s here", ErrMoved, slots.Of(h), c.modeOf(int(slots.Of(h))))
		}
	}
	return nil
}

// frozen reports whether the key of hash h is in a frozen slot.
func (c *core) frozen(h uint64) bool { return c.modes != nil && c.modes[slots.Of(h)] == slotFrozen }

// modeOf is slot s's mode.
func (c *core) modeOf(s int) slotMode {
	if c.modes == nil {
		return slotServed
	}
	return c.modes[s]
}

// checkRanges refuses invalid, unsorted or overlapping ranges.
func checkRanges(rs []slots.Range) error {
	if len(rs) == 0 {
		return fmt.Errorf("%w: no slot range", ErrInvalid)
	}
	for i, r := range rs {
		if !r.Valid() {
			return fmt.Errorf("%w: slot range %d-%d", ErrInvalid, r.First, r.Last)
		}
		if i > 0 && rs[i-1].Last >= r.First {
			return fmt.Errorf("%w: slot ranges %s and %s are out of order or overlap", ErrInvalid, rs[i-1], r)
		}
	}
	return nil
}

// inRanges reports whether slot s is in rs.
func inRanges(rs []slots.Range, s slots.Slot) bool {
	for _, r := range rs {
		if r.Contains(s) {
			return true
		}
	}
	return false
}

// transition moves every slot of rs from mode from to mode to. Slots
// already in mode to are left (the operation is idempotent); a slot in
// any other mode refuses the whole operation.
func (c *core) transition(rs []slots.Range, from, to slotMode, op string) error {
	if err := checkRanges(rs); err != nil {
		return err
	}
	for _, r := range rs {
		for s := int(r.First); s <= int(r.Last); s++ {
			if m := c.modeOf(s); m != from && m != to {
				return fmt.Errorf("%w: %s slot %d: it is %s", ErrSlotRefused, op, s, m)
			}
		}
	}
	nm := new(slotModes) // replaced, never mutated: a snapshot may share the old one
	if c.modes != nil {
		*nm = *c.modes
	}
	for _, r := range rs {
		for s := int(r.First); s <= int(r.Last); s++ {
			nm[s] = to
		}
	}
	c.modes = nm
	c.dropModesIfAllServed()
	return nil
}

// dropModesIfAllServed returns to the nil modes when every slot is
// served, so that a State that served every slot snapshots as before.
func (c *core) dropModesIfAllServed() {
	if c.modes != nil && *c.modes == (slotModes{}) {
		c.modes = nil
	}
}

// freeze stops serving rs's slots and keeps their state for Export.
func (c *core) freeze(rs []slots.Range) error {
	return c.transition(rs, slotServed, slotFrozen, "freeze")
}

// thaw serves frozen slots again (a move aborted before its import).
//
// An Expire re-queues a frozen key a second ahead each time it meets it
// (expireEntry), which can be past its earliest lease expiry: thaw queues
// every leased key of rs at its earliest expiry again, as the expiry
// wheel's invariant requires, so that a lease that fell due during the
// freeze ends at the next Expire, as at a target that imported the key.
func (c *core) thaw(rs []slots.Range) error {
	if err := c.transition(rs, slotFrozen, slotServed, "thaw"); err != nil {
		return err
	}
	e := &c.scr.e
	c.eachKeyIn(rs, func(_ int, s *slot) {
		if s.link != 0 {
			c.loadEntry(e, s.hash, s.link)
			c.queueKey(e, s.hash, s.link, e.minSec())
		}
	})
	return nil
}

// disown marks served slots that hold no key as not this group's.
func (c *core) disown(rs []slots.Range) error {
	if err := checkRanges(rs); err != nil {
		return err
	}
	n := 0
	c.eachKeyIn(rs, func(int, *slot) { n++ })
	if n > 0 {
		return fmt.Errorf("%w: disown: %d keys are tracked in %s", ErrSlotRefused, n, slots.FormatRanges(rs))
	}
	return c.transition(rs, slotServed, slotGone, "disown")
}

// eachKeyIn calls f for every tracked key in rs's slots, in table order.
func (c *core) eachKeyIn(rs []slots.Range, f func(i int, s *slot)) {
	t := &c.tab
	for i := 0; i < t.size; i++ {
		if s := t.at(i); s.lim != 0 && inRanges(rs, slots.Of(s.hash)) {
			f(i, s)
		}
	}
}

// drop frees the keys of frozen slots rs (after the move's commit) and
// marks the slots gone. It returns how many keys it freed.
func (c *core) drop(rs []slots.Range) (int, error) {
	if err := checkRanges(rs); err != nil {
		return 0, err
	}
	for _, r := range rs {
		for s := int(r.First); s <= int(r.Last); s++ {
			if m := c.modeOf(s); m != slotFrozen && m != slotGone {
				return 0, fmt.Errorf("%w: drop slot %d: it is %s", ErrSlotRefused, s, m)
			}
		}
	}
	n := 0
	e := &c.scr.e
	t := &c.tab
	for i := 0; i < t.size; {
		s := t.at(i)
		if s.lim == 0 || !inRanges(rs, slots.Of(s.hash)) {
			i++
			continue
		}
		if s.link != 0 {
			c.loadEntry(e, s.hash, s.link)
			for len(e.leases) > 0 {
				c.dropLease(e, len(e.leases)-1, s.hash)
			}
			c.storeEntry(s.hash, i, e, math.MaxInt64, false)
		}
		lim := t.at(i).lim
		t.remove(c, i)
		c.lims.unref(lim)
		n++
		// the next key moved into i
	}
	c.tab.maybeShrink(c)
	return n, c.transition(rs, slotFrozen, slotGone, "drop")
}

// Export format (integers little-endian; varints as encoding/binary):
//
//	header  "ALLOTSLT" uvarint(format version = 1)
//	body    ranges:  uvarint n, n × (uvarint first, uvarint last)
//	        limits:  uvarint n, n × (byte algorithm, varint quota, varint window ns, varint burst)
//	        agents:  uvarint n, n × (str id, varint last contact Unix ns)
//	        keys:    uvarint n, n × key, in hash order
//	key     fixed64 hash, varint A, varint B (bucket.State), uvarint limit (1-based),
//	        uvarint leases; with leases: str key, varint base, fixed32 grant rate,
//	        fixed32 deny rate, leases × (uvarint agent (1-based), varint need,
//	        varint held, varint win, varint granted at, varint expiry,
//	        fixed32 demand float32 bits), in agent order
//	trailer crc32c(header+body) uint32 · len(header+body) uint64
//
// Agents and limits are named by their index in the export, not by the
// source's numbers: the target has numbers of its own.
const (
	exportMagic   = "ALLOTSLT"
	exportVersion = 1
	exportTrailer = 4 + 8
)

// export encodes the keys of rs's slots (every one frozen).
func (c *core) export(rs []slots.Range) ([]byte, error) {
	if err := checkRanges(rs); err != nil {
		return nil, err
	}
	for _, r := range rs {
		for s := int(r.First); s <= int(r.Last); s++ {
			if m := c.modeOf(s); m != slotFrozen {
				return nil, fmt.Errorf("%w: export slot %d: it is %s, not frozen", ErrSlotRefused, s, m)
			}
		}
	}
	type keyRec struct {
		sl     slot
		key    []byte
		ent    entry
		leases []lease
	}
	var (
		keys    []keyRec
		limIdx  = map[uint32]uint64{}
		lims    []uint32
		agIdx   = map[uint32]uint64{}
		ags     []*agentRec
		ent     entry
		pageSet = c.pageSets()
	)
	c.eachKeyIn(rs, func(_ int, s *slot) {
		k := keyRec{sl: *s}
		if _, ok := limIdx[s.lim]; !ok {
			lims = append(lims, s.lim)
			limIdx[s.lim] = uint64(len(lims))
		}
		if s.link != 0 {
			if !decodeEntry(&pageSet, &c.codec, s.link, s.hash, &ent) {
				panic(fmt.Sprintf("state: key %016x: corrupt lease entry at %#x", s.hash, s.link))
			}
			k.ent = ent
			k.key = c.keyOf(nil, &ent)
			k.leases = slices.Clone(ent.leases)
			for _, l := range k.leases {
				if _, ok := agIdx[l.agent]; !ok {
					ags = append(ags, c.byNum[l.agent])
					agIdx[l.agent] = uint64(len(ags))
				}
			}
		}
		keys = append(keys, k)
	})
	b := append([]byte(exportMagic), exportVersion)
	b = binary.AppendUvarint(b, uint64(len(rs)))
	for _, r := range rs {
		b = binary.AppendUvarint(b, uint64(r.First))
		b = binary.AppendUvarint(b, uint64(r.Last))
	}
	b = binary.AppendUvarint(b, uint64(len(lims)))
	for _, li := range lims {
		k := c.lims.ents[li].key
		b = append(b, byte(k.alg))
		b = binary.AppendVarint(b, k.quota)
		b = binary.AppendVarint(b, int64(k.window))
		b = binary.AppendVarint(b, k.burst)
	}
	b = binary.AppendUvarint(b, uint64(len(ags)))
	for _, a := range ags {
		b = appendStr(b, a.id)
		b = binary.AppendVarint(b, a.lastContact)
	}
	b = binary.AppendUvarint(b, uint64(len(keys)))
	for _, k := range keys {
		b = binary.LittleEndian.AppendUint64(b, k.sl.hash)
		b = binary.AppendVarint(b, k.sl.st.A)
		b = binary.AppendVarint(b, k.sl.st.B)
		b = binary.AppendUvarint(b, limIdx[k.sl.lim])
		b = binary.AppendUvarint(b, uint64(len(k.leases)))
		if len(k.leases) == 0 {
			continue
		}
		b = appendStr(b, string(k.key))
		b = binary.AppendVarint(b, k.ent.base)
		b = binary.LittleEndian.AppendUint32(b, packRate(k.ent.grant))
		b = binary.LittleEndian.AppendUint32(b, packRate(k.ent.deny))
		for _, l := range k.leases {
			b = binary.AppendUvarint(b, agIdx[l.agent])
			b = binary.AppendVarint(b, l.need)
			b = binary.AppendVarint(b, l.held)
			b = binary.AppendVarint(b, l.win)
			b = binary.AppendVarint(b, l.grantedAt)
			b = binary.AppendVarint(b, l.expiry)
			b = binary.LittleEndian.AppendUint32(b, math.Float32bits(l.demand))
		}
	}
	b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
	b = binary.LittleEndian.AppendUint64(b, uint64(len(b)-4))
	return b, nil
}

// Export is a decoded export.
type Export struct {
	Ranges []slots.Range
	Keys   []ExportedKey // in hash order
}

// ExportedKey is one key of an export.
type ExportedKey struct {
	Hash   uint64
	Limit  bucket.Limit
	State  bucket.State
	Key    string // canonical key; "" for a key without leases
	Base   int64  // the lease entry's base, Unix ms
	Grant  int64  // grant and deny rates, milli-units per second as of Base
	Deny   int64
	Leases []ExportedLease // in agent id order
}

// ExportedLease is one agent's lease on an exported key.
type ExportedLease struct {
	Agent       string
	LastContact int64 // the agent's last contact with the source, Unix ns
	Need, Held  int64
	Win         int64
	GrantedAt   int64 // Unix ms
	Expiry      int64 // Unix ns
	Demand      float32
}

// DecodeExport decodes and checks an export: its framing, its checksum,
// and that every key is in its ranges, in hash order, and consistent
// (ErrBadExport otherwise). It never panics.
func DecodeExport(data []byte) (*Export, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrBadExport, fmt.Sprintf(format, args...))
	}
	if len(data) < len(exportMagic)+1+exportTrailer {
		return nil, bad("%d bytes is too short", len(data))
	}
	if string(data[:len(exportMagic)]) != exportMagic {
		return nil, bad("bad magic")
	}
	body, tr := data[:len(data)-exportTrailer], data[len(data)-exportTrailer:]
	if n := binary.LittleEndian.Uint64(tr[4:]); n != uint64(len(body)) {
		return nil, bad("length %d, trailer says %d (truncated?)", len(body), n)
	}
	if crc32.Checksum(body, castagnoli) != binary.LittleEndian.Uint32(tr[:4]) {
		return nil, bad("checksum mismatch")
	}
	d := &dec{b: body[len(exportMagic):]}
	if v := d.byte(); d.err == nil && v != exportVersion {
		return nil, bad("format version %d, this binary reads %d", v, exportVersion)
	}
	out := &Export{}
	nr := d.count("ranges")
	for i := 0; i < nr && d.err == nil; i++ {
		first, last := d.uvarintMax(slots.Count-1, "slot"), d.uvarintMax(slots.Count-1, "slot")
		out.Ranges = append(out.Ranges, slots.Range{First: slots.Slot(first), Last: slots.Slot(last)})
	}
	if d.err == nil {
		if err := checkRanges(out.Ranges); err != nil {
			return nil, bad("%v", err)
		}
	}
	nl := d.count("limits")
	lims := make([]bucket.Limit, 0, nl)
	seenLim := map[limitKey]bool{}
	for i := 0; i < nl && d.err == nil; i++ {
		alg, quota, window, burst := bucket.Algorithm(d.byte()), d.varint(), d.varint(), d.varint()
		if d.err != nil {
			break
		}
		l, err := bucket.NewLimit(alg, quota, time.Duration(window), burst)
		if err != nil {
			return nil, bad("limit %d: %v", i+1, err)
		}
		if seenLim[keyOf(l)] {
			return nil, bad("limit %d is a duplicate", i+1)
		}
		seenLim[keyOf(l)] = true
		lims = append(lims, l)
	}
	na := d.count("agents")
	type agent struct {
		id      string
		contact int64
	}
	ags := make([]agent, 0, na)
	seenAg := map[string]bool{}
	for i := 0; i < na && d.err == nil; i++ {
		a := agent{id: d.str(), contact: d.varint()}
		if d.err != nil {
			break
		}
		if a.id == "" || len(a.id) > maxAgentID || seenAg[a.id] {
			return nil, bad("agent %d: empty, too long or repeated id", i+1)
		}
		seenAg[a.id] = true
		ags = append(ags, a)
	}
	nk := d.count("keys")
	var prev uint64
	for i := 0; i < nk && d.err == nil; i++ {
		k := ExportedKey{Hash: d.fixed64(), State: bucket.State{A: d.varint(), B: d.varint()}}
		li := d.uvarintMax(uint64(len(lims)), "key limit")
		n := d.count("leases")
		if d.err != nil {
			break
		}
		if li == 0 {
			return nil, bad("key %016x: no limit", k.Hash)
		}
		if i > 0 && k.Hash <= prev {
			return nil, bad("keys out of order")
		}
		prev = k.Hash
		if !inRanges(out.Ranges, slots.Of(k.Hash)) {
			return nil, bad("key %016x is outside the export's slots", k.Hash)
		}
		k.Limit = lims[li-1]
		if n > 0 {
			key := d.view()
			k.Base = d.varint()
			grant, deny := d.fixed32(), d.fixed32()
			if d.err != nil {
				break
			}
			if xxhash.Sum64(key) != k.Hash || k.Base < 0 || k.Base > baseMax ||
				packRate(unpackRate(grant)) != grant || packRate(unpackRate(deny)) != deny {
				return nil, bad("key %016x: bad key, base or rates", k.Hash)
			}
			if tpl, val, ok := splitKey(key, nil, nil); !ok || !bytes.Equal(joinKey(nil, string(tpl), val), key) {
				return nil, bad("key %016x: malformed key", k.Hash)
			}
			k.Key, k.Grant, k.Deny = string(key), unpackRate(grant), unpackRate(deny)
			seen := map[uint64]bool{}
			for j := 0; j < n && d.err == nil; j++ {
				ai := d.uvarintMax(uint64(len(ags)), "lease agent")
				l := ExportedLease{Need: d.varint(), Held: d.varint(), Win: d.varint(), GrantedAt: d.varint(),
					Expiry: d.varint(), Demand: math.Float32frombits(d.fixed32())}
				if d.err != nil {
					break
				}
				if ai == 0 || seen[ai] || l.Need < 0 || l.Held < 0 || l.Win < 0 || l.GrantedAt < 0 ||
					l.Demand != l.Demand || l.Demand < 0 {
					return nil, bad("key %016x: bad lease", k.Hash)
				}
				seen[ai] = true
				l.Agent, l.LastContact = ags[ai-1].id, ags[ai-1].contact
				k.Leases = append(k.Leases, l)
			}
			slices.SortFunc(k.Leases, func(x, y ExportedLease) int { return strings.Compare(x.Agent, y.Agent) })
		}
		out.Keys = append(out.Keys, k)
	}
	if d.err != nil {
		return nil, bad("%v", errors.Unwrap(d.err))
	}
	if len(d.b) != 0 {
		return nil, bad("%d trailing bytes", len(d.b))
	}
	return out, nil
}

// importKeys installs an export's keys, in slots that owned covers and
// that are gone here, and serves those slots. It refuses (changing
// nothing) an export that does not decode, slots owned does not cover,
// slots this State serves or has frozen, and keys it tracks.
func (c *core) importKeys(data []byte, owned []slots.Range) (int, error) {
	x, err := DecodeExport(data)
	if err != nil {
		return 0, err
	}
	for _, r := range x.Ranges {
		for s := int(r.First); s <= int(r.Last); s++ {
			if !inRanges(owned, slots.Slot(s)) {
				return 0, fmt.Errorf("%w: import: slot %d is not this group's in the map it was given", ErrSlotRefused, s)
			}
			if m := c.modeOf(s); m != slotGone {
				return 0, fmt.Errorf("%w: import: slot %d is %s here", ErrSlotRefused, s, m)
			}
		}
	}
	for i := range x.Keys {
		k := &x.Keys[i]
		if c.tab.find(k.Hash) >= 0 {
			return 0, fmt.Errorf("%w: import: key %016x is already tracked", ErrSlotRefused, k.Hash)
		}
		for _, l := range k.Leases {
			if !c.storedForm(k, l) {
				return 0, fmt.Errorf("%w: key %016x: lease times or demand not in stored form (another lease configuration?)",
					ErrBadExport, k.Hash)
			}
		}
	}
	// Room in the arena, checked before anything changes.
	var need []int
	for _, k := range x.Keys {
		if len(k.Leases) > 0 {
			_, val, _ := splitKey([]byte(k.Key), nil, nil)
			need = append(need, entrySize(len(k.Leases), math.MaxUint32, len(val)))
		}
	}
	if !c.ar.canAllocAll(need) {
		return 0, fmt.Errorf("%w: import: the leased keys exceed the arena", ErrSlotRefused)
	}
	e := &c.scr.e
	unknown := c.mayShare() // the export does not carry the shares issued
	for _, k := range x.Keys {
		idx := c.tab.insert(c, k.Hash, c.lims.ref(k.Limit))
		c.tab.mut(c, idx).st = k.State
		if len(k.Leases) == 0 {
			continue
		}
		for _, l := range k.Leases {
			if c.agents[l.Agent] == nil {
				c.touchAgent(nil, l.Agent, l.LastContact)
			}
		}
		ls := make([]lease, 0, len(k.Leases))
		for _, l := range k.Leases {
			ls = append(ls, lease{agent: c.agents[l.Agent].num, need: l.Need, held: l.Held, win: l.Win,
				grantedAt: l.GrantedAt, expiry: l.Expiry, demand: l.Demand})
		}
		slices.SortFunc(ls, func(x, y lease) int { return cmp.Compare(x.agent, y.agent) })
		c.scr.tpl, c.scr.val, _ = splitKey([]byte(k.Key), c.scr.tpl[:0], c.scr.val[:0])
		c.newEntry(e)
		e.base, e.grant, e.deny = k.Base, k.Grant, k.Deny
		for _, l := range ls {
			c.addLease(e, len(e.leases), l)
		}
		c.storeEntry(k.Hash, idx, e, math.MaxInt64, false)
		if unknown && c.sharedKey(k.Key) {
			c.markUnknown(e, k.Hash)
		}
	}
	return len(x.Keys), c.transition(x.Ranges, slotGone, slotServed, "import")
}

// storedForm reports whether l, a lease of k, is as this State's lease
// codec stores it (its times and demand would not be rounded): a lease
// exported by a State of the same configuration always is.
func (c *core) storedForm(k *ExportedKey, l ExportedLease) bool {
	lc := leaseCodec{unit: c.codec.unit}
	ll := lease{agent: 1, need: l.Need, held: l.Held, win: l.Win, grantedAt: l.GrantedAt, expiry: l.Expiry, demand: l.Demand}
	var b [leaseBytes]byte
	lc.encodeLease(b[:], &ll, k.Hash, k.Base)
	return ll.expiry == l.Expiry && ll.grantedAt == l.GrantedAt && ll.demand == l.Demand
}

// modeRun is a run of slots in one mode.
type modeRun struct {
	slots.Range
	mode slotMode
}

// runs returns the maximal runs of slots not served, in slot order.
func (m *slotModes) runs() []modeRun {
	var out []modeRun
	for s := 0; s < slots.Count; {
		if m[s] == slotServed {
			s++
			continue
		}
		e := s
		for e+1 < slots.Count && m[e+1] == m[s] {
			e++
		}
		out = append(out, modeRun{slots.Range{First: slots.Slot(s), Last: slots.Slot(e)}, m[s]})
		s = e + 1
	}
	return out
}

// restoreModes reads a snapshot's slot modes (after its keys), checking
// that the runs are valid, in order, maximal, and that no gone slot holds
// a key.
func (c *core) restoreModes(d *dec) error {
	n := d.count("slot runs")
	if d.err == nil && n == 0 {
		return corrupt("slot modes without a slot that is not served")
	}
	m := new(slotModes)
	var prev modeRun
	for i := 0; i < n && d.err == nil; i++ {
		r := modeRun{slots.Range{First: slots.Slot(d.uvarintMax(slots.Count-1, "slot")),
			Last: slots.Slot(d.uvarintMax(slots.Count-1, "slot"))}, slotMode(d.byte())}
		if d.err != nil {
			break
		}
		if !r.Valid() || (r.mode != slotFrozen && r.mode != slotGone) ||
			(i > 0 && (r.First <= prev.Last || r.First == prev.Last+1 && r.mode == prev.mode)) {
			return corrupt("slot run %s (%d) is invalid, out of order or not maximal", r.Range, r.mode)
		}
		prev = r
		for s := int(r.First); s <= int(r.Last); s++ {
			m[s] = r.mode
		}
	}
	if d.err != nil {
		return d.err
	}
	for i := 0; i < c.tab.size; i++ {
		if s := c.tab.at(i); s.lim != 0 && m[slots.Of(s.hash)] == slotGone {
			return corrupt("key %016x is in slot %d, which is not this group's", s.hash, slots.Of(s.hash))
		}
	}
	c.modes = m
	return nil
}
