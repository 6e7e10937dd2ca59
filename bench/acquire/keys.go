package main

import (
	"encoding/binary"
	"strconv"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Keys of a call. Every key the load sends is "bench", user=n for a key
// number n, and its fields follow from n: in -mode grants every key is a
// renewal (want 5, demand 5); in -mode fleet a key below -hot-keys is a
// hot renewal (want 5, demand 5, held 2, charged 3) and any other a cold
// first use (charged 1). A call is built as its key numbers, and packed
// straight from them (packKeys) or made messages (keyMessages).

// keySet builds keys from key numbers: the numbers below len(msgs) have
// a prebuilt message (msgs[n], shared read-only), the others are cold keys
// made per call.
type keySet struct {
	msgs []*allotv1.KeyAcquire
	// tail and coldTail are the packed flags and fields of a prebuilt
	// key and of a cold key (what follows a key's entries in
	// AppendPackedKeys' output).
	tail, coldTail []byte
}

// The keys' domain and their one descriptor key.
const (
	benchDomain = "bench"
	benchKey    = "user"
)

// keyMessage returns the message of key n with the fields of proto.
func keyMessage(n int, proto *allotv1.KeyAcquire) *allotv1.KeyAcquire {
	return &allotv1.KeyAcquire{Domain: benchDomain, Entries: []*allotv1.Entry{{Key: benchKey, Value: strconv.Itoa(n)}},
		Want: proto.Want, Demand: proto.Demand, Held: proto.Held, Charged: proto.Charged}
}

var (
	grantsKey = &allotv1.KeyAcquire{Want: 5, Demand: 5}
	hotKey    = &allotv1.KeyAcquire{Want: 5, Demand: 5, Held: 2, Charged: 3}
	coldKey   = &allotv1.KeyAcquire{Charged: 1}
)

// newKeySet prebuilds n keys with the fields of proto; the numbers from n
// up are cold keys.
func newKeySet(n int, proto *allotv1.KeyAcquire) *keySet {
	ks := &keySet{msgs: make([]*allotv1.KeyAcquire, n), tail: packedFields(proto), coldTail: packedFields(coldKey)}
	for i := range ks.msgs {
		ks.msgs[i] = keyMessage(i, proto)
	}
	return ks
}

// packedFields returns the flags and fields of k as AppendPackedKeys
// writes them: what follows, in k packed alone with no domain and no
// entries, the count (1), the new empty domain (0, then length 0) and
// the entry count (0).
func packedFields(k *allotv1.KeyAcquire) []byte {
	b := allotv1.AppendPackedKeys(nil, []*allotv1.KeyAcquire{{Want: k.Want, Demand: k.Demand, Held: k.Held, Charged: k.Charged}})
	return b[4:]
}

// message returns key n's message.
func (ks *keySet) message(n int) *allotv1.KeyAcquire {
	if n < len(ks.msgs) {
		return ks.msgs[n]
	}
	return keyMessage(n, coldKey)
}

// keyMessages returns the messages of keys nums.
func (ks *keySet) keyMessages(nums []int) []*allotv1.KeyAcquire {
	out := make([]*allotv1.KeyAcquire, len(nums))
	for i, n := range nums {
		out[i] = ks.message(n)
	}
	return out
}

// packKeys appends keys nums to dst in the packed form, byte for byte as
// AppendPackedKeys(dst, ks.keyMessages(nums)) would. Every key has the
// same domain and descriptor key, so the first key carries both as new
// dictionary strings (1 and 2) and the others name them by index.
func (ks *keySet) packKeys(dst []byte, nums []int) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(nums)))
	for i, n := range nums {
		if i == 0 {
			dst = append(dst, 0, byte(len(benchDomain)))
			dst = append(dst, benchDomain...)
			dst = append(dst, 1, 0, byte(len(benchKey)))
			dst = append(dst, benchKey...)
		} else {
			dst = append(dst, 1, 1, 2) // domain 1, one entry, key 2
		}
		// The value's length (under 128: one byte), then its digits.
		at := len(dst)
		dst = strconv.AppendInt(append(dst, 0), int64(n), 10)
		dst[at] = byte(len(dst) - at - 1)
		if n < len(ks.msgs) {
			dst = append(dst, ks.tail...)
		} else {
			dst = append(dst, ks.coldTail...)
		}
	}
	return dst
}

// packedSize is a capacity that holds nums packed: under 30 bytes a key.
func packedSize(nums []int) int { return 10 + 30*len(nums) }
