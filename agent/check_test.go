package agent

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/agent/internal/policy"
	"github.com/allot/allot/pkg/rules"
)

// TestColdKeyFallbackThenLease walks one key from first sight (fallback,
// charged) through its first grant (lease) and back to fallback when the
// lease runs dry, checking the charge reported at each Acquire.
func TestColdKeyFallbackThenLease(t *testing.T) {
	s := newStepped(t)
	d := desc("api_key", "k1")

	// step 0: first sight → fallback bucket (N=1: full burst 50), charged.
	got := check(t, s.Agent, d)
	if !got.Allowed || got.Source != SourceFallback || got.Remaining != 49 || got.Policy != "per_key" {
		t.Fatalf("step 0: %+v, want allowed from fallback with 49 left (per_key)", got)
	}
	ks := keyOf(t, s.Agent, d)
	if c := ks.charged.Load(); c != 1 {
		t.Fatalf("step 0: charged %d, want 1", c)
	}

	// step 1: the refill tick reports the charge and asks for a lease.
	s.step()
	req := s.fake.lastAcquire()
	if req == nil || len(req.Keys) != 1 {
		t.Fatalf("step 1: Acquire %v, want one key", req)
	}
	k := req.Keys[0]
	if k.Charged != 1 || k.Want < 1 || k.Domain != "test" {
		t.Fatalf("step 1: KeyAcquire %+v, want charged 1, want ≥ 1", k)
	}
	if c := ks.charged.Load(); c != 0 {
		t.Fatalf("step 1: charged %d after the report, want 0", c)
	}
	bal := ks.balance.Load()
	if bal != k.Want {
		t.Fatalf("step 1: balance %d, want the %d asked for", bal, k.Want)
	}
	// Global: 50 − 1 charged − the grant.
	if rem := s.fake.bucketRemaining(t, "test:api_key=k1"); rem != 49-bal {
		t.Fatalf("step 1: global remaining %d, want %d", rem, 49-bal)
	}

	// step 2: spend the lease; Remaining counts down by one per check.
	prev := int64(-1)
	for i := range bal {
		got = check(t, s.Agent, d)
		if !got.Allowed || got.Source != SourceLease {
			t.Fatalf("step 2.%d: %+v, want allowed from the lease", i, got)
		}
		if prev >= 0 && got.Remaining != prev-1 {
			t.Fatalf("step 2.%d: Remaining %d, want %d", i, got.Remaining, prev-1)
		}
		prev = got.Remaining
	}
	if b := ks.balance.Load(); b != 0 {
		t.Fatalf("step 2: balance %d, want 0", b)
	}

	// step 3: the lease is dry: the fallback decides, re-based to this
	// agent's share of what the allocator said is left (not a new burst).
	got = check(t, s.Agent, d)
	if !got.Allowed || got.Source != SourceFallback {
		t.Fatalf("step 3: %+v, want allowed from the fallback", got)
	}
	if want := 49 - bal - 1; got.Remaining != want {
		t.Fatalf("step 3: fallback Remaining %d, want %d (re-based to the global remaining)", got.Remaining, want)
	}
	if c := ks.charged.Load(); c != 1 {
		t.Fatalf("step 3: charged %d, want 1", c)
	}
}

// TestLeaseExpiryFallsBack: a lease is not spent past its expiry (measured
// from the send time minus the safety margin).
func TestLeaseExpiryFallsBack(t *testing.T) {
	s := newStepped(t)
	d := desc("tier", "free", "route", "/search", "user", "u1")
	check(t, s.Agent, d)
	s.step()
	ks := keyOf(t, s.Agent, d)
	if ks.balance.Load() == 0 {
		t.Fatalf("no lease granted")
	}
	ttl := s.fake.ttl
	if got := check(t, s.Agent, d); got.Source != SourceLease {
		t.Fatalf("before expiry: source %v, want lease", got.Source)
	}
	s.clock.advance(ttl - policy.LeaseMargin(ttl))
	if got := check(t, s.Agent, d); got.Source != SourceFallback || !got.Allowed {
		t.Fatalf("at expiry: %+v, want allowed from the fallback", got)
	}
}

// TestExhaustedDeniesUntilRetry: after EXHAUSTED the key is denied without
// asking the allocator, until retry_after.
func TestExhaustedDeniesUntilRetry(t *testing.T) {
	s := newStepped(t)
	d := desc("small", "s1")
	// The fallback admits the burst (3); the allocator is charged 3.
	for i := range 3 {
		if got := check(t, s.Agent, d); !got.Allowed {
			t.Fatalf("check %d denied: %+v", i, got)
		}
	}
	if got := check(t, s.Agent, d); got.Allowed {
		t.Fatalf("4th check allowed: %+v", got)
	}
	s.step() // charged 3, want ≥ 1 → nothing left: EXHAUSTED
	ks := keyOf(t, s.Agent, d)
	du := ks.deniedUntil.Load()
	if du <= s.clock.now() {
		t.Fatalf("deniedUntil %d not in the future (now %d)", du, s.clock.now())
	}
	calls, _, _ := s.fake.counts()
	got := check(t, s.Agent, d)
	if got.Allowed || got.Source != SourceLease || got.RetryAfter <= 0 {
		t.Fatalf("while exhausted: %+v, want denied by the lease with RetryAfter", got)
	}
	s.step()
	if c, _, _ := s.fake.counts(); c != calls {
		t.Fatalf("the agent asked the allocator again while exhausted (%d → %d calls)", calls, c)
	}
	// 3/hour: one token every 20 minutes.
	s.clock.advance(got.RetryAfter)
	s.step()
	got = check(t, s.Agent, d)
	if !got.Allowed {
		t.Fatalf("after RetryAfter: %+v, want allowed", got)
	}
}

// TestShadowCountedNotEnforced: a shadow rule over its limit allows, flags
// the decision and counts it.
func TestShadowCountedNotEnforced(t *testing.T) {
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	d := desc("shadow", "x")
	if got := check(t, a, d); !got.Allowed || got.Shadow {
		t.Fatalf("first: %+v, want allowed, not shadow", got)
	}
	got := check(t, a, d)
	if !got.Allowed || !got.Shadow || got.Policy != "shadowed" {
		t.Fatalf("second: %+v, want allowed and shadow", got)
	}
	if n := a.met.shadows(); n != 1 {
		t.Fatalf("shadow counter %d, want 1", n)
	}
}

// TestReplaces: a matched rule that replaces another drops it from the
// request.
func TestReplaces(t *testing.T) {
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	ip, vip := desc("ip", "1.2.3.4"), desc("vip", "yes")
	for i := range 5 {
		got := check(t, a, ip, vip)
		if !got.Allowed || got.Policy != "vip" {
			t.Fatalf("check %d: %+v, want allowed under vip (ip replaced)", i, got)
		}
	}
	// Alone, ip is limited to 2.
	check(t, a, ip)
	check(t, a, ip)
	if got := check(t, a, ip); got.Allowed {
		t.Fatalf("ip alone: 3rd allowed, want denied")
	}
}

// TestHitsAddendZeroChecksWithoutConsuming: a descriptor with an explicit
// hits_addend 0 is evaluated but takes nothing.
func TestHitsAddendZeroChecksWithoutConsuming(t *testing.T) {
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	peek := desc("small", "p")
	peek.HitsAddendSet = true
	for i := range 10 {
		got := check(t, a, peek)
		if !got.Allowed || got.Remaining != 3 {
			t.Fatalf("peek %d: %+v, want allowed with 3 remaining", i, got)
		}
	}
	// Request-level hits 0 means 1.
	got := check(t, a, desc("small", "p"))
	if !got.Allowed || got.Remaining != 2 {
		t.Fatalf("hits 0: %+v, want one token taken", got)
	}
	// A descriptor's HitsAddend overrides the request's hits.
	d := desc("small", "p")
	d.HitsAddend = 2
	got, err := a.Check(context.Background(), "test", []Descriptor{d}, 7)
	if err != nil || !got.Allowed || got.Remaining != 0 {
		t.Fatalf("hits_addend 2: %+v %v, want allowed with 0 left", got, err)
	}
	got, _ = a.Check(context.Background(), "test", []Descriptor{desc("small", "p")}, 1)
	if got.Allowed {
		t.Fatalf("empty bucket: %+v, want denied", got)
	}
	// Exhausted but not in debt: a check-only descriptor is allowed, as in
	// envoyproxy/ratelimit.
	if got := check(t, a, peek); !got.Allowed || got.Remaining != 0 {
		t.Fatalf("peek of an empty bucket: %+v, want allowed with 0", got)
	}
}

// TestMultiDescriptorRefund: when one descriptor denies, the tokens taken
// for the others are given back (lease and fallback alike).
func TestMultiDescriptorRefund(t *testing.T) {
	s := newStepped(t)
	big := desc("tier", "free", "route", "/a", "user", "u")
	small := desc("small", "z")
	// Lease the big key.
	check(t, s.Agent, big)
	s.step()
	ksBig := keyOf(t, s.Agent, big)
	bal := ksBig.balance.Load()
	// Use up small (fallback, burst 3).
	for range 3 {
		check(t, s.Agent, small)
	}
	ksSmall := keyOf(t, s.Agent, small)
	charged := ksSmall.charged.Load()
	got, statuses, err := s.CheckStatuses(context.Background(), "test", []Descriptor{big, small}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got.Allowed || got.Policy != "small" {
		t.Fatalf("decision %+v, want denied by small", got)
	}
	if b := ksBig.balance.Load(); b != bal {
		t.Fatalf("big key balance %d after the denied request, want %d (refunded)", b, bal)
	}
	if c := ksSmall.charged.Load(); c != charged {
		t.Fatalf("small charged %d, want %d", c, charged)
	}
	if len(statuses) != 2 || !statuses[0].Allowed || statuses[1].Allowed {
		t.Fatalf("statuses %+v, want [allowed, denied]", statuses)
	}

	// The other order: a deny first, then the rest is only evaluated.
	got, statuses, err = s.CheckStatuses(context.Background(), "test", []Descriptor{small, big}, 1, statuses)
	if err != nil || got.Allowed {
		t.Fatalf("decision %+v %v, want denied", got, err)
	}
	if b := ksBig.balance.Load(); b != bal {
		t.Fatalf("big key balance %d after a request denied first, want %d (untouched)", b, bal)
	}
	if len(statuses) != 2 || statuses[0].Allowed || !statuses[1].Allowed {
		t.Fatalf("statuses %+v, want [denied, allowed]", statuses)
	}

	// Fallback refund: two fallback keys; the second denies.
	fresh := desc("api_key", "fresh")
	check(t, s.Agent, fresh)
	ksFresh := keyOf(t, s.Agent, fresh)
	before := ksFresh.charged.Load()
	got = check(t, s.Agent, fresh, small)
	if got.Allowed {
		t.Fatalf("fresh+small allowed")
	}
	if c := ksFresh.charged.Load(); c != before {
		t.Fatalf("fresh charged %d after refund, want %d", c, before)
	}
	if got := check(t, s.Agent, fresh); got.Remaining != 48 {
		t.Fatalf("fresh fallback remaining %d, want 48 (the refunded token is back)", got.Remaining)
	}
}

// TestUnknownDomainAndNoMatch are allowed and unlimited.
func TestUnknownDomainAndNoMatch(t *testing.T) {
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	for _, tc := range []struct {
		domain string
		d      Descriptor
	}{
		{"nope", desc("api_key", "x")},
		{"test", desc("nothing", "x")},
		{"test", desc("free", "x")}, // unlimited rule
	} {
		got, err := a.Check(context.Background(), tc.domain, []Descriptor{tc.d}, 1)
		if err != nil || !got.Allowed || got.Source != SourceUnlimited || got.Rule != nil {
			t.Fatalf("%s %v: %+v %v, want allowed unlimited", tc.domain, tc.d.Entries, got, err)
		}
	}
	var nilAgent = newAgent(t, Config{})
	if got := check(t, nilAgent, desc("api_key", "x")); !got.Allowed || got.Source != SourceUnlimited {
		t.Fatalf("no rules: %+v", got)
	}
}

func TestInvalidInput(t *testing.T) {
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	many := make([]Descriptor, MaxDescriptors+1)
	for i := range many {
		many[i] = desc("api_key", "x")
	}
	for _, tc := range []struct {
		name   string
		domain string
		descs  []Descriptor
	}{
		{"empty domain", "", []Descriptor{desc("a", "b")}},
		{"no descriptors", "test", nil},
		{"empty descriptor", "test", []Descriptor{{}}},
		{"empty key", "test", []Descriptor{desc("", "v")}},
		{"too many", "test", many},
		{"too long", "test", []Descriptor{desc("api_key", strings.Repeat("x", MaxKeyBytes))}},
		{"invalid UTF-8 value", "test", []Descriptor{desc("api_key", "k\xff")}},
		{"NUL in value", "test", []Descriptor{desc("api_key", "k\x00")}},
		{"CRLF in value", "test", []Descriptor{desc("api_key", "k\r\nX: y")}},
		{"invalid UTF-8 key", "test", []Descriptor{desc("api\xff", "k")}},
		{"invalid UTF-8 domain", "te\xffst", []Descriptor{desc("api_key", "k")}},
		{"control in domain", "te\x01st", []Descriptor{desc("api_key", "k")}},
	} {
		if _, err := a.Check(context.Background(), tc.domain, tc.descs, 1); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: err %v, want ErrInvalid", tc.name, err)
		}
	}
}

// TestManyDescriptors uses the pooled scratch path (more than stackDescs).
func TestManyDescriptors(t *testing.T) {
	a := newAgent(t, Config{Rules: mustCompile(t, 1, testRules)})
	descs := make([]Descriptor, 12)
	for i := range descs {
		descs[i] = desc("api_key", string(rune('a'+i)))
	}
	descs[11] = desc("small", "m")
	for i := range 3 {
		got, st, err := a.CheckStatuses(context.Background(), "test", descs, 1, nil)
		if err != nil || !got.Allowed || len(st) != 12 || got.Policy != "small" || got.Remaining != int64(2-i) {
			t.Fatalf("check %d: %+v %v (%d statuses)", i, got, err, len(st))
		}
	}
	got, _, _ := a.CheckStatuses(context.Background(), "test", descs, 1, nil)
	if got.Allowed {
		t.Fatalf("4th: allowed")
	}
	// The denied request took nothing from the other keys: 3 taken of 50.
	if got := check(t, a, descs[0]); got.Remaining != 46 {
		t.Fatalf("a: remaining %d, want 46", got.Remaining)
	}
}

// TestLocalBackend: local rules use a per-agent bucket at the full rate and
// never reach the allocator.
func TestLocalBackend(t *testing.T) {
	s := newStepped(t)
	d := desc("local", "l")
	for i := range 5 {
		if got := check(t, s.Agent, d); !got.Allowed || got.Source != SourceLocal {
			t.Fatalf("check %d: %+v, want allowed, local", i, got)
		}
	}
	if got := check(t, s.Agent, d); got.Allowed {
		t.Fatalf("6th allowed")
	}
	s.step()
	if req := s.fake.lastAcquire(); req != nil {
		for _, k := range req.Keys {
			if k.Entries[0].Key == "local" {
				t.Fatalf("a local key was sent to the allocator: %+v", k)
			}
		}
	}
}

// TestFallbackLimit pins the R/N derivation.
func TestFallbackLimit(t *testing.T) {
	set := mustCompile(t, 1, testRules)
	r := set.Match("test", []rules.Entry{{Key: "api_key", Value: "x"}}) // 50/hour burst 50
	for _, tc := range []struct {
		n             uint32
		quota, burst  int64
		window        time.Duration
		wantRemaining int64
	}{
		{1, 50, 50, time.Hour, 50},
		{2, 25, 25, time.Hour, 25},
		{3, 50, 17, 3 * time.Hour, 17},
		{100, 50, 1, 100 * time.Hour, 1},
	} {
		l, err := fallbackLimit(r.Limit, tc.n)
		if err != nil {
			t.Fatalf("n=%d: %v", tc.n, err)
		}
		if l.Quota() != tc.quota || l.Burst() != tc.burst || l.Window() != tc.window {
			t.Errorf("n=%d: %v, want quota %d burst %d window %v", tc.n, l, tc.quota, tc.burst, tc.window)
		}
	}
}

// TestShareThresholdSharesOneBudget: values matching a share_threshold
// wildcard share one budget key (and one key state), other rules keep one
// budget per value.
func TestShareThresholdSharesOneBudget(t *testing.T) {
	s := newStepped(t)
	a, b := desc("path", "/api/a"), desc("path", "/api/b")
	check(t, s.Agent, a)
	check(t, s.Agent, b)
	if got := check(t, s.Agent, a); !got.Allowed || got.Remaining != 0 {
		t.Fatalf("third check: %+v, want the shared budget's last token", got)
	}
	if got := check(t, s.Agent, b); got.Allowed {
		t.Fatalf("fourth check on another value allowed: the budget is not shared")
	}
	if keyOf(t, s.Agent, a) != keyOf(t, s.Agent, b) {
		t.Fatalf("two key states for one shared budget")
	}
	s.step()
	req := s.fake.lastAcquire()
	if len(req.Keys) != 1 || req.Keys[0].Charged != 3 {
		t.Fatalf("Acquire %+v, want one key charged 3", req.Keys)
	}
	if keyOf(t, s.Agent, desc("api_key", "x1")) != nil {
		t.Fatalf("untouched key tracked")
	}
	check(t, s.Agent, desc("api_key", "x1"))
	check(t, s.Agent, desc("api_key", "x2"))
	if keyOf(t, s.Agent, desc("api_key", "x1")) == keyOf(t, s.Agent, desc("api_key", "x2")) {
		t.Fatalf("two api_key values share a key state")
	}
}

// TestCheckNextAfter: an allowed decision carries the time until more quota
// (the next token of 30/minute, every 2 s), not until the bucket is full;
// a denied one carries none.
func TestCheckNextAfter(t *testing.T) {
	clock := newFakeClock()
	cfg := DefaultConfig()
	cfg.Now = clock.now
	cfg.Rules = mustCompile(t, 0, `
domain: test
descriptors:
  - key: api_key
    rate_limit: {name: free, unit: minute, requests_per_unit: 30, burst: 10}
`)
	a := newAgent(t, cfg)
	d := desc("api_key", "k")
	for i, want := range []struct{ next, reset time.Duration }{{2 * time.Second, 2 * time.Second}, {2 * time.Second, 4 * time.Second}} {
		if got := check(t, a, d); !got.Allowed || got.NextAfter != want.next || got.ResetAfter != want.reset {
			t.Fatalf("check %d: %+v, want NextAfter %v and ResetAfter %v", i+1, got, want.next, want.reset)
		}
	}
	clock.advance(500 * time.Millisecond)
	if got := check(t, a, d); got.NextAfter != 1500*time.Millisecond {
		t.Fatalf("check 3, 0.5 s later: NextAfter %v, want 1.5s", got.NextAfter)
	}
}

// TestReportedLimitIsEnforced pins a shadow-mode limit reported in place
// of the enforced ones: the decision reported the lowest Remaining among
// every matched limit, shadow or not, and the transports, which never
// advertise a shadow-mode rule, then sent no RateLimit fields at all. An
// allowed request reports the enforced limit with the lowest Remaining,
// before and after the shadow limit would deny; a shadow limit is
// reported only when no enforced limit matched.
func TestReportedLimitIsEnforced(t *testing.T) {
	const yaml = `
domain: test
descriptors:
  - key: route
    shadow_mode: true
    rate_limit: {name: trial_route, unit: minute, requests_per_unit: 2}
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 100}
  - key: region
    rate_limit: {name: per_region, unit: minute, requests_per_unit: 50}
`
	clock := newFakeClock()
	a := newAgent(t, Config{Rules: mustCompile(t, 1, yaml), Now: clock.now})
	for i := 1; i <= 4; i++ {
		got := check(t, a, desc("route", "/x"), desc("api_key", "k"), desc("region", "eu"))
		if !got.Allowed || got.Shadow != (i > 2) || got.Policy != "per_region" || got.Remaining != int64(50-i) || got.Rule.ShadowMode {
			t.Fatalf("check %d: %+v, want allowed under per_region with %d left (shadow %v)", i, got, 50-i, i > 2)
		}
	}
	if got := check(t, a, desc("route", "/y")); !got.Allowed || got.Policy != "trial_route" || got.Remaining != 1 {
		t.Fatalf("shadow limit alone: %+v, want it reported, allowed with 1 left", got)
	}
}

// TestDeniedReportsLongestWait pins a Retry-After shorter than the true
// wait: Check stopped at the first denying descriptor and reported its
// wait (30 s of per_key) though another enforced limit also denied the
// request (route_daily, 8 h), so a client retrying on time was denied
// again. A denied request reports the denying limit with the longest wait,
// in either order of the descriptors and with statuses too, and still
// consumes nothing. Keys this agent has not seen are not looked up for it
// (no new key, so no Acquire, on the deny path).
func TestDeniedReportsLongestWait(t *testing.T) {
	const yaml = `
domain: test
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 2}
  - key: route
    rate_limit: {name: route_daily, unit: day, requests_per_unit: 3}
  - key: shadow
    shadow_mode: true
    rate_limit: {name: shadowed, unit: day, requests_per_unit: 1}
`
	clock := newFakeClock()
	a := newAgent(t, Config{Rules: mustCompile(t, 1, yaml), Now: clock.now})
	k1, k2, route := desc("api_key", "k1"), desc("api_key", "k2"), desc("route", "/x")
	check(t, a, desc("shadow", "s"))
	for i, d := range []Descriptor{k1, k1, k2} {
		if got := check(t, a, d, route); !got.Allowed {
			t.Fatalf("request %d: %+v, want allowed", i+1, got)
		}
	}
	const day = 8 * time.Hour // route_daily's next token: 3/day
	for _, descs := range [][]Descriptor{
		{k1, route}, {route, k1}, {k1, desc("shadow", "s"), route}, {k1, route, k1},
	} {
		for range 2 { // the second through the request memo
			got := check(t, a, descs...)
			if got.Allowed || got.Policy != "route_daily" || got.RetryAfter != day || got.Remaining != 0 {
				t.Fatalf("%v: %+v, want denied by route_daily, retry in %v", descs, got, day)
			}
			_, sts, err := a.CheckStatuses(context.Background(), "test", descs, 1, nil)
			if err != nil || len(sts) != len(descs) {
				t.Fatalf("%v: statuses %+v, %v", descs, sts, err)
			}
		}
		got, _, _ := a.CheckStatuses(context.Background(), "test", descs, 1, nil)
		if got.Allowed || got.Policy != "route_daily" || got.RetryAfter != day {
			t.Fatalf("%v with statuses: %+v, want denied by route_daily, retry in %v", descs, got, day)
		}
	}
	// Denied by per_key alone: its own wait.
	if got := check(t, a, k1); got.Allowed || got.Policy != "per_key" || got.RetryAfter != 30*time.Second {
		t.Fatalf("k1 alone: %+v, want denied by per_key, retry in 30s", got)
	}
	// The denied requests took nothing: per_key's next token comes 30 s
	// after the two it admitted.
	clock.advance(30 * time.Second)
	if got := check(t, a, k1); !got.Allowed || got.Remaining != 0 {
		t.Fatalf("k1 30 s later: %+v, want allowed with 0 left", got)
	}
	// A key not seen before, after the deny: not looked up, not tracked.
	fresh := desc("api_key", "fresh")
	if got := check(t, a, route, fresh); got.Allowed || got.Policy != "route_daily" {
		t.Fatalf("route, fresh key: %+v, want denied by route_daily", got)
	}
	if keyOf(t, a, fresh) != nil {
		t.Fatalf("a denied request's later key was tracked: the deny path made a new key")
	}
}

// TestNextAfterFromTheDecidingLimit pins t computed from the wrong limit:
// an allowed request's NextAfter came from the rule's full rate even when
// this agent's own, slower bucket decided it. In fallback with 4 live
// agents, 60/minute burst 4 is a bucket of 15/minute burst 1 here: its
// next token is 4 s away, not 1 s, and the next request is denied for
// those 4 s. A static share (4 slots of 40/hour: 10/hour) is the same,
// on the memo's fast path too.
func TestNextAfterFromTheDecidingLimit(t *testing.T) {
	s := newStepped(t, `
domain: test
descriptors:
  - key: api_key
    rate_limit: {name: per_key, unit: minute, requests_per_unit: 60, burst: 4}
`)
	s.liveAgents.Store(4)
	d := desc("api_key", "fb")
	for i := range 2 {
		got := check(t, s.Agent, d)
		if !got.Allowed || got.Source != SourceFallback || got.Remaining != 0 || got.NextAfter != 4*time.Second {
			t.Fatalf("check %d: %+v, want allowed from the fallback bucket, next token in 4s", 2*i+1, got)
		}
		if got := check(t, s.Agent, d); got.Allowed || got.RetryAfter != 4*time.Second {
			t.Fatalf("check %d: %+v, want denied for 4s", 2*i+2, got)
		}
		s.clock.advance(4 * time.Second)
	}

	st := newStatic(t)
	slow := desc("slow", "a")
	for i := range 3 { // the first on the slow path, then through the memo
		got := wantSource(t, st, slow, SourceStatic)
		if got.Remaining != int64(9-i) || got.NextAfter != 6*time.Minute {
			t.Fatalf("static check %d: %+v, want %d left, next token in 6m (10/hour)", i+1, got, 9-i)
		}
	}
}
