// Package grpclimit rate-limits gRPC calls with the embedded agent: server
// interceptors (unary and stream) that build descriptors from the call's
// full method name and from configured metadata keys, ask a Checker for a
// decision, and either run the handler or fail the call with
// codes.ResourceExhausted.
//
//	lim, err := grpclimit.New(grpclimit.Config{
//		Domain:      "orders",
//		Descriptors: []grpclimit.DescriptorConfig{{{Source: "metadata", Key: "api_key", Metadata: "x-api-key"}, {Source: "method"}}},
//	}, ag) // ag: *agent.Agent
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(lim.Unary()), grpc.ChainStreamInterceptor(lim.Stream()))
//
// # The contract
//
// Allowed: the handler runs; the RateLimit-Policy and RateLimit fields of
// the reported limit (the same values the HTTP middleware writes, see
// agent/httplimit) are sent as header metadata "ratelimit-policy" and
// "ratelimit".
//
// Denied: the handler does not run. The status is ResourceExhausted with a
// google.rpc.RetryInfo detail (the retry delay) and the trailers
// "ratelimit-policy", "ratelimit" and "retry-after" (delay-seconds, as the
// HTTP 429). A stream is checked once, when it opens.
//
// Bad input fails the call with InvalidArgument (a fixed message naming
// the metadata key, never the value), before anything is consumed and
// without running the handler: a metadata value longer than MaxValueBytes,
// one that is not valid text (rules.ValidText: invalid UTF-8, such as the
// raw bytes of a -bin key, or a control character such as a tab), and
// descriptors the Checker refuses as invalid (agent.ErrInvalid, e.g. one
// longer than agent.MaxKeyBytes). A call with no descriptor (a metadata
// key absent) runs unchecked. Any other Checker error runs the call
// unchecked (fail open), logged at most once a second; rules with
// failure_mode closed are enforced by the agent itself.
package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/allot/allot/agent"
	"github.com/allot/allot/agent/httplimit"
	"github.com/allot/allot/agent/internal/descconf"
	"github.com/allot/allot/pkg/rules"
)

// Checker decides a call. *agent.Agent implements it. Check must not
// retain descs after it returns. An error wrapping agent.ErrInvalid fails
// the call with InvalidArgument; any other error runs it unchecked.
type Checker interface {
	Check(ctx context.Context, domain string, descs []agent.Descriptor, hits uint32) (agent.Decision, error)
}

// Metadata keys of the fields (gRPC metadata keys are lower case).
const (
	MetadataRateLimit       = "ratelimit"
	MetadataRateLimitPolicy = "ratelimit-policy"
	MetadataRetryAfter      = "retry-after"
)

// Limits on the configuration and on call values.
const (
	// MaxDescriptors is the most descriptors a Config may declare.
	MaxDescriptors = httplimit.MaxDescriptors
	// MaxEntries is the most entries one descriptor may have.
	MaxEntries = httplimit.MaxEntries
	// DefaultMaxValueBytes bounds one metadata value.
	DefaultMaxValueBytes = httplimit.DefaultMaxValueBytes
)

// Sources of entry values.
const (
	SourceMethod   = "method"   // the full method name, "/pkg.Service/Method"; default key "method"
	SourceService  = "service"  // the service part, "pkg.Service"; default key "service"
	SourceMetadata = "metadata" // the first value of a metadata key (Metadata); key required
	SourceStatic   = "static"   // a constant (Value); key required
)

// Config declares the descriptors of a call. The zero Config extracts
// nothing (every call runs unchecked).
type Config struct {
	// Domain is the rules domain; required when Descriptors are set.
	Domain string `yaml:"domain"`
	// Descriptors are checked for every call, in order. A descriptor with
	// a metadata entry whose key is absent from the call is skipped.
	Descriptors []DescriptorConfig `yaml:"descriptors"`
	// MaxValueBytes bounds a metadata value; 0 means DefaultMaxValueBytes.
	MaxValueBytes int `yaml:"max_value_bytes"`
}

// DescriptorConfig is one descriptor: an ordered list of entries.
type DescriptorConfig []EntryConfig

// EntryConfig is one descriptor entry.
type EntryConfig struct {
	// Source is method, service, metadata or static.
	Source string `yaml:"source"`
	// Key is the descriptor key; method and service default to their name.
	Key string `yaml:"key"`
	// Metadata is the metadata key read by a metadata entry.
	Metadata string `yaml:"metadata"`
	// Value is the constant of a static entry.
	Value string `yaml:"value"`
}

type entrySpec struct {
	src   string
	key   string
	md    string // lower case
	value string
}

// Limiter holds the compiled configuration and the interceptors' hooks.
// Build it with New; set the optional fields before first use.
type Limiter struct {
	checker  Checker
	domain   string
	descs    [][]entrySpec
	total    int
	maxValue int

	// Hits returns the tokens a call costs. Nil means 1.
	Hits func(ctx context.Context, fullMethod string) uint32
	// Logger receives limiter errors (warn, at most one line a second).
	// Nil means slog.Default().
	Logger *slog.Logger

	lastErrLog atomic.Int64 // unix nanos of the last limiter-error line
}

// New validates cfg and returns a Limiter deciding with c.
func New(cfg Config, c Checker) (*Limiter, error) {
	if c == nil {
		return nil, errors.New("grpclimit: nil Checker")
	}
	dc, err := descconf.Compile("grpclimit", bounds, cfg.Domain, cfg.MaxValueBytes, cfg.Descriptors, compileEntry)
	if err != nil {
		return nil, err
	}
	return &Limiter{checker: c, domain: cfg.Domain, maxValue: dc.MaxValue, descs: dc.Descs, total: dc.Total}, nil
}

var bounds = descconf.Bounds{MaxDescriptors: MaxDescriptors, MaxEntries: MaxEntries, DefaultMaxValue: DefaultMaxValueBytes}

func compileEntry(e EntryConfig) (entrySpec, error) {
	s := entrySpec{src: e.Source, key: e.Key, value: e.Value}
	switch e.Source {
	case SourceMethod, SourceService:
		if s.key == "" {
			s.key = e.Source
		}
		if e.Metadata != "" || e.Value != "" {
			return s, fmt.Errorf("source %s takes no metadata or value", e.Source)
		}
	case SourceMetadata:
		if e.Key == "" || e.Metadata == "" {
			return s, errors.New("a metadata entry needs key and metadata")
		}
		s.md = strings.ToLower(e.Metadata)
		if strings.HasPrefix(s.md, "grpc-") || strings.ContainsAny(s.md, " :\t") {
			return s, fmt.Errorf("%q is not a usable metadata key", e.Metadata)
		}
	case SourceStatic:
		if e.Key == "" || e.Value == "" {
			return s, errors.New("a static entry needs key and value")
		}
	case "":
		return s, errors.New("entry has no source (method, service, metadata or static)")
	default:
		return s, fmt.Errorf("unknown source %q (want method, service, metadata or static)", e.Source)
	}
	return s, nil
}

// errBadValue is the InvalidArgument of a call whose metadata value is
// unusable (why: "too long", "not valid UTF-8 text"); it names the key,
// never the value.
func errBadValue(key, why string) error {
	return status.Error(codes.InvalidArgument, "grpclimit: metadata "+strconv.Quote(key)+" is "+why)
}

// errInvalidDescriptors is the InvalidArgument of a call whose descriptors
// the Checker refused as invalid (agent.ErrInvalid).
var errInvalidDescriptors = status.Error(codes.InvalidArgument, "grpclimit: the call's rate-limit descriptors are invalid")

// Descriptors returns the call's descriptors. Descriptors whose metadata
// is absent are left out; the result may be empty. A value over the bound
// or not valid text (rules.ValidText) is an InvalidArgument status error.
func (l *Limiter) Descriptors(ctx context.Context, fullMethod string) ([]agent.Descriptor, error) {
	if len(l.descs) == 0 {
		return nil, nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	descs := make([]agent.Descriptor, 0, len(l.descs))
	entries := make([]rules.Entry, 0, l.total)
	for _, d := range l.descs {
		start := len(entries)
		ok := true
		for _, e := range d {
			var v string
			switch e.src {
			case SourceMethod:
				v = fullMethod
			case SourceService:
				v = service(fullMethod)
			case SourceStatic:
				v = e.value
			case SourceMetadata:
				if vs := md[e.md]; len(vs) > 0 {
					v = strings.TrimSpace(vs[0])
				}
				if len(v) > l.maxValue {
					return nil, errBadValue(e.md, "too long")
				}
				if !rules.ValidText(v) {
					return nil, errBadValue(e.md, "not valid UTF-8 text")
				}
			}
			if v == "" {
				ok = false
				break
			}
			entries = append(entries, rules.Entry{Key: e.key, Value: v})
		}
		if !ok {
			entries = entries[:start]
			continue
		}
		descs = append(descs, agent.Descriptor{Entries: entries[start:len(entries):len(entries)]})
	}
	return descs, nil
}

// service returns "pkg.Service" of "/pkg.Service/Method".
func service(fullMethod string) string {
	s := strings.TrimPrefix(fullMethod, "/")
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		return s[:i]
	}
	return s
}

// check decides the call: nil to run it (with the fields to send as
// header metadata, possibly nil), or the status error to fail it with
// (whose trailers are in the returned metadata).
func (l *Limiter) check(ctx context.Context, fullMethod string) (header, trailer metadata.MD, err error) {
	descs, err := l.Descriptors(ctx, fullMethod)
	if err != nil {
		return nil, nil, err
	}
	if len(descs) == 0 {
		return nil, nil, nil
	}
	hits := uint32(1)
	if l.Hits != nil {
		hits = l.Hits(ctx, fullMethod)
	}
	d, err := l.checker.Check(ctx, l.domain, descs, hits)
	if errors.Is(err, agent.ErrInvalid) {
		// The call's own values are unusable, not the limiter: running
		// it would skip every other limit on it.
		return nil, nil, errInvalidDescriptors
	}
	if err != nil {
		l.limiterError(err)
		return nil, nil, nil
	}
	fields := fieldsMD(d)
	if d.Allowed {
		return fields, nil, nil
	}
	if fields == nil {
		fields = metadata.MD{}
	}
	retry := httplimit.RetryAfterSeconds(d)
	fields[MetadataRetryAfter] = []string{strconv.FormatInt(retry, 10)}
	st := status.New(codes.ResourceExhausted, "rate limit exceeded")
	// The delay is Retry-After's: a client never retries earlier than the
	// trailer says. RetryAfterSeconds is at most httplimit.MaxRetryAfter
	// (about 36.5 years), so the multiplication cannot overflow.
	delay := time.Duration(retry) * time.Second
	if ds, derr := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(delay)}); derr == nil {
		st = ds
	}
	return nil, fields, st.Err()
}

// fieldsMD returns the RateLimit fields of d as metadata (nil when d
// reports no limit).
func fieldsMD(d agent.Decision) metadata.MD {
	buf, n, ok := httplimit.AppendFields(make([]byte, 0, 96), d)
	if !ok {
		return nil
	}
	s := string(buf)
	return metadata.MD{MetadataRateLimitPolicy: {s[:n]}, MetadataRateLimit: {s[n+2:]}}
}

func (l *Limiter) limiterError(err error) {
	now := time.Now().UnixNano()
	last := l.lastErrLog.Load()
	if now-last >= int64(time.Second) && l.lastErrLog.CompareAndSwap(last, now) {
		lg := l.Logger
		if lg == nil {
			lg = slog.Default()
		}
		lg.Warn("grpclimit: limiter error, call let through (fail open)", "err", err)
	}
}

// Unary returns the unary server interceptor.
func (l *Limiter) Unary() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		header, trailer, err := l.check(ctx, info.FullMethod)
		if err != nil {
			if trailer != nil {
				_ = grpc.SetTrailer(ctx, trailer)
			}
			return nil, err
		}
		if header != nil {
			_ = grpc.SetHeader(ctx, header)
		}
		return handler(ctx, req)
	}
}

// Stream returns the stream server interceptor: the stream is checked once,
// when it opens.
func (l *Limiter) Stream() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		header, trailer, err := l.check(ss.Context(), info.FullMethod)
		if err != nil {
			if trailer != nil {
				ss.SetTrailer(trailer)
			}
			return err
		}
		if header != nil {
			_ = ss.SetHeader(header)
		}
		return handler(srv, ss)
	}
}
