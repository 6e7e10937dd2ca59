package agent

import (
	"math"

	"github.com/allot/allot/agent/internal/policy"
)

// The refill loop visits only the keys that need it. A key is awake (in
// refiller.awake, visited by every scan) from the moment a check touches
// it or the loop changes it until a scan finds it at rest: no demand left
// in its EWMA, nothing spent since the previous scan, not queued, not in
// flight, nothing picked and nothing to forget. Such a scan's verdict
// cannot change until a check touches the key again or the clock crosses
// one of the key's deadlines (policy.Core.RestUntil), so the key sleeps: it leaves the
// awake list and waits in a min-heap ordered by its next deadline, and is
// visited again when that deadline passes or a check wakes it. An idle
// gateway holding many keys then costs nothing per scan but the keys whose
// deadline has come (bench/idle measures it).
//
// Waking is lock-free and cannot be missed (keyState.dormant): the loop
// stores dormant = true and then reads the key's counters again, comparing
// them with what the scan read; a check changes the counters and then
// reads dormant (Agent.wake, at the end of decide and in refund). With
// sequentially consistent atomics at least one of the two sees the other:
// either the loop sees the change and keeps the key awake, or the check
// sees dormant and hands the key back to the loop.

// wake hands a dormant key back to the refill loop. Checks call it after
// changing a key's state.
func (a *Agent) wake(ks *keyState) {
	if !ks.dormant.CompareAndSwap(true, false) {
		return
	}
	a.wakeMu.Lock()
	a.woken = append(a.woken, ks)
	a.wakeMu.Unlock()
}

// sleep tries to put ks, which a scan at now found at rest with o, to
// sleep. It reports false (ks stays awake) when a check changed the key
// meanwhile or the key must stay awake.
func (a *Agent) sleep(ks *keyState, o *policy.Obs, now int64) bool {
	rf := &a.rf
	until, ok := rf.core.RestUntil(&ks.Key, o, now)
	if !ok {
		return false
	}
	if ks.Demand.Rate > 0 {
		rf.decayHorizon = max(rf.decayHorizon, int64(policy.DecayTime(ks.Demand.Rate)))
	}
	if rf.alwaysAwake {
		return false
	}
	ks.dormant.Store(true)
	if !ks.unchanged(o) || ks.queued.Load() || ks.fbUsed.Load() {
		// If a check woke it first, it is also in the woken list;
		// awaken skips a key that is awake already.
		ks.dormant.CompareAndSwap(true, false)
		return false
	}
	ks.awake, ks.asleep = false, true
	ks.sleptSeq = rf.scanSeq
	if until != math.MaxInt64 {
		rf.due.push(ks, until)
	}
	if ks.Demand.Rate > 0 {
		ks.sleptDemand = ks.Demand.Rate
		rf.hot.push(ks)
	}
	return true
}

// awaken puts ks in the awake list (the loop changed it, a check woke it,
// or its deadline passed). A key that slept catches up on the scans it
// missed: they found nothing spent, so each only decayed its demand.
func (rf *refiller) awaken(ks *keyState) {
	if ks.asleep {
		ks.asleep = false
		if ks.dueIdx != 0 {
			rf.due.remove(ks)
		}
		if ks.hotIdx != 0 {
			rf.hot.remove(ks)
		}
		if ks.Demand.Rate > 0 {
			rf.decay(ks)
		}
	}
	if ks.awake || ks.dropped.Load() {
		return
	}
	if !ks.tracked {
		ks.tracked = true
		rf.tracked++
	}
	ks.dormant.CompareAndSwap(true, false)
	ks.awake = true
	rf.awake = append(rf.awake, ks)
}

// decay applies to ks's demand the scans since it fell asleep, as each of
// them would have: nothing spent, and (the hot heap sees to it) never a
// scan long enough for demandFell.
func (rf *refiller) decay(ks *keyState) {
	// The records it needs are kept (record prunes only those older than
	// the longest decay time, and the key's deadline wakes it within its
	// own); the clamp only guards the index.
	i := 0
	if ks.sleptSeq+1 > rf.scanBase {
		i = int(ks.sleptSeq + 1 - rf.scanBase)
	}
	for ; i < len(rf.scans) && ks.Demand.Rate > 0; i++ {
		ks.Demand.Decay(rf.scans[i].alpha)
	}
}

// scanRec is one scan's decay step (time, dt in seconds, EWMA alpha), kept
// for the sleeping keys whose demand has not decayed yet.
type scanRec struct {
	at        int64
	dt, alpha float64
}

// record notes a scan that decays demands (dt > 0) and drops the records
// no sleeping key can need: those older than the longest decay time.
func (rf *refiller) record(now int64, dt, alpha float64) {
	rf.scanSeq++
	if len(rf.scans) == 0 {
		rf.scanBase = rf.scanSeq
	}
	rf.scans = append(rf.scans, scanRec{at: now, dt: dt, alpha: alpha})
	drop := 0
	for drop < len(rf.scans)-1 && rf.scans[drop].at < now-rf.decayHorizon {
		drop++
	}
	if drop > 0 {
		n := copy(rf.scans, rf.scans[drop:])
		rf.scans = rf.scans[:n]
		rf.scanBase += uint64(drop)
	}
}

// collect wakes the keys checks handed back, those whose deadline has
// passed, and, before a scan of dt seconds, those whose demand could read
// as a fall over it (see demandFell).
func (a *Agent) collect(now int64, dt float64) {
	rf := &a.rf
	a.wakeMu.Lock()
	woken := a.woken
	a.woken = rf.wokenSpare[:0]
	a.wakeMu.Unlock()
	for _, ks := range woken {
		rf.awaken(ks)
	}
	clear(woken)
	rf.wokenSpare = woken[:0]
	for len(rf.due) > 0 && rf.due[0].dueAt <= now {
		rf.awaken(rf.due[0])
	}
	for dt > 0 && len(rf.hot) > 0 && rf.hot[0].sleptDemand*dt >= policy.ShiftMinTokens {
		rf.awaken(rf.hot[0])
	}
}

// dueHeap is a min-heap of sleeping keys by their deadline (keyState.dueAt);
// keyState.dueIdx is a key's index in it plus one (0: not in it).
type dueHeap []*keyState

func (h *dueHeap) push(ks *keyState, at int64) {
	ks.dueAt = at
	*h = append(*h, ks)
	ks.dueIdx = int32(len(*h))
	heapUp(*h, len(*h)-1, dueLess, dueIdx)
}

func (h *dueHeap) remove(ks *keyState) { *h = heapRemove(*h, int(ks.dueIdx)-1, dueLess, dueIdx) }

func dueLess(x, y *keyState) bool { return x.dueAt < y.dueAt }
func dueIdx(ks *keyState) *int32  { return &ks.dueIdx }
func hotLess(x, y *keyState) bool { return x.sleptDemand > y.sleptDemand }
func hotIdx(ks *keyState) *int32  { return &ks.hotIdx }
func (h *hotHeap) push(ks *keyState) {
	*h = append(*h, ks)
	ks.hotIdx = int32(len(*h))
	heapUp(*h, len(*h)-1, hotLess, hotIdx)
}
func (h *hotHeap) remove(ks *keyState) { *h = heapRemove(*h, int(ks.hotIdx)-1, hotLess, hotIdx) }

// hotHeap is a max-heap of sleeping keys by their demand when they fell
// asleep (keyState.sleptDemand, an upper bound of their demand since);
// keyState.hotIdx is a key's index in it plus one (0: not in it).
type hotHeap []*keyState

func heapRemove(h []*keyState, i int, less func(x, y *keyState) bool, idx func(*keyState) *int32) []*keyState {
	last := len(h) - 1
	*idx(h[i]) = 0
	if i != last {
		h[i] = h[last]
		*idx(h[i]) = int32(i + 1)
	}
	h[last] = nil
	h = h[:last]
	if i != last {
		heapDown(h, i, less, idx)
		heapUp(h, i, less, idx)
	}
	return h
}

func heapSwap(h []*keyState, i, j int, idx func(*keyState) *int32) {
	h[i], h[j] = h[j], h[i]
	*idx(h[i]) = int32(i + 1)
	*idx(h[j]) = int32(j + 1)
}

func heapUp(h []*keyState, i int, less func(x, y *keyState) bool, idx func(*keyState) *int32) {
	for i > 0 {
		p := (i - 1) / 2
		if !less(h[i], h[p]) {
			return
		}
		heapSwap(h, i, p, idx)
		i = p
	}
}

func heapDown(h []*keyState, i int, less func(x, y *keyState) bool, idx func(*keyState) *int32) {
	for {
		l := 2*i + 1
		if l >= len(h) {
			return
		}
		m := l
		if r := l + 1; r < len(h) && less(h[r], h[l]) {
			m = r
		}
		if !less(h[m], h[i]) {
			return
		}
		heapSwap(h, i, m, idx)
		i = m
	}
}
