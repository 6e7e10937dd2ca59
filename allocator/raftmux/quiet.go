//go:build linux

package raftmux

import (
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"unsafe"
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
type quietConn struct {
	*net.TCPConn
	raw    syscall.RawConn
	closed atomic.Bool
}

// quiet wraps c when it is a TCP connection whose descriptor it can reach,
// and returns c as it is otherwise.
func quiet(c net.Conn) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	return &quietConn{TCPConn: tc, raw: raw}
}

func (c *quietConn) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	var n int
	var errno syscall.Errno
	err := c.raw.Read(func(fd uintptr) bool {
		for {
			r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
			switch e {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false
			}
			n, errno = int(r), e
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
		return 0, nil
	}
	var n int
	var errno syscall.Errno
	err := c.raw.Write(func(fd uintptr) bool {
		for n < len(b) {
			r, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&b[n])), uintptr(len(b)-n))
			switch e {
			case 0:
				n += int(r)
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

func (c *quietConn) Close() error {
	c.closed.Store(true)
	return c.TCPConn.Close()
}

// opError reports err as net.Conn does: a deadline as a timeout, a
// closed connection as net.ErrClosed.
func (c *quietConn) opError(op string, err error) error {
	var oe *net.OpError
	if errors.As(err, &oe) {
		err = oe.Err
	}
	if c.closed.Load() && !errors.Is(err, os.ErrDeadlineExceeded) {
		err = net.ErrClosed
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}
