package grpclimit

import (
	"context"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/bucket"
	"github.com/allot/allot/pkg/rules"
)

type neverChecker struct{}

func (neverChecker) Check(ctx context.Context, domain string, descs []agent.Descriptor, hits uint32) (agent.Decision, error) {
	r := &rules.Rule{Name: "p", RequestsPerUnit: 60}
	return agent.Decision{Allowed: false, Policy: "p", Quota: 60, Rule: r, RetryAfter: bucket.Never}, nil
}

// TestRetryInfoDelayNeverNegative: a denial whose retry delay is
// bucket.Never (a request larger than the rule's burst) carries a positive
// RetryInfo delay, not one overflowed to a negative duration.
func TestRetryInfoDelayNeverNegative(t *testing.T) {
	l, err := New(Config{Domain: "d", Descriptors: []DescriptorConfig{{{Source: SourceStatic, Key: "k", Value: "v"}}}}, neverChecker{})
	if err != nil {
		t.Fatal(err)
	}
	_, trl, err := l.check(context.Background(), "/s/M")
	st := status.Convert(err)
	found := false
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			found = true
			t.Logf("retry-after trailer %q, RetryInfo delay %v", trl.Get(MetadataRetryAfter), ri.GetRetryDelay().AsDuration())
			if ri.GetRetryDelay().AsDuration() <= 0 {
				t.Errorf("RetryInfo delay %v, want a positive one", ri.GetRetryDelay().AsDuration())
			}
		}
	}
	if !found {
		t.Fatalf("no RetryInfo in the denial %v", st)
	}
}
