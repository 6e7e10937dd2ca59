package raftmux

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// HeaderLen is the length of a connection header.
const HeaderLen = 8

const (
	headerMagic   = 0xA7
	headerVersion = 1
)

// ErrBadHeader is wrapped by every error ParseHeader returns.
var ErrBadHeader = errors.New("raftmux: bad connection header")

// AppendHeader appends the header naming group to dst.
func AppendHeader(dst []byte, group uint32) []byte {
	dst = append(dst, headerMagic, 'r', 'g', headerVersion)
	return binary.BigEndian.AppendUint32(dst, group)
}

// Tagged reports whether a connection whose first byte is b carries a
// header; one that does not is for group 0, in the bare Raft protocol.
func Tagged(b byte) bool { return b == headerMagic }

// ParseHeader returns the group a header names. b must be exactly
// HeaderLen bytes of version 1.
func ParseHeader(b []byte) (uint32, error) {
	if len(b) != HeaderLen {
		return 0, fmt.Errorf("%w: %d bytes, want %d", ErrBadHeader, len(b), HeaderLen)
	}
	if b[0] != headerMagic || b[1] != 'r' || b[2] != 'g' {
		return 0, fmt.Errorf("%w: magic % x, want a7 72 67", ErrBadHeader, b[:3])
	}
	if b[3] != headerVersion {
		return 0, fmt.Errorf("%w: version %d, want %d", ErrBadHeader, b[3], headerVersion)
	}
	return binary.BigEndian.Uint32(b[4:]), nil
}
