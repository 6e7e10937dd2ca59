package rls

import (
	"context"
	"testing"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// FuzzShouldRateLimit feeds arbitrary RateLimitRequest bytes (as Envoy
// would send them over gRPC) to ShouldRateLimit: it never panics, and it
// either answers with one status per descriptor or refuses with
// InvalidArgument.
func FuzzShouldRateLimit(f *testing.F) {
	seed := func(r *rlsv3.RateLimitRequest) {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	entry := func(k, v string) *rlcommon.RateLimitDescriptor_Entry {
		return &rlcommon.RateLimitDescriptor_Entry{Key: k, Value: v}
	}
	seed(&rlsv3.RateLimitRequest{Domain: "rls-test", Descriptors: []*rlcommon.RateLimitDescriptor{
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("api_key", "k")}}}})
	seed(&rlsv3.RateLimitRequest{Domain: "rls-test", HitsAddend: 3, Descriptors: []*rlcommon.RateLimitDescriptor{
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("path", "/a")}},
		{Entries: []*rlcommon.RateLimitDescriptor_Entry{entry("shadowed", "x")}}}})
	seed(&rlsv3.RateLimitRequest{Domain: "other", Descriptors: []*rlcommon.RateLimitDescriptor{{}}})
	seed(&rlsv3.RateLimitRequest{})

	a, srv := newTestServer(f)
	f.Cleanup(func() { a.Close(context.Background()) })
	f.Fuzz(func(t *testing.T, b []byte) {
		req := new(rlsv3.RateLimitRequest)
		if proto.Unmarshal(b, req) != nil {
			return // gRPC would refuse it before the handler
		}
		resp, err := srv.ShouldRateLimit(context.Background(), req)
		if err != nil {
			if c := status.Code(err); c != codes.InvalidArgument {
				t.Fatalf("error %v (code %v), want InvalidArgument", err, c)
			}
			return
		}
		if len(resp.GetStatuses()) != len(req.GetDescriptors()) {
			t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(req.GetDescriptors()))
		}
		if resp.GetOverallCode() == rlsv3.RateLimitResponse_UNKNOWN {
			t.Fatalf("overall code UNKNOWN")
		}
	})
}
