package state

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"maps"
	"math"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Snapshot format (all integers little-endian; varints as encoding/binary):
//
//	header  "ALLOTSNP" uvarint(format version = 3)
//	body    scalars, rules, limits, members, agents, keys, leased keys
//	trailer crc32c(header+body) uint32 · len(header+body) uint64 · "ALLOTEND"
//
// A leased key is its hash, canonical key, base (Unix ms), packed grant and
// deny rates, and its leases (agent, need, held, tokens granted in the
// window of the latest grant, latest grant in Unix ms, expiry in Unix ns,
// demand as float32 bits). Records appear in a canonical
// order (keys and leased keys by hash, agents and members by id, leases by
// agent number), so equal states give equal bytes. Derived data (counters,
// the arena layout, the expiry wheel, limit reference counts) is not
// stored: Restore recomputes it and checks the stored data for
// consistency. Version 2 (compact leased keys) replaced version 1; version
// 3 added the per-lease window grant count (grant pacing). Version 4 is
// version 3 followed by the slots' modes (slots.go) — uvarint runs, runs ×
// (uvarint first slot, uvarint last slot, byte mode), the slots not served
// in slot order — and is written only by a State that does not serve every
// slot, so a cluster of one group writes version 3. Version 5 is version
// 3 followed by a byte (1: version 4's slot modes follow, 0: they do not)
// and the regional ledger (upstream.go) as one length-prefixed blob; it is
// written only by a regional cluster's State that holds a ledger. Version
// 6 is version 5 with the ledger in its format 2 (each pool followed by
// the global cluster's limit of its key, upstream.go), written once a pool
// has recorded one. Version 7 is version 3 followed by a flags byte
// (1: version 4's slot modes follow, 2: the regional ledger follows as in
// version 5, 4: that ledger is in format 2), those, and the slot fence
// (slotentry.go) as a uvarint; it is written only by a State that has
// applied a fenced slot entry. Version 8 is version 7 whose flags may
// also hold 8: the ledger's pools may hold tokens and a debt at once (a
// mint that kept part of itself from the debt, upstream.go), and whose
// slot fence may be 0; it is written only while a pool does. Version 9
// is version 8 whose flags may also hold 16: the issued shares
// (shares.go) follow the slot fence, as uvarint n, n × (fixed64 key
// hash, uvarint agent number, varint share in milli-tokens/s, -1 for
// unknown) in (hash, agent) order, each naming a lease; it is written
// only while the state records a share. Version 10 is version 9 whose
// flags need not hold 16 and always hold 32: the static shares' state
// (static.go) follows, as a length-prefixed blob; it is written only while
// static shares are on. Restore reads versions 2 to 10: a
// version-2 lease has granted nothing in the current window, and its
// demand is truncated as a lease stores it (roundDemand); a lease
// restored from a version before 9 under a scope: global rule, outside
// a regional cluster, is recorded as of unknown share (shares.go): the
// snapshot does not say what it was issued.
const (
	snapMagic     = "ALLOTSNP"
	snapEnd       = "ALLOTEND"
	snapVersion   = 3
	snapVersionV2 = 2 // still restored
	snapVersionV4 = 4 // version 3 and the slots' modes
	// snapVersionLedger is version 3, a flag byte (1: the slots' modes
	// follow, as in version 4), then the regional ledger (upstream.go). A
	// state with a ledger is written as version 5.
	snapVersionLedger = 5
	// snapVersionLimits is version 5 with the ledger in format 2.
	snapVersionLimits = 6
	// snapVersionFence is version 3, a flags byte (snapFlag*), what the
	// flags name, then the slot fence.
	snapVersionFence = 7
	snapFlagModes    = 1
	snapFlagLedger   = 2
	snapFlagLimits   = 4
	// snapVersionKeep is version 7 with snapFlagKeep allowed and the slot
	// fence 0 allowed.
	snapVersionKeep = 8
	snapFlagKeep    = 8
	// snapVersionShares is version 8 with snapFlagShares allowed: the
	// issued shares follow the slot fence.
	snapVersionShares = 9
	snapFlagShares    = 16
	// snapVersionStatic is version 9 with snapFlagShares optional and
	// snapFlagStatic, which it always holds: the static shares' state
	// (static.go, staticView.encode) follows, as one length-prefixed blob.
	snapVersionStatic = 10
	snapFlagStatic    = 32
	snapTrailer       = 4 + 8 + len(snapEnd)
	snapFlushSize     = 64 << 10
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Snapshot is a point-in-time capture of a State, taken cheaply under the
// lock: the key table's chunks, the arena's pages and the agent records are
// shared copy-on-write with the live state, so capture copies pointers
// only (one per 4096 keys, per 64 KiB of leased-key entries and per
// agent). Persist streams
// it; Release ends the sharing (call it when done, after Persist or
// instead of it; safe to call twice). A Snapshot is used by one goroutine.
type Snapshot interface {
	Persist(w io.Writer) error
	Release()
}

type snapshot struct {
	s    *State
	once sync.Once
	v    *view
}

// view is the captured state.
type view struct {
	now, rulesUpdated int64
	rules             *rules.Set
	lims              limits
	chunks            []*chunk
	tabN              int
	pages             pageSets
	tpls              []string
	codec             leaseCodec
	agents            []*agentRec
	members           []*allotv1.Member
	nextAgent         uint32
	sweepSeg          uint32
	modes             *slotModes
	ledger            []byte // the regional ledger, encoded (nil: none)
	ledgerLimits      bool   // ledger is in format 2
	ledgerKeep        bool   // a pool holds tokens and a debt at once (format 2)
	slotFence         uint64
	shares            map[extKey]int64
	static            *staticView // the static shares' state (nil: off)
}

// Snapshot captures the state for Persist. The capture is O(chunks +
// pages + agents) pointer copies under the lock; the table and the arena
// are not copied (mutations after the capture copy a 128 KiB chunk or a
// 64 KiB page on first write).
func (s *State) Snapshot() (Snapshot, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.st
	c.gen++
	s.live++
	v := &view{
		now:          c.now,
		rulesUpdated: c.rulesUpdated,
		rules:        c.rules,
		lims:         c.lims.clone(),
		chunks:       slices.Clone(c.tab.chunks),
		tabN:         c.tab.n,
		pages:        c.pageSets(),
		tpls:         slices.Clone(c.tpls.strs),
		codec:        leaseCodec{unit: c.codec.unit, ext: maps.Clone(c.codec.ext)},
		nextAgent:    c.nextAgent,
		sweepSeg:     c.sweepSeg,
		modes:        c.modes,
		slotFence:    c.slotFence,
	}
	if len(c.shares) > 0 {
		v.shares = maps.Clone(c.shares)
	}
	v.ledger, v.ledgerLimits, v.ledgerKeep = c.encodeLedger()
	v.static = c.captureStatic()
	for i := range v.pages {
		v.pages[i] = slices.Clone(v.pages[i]) // COW replaces pages in the live slices
	}
	v.agents = make([]*agentRec, 0, len(c.agents))
	for _, a := range c.agents {
		v.agents = append(v.agents, a)
	}
	v.members = make([]*allotv1.Member, 0, len(c.members))
	for _, m := range c.members {
		v.members = append(v.members, m)
	}
	return &snapshot{s: s, v: v}, nil
}

// Release ends the snapshot's sharing with the live state. Safe to call
// twice.
func (sn *snapshot) Release() {
	sn.once.Do(func() {
		sn.s.mu.Lock()
		sn.s.live--
		sn.s.mu.Unlock()
		sn.v = nil
	})
}

// Persist writes the snapshot in the versioned binary format. It does the
// sorting and encoding outside the state's lock.
func (sn *snapshot) Persist(w io.Writer) error {
	v := sn.v
	if v == nil {
		return errors.New("state: persist of a released snapshot")
	}
	e := &enc{w: w, crc: 0}
	e.raw([]byte(snapMagic))
	flagged := v.slotFence > 0 || v.ledgerKeep || v.shares != nil || v.static != nil // the flags byte and the fence follow the leases
	if v.static != nil {
		e.uvarint(snapVersionStatic)
	} else if v.shares != nil {
		e.uvarint(snapVersionShares)
	} else if v.ledgerKeep {
		e.uvarint(snapVersionKeep)
	} else if v.slotFence > 0 {
		e.uvarint(snapVersionFence)
	} else if v.ledgerLimits {
		e.uvarint(snapVersionLimits)
	} else if v.ledger != nil {
		e.uvarint(snapVersionLedger)
	} else if v.modes != nil {
		e.uvarint(snapVersionV4)
	} else {
		e.uvarint(snapVersion)
	}

	e.varint(v.now)
	e.varint(v.rulesUpdated)
	e.uvarint(uint64(v.nextAgent))
	e.uvarint(uint64(v.sweepSeg))

	if v.rules == nil {
		e.uvarint(0)
	} else {
		e.uvarint(1)
		e.uvarint(v.rules.Version())
		files := v.rules.Files()
		e.uvarint(uint64(len(files)))
		for _, f := range files {
			e.str(f.Name)
			e.str(f.Domain)
			e.bytes(f.Source)
		}
	}

	e.uvarint(uint64(len(v.lims.ents)))
	for _, le := range v.lims.ents[1:] {
		if le.refs == 0 {
			e.byte(0)
			continue
		}
		e.byte(1)
		e.byte(byte(le.key.alg))
		e.varint(le.key.quota)
		e.varint(int64(le.key.window))
		e.varint(le.key.burst)
	}

	sort.Slice(v.members, func(i, j int) bool { return v.members[i].Id < v.members[j].Id })
	e.uvarint(uint64(len(v.members)))
	for _, m := range v.members {
		for _, f := range [...]string{m.Id, m.RaftAddr, m.GrpcAddr, m.HttpAddr, m.Role, m.Suffrage} {
			e.str(f)
		}
	}

	sort.Slice(v.agents, func(i, j int) bool { return v.agents[i].id < v.agents[j].id })
	e.uvarint(uint64(len(v.agents)))
	for _, a := range v.agents {
		e.str(a.id)
		e.uvarint(uint64(a.num))
		e.uvarint(a.lastReq)
		e.byte(a.lastKind)
		resp, err := a.response()
		if err != nil {
			return fmt.Errorf("state: encode the recorded response of agent %q: %w", a.id, err)
		}
		e.bytes(resp)
		e.varint(a.lastContact)
		e.uvarint(uint64(a.fallbackKeys))
	}

	e.uvarint(uint64(v.tabN))
	for _, ch := range v.chunks {
		for k := range ch {
			s := &ch[k]
			if s.lim == 0 {
				continue
			}
			e.fixed64(s.hash)
			e.varint(s.st.A)
			e.varint(s.st.B)
			e.uvarint(uint64(s.lim))
		}
	}

	nLeased := 0
	for _, ch := range v.chunks {
		for k := range ch {
			if ch[k].link != 0 {
				nLeased++
			}
		}
	}
	e.uvarint(uint64(nLeased))
	var (
		ent entry
		kb  []byte
	)
	for _, ch := range v.chunks {
		for k := range ch {
			s := &ch[k]
			if s.link == 0 {
				continue
			}
			if !decodeEntry(&v.pages, &v.codec, s.link, s.hash, &ent) {
				return fmt.Errorf("state: persist: key %016x: corrupt lease entry", s.hash)
			}
			kb = joinKey(kb[:0], v.tpls[ent.tpl], ent.value)
			e.fixed64(s.hash)
			e.bytes(kb)
			e.varint(ent.base)
			e.fixed32(packRate(ent.grant))
			e.fixed32(packRate(ent.deny))
			e.uvarint(uint64(len(ent.leases)))
			for _, l := range ent.leases {
				e.uvarint(uint64(l.agent))
				e.varint(l.need)
				e.varint(l.held)
				e.varint(l.win)
				e.varint(l.grantedAt)
				e.varint(l.expiry)
				e.fixed32(math.Float32bits(l.demand))
			}
		}
	}
	switch {
	case flagged:
		var flags byte
		if v.static != nil {
			flags |= snapFlagStatic
		}
		if v.shares != nil {
			flags |= snapFlagShares
		}
		if v.ledgerKeep {
			flags |= snapFlagKeep
		}
		if v.modes != nil {
			flags |= snapFlagModes
		}
		if v.ledger != nil {
			flags |= snapFlagLedger
		}
		if v.ledgerLimits {
			flags |= snapFlagLimits
		}
		e.byte(flags)
	case v.ledger != nil:
		if v.modes != nil {
			e.byte(1)
		} else {
			e.byte(0)
		}
	}
	if v.modes != nil {
		runs := v.modes.runs()
		e.uvarint(uint64(len(runs)))
		for _, r := range runs {
			e.uvarint(uint64(r.First))
			e.uvarint(uint64(r.Last))
			e.byte(byte(r.mode))
		}
	}
	if v.ledger != nil {
		e.bytes(v.ledger)
	}
	if flagged {
		e.uvarint(v.slotFence)
	}
	if v.shares != nil {
		recs := sortedShares(v.shares)
		e.uvarint(uint64(len(recs)))
		for _, r := range recs {
			e.fixed64(r.hash)
			e.uvarint(uint64(r.agent))
			e.varint(r.share)
		}
	}
	if v.static != nil {
		e.bytes(v.static.encode())
	}
	return e.finish()
}

// enc buffers output and keeps the running CRC and length.
type enc struct {
	w   io.Writer
	buf []byte
	crc uint32
	n   uint64
	err error
}

func (e *enc) flush() {
	if len(e.buf) == 0 || e.err != nil {
		e.buf = e.buf[:0]
		return
	}
	e.crc = crc32.Update(e.crc, castagnoli, e.buf)
	e.n += uint64(len(e.buf))
	_, e.err = e.w.Write(e.buf)
	e.buf = e.buf[:0]
}

func (e *enc) grow() {
	if len(e.buf) >= snapFlushSize {
		e.flush()
	}
}
func (e *enc) raw(b []byte)     { e.buf = append(e.buf, b...); e.grow() }
func (e *enc) byte(b byte)      { e.buf = append(e.buf, b); e.grow() }
func (e *enc) uvarint(x uint64) { e.buf = binary.AppendUvarint(e.buf, x); e.grow() }
func (e *enc) varint(x int64)   { e.buf = binary.AppendVarint(e.buf, x); e.grow() }
func (e *enc) fixed64(x uint64) { e.buf = binary.LittleEndian.AppendUint64(e.buf, x); e.grow() }
func (e *enc) fixed32(x uint32) { e.buf = binary.LittleEndian.AppendUint32(e.buf, x); e.grow() }
func (e *enc) str(s string)     { e.uvarint(uint64(len(s))); e.buf = append(e.buf, s...); e.grow() }
func (e *enc) bytes(b []byte)   { e.uvarint(uint64(len(b))); e.raw(b) }
func (e *enc) finish() error {
	e.flush()
	if e.err != nil {
		return fmt.Errorf("state: persist: %w", e.err)
	}
	t := binary.LittleEndian.AppendUint32(nil, e.crc)
	t = binary.LittleEndian.AppendUint64(t, e.n)
	t = append(t, snapEnd...)
	if _, err := e.w.Write(t); err != nil {
		return fmt.Errorf("state: persist: %w", err)
	}
	return nil
}

// Restore replaces the state with the snapshot read from r. The snapshot is
// read and checked completely (framing, CRC, every cross-reference) into a
// fresh state before it is swapped in under the lock; any error wraps
// ErrCorruptSnapshot (or is the reader's error) and leaves the state as it
// was.
func (s *State) Restore(r io.Reader) error {
	data, err := io.ReadAll(bufio.NewReaderSize(r, 1<<20))
	if err != nil {
		return fmt.Errorf("state: restore: read: %w", err)
	}
	c, err := decodeSnapshot(s.cfg, data)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.st = c
	s.mu.Unlock()
	return nil
}

func corrupt(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrCorruptSnapshot, fmt.Sprintf(format, args...))
}

func decodeSnapshot(cfg Config, data []byte) (*core, error) {
	if len(data) < len(snapMagic)+1+snapTrailer {
		return nil, corrupt("%d bytes is too short", len(data))
	}
	if string(data[:len(snapMagic)]) != snapMagic {
		return nil, corrupt("bad magic")
	}
	tr := data[len(data)-snapTrailer:]
	body := data[:len(data)-snapTrailer]
	if string(tr[12:]) != snapEnd {
		return nil, corrupt("missing end marker (truncated?)")
	}
	if n := binary.LittleEndian.Uint64(tr[4:12]); n != uint64(len(body)) {
		return nil, corrupt("length %d, trailer says %d (truncated?)", len(body), n)
	}
	if crc := crc32.Checksum(body, castagnoli); crc != binary.LittleEndian.Uint32(tr[:4]) {
		return nil, corrupt("checksum mismatch")
	}
	d := &dec{b: body[len(snapMagic):]}
	version := d.uvarint()
	if d.err == nil && version != snapVersion && version != snapVersionV2 && version != snapVersionV4 && version != snapVersionLedger && version != snapVersionLimits && version != snapVersionFence && version != snapVersionKeep && version != snapVersionShares && version != snapVersionStatic {
		return nil, corrupt("format version %d, this binary reads %d to %d", version, snapVersionV2, snapVersionStatic)
	}
	c := newCore(cfg)
	c.now = d.varint()
	c.rulesUpdated = d.varint()
	c.nextAgent = uint32(d.uvarintMax(math.MaxUint32, "next agent"))
	c.sweepSeg = uint32(d.uvarintMax(uint64(cfg.SweepSegments-1), "sweep segment"))

	// Rules.
	if present := d.uvarintMax(1, "rules flag"); present == 1 {
		version := d.uvarint()
		n := d.count("rule files")
		files := make([]rules.File, 0, n)
		for i := 0; i < n && d.err == nil; i++ {
			files = append(files, rules.File{Name: d.str(), Domain: d.str(), Source: d.bytes()})
		}
		if d.err != nil {
			return nil, d.err
		}
		set, err := rules.Compile(version, files)
		if err != nil {
			return nil, corrupt("rules: %v", err)
		}
		c.setRules(set, c.rulesUpdated)
	}

	// Limits.
	nl := d.count("limits")
	if d.err == nil && nl < 1 {
		return nil, corrupt("limits table without its reserved entry")
	}
	present := make([]bool, max(nl, 1))
	for i := 1; i < nl && d.err == nil; i++ {
		c.lims.ents = append(c.lims.ents, limitEnt{})
		if d.byte() == 0 {
			continue
		}
		present[i] = true
		alg, quota, window, burst := bucket.Algorithm(d.byte()), d.varint(), time.Duration(d.varint()), d.varint()
		if d.err != nil {
			break
		}
		l, err := bucket.NewLimit(alg, quota, window, burst)
		if err != nil {
			return nil, corrupt("limit %d: %v", i, err)
		}
		k := keyOf(l)
		if _, dup := c.lims.idx[k]; dup {
			return nil, corrupt("limit %d is a duplicate", i)
		}
		c.lims.ents[i] = limitEnt{lim: l, key: k}
		c.lims.idx[k] = uint32(i)
	}

	// Members.
	nm := d.count("members")
	var lastID string
	for i := 0; i < nm && d.err == nil; i++ {
		m := &allotv1.Member{Id: d.str(), RaftAddr: d.str(), GrpcAddr: d.str(), HttpAddr: d.str(), Role: d.str(), Suffrage: d.str()}
		if d.err == nil && (m.Id == "" || (i > 0 && m.Id <= lastID)) {
			return nil, corrupt("members out of order")
		}
		lastID = m.Id
		c.members[m.Id] = m
	}

	// Agents.
	na := d.count("agents")
	lastID = ""
	for i := 0; i < na && d.err == nil; i++ {
		a := &agentRec{id: d.str(), num: uint32(d.uvarintMax(math.MaxUint32, "agent number")), lastReq: d.uvarint(),
			lastKind: d.byte(), lastResp: d.bytes(), lastContact: d.varint(),
			fallbackKeys: uint32(d.uvarintMax(math.MaxUint32, "fallback keys"))}
		if d.err != nil {
			break
		}
		if a.id == "" || (i > 0 && a.id <= lastID) {
			return nil, corrupt("agents out of order")
		}
		if a.num == 0 || c.byNum[a.num] != nil {
			return nil, corrupt("agent %q: bad or duplicate number %d", a.id, a.num)
		}
		if a.lastKind > kindRelease || (a.lastKind == kindNone) != (a.lastReq == 0) {
			return nil, corrupt("agent %q: bad last call kind", a.id)
		}
		lastID = a.id
		c.agents[a.id] = a
		c.byNum[a.num] = a
	}

	// Keys, in hash order.
	nk := d.count("keys")
	if d.err == nil {
		capa := minTableCap
		for nk*maxLoadDen > capa*maxLoadNum {
			capa *= 2
		}
		c.tab.init(capa)
	}
	next := 0
	var prev uint64
	for i := 0; i < nk && d.err == nil; i++ {
		sl := slot{hash: d.fixed64(), st: bucket.State{A: d.varint(), B: d.varint()}}
		sl.lim = uint32(d.uvarintMax(uint64(nl-1), "key limit"))
		if d.err != nil {
			break
		}
		if i > 0 && sl.hash <= prev {
			return nil, corrupt("keys out of order")
		}
		prev = sl.hash
		if int(sl.lim) >= len(c.lims.ents) || !present[sl.lim] {
			return nil, corrupt("key %016x names a free limit %d", sl.hash, sl.lim)
		}
		c.lims.ents[sl.lim].refs++
		next = c.tab.placeNext(c, sl, next)
	}
	if d.err != nil {
		return nil, d.err
	}
	for i := 1; i < len(c.lims.ents); i++ {
		if present[i] && c.lims.ents[i].refs == 0 {
			return nil, corrupt("limit %d is not used by any key", i)
		}
	}

	// Leased keys.
	if err := c.restoreLeased(d, version); err != nil {
		return nil, err
	}
	hasModes := version == snapVersionV4
	ledger := version == snapVersionLedger || version == snapVersionLimits
	limits := version == snapVersionLimits
	keep, shares, static := false, false, false
	switch version {
	case snapVersionLedger, snapVersionLimits:
		switch d.byte() {
		case 0:
		case 1:
			hasModes = true
		default:
			d.fail("slot modes flag")
		}
	case snapVersionFence, snapVersionKeep, snapVersionShares, snapVersionStatic:
		flags := d.byte()
		known := byte(snapFlagModes | snapFlagLedger | snapFlagLimits)
		if version >= snapVersionKeep {
			known |= snapFlagKeep
		}
		if version >= snapVersionShares {
			known |= snapFlagShares
		}
		if version == snapVersionStatic {
			known |= snapFlagStatic
		}
		if flags&^known != 0 || (flags&snapFlagLimits != 0 && flags&snapFlagLedger == 0) ||
			(flags&snapFlagKeep != 0 && flags&snapFlagLimits == 0) {
			d.fail("snapshot flags")
		}
		hasModes, ledger, limits = flags&snapFlagModes != 0, flags&snapFlagLedger != 0, flags&snapFlagLimits != 0
		keep = flags&snapFlagKeep != 0
		shares = flags&snapFlagShares != 0
		static = flags&snapFlagStatic != 0
		if version == snapVersionShares && !shares || version == snapVersionStatic && !static {
			d.fail("snapshot flags")
		}
	}
	if hasModes {
		if err := c.restoreModes(d); err != nil {
			return nil, err
		}
	}
	if ledger {
		b := d.bytes()
		if d.err != nil {
			return nil, d.err
		}
		if err := c.decodeLedger(b, limits, keep); err != nil {
			return nil, err
		}
	}
	if version == snapVersionFence || version == snapVersionKeep || version == snapVersionShares || version == snapVersionStatic {
		if c.slotFence = d.uvarintMax(1<<63-1, "slot fence"); c.slotFence == 0 && version == snapVersionFence && d.err == nil {
			d.fail("slot fence")
		}
		if d.err != nil {
			return nil, d.err
		}
	}
	if shares {
		if err := c.restoreShares(d); err != nil {
			return nil, err
		}
	}
	if static {
		b := d.bytes()
		if d.err != nil {
			return nil, d.err
		}
		if err := c.decodeStatic(b); err != nil {
			return nil, err
		}
	}
	if len(d.b) != 0 {
		return nil, corrupt("%d trailing bytes", len(d.b))
	}
	c.rebuildWheel()
	return c, nil
}

// restoreLeased reads the leased keys into c's arena, checking that each is
// a tracked key, that its hash is its key's, that its leases name known
// agents in order, and that every number is in the canonical form the
// arena stores it in (so the state re-persists to the same bytes).
func (c *core) restoreLeased(d *dec, version uint64) error {
	ni := d.count("leased keys")
	var (
		prev          uint64
		cur           int // table cursor
		e             entry
		given         []lease
		tpl, val, buf []byte
	)
	// Before version 9 the shares issued are not recorded (shares.go).
	unknown := version < snapVersionShares && c.mayShare()
	for i := 0; i < ni && d.err == nil; i++ {
		h := d.fixed64()
		key := d.view()
		base := d.varint()
		grant, deny := d.fixed32(), d.fixed32()
		n := d.count("leases")
		if d.err != nil {
			break
		}
		if (i > 0 && h <= prev) || n == 0 {
			return corrupt("leased keys out of order or empty")
		}
		prev = h
		// Leased keys come in hash order, as the slots are.
		for cur < c.tab.size && (c.tab.at(cur).lim == 0 || c.tab.at(cur).hash < h) {
			cur++
		}
		idx := cur
		if idx == c.tab.size || c.tab.at(idx).hash != h {
			return corrupt("leased key %016x is not tracked", h)
		}
		if xxhash.Sum64(key) != h || base < 0 || base > baseMax ||
			packRate(unpackRate(grant)) != grant || packRate(unpackRate(deny)) != deny {
			return corrupt("leased key %016x: bad key, base or rates", h)
		}
		var ok bool
		tpl, val, ok = splitKey(key, tpl[:0], val[:0])
		if buf = joinKey(buf[:0], string(tpl), val); !ok || !bytes.Equal(buf, key) {
			return corrupt("leased key %016x: malformed key", h)
		}
		given = given[:0]
		for j := 0; j < n && d.err == nil; j++ {
			l := lease{agent: uint32(d.uvarintMax(math.MaxUint32, "lease agent")), need: d.varint(), held: d.varint()}
			if version >= 3 {
				l.win = d.varint()
			}
			l.grantedAt, l.expiry, l.demand = d.varint(), d.varint(), math.Float32frombits(d.fixed32())
			if d.err != nil {
				break
			}
			if version < 3 {
				l.demand = roundDemand32(l.demand)
			}
			if c.byNum[l.agent] == nil || (j > 0 && l.agent <= given[j-1].agent) || l.need < 0 || l.held < 0 ||
				l.win < 0 || l.grantedAt < 0 || l.demand != l.demand || l.demand < 0 {
				return corrupt("leased key %016x: bad lease", h)
			}
			given = append(given, l)
		}
		if d.err != nil {
			break
		}
		e = entry{base: base, grant: unpackRate(grant), deny: unpackRate(deny), value: val, leases: e.leases[:0]}
		size := entrySize(n, math.MaxUint32, len(val))
		if !c.ar.canAlloc(size) {
			return corrupt("leased keys exceed the arena")
		}
		e.tpl = c.tpls.ref(tpl)
		for _, l := range given {
			c.addLease(&e, len(e.leases), l)
		}
		c.storeEntry(h, idx, &e, math.MaxInt64, false)
		if unknown && c.sharedKey(string(key)) {
			c.markUnknown(&e, h)
		}
		for j, l := range e.leases { // as stored
			if l.expiry != given[j].expiry || l.grantedAt != given[j].grantedAt || l.demand != given[j].demand {
				return corrupt("leased key %016x: lease times or demand not in stored form", h)
			}
		}
	}
	return d.err
}

// restoreShares reads the issued shares (version 9), checking that they
// are in order, that each names a lease and that none is below
// shareUnknown.
func (c *core) restoreShares(d *dec) error {
	n := d.count("shares")
	if d.err == nil && n == 0 {
		return corrupt("shares flagged but none recorded")
	}
	c.shares = make(map[extKey]int64, n)
	var prev extKey
	e := &c.scr.e
	for i := 0; i < n && d.err == nil; i++ {
		k := extKey{hash: d.fixed64(), agent: uint32(d.uvarintMax(math.MaxUint32, "share agent"))}
		s := d.varint()
		if d.err != nil {
			break
		}
		if i > 0 && (k.hash < prev.hash || (k.hash == prev.hash && k.agent <= prev.agent)) {
			return corrupt("shares out of order")
		}
		prev = k
		idx := c.tab.find(k.hash)
		if idx < 0 || c.tab.at(idx).link == 0 {
			return corrupt("share of key %016x, which has no lease", k.hash)
		}
		c.loadEntry(e, k.hash, c.tab.at(idx).link)
		if _, ok := e.find(k.agent); !ok || s < shareUnknown {
			return corrupt("share of key %016x: no lease of agent %d, or a bad share", k.hash, k.agent)
		}
		c.shares[k] = s
	}
	return d.err
}

// dec reads the body; the first error sticks and later reads return zero.
type dec struct {
	b   []byte
	err error
}

func (d *dec) fail(what string) {
	if d.err == nil {
		d.err = corrupt("truncated or malformed %s", what)
	}
}

func (d *dec) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *dec) uvarintMax(limit uint64, what string) uint64 {
	v := d.uvarint()
	if v > limit {
		d.fail(what)
		return 0
	}
	return v
}

// count reads a record count; it cannot exceed the bytes left, so a corrupt
// count cannot make the decoder allocate without bound.
func (d *dec) count(what string) int {
	v := d.uvarint()
	if v > uint64(len(d.b)) {
		d.fail(what + " count")
		return 0
	}
	return int(v)
}

func (d *dec) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.fail("varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *dec) byte() byte {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 1 {
		d.fail("byte")
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

func (d *dec) fixed32() uint32 {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 4 {
		d.fail("fixed32")
		return 0
	}
	v := binary.LittleEndian.Uint32(d.b)
	d.b = d.b[4:]
	return v
}

func (d *dec) fixed64() uint64 {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 8 {
		d.fail("fixed64")
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	return v
}

func (d *dec) bytes() []byte {
	n := d.count("bytes")
	if d.err != nil {
		return nil
	}
	v := bytes.Clone(d.b[:n])
	d.b = d.b[n:]
	return v
}

// view returns the next length-prefixed bytes without copying them.
func (d *dec) view() []byte {
	n := d.count("bytes")
	if d.err != nil {
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *dec) str() string {
	n := d.count("string")
	if d.err != nil {
		return ""
	}
	v := string(d.b[:n])
	d.b = d.b[n:]
	return v
}
