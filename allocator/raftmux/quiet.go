//go:build linux

package raftmux

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
)

// quietConn reads and writes a TCP connection with raw system calls on
// its non-blocking socket, waiting for readiness through the runtime's
// poller as net.Conn does. A plain net.Conn read or write tells the Go
// scheduler it enters a system call, and when the process is idle that
// wakes the runtime's monitor thread (sysmon), which then naps in 20 µs
// steps until the call's goroutine parks: an idle leader's heartbeats
// (a write and two reads each, on both ends) cost several thread wake-ups
// each that way, most of an idle allocator's CPU. A non-blocking read or
// write returns at once, so the scheduler need not know of it.
// Deadlines, Close and the rest behave as the wrapped *net.TCPConn's.
//
// The socket must stay non-blocking: a raw call that blocked would hold
// its scheduler slot unknown to the runtime (a garbage collection could
// not stop the world). quiet wraps only a socket it finds non-blocking,
// and nothing here makes one blocking (as os.File.Fd on a copy from
// TCPConn.File would). Under the race detector the calls are the syscall
// package's, which tell the detector what they read and write
// (quiet_race.go).
type quietConn struct {
	*net.TCPConn
	raw syscall.RawConn
}

// quiet wraps c when it is a TCP connection with a non-blocking descriptor
// it can reach, and returns c as it is otherwise.
func quiet(c net.Conn) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	nonblock := false
	if err := raw.Control(func(fd uintptr) {
		flags, _, e := syscall.RawSyscall(syscall.SYS_FCNTL, fd, syscall.F_GETFL, 0)
		nonblock = e == 0 && flags&syscall.O_NONBLOCK != 0
	}); err != nil || !nonblock {
		return c
	}
	return &quietConn{TCPConn: tc, raw: raw}
}

func (c *quietConn) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return c.TCPConn.Read(b) // nothing to wait for; a closed connection's error
	}
	var n int
	var errno syscall.Errno
	err := c.raw.Read(func(fd uintptr) bool {
		for {
			r, e := sysRead(fd, b)
			switch e {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false
			}
			n, errno = r, e
			return true
		}
	})
	if err != nil {
		return 0, c.opError("read", err)
	}
	if errno != 0 {
		return 0, c.opError("read", os.NewSyscallError("read", errno))
	}
	if n == 0 {
		return 0, io.EOF
	}
	return n, nil
}

func (c *quietConn) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return c.TCPConn.Write(b)
	}
	var n int
	var errno syscall.Errno
	err := c.raw.Write(func(fd uintptr) bool {
		for n < len(b) {
			r, e := sysWrite(fd, b[n:])
			switch e {
			case 0:
				n += r
			case syscall.EINTR:
			case syscall.EAGAIN:
				return false
			default:
				errno = e
				return true
			}
		}
		return true
	})
	if err != nil {
		return n, c.opError("write", err)
	}
	if errno != 0 {
		return n, c.opError("write", os.NewSyscallError("write", errno))
	}
	return n, nil
}

// opError reports err as net.Conn does, under the operation's name: the
// poller's errors (os.ErrDeadlineExceeded, net.ErrClosed) unwrapped from
// RawConn's "raw-read" or "raw-write" error.
func (c *quietConn) opError(op string, err error) error {
	var oe *net.OpError
	if errors.As(err, &oe) {
		err = oe.Err
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}
