package rls

import (
	"context"
	"runtime"
	"strings"
	"testing"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// wideRequest is a RateLimitRequest of domain rls-test and about size
// bytes in all, made of empty messages: with many false, one descriptor
// of empty entries (after a limit override when override), else empty
// descriptors.
func wideRequest(size int, many, override bool) []byte {
	msg := protowire.AppendTag(nil, 1, protowire.BytesType) // domain
	msg = protowire.AppendString(msg, "rls-test")
	n := (size - 64) / 2 // an empty message is 2 bytes
	if many {
		for range n {
			msg = protowire.AppendTag(msg, 2, protowire.BytesType) // descriptors
			msg = protowire.AppendVarint(msg, 0)
		}
		return msg
	}
	var d []byte
	if override {
		d = protowire.AppendTag(d, 2, protowire.BytesType) // limit
		d = protowire.AppendVarint(d, 0)
	}
	for range n {
		d = protowire.AppendTag(d, 1, protowire.BytesType) // entries
		d = protowire.AppendVarint(d, 0)
	}
	msg = protowire.AppendTag(msg, 2, protowire.BytesType)
	return protowire.AppendBytes(msg, d)
}

// allocated is what f allocates on average over runs calls, in bytes.
func allocated(runs int, f func()) uint64 {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range runs {
		f()
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(runs)
}

// TestRefusedRequestAllocationIsBounded pins an amplification: a request
// of one descriptor with ~half a million empty entries (1 MiB on the
// wire, as the gateway then accepted) made the server allocate ~78 MiB
// before refusing it for its entry count: a rules.Entry for each. The
// counts are checked before anything is copied: refusing a request of
// too many entries or descriptors, at the size the gateway accepts
// (64 KiB), costs the server's codec one copy of the bytes; the standard
// codec's path (a request the codec leaves to it, here for its limit
// override) adds nothing to protobuf's own message.
func TestRefusedRequestAllocationIsBounded(t *testing.T) {
	a, srv := newTestServer(t)
	defer a.Close(context.Background())
	cd := newCodec()
	const size = maxFastRequest
	const slack = 8 << 10 // the status error, the descriptors' headers
	for _, tc := range []struct {
		name string
		many bool
		want string
	}{
		{"one descriptor of ~32k entries", false, "entries, want 1 to 64"},
		{"~32k descriptors", true, "descriptors, at most 64"},
	} {
		msg := wideRequest(size, tc.many, false)
		got := allocated(20, func() {
			c := getRequest()
			defer putRequest(c)
			if err := cd.Unmarshal(mem.BufferSlice{mem.SliceBuffer(msg)}, c); err != nil {
				t.Fatal(err)
			}
			if !c.fast {
				t.Fatalf("%s: not decoded by the server's codec", tc.name)
			}
			if _, _, err := srv.answer(context.Background(), c); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%s: %v, want InvalidArgument (%s)", tc.name, err, tc.want)
			}
		})
		if got > uint64(len(msg))+slack {
			t.Errorf("%s (%d bytes): refusing it allocated %d bytes, want at most the request's copy + %d", tc.name, len(msg), got, slack)
		}
	}

	msg := wideRequest(size, false, true)
	m := new(rlsv3.RateLimitRequest)
	if err := proto.Unmarshal(msg, m); err != nil {
		t.Fatal(err)
	}
	got := allocated(20, func() {
		c := getRequest()
		defer putRequest(c)
		c.fromRequest(m)
		if _, _, err := srv.answer(context.Background(), c); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("a limit override and ~32k entries: %v, want InvalidArgument", err)
		}
	})
	if got > slack {
		t.Errorf("a limit override and %d entries: refusing the decoded message allocated %d bytes, want at most %d", len(m.Descriptors[0].Entries), got, slack)
	}
}
