//go:build linux && !race

package raftmux

import (
	"syscall"
	"unsafe"
)

// sysRead and sysWrite make one read or write on the non-blocking socket fd
// without telling the scheduler (see quietConn). b is not empty.
func sysRead(fd uintptr, b []byte) (int, syscall.Errno) {
	r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(r), e
}

func sysWrite(fd uintptr, b []byte) (int, syscall.Errno) {
	r, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(r), e
}
