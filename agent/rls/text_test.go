package rls

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	rlcommon "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	dto "github.com/prometheus/client_model/go"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/pkg/rules"
)

// rawCodec sends pre-encoded bytes: the way a client whose protobuf
// library does not check UTF-8 puts invalid bytes into a string field.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	if b, ok := v.([]byte); ok {
		return b, nil
	}
	return proto.Marshal(v.(proto.Message))
}

func (rawCodec) Unmarshal(data []byte, v any) error { return proto.Unmarshal(data, v.(proto.Message)) }
func (rawCodec) Name() string                       { return "proto" }

// TestInvalidTextIsInvalidArgument: descriptor values with control
// characters are InvalidArgument, and so are invalid UTF-8 bytes (sent
// pre-encoded, as a client whose protobuf library does not check UTF-8
// would), which gRPC's decoder refuses before the handler runs (it said
// Internal, as if the server had failed); valid multi-byte text is decided
// like any key.
func TestInvalidTextIsInvalidArgument(t *testing.T) {
	set, err := rules.Compile(1, []rules.File{{Name: "rls.yaml", Source: []byte(testRules)}})
	if err != nil {
		t.Fatal(err)
	}
	cfg := agent.DefaultConfig()
	cfg.Rules = set
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(a, Options{})
	if err != nil {
		t.Fatal(err)
	}
	cc := serveConn(t, srv, func() { a.Close(context.Background()) })
	c := rlsv3.NewRateLimitServiceClient(cc)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	for _, v := range []string{"k\x00", "k\r\nX: y", "k\x7f", "k\u0085"} {
		_, err := c.ShouldRateLimit(ctx, &rlsv3.RateLimitRequest{Domain: "rls-test",
			Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", v)}})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("value %q: err %v, want InvalidArgument", v, err)
		}
	}
	before := counted(t, srv.byCode[outInvalid])
	for i, bad := range []string{"\xff", "\xc0\xaf", "\xed\xa0\x80"} {
		// Encode with a same-length placeholder, then swap the bytes in.
		ph := bytes.Repeat([]byte{'#'}, len(bad))
		b, err := proto.Marshal(&rlsv3.RateLimitRequest{Domain: "rls-test",
			Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "k"+string(ph))}})
		if err != nil {
			t.Fatal(err)
		}
		b = bytes.Replace(b, ph, []byte(bad), 1)
		var out rlsv3.RateLimitResponse
		err = cc.Invoke(ctx, "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", b, &out, grpc.ForceCodec(rawCodec{}))
		if c := status.Code(err); c != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), "UTF-8") {
			t.Errorf("value %s: err %v, want InvalidArgument saying the strings must be UTF-8", fmt.Sprintf("%+q", "k"+bad), err)
		}
		if got := counted(t, srv.byCode[outInvalid]); got != before+float64(i+1) {
			t.Errorf("value %s: %v requests counted invalid, want %v", fmt.Sprintf("%+q", "k"+bad), got, before+float64(i+1))
		}
	}
	// Valid multi-byte text is a key like any other.
	resp := call(t, c, &rlsv3.RateLimitRequest{Domain: "rls-test",
		Descriptors: []*rlcommon.RateLimitDescriptor{desc("api_key", "clé-ключ-🔑")}})
	if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
		t.Errorf("multi-byte key: %v", resp)
	}
}

// counted reads a counter.
func counted(t *testing.T, c interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
