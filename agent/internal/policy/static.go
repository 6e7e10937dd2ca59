package policy

// Static shares (docs/static-shares.md). While the agent holds a slot, a
// key of a static-eligible rule that is not in the hot-key set is decided
// from its static share, a bucket of the rule's rate and burst divided by
// the slots, without the allocator. Such a key is sent only to promote it
// (KeyAcquire.promote): when its share nears exhaustion. Two signs say so,
// whichever comes first: the share's bucket holds less than half its burst
// after a check (StaticLow, seen by the check path), or the key's demand
// EWMA passes half the share's rate (StaticBusy, seen by a scan).

// StaticLow reports whether a static share of burst tokens that holds
// level tokens after a check is low enough to promote its key.
func StaticLow(level, burst int64) bool { return 2*level < burst }

// StaticBusy reports whether a key whose demand EWMA is demand (tokens/s)
// spends enough of a static share of rate tokens/s to promote it.
func StaticBusy(demand, rate float64) bool { return rate > 0 && 2*demand > rate }
