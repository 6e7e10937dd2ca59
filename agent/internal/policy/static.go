package policy

// Static shares (docs/static-shares.md). While the agent holds a slot, a
// key of a static-eligible rule that is not in the hot-key set is decided
// from its static share, a bucket of the rule's rate and burst divided by
// the slots, without the allocator. Such a key is sent only to promote it
// (KeyAcquire.promote): when its share nears exhaustion. Two signs say so,
// whichever comes first: the share's bucket holds less than half its burst
// after a check (StaticLow, seen by the check path), or the key's demand
// estimate passes half the share's rate (StaticBusy, seen by a scan). The
// estimate is Demand.Of, the EWMA capped for a sparse key by its rate from
// the gaps between uses: one request makes the EWMA read about 1/s for a
// moment, over half of most per-key shares (100 a minute over 10 slots is
// 0.17/s), and promoting at it would coordinate every key at its first use.

// StaticLow reports whether a static share of burst tokens that holds
// level tokens after a check is low enough to promote its key.
func StaticLow(level, burst int64) bool { return 2*level < burst }

// StaticBusy reports whether a key whose demand estimate is demand
// (tokens/s) spends enough of a static share of rate tokens/s to promote
// it.
func StaticBusy(demand, rate float64) bool { return rate > 0 && 2*demand > rate }
