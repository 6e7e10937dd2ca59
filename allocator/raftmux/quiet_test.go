//go:build linux

package raftmux

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// quietPair returns a quietConn and the plain TCP connection at its other
// end.
func quietPair(t *testing.T) (*quietConn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	q, ok := quiet(c).(*quietConn)
	if !ok {
		t.Fatalf("quiet(%T) did not wrap it", c)
	}
	peer, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { q.Close(); peer.Close() })
	return q, peer
}

func TestQuietConnRoundTripAndEOF(t *testing.T) {
	q, peer := quietPair(t)
	// More than a socket buffer holds, so that the write waits for the
	// reader and resumes where it stopped.
	want := make([]byte, 8<<20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	errc := make(chan error, 1)
	go func() {
		n, err := q.Write(want)
		if err == nil && n != len(want) {
			err = io.ErrShortWrite
		}
		errc <- err
	}()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(peer, got); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("Write: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("bytes differ")
	}
	if _, err := peer.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	n, err := q.Read(buf)
	if err != nil || string(buf[:n]) != "pong" {
		t.Fatalf("Read = %q, %v", buf[:n], err)
	}
	if n, err := q.Read(nil); n != 0 || err != nil {
		t.Fatalf("Read(nil) = %d, %v", n, err)
	}
	peer.Close()
	if _, err := q.Read(buf); err != io.EOF {
		t.Fatalf("Read after the peer closed = %v, want io.EOF", err)
	}
}

func TestQuietConnDeadline(t *testing.T) {
	q, _ := quietPair(t)
	if err := q.SetReadDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	_, err := q.Read(make([]byte, 1))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read past the deadline = %v, want a timeout", err)
	}
	// The connection still works once the deadline is lifted.
	if err := q.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
}

func TestQuietConnCloseUnblocksRead(t *testing.T) {
	q, _ := quietPair(t)
	errc := make(chan error, 1)
	go func() {
		_, err := q.Read(make([]byte, 1))
		errc <- err
	}()
	// The read is parked in the poller (or about to be): closing must end
	// it with net.ErrClosed either way.
	time.AfterFunc(10*time.Millisecond, func() { q.Close() })
	select {
	case err := <-errc:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Read on a closed connection = %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Read did not return after Close")
	}
	if _, err := q.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Write on a closed connection = %v, want net.ErrClosed", err)
	}
}

func TestQuietLeavesOtherConnsAlone(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if quiet(a) != a {
		t.Fatal("quiet wrapped a connection that is not TCP")
	}
}

func TestQuietConnZeroLengthOnClosed(t *testing.T) {
	q, _ := quietPair(t)
	if n, err := q.Write(nil); n != 0 || err != nil {
		t.Fatalf("Write(nil) = %d, %v", n, err)
	}
	q.Close()
	if _, err := q.Read(nil); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Read(nil) on a closed connection = %v, want net.ErrClosed", err)
	}
	if _, err := q.Write(nil); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Write(nil) on a closed connection = %v, want net.ErrClosed", err)
	}
}

// A socket that has been made blocking (os.File.Fd on a copy from File
// does that to the shared file description) is left unwrapped: a raw
// call on it could block unknown to the scheduler.
func TestQuietLeavesBlockingSocketAlone(t *testing.T) {
	q, _ := quietPair(t)
	f, err := q.TCPConn.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_ = f.Fd() // puts the file description in blocking mode
	if c := quiet(q.TCPConn); c != net.Conn(q.TCPConn) {
		t.Fatalf("quiet wrapped a blocking socket: %T", c)
	}
}

// Closing the TCP connection underneath, not through the wrapper, ends a
// parked Read with net.ErrClosed too.
func TestQuietConnInnerCloseUnblocksRead(t *testing.T) {
	q, _ := quietPair(t)
	errc := make(chan error, 1)
	go func() {
		_, err := q.Read(make([]byte, 1))
		errc <- err
	}()
	time.AfterFunc(10*time.Millisecond, func() { q.TCPConn.Close() })
	select {
	case err := <-errc:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Read = %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Read did not return after the close")
	}
}
