//go:build linux && race

package raftmux

import (
	"errors"
	"syscall"
)

// sysRead and sysWrite are the syscall package's calls under the race
// detector: they report the bytes read and written, and order a write
// before the reads that see it, as net.Conn's do. b is not empty.
func sysRead(fd uintptr, b []byte) (int, syscall.Errno) {
	n, err := syscall.Read(int(fd), b)
	return max(n, 0), errno(err)
}

func sysWrite(fd uintptr, b []byte) (int, syscall.Errno) {
	n, err := syscall.Write(int(fd), b)
	return max(n, 0), errno(err)
}

func errno(err error) syscall.Errno {
	var e syscall.Errno
	if err != nil && !errors.As(err, &e) {
		return syscall.EIO
	}
	return e
}
