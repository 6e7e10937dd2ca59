package redislimit

import (
	"math/rand/v2"
	"strconv"

	"github.com/allot/allot/pkg/bucket"
)

// MaxShards bounds the sub-keys of one key.
const MaxShards = 1024

// effectiveShards returns the number of sub-keys a key limited by l is split
// into when `shards` are asked for: at most the quota and the burst, so that
// every sub-key gets at least one token of each, and at most MaxShards.
// Values ≤ 1 mean unsharded.
func effectiveShards(l bucket.Limit, shards int) int {
	if shards <= 1 {
		return 1
	}
	n := int64(min(shards, MaxShards))
	n = min(n, l.Quota(), l.Burst())
	return int(max(n, 1))
}

// splitPart returns sub-key i's part of total split n ways: ⌊total/n⌋, plus
// one for the first total mod n sub-keys, so that the parts sum to total.
func splitPart(total int64, n, i int) int64 {
	p := total / int64(n)
	if int64(i) < total%int64(n) {
		p++
	}
	return p
}

// subLimit returns the limit of sub-key i of n (n from effectiveShards):
// quota and burst split exactly, so the sub-keys together admit what the key
// would.
func subLimit(l bucket.Limit, n, i int) (bucket.Limit, error) {
	if n <= 1 {
		return l, nil
	}
	q := splitPart(l.Quota(), n, i)
	b := splitPart(l.Burst(), n, i)
	if a := l.Algorithm(); a == bucket.SlidingWindow || a == bucket.FixedWindow {
		b = q
	}
	return bucket.NewLimit(l.Algorithm(), q, l.Window(), b)
}

// mainKey returns the Redis key of the budget key: prefix{tag}key, where the
// tag's slot follows the budget key's hash, so user-controlled braces in the
// budget key never decide placement.
func (b *Backend) mainKey(key string, h uint64) string {
	return b.cfg.KeyPrefix + "{" + slotTag(int(h%numSlots)) + "}" + key
}

// subKey returns the Redis key of sub-key i of n: prefix{tag}key#i/n, with
// the tag's slot from subSlot. The shard count is part of the name, so
// changing a rule's shards starts fresh sub-keys.
func (b *Backend) subKey(key string, h uint64, n, i int) string {
	return b.cfg.KeyPrefix + "{" + slotTag(subSlot(h, n, i)) + "}" + key + "#" + strconv.Itoa(i) + "/" + strconv.Itoa(n)
}

// pick returns the sub-key a check tries first.
func (b *Backend) pick(h uint64, n int) int {
	if b.cfg.Affinity {
		return int((h ^ b.seed) % uint64(n))
	}
	return rand.IntN(n)
}

// other returns a sub-key other than i, at random.
func other(i, n int) int { return (i + 1 + rand.IntN(n-1)) % n }
