// Package tracing is the binaries' OpenTelemetry tracing: a TracerProvider
// that exports spans over OTLP/gRPC, and the gRPC and HTTP instrumentation
// that feeds it.
//
// Tracing is off unless a binary is started with -otel: without it no
// Tracer exists and nothing of this package is on any request path. With
// it, the exporter and the sampler are configured by the standard
// OpenTelemetry environment variables, read by the SDK itself:
// OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT),
// OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_INSECURE and the other
// OTEL_EXPORTER_OTLP_* variables; OTEL_TRACES_SAMPLER and
// OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on);
// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; OTEL_BSP_* for the
// batch span processor. OTEL_SDK_DISABLED=true keeps tracing off even
// with -otel.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
)

// Tracing is a running TracerProvider and the instrumentation that uses
// it. Its methods are safe for concurrent use. Shutdown flushes the spans
// not yet exported.
type Tracing struct {
	tp   *sdktrace.TracerProvider
	prop propagation.TextMapPropagator
}

// Disabled reports whether OTEL_SDK_DISABLED turns the SDK off.
func Disabled() bool {
	return strings.EqualFold(strings.TrimSpace(os.Getenv("OTEL_SDK_DISABLED")), "true")
}

// Start builds the OTLP/gRPC exporter and a TracerProvider that batches
// into it, sampled per OTEL_TRACES_SAMPLER; service is the service.name
// unless OTEL_SERVICE_NAME sets one. The exporter connects lazily: an
// unreachable collector costs dropped spans, not a failed start. The
// SDK's errors (a failed export) go to logger at WARN.
func Start(ctx context.Context, service string, logger *slog.Logger) (*Tracing, error) {
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		logger.Warn("tracing: spans dropped", "err", err)
	}))
	exp, err := otlptracegrpc.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: OTLP exporter: %w", err)
	}
	return New(sdktrace.WithBatcher(exp), service)
}

// New builds a Tracing whose spans go to the span processor registered by
// opt (sdktrace.WithBatcher, WithSyncer or WithSpanProcessor): Start's
// OTLP exporter, or a test's in-memory one.
func New(opt sdktrace.TracerProviderOption, service string) (*Tracing, error) {
	res, err := resource.Merge(resource.Default(),
		resource.NewSchemaless(semconv.ServiceName(service)))
	if err != nil {
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over the default.
	if env, err := resource.New(context.Background(), resource.WithFromEnv()); err == nil {
		if merged, err := resource.Merge(res, env); err == nil {
			res = merged
		}
	}
	tp := sdktrace.NewTracerProvider(opt, sdktrace.WithResource(res))
	prop := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	return &Tracing{tp: tp, prop: prop}, nil
}

// TracerProvider is the provider the instrumentation records into.
func (t *Tracing) TracerProvider() trace.TracerProvider { return t.tp }

// ServerOption instruments a gRPC server: a span per call, continuing the
// caller's trace context when it sends one.
func (t *Tracing) ServerOption() grpc.ServerOption {
	return grpc.StatsHandler(otelgrpc.NewServerHandler(
		otelgrpc.WithTracerProvider(t.tp), otelgrpc.WithPropagators(t.prop)))
}

// DialOption instruments a gRPC client connection: a span per call, whose
// context is sent to the server.
func (t *Tracing) DialOption() grpc.DialOption {
	return grpc.WithStatsHandler(otelgrpc.NewClientHandler(
		otelgrpc.WithTracerProvider(t.tp), otelgrpc.WithPropagators(t.prop)))
}

// HTTPHandler instruments an HTTP handler: a span per request, named by
// name(r) (a bounded set of names: never the raw path).
func (t *Tracing) HTTPHandler(h http.Handler, name func(*http.Request) string) http.Handler {
	return otelhttp.NewHandler(h, "http",
		otelhttp.WithTracerProvider(t.tp), otelhttp.WithPropagators(t.prop),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return name(r) }))
}

// Shutdown exports the spans still buffered and stops the provider, within
// ctx. Safe to call twice.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if err := t.tp.Shutdown(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("tracing: shutdown: %w", err)
	}
	return nil
}
