package tracing

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestSpans: a gRPC call between an instrumented client and server makes
// a client span and a server span of the same trace, the server's a child
// of the client's; an instrumented HTTP handler makes a server span named
// by the name function; spans carry the service name.
func TestSpans(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tr, err := New(sdktrace.WithSyncer(exp), "allot-test")
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Shutdown(context.Background())

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(tr.ServerOption())
	healthpb.RegisterHealthServer(srv, health.NewServer())
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(ln) }()
	defer func() { srv.Stop(); <-done }()
	cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()), tr.DialOption())
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, err := healthpb.NewHealthClient(cc).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}

	h := tr.HTTPHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !trace.SpanContextFromContext(r.Context()).IsSampled() {
			t.Error("the handler runs without a sampled span")
		}
	}), func(r *http.Request) string { return "check " + r.Method })
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodPost, "/json", nil))

	const method = "grpc.health.v1.Health/Check"
	var client, server, httpSpan *tracetest.SpanStub
	var spans tracetest.SpanStubs
	// The server ends its span after the client has its answer: wait for
	// all three, with a deadline.
	for deadline := time.Now().Add(5 * time.Second); ; {
		client, server, httpSpan = nil, nil, nil
		spans = exp.GetSpans()
		for i := range spans {
			s := &spans[i]
			switch {
			case s.Name == method && s.SpanKind == trace.SpanKindClient:
				client = s
			case s.Name == method && s.SpanKind == trace.SpanKindServer:
				server = s
			case s.Name == "check POST" && s.SpanKind == trace.SpanKindServer:
				httpSpan = s
			}
		}
		if (client != nil && server != nil && httpSpan != nil) || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond) // polling the exporter until the deadline
	}
	if client == nil || server == nil || httpSpan == nil {
		t.Fatalf("spans %v: want a client and a server span of %s and an HTTP span \"check POST\"", names(spans), method)
	}
	if server.Parent.SpanID() != client.SpanContext.SpanID() || server.SpanContext.TraceID() != client.SpanContext.TraceID() {
		t.Errorf("the server span is not the client span's child: parent %v, client %v", server.Parent, client.SpanContext)
	}
	for _, s := range []*tracetest.SpanStub{client, server, httpSpan} {
		if v, ok := s.Resource.Set().Value("service.name"); !ok || v.AsString() != "allot-test" {
			t.Errorf("%s: service.name = %v", s.Name, v)
		}
	}
	if err := tr.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := tr.Shutdown(context.Background()); err != nil {
		t.Fatalf("second Shutdown: %v", err)
	}
}

// TestServiceNameFromEnv: OTEL_SERVICE_NAME names the service.
func TestServiceNameFromEnv(t *testing.T) {
	t.Setenv("OTEL_SERVICE_NAME", "edge-1")
	exp := tracetest.NewInMemoryExporter()
	tr, err := New(sdktrace.WithSyncer(exp), "allot-test")
	if err != nil {
		t.Fatal(err)
	}
	_, span := tr.TracerProvider().Tracer("t").Start(context.Background(), "s")
	span.End()
	spans := exp.GetSpans() // before Shutdown, which empties the exporter
	if err := tr.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(spans) != 1 {
		t.Fatalf("%d spans", len(spans))
	}
	if v, _ := spans[0].Resource.Set().Value("service.name"); v.AsString() != "edge-1" {
		t.Errorf("service.name = %q, want edge-1", v.AsString())
	}
}

func TestDisabled(t *testing.T) {
	for v, want := range map[string]bool{"": false, "false": false, "true": true, " TRUE ": true} {
		t.Setenv("OTEL_SDK_DISABLED", v)
		if got := Disabled(); got != want {
			t.Errorf("OTEL_SDK_DISABLED=%q: Disabled() = %v", v, got)
		}
	}
}

func names(spans tracetest.SpanStubs) []string {
	var n []string
	for _, s := range spans {
		n = append(n, s.Name+"/"+s.SpanKind.String())
	}
	return n
}
