package rls

import (
	"context"
	"math"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

// descriptorStatus builds one status in messages of its own: the
// reference that fillStatus (one allocation per response, shared limits)
// must match.
func descriptorStatus(st *agent.Status) *rlsv3.RateLimitResponse_DescriptorStatus {
	out := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
	r := st.Rule
	if r == nil {
		return out
	}
	if r.Unlimited {
		out.LimitRemaining = math.MaxUint32
		return out
	}
	if !st.Allowed && !st.Shadow && !r.ShadowMode {
		out.Code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	out.CurrentLimit = currentLimit(r)
	out.LimitRemaining = uint32(max(0, min(st.Remaining, math.MaxUint32)))
	reset := st.ResetAfter
	if out.Code == rlsv3.RateLimitResponse_OVER_LIMIT && st.RetryAfter > 0 {
		reset = min(st.RetryAfter, httplimit.MaxRetryAfter)
	}
	out.DurationUntilReset = durationpb.New(max(reset, 0))
	return out
}

// TestFillStatusMatchesReference: statuses built into a response's blocks,
// with current_limit shared through the cache, equal the reference built
// message by message, for every kind of status, response sizes 1 to 5 and
// a rule that takes another's cache slot and back.
func TestFillStatusMatchesReference(t *testing.T) {
	set, err := rules.Compile(1, []rules.File{{Name: "rls.yaml", Source: []byte(testRules)}})
	if err != nil {
		t.Fatal(err)
	}
	var rs []*rules.Rule
	for _, d := range []string{"api_key", "path", "shadowed", "free", "team"} {
		v := "x"
		if d == "path" {
			v = "/a"
		}
		r := set.Match("rls-test", []rules.Entry{{Key: d, Value: v}})
		if r == nil {
			t.Fatalf("no rule for %s", d)
		}
		rs = append(rs, r)
	}
	rs = append(rs, nil)
	var sts []agent.Status
	for _, r := range rs {
		for _, st := range []agent.Status{
			{Allowed: true, Remaining: 3, ResetAfter: 1500 * time.Millisecond},
			{Allowed: false, Remaining: 0, ResetAfter: time.Minute, RetryAfter: 250 * time.Millisecond},
			{Allowed: false, Remaining: -4, ResetAfter: time.Minute},
			{Allowed: false, Remaining: 0, ResetAfter: time.Minute, RetryAfter: bucket.Never},
			{Allowed: true, Shadow: true, Remaining: math.MaxInt64, ResetAfter: -time.Second},
			{Allowed: true, Remaining: 1 << 40},
		} {
			st.Rule = r
			sts = append(sts, st)
		}
	}
	s, err := New(fakeChecker{}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for round := range 2 {
		for n := 1; n <= 5; n++ {
			for i := 0; i+n <= len(sts); i += n {
				resp, blk := newResponse(n)
				if len(resp.Statuses) != n || len(blk) != n {
					t.Fatalf("newResponse(%d): %d statuses, %d blocks", n, len(resp.Statuses), len(blk))
				}
				for j := range n {
					s.fillStatus(&blk[j], &sts[i+j])
				}
				for j := range n {
					if want := descriptorStatus(&sts[i+j]); !proto.Equal(resp.Statuses[j], want) {
						t.Fatalf("round %d, status %+v: got %v, want %v", round, sts[i+j], resp.Statuses[j], want)
					}
				}
			}
		}
		// Another rule in every slot: the next round rebuilds the limits.
		for i := range s.limits.slots {
			s.limits.slots[i].Store(&limitEntry{rule: &rules.Rule{}, lim: &rlsv3.RateLimitResponse_RateLimit{Name: "other"}})
		}
	}
}

// TestOverLimitDurationNeverClamped: an over-limit status that can never
// be admitted (bucket.Never) reports duration_until_reset at
// httplimit.MaxRetryAfter, not 292 years.
func TestOverLimitDurationNeverClamped(t *testing.T) {
	set, err := rules.Compile(1, []rules.File{{Name: "rls.yaml", Source: []byte(testRules)}})
	if err != nil {
		t.Fatal(err)
	}
	r := set.Match("rls-test", []rules.Entry{{Key: "api_key", Value: "x"}})
	s, err := New(fakeChecker{}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	resp, blk := newResponse(1)
	s.fillStatus(&blk[0], &agent.Status{Rule: r, ResetAfter: time.Minute, RetryAfter: bucket.Never})
	st := resp.Statuses[0]
	if st.Code != rlsv3.RateLimitResponse_OVER_LIMIT || st.DurationUntilReset.AsDuration() != httplimit.MaxRetryAfter {
		t.Fatalf("%v, duration_until_reset %v; want OVER_LIMIT and %v", st.Code, st.DurationUntilReset.AsDuration(), httplimit.MaxRetryAfter)
	}
}

type fakeChecker struct{}

func (fakeChecker) CheckStatuses(_ context.Context, _ string, _ []agent.Descriptor, _ uint32, out []agent.Status) (agent.Decision, []agent.Status, error) {
	return agent.Decision{}, out, nil
}
