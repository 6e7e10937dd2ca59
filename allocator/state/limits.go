package state

import (
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// limits interns the distinct bucket.Limits that tracked keys are under, so
// that a 32-byte slot names its limit with a uint32. Entries are reference
// counted by slots and freed at zero; a new limit takes the lowest free
// index, so the table's layout is a function of the applied commands only.
//
// A key keeps its state while its rule's limit parameters stay the same
// (even if the rule is renamed or moved); when a PutRules changes them, the
// key's balance carries over to the new limit at its next use (carryOver).
type limits struct {
	ents []limitEnt // index 0 is unused: slot.lim == 0 marks an empty slot
	idx  map[limitKey]uint32
}

type limitEnt struct {
	lim  bucket.Limit
	key  limitKey
	refs uint32 // 0: free
	// The limit's capacity and refill at the state's refresh interval
	// (capacityRefill), once a grant has needed them (sized: set).
	sized            bool
	capacity, refill int64
}

// sizes returns the capacity and refill of the limit at index i at
// refresh interval f, the one of every call (the state's).
func (ls *limits) sizes(i uint32, f time.Duration) (capacity, refill int64) {
	e := &ls.ents[i]
	if !e.sized {
		e.capacity, e.refill = capacityRefill(e.lim, f)
		e.sized = true
	}
	return e.capacity, e.refill
}

type limitKey struct {
	alg    bucket.Algorithm
	quota  int64
	window time.Duration
	burst  int64
}

func keyOf(l bucket.Limit) limitKey {
	return limitKey{alg: l.Algorithm(), quota: l.Quota(), window: l.Window(), burst: l.Burst()}
}

func (ls *limits) init() {
	ls.ents = make([]limitEnt, 1, 8)
	ls.idx = make(map[limitKey]uint32)
}

// lookup returns l's index without taking a reference (0: not interned).
func (ls *limits) lookup(l bucket.Limit) uint32 { return ls.idx[keyOf(l)] }

// ref interns l if needed and takes a reference.
func (ls *limits) ref(l bucket.Limit) uint32 {
	k := keyOf(l)
	if i, ok := ls.idx[k]; ok {
		ls.ents[i].refs++
		return i
	}
	i := uint32(0)
	for j := 1; j < len(ls.ents); j++ {
		if ls.ents[j].refs == 0 {
			i = uint32(j)
			break
		}
	}
	if i == 0 {
		ls.ents = append(ls.ents, limitEnt{})
		i = uint32(len(ls.ents) - 1)
	}
	ls.ents[i] = limitEnt{lim: l, key: k, refs: 1}
	ls.idx[k] = i
	return i
}

// unref drops a reference and frees the entry at zero.
func (ls *limits) unref(i uint32) {
	e := &ls.ents[i]
	e.refs--
	if e.refs == 0 {
		delete(ls.idx, e.key)
		*e = limitEnt{}
		for len(ls.ents) > 1 && ls.ents[len(ls.ents)-1].refs == 0 {
			ls.ents = ls.ents[:len(ls.ents)-1]
		}
	}
}

func (ls *limits) get(i uint32) bucket.Limit { return ls.ents[i].lim }

// clone copies the table for a snapshot (it is small: one entry per
// distinct limit).
func (ls *limits) clone() limits {
	return limits{ents: append([]limitEnt(nil), ls.ents...)}
}
