package bucket_test

import (
	"fmt"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

// 30 requests a minute with bursts of 10: ten at once, then one every 2s.
func ExampleLimit_AllowN() {
	l, err := bucket.NewLimit(bucket.TokenBucket, 30, time.Minute, 10)
	if err != nil {
		panic(err)
	}
	var s bucket.State // the zero State is a full bucket
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()
	for range 10 {
		l.AllowN(&s, now, 1)
	}
	r := l.AllowN(&s, now, 1)
	fmt.Println(r.Allowed, r.Remaining, r.RetryAfter)
	r = l.AllowN(&s, now+int64(r.RetryAfter), 1)
	fmt.Println(r.Allowed, r.Remaining, r.ResetAfter)
	// Output:
	// false 0 2s
	// true 0 20s
}

// The allocator's view of a lease: grant what is available, take back what
// was not spent, and charge what an agent admitted on its own.
func ExampleLimit_TakeUpTo() {
	l, _ := bucket.NewLimit(bucket.TokenBucket, 100, time.Second, 100)
	var s bucket.State
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()
	granted := l.TakeUpTo(&s, now, 60) // lease 60 tokens to agent A
	fmt.Println(granted, l.TakeUpTo(&s, now, 60))
	l.GiveBack(&s, now, 10) // A hands 10 back unspent
	l.Debit(&s, now, 5)     // B admitted 5 while it had no lease
	fmt.Println(l.Peek(s, now).Remaining)
	// Output:
	// 60 40
	// 5
}
