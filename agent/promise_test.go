package agent

import (
	"context"
	"testing"
	"time"

	"github.com/allot/allot/pkg/bucket"
)

const promiseRules = `
domain: test
descriptors:
  - key: api_key
    rate_limit: {name: free, unit: minute, requests_per_unit: 30, burst: 10}
`

// TestRetryAfterKept pins the broken promise: a burst admitted by the
// fallback bucket is charged to the allocator only at the next Acquire,
// so the allocator's bucket refills later than the fallback's, and a client
// that waited exactly Retry-After was denied by the allocator's EXHAUSTED
// answer. It is admitted now, once, and charged.
func TestRetryAfterKept(t *testing.T) {
	clock := newFakeClock()
	fake := newFake(t, clock.now, promiseRules)
	cfg := drivenConfig(t, "promise", clock, &directClient{f: fake}, promiseRules)
	a := newAgent(t, cfg)
	d := desc("api_key", "k")
	for i := range 10 {
		if got := check(t, a, d); !got.Allowed {
			t.Fatalf("burst request %d: %+v, want allowed", i+1, got)
		}
		clock.advance(2 * time.Millisecond)
	}
	t11 := clock.now()
	denied := check(t, a, d)
	if denied.Allowed || denied.RetryAfter <= 0 {
		t.Fatalf("11th request: %+v, want denied with a retry delay", denied)
	}
	// The charges reach the allocator a scan later.
	for range 3 {
		clock.advance(100 * time.Millisecond)
		if err := a.refill(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if ks := keyOf(t, a, d); !ks.Paced || ks.deniedUntil.Load() <= t11+int64(denied.RetryAfter) {
		t.Fatalf("the key is not paced past the promised moment (paced %v, deniedUntil %v after the denial, Retry-After %v): the test does not reproduce the broken promise",
			ks.Paced, time.Duration(ks.deniedUntil.Load()-t11), denied.RetryAfter)
	}
	if got := check(t, a, d); got.Allowed {
		t.Fatalf("a request before Retry-After: %+v, want denied", got)
	}
	clock.ns.Store(t11 + int64(denied.RetryAfter))
	got := check(t, a, d)
	if !got.Allowed {
		t.Fatalf("the request exactly Retry-After after the denial: %+v, want allowed", got)
	}
	if again := check(t, a, d); again.Allowed {
		t.Fatalf("a second request at the same moment: %+v, want denied (a promise is kept once)", again)
	}
	for range 20 { // past a paced key's next ask
		clock.advance(100 * time.Millisecond)
		if err := a.refill(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if b := fake.booksOf(keyOf(t, a, d).key); b.charged != 11 {
		t.Fatalf("the allocator was charged %d tokens, want 11 (the kept request is charged)", b.charged)
	}
}

// TestKeepPromiseSteps: a promise is kept once, at or after its moment, for
// at most the tokens denied, while this agent admitted nothing else on the
// key, and within promiseHold; a pending earlier promise is not replaced by
// a later one.
func TestKeepPromiseSteps(t *testing.T) {
	const s = int64(time.Second)
	ks := &keyState{}
	steps := []struct {
		now, n int64
		retry  time.Duration
		spend  int64 // tokens admitted on the key before the step
		want   bool
	}{
		0:  {now: 0, n: 1, retry: 2 * time.Second, want: false},           // denied: promise at 2 s
		1:  {now: s, n: 1, retry: 3 * time.Second, want: false},           // denied again: the 2 s promise stays
		2:  {now: 2*s - 1, n: 1, retry: time.Nanosecond, want: false},     // before the moment: a promise at 2 s still
		3:  {now: 2 * s, n: 2, retry: time.Second, want: false},           // more tokens than promised: a new promise at 3 s for 2
		4:  {now: 3 * s, n: 1, want: true},                                // kept
		5:  {now: 3 * s, n: 1, retry: time.Second, want: false},           // once: a new promise at 4 s
		6:  {now: 4 * s, n: 1, spend: 1, retry: time.Second, want: false}, // this agent admitted one since: lapsed, a new one at 5 s
		7:  {now: 5*s + int64(promiseHold), n: 1, retry: 0, want: false},  // too late, and no new promise
		8:  {now: 8 * s, n: 1, retry: time.Second, want: false},           // a new one at 9 s
		9:  {now: 9 * s, n: 1, retry: time.Second, want: true},            // kept
		10: {now: 10 * s, n: 1, retry: bucket.Never, want: false},         // n above the burst: no promise
		11: {now: 11 * s, n: 1, retry: bucket.Never, want: false},         // still none
	}
	for i, st := range steps {
		ks.spent.Add(st.spend)
		if got := ks.keepPromise(st.now, st.n, st.retry); got != st.want {
			t.Fatalf("step %d: keepPromise(%v, %d, %v) = %v, want %v (promise %+v)",
				i, time.Duration(st.now), st.n, st.retry, got, st.want, ks.promise)
		}
	}
}
