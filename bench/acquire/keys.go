package main

import (
	"strconv"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Keys of a call. Every key the load sends is "bench", user=n for a key
// number n, and its fields follow from n: in -mode grants every key is a
// renewal (want 5, demand 5); in -mode fleet a key below -hot-keys is a
// hot renewal (want 5, demand 5, held 2, charged 3) and any other a cold
// first use (charged 1). A call is built as its key numbers, and packed
// straight from them (packKeys, with allotv1.PackedKeysWriter) or made
// messages (keyMessages).

// keySet builds keys from key numbers: the numbers below len(msgs) have
// a prebuilt message (msgs[n], shared read-only) with the fields of
// proto, the others are cold keys made per call.
type keySet struct {
	msgs []*allotv1.KeyAcquire
	// fields and coldFields are the packed flags and amounts of a
	// prebuilt key and of a cold key.
	fields, coldFields []byte
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
	ks := &keySet{msgs: make([]*allotv1.KeyAcquire, n),
		fields: allotv1.AppendPackedKeyFields(nil, proto), coldFields: allotv1.AppendPackedKeyFields(nil, coldKey)}
	for i := range ks.msgs {
		ks.msgs[i] = keyMessage(i, proto)
	}
	return ks
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

// packKeys appends keys nums to dst in the packed form, as
// AppendPackedKeys(dst, ks.keyMessages(nums)) would, without a message
// per key.
func (ks *keySet) packKeys(dst []byte, nums []int) []byte {
	var w allotv1.PackedKeysWriter
	w.Start(dst, len(nums))
	var num [20]byte
	for _, n := range nums {
		w.Head(benchDomain, 1)
		w.EntryBytes(benchKey, strconv.AppendInt(num[:0], int64(n), 10))
		if n < len(ks.msgs) {
			w.FieldsPacked(ks.fields)
		} else {
			w.FieldsPacked(ks.coldFields)
		}
	}
	return w.B
}

// packedSize is a capacity that holds nums packed: under 30 bytes a key.
func packedSize(nums []int) int { return 10 + 30*len(nums) }
