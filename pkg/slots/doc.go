// Package slots divides the budget key space into Count (1024) fixed slots
// and assigns the slots to Raft groups.
//
// A key's slot is the low ten bits of the xxhash64 of its canonical budget
// key (rules.KeyHash, which the agent and the allocator both compute):
// Of(h) = h mod 1024. The low bits are used because the allocator's key
// table places a key by the high bits of the same hash (a multiply-high
// reduction); a group that owns a contiguous run of slots still spreads its
// keys over the whole table.
//
// A Map says which group owns each slot, and carries a version that grows
// with every change. Its zero value is version 0 with every slot owned by
// group 0: a cluster of one group. Even builds the map of a new cluster;
// Rebalance plans the moves that even out an existing one with the fewest
// slots moved; Map.Apply carries moves out. Ranges of slots are written
// "A-B" (inclusive) or "A", and a map as "A-B=G,..." in slot order.
//
// Both sides use it: the agent to send a key's refill to the group that
// owns the key, the allocator to serve only the slots its group owns.
// Everything here is a pure value or function, safe for concurrent use.
package slots
