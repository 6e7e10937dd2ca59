package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// TestRLSConnectionLimits pins an RLS port with no connection cap that
// kept half-open HTTP/2 connections: beyond -rls-max-conns a connection
// is not served until another closes, and a peer that opens HTTP/2 and
// then answers nothing is closed after -rls-keepalive (twice: the idle
// time, then the unanswered ping).
func TestRLSConnectionLimits(t *testing.T) {
	gw, _ := binaries(t)
	dir := t.TempDir()
	rulesFile := writeFile(t, dir, "rules.yaml", drainRules)
	cfg := writeFile(t, dir, "gateway.yaml", fmt.Sprintf("upstream: %s\nrules: [%s]\ndomain: drain\ndescriptors: [[{generic_key: all}]]\n",
		backend(t), rulesFile))
	_, a := startGateway(t, gw, "-config", cfg, "-listen", "127.0.0.1:0", "-rls-addr", "127.0.0.1:0",
		"-http-addr", "127.0.0.1:0", "-rls-max-conns", "2", "-rls-keepalive", "1s")

	check := func(cc *grpc.ClientConn, within time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), within)
		defer cancel()
		_, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
		return err
	}
	dial := func() *grpc.ClientConn {
		cc, err := grpc.NewClient(a.rls, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		return cc
	}
	first, second, third := dial(), dial(), dial()
	defer second.Close()
	defer third.Close()
	for i, cc := range []*grpc.ClientConn{first, second} {
		if err := check(cc, 10*time.Second); err != nil {
			t.Fatalf("connection %d within the cap: %v", i+1, err)
		}
	}
	if err := check(third, 500*time.Millisecond); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a third connection with -rls-max-conns 2: %v, want it not served (DeadlineExceeded)", err)
	}
	first.Close()
	if err := check(third, 10*time.Second); err != nil {
		t.Fatalf("the third connection once one closed: %v", err)
	}
	second.Close()
	third.Close()

	// A half-open peer: the HTTP/2 preface and an empty SETTINGS frame,
	// then silence (no SETTINGS ack, no PING ack).
	conn, err := net.Dial("tcp", a.rls)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write(append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), 0, 0, 0, 4, 0, 0, 0, 0, 0)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.Copy(io.Discard, conn); err != nil {
		t.Fatalf("half-open connection not closed by the server: %v", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("half-open connection closed after %v, want about 2 × -rls-keepalive", d)
	}
}
