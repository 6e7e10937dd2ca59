// Package upstream is the regional allocator's policy for a global key: a
// rule with scope: global, whose budget the global allocator cluster holds.
// The regional leader acts as an agent of the global cluster: it leases
// tokens of the key, sized by its region's demand (the sum its gateways
// report), and sub-grants them to its own gateways, never more than it
// holds. It refills ahead of need, with the cross-region round trip in its
// low watermark, so no request and no regional refill waits on the
// cross-region hop; it hands back what demand no longer needs, and all it
// holds once its gateways no longer use the key (Key.Idle), after which it
// makes no call for the key; and when it is cut off from the global
// cluster (or its call is overdue) it spends what it holds, then falls to
// a bounded share of the rule's rate: the fair share the global cluster
// sent with its last grant (global_fallback: fair_share, the default; see
// Key.Granted) or a static fraction of the rate (global_fallback:
// static).
//
// Key is the policy of one key. It is deterministic and single-threaded:
// every method takes the time (Unix nanoseconds) and the event as
// arguments, starts no goroutine and reads no clock, so the regional
// leader, the simulator (bench/sim -scenarios regions) and the scripts in
// testdata drive it the same way. A Key is not safe for concurrent use.
//
// The invariants, checked by the property tests:
//
//   - what a region sub-grants from its lease never exceeds what it holds:
//     the tokens granted to it less those it returned;
//   - each upstream grant is counted once, however replies are lost,
//     repeated or reordered, so across regions the total held is at most
//     what the global bucket granted;
//   - a region cut off, or whose call in flight is overdue (three measured
//     round trips; see Key.OverdueAfter), admits beyond its lease at most
//     its fallback share of the rate for as long as it is so and its
//     lease is spent, and reports every token it minted as
//     outage_charged: a call that fails owes its charge again.
package upstream
