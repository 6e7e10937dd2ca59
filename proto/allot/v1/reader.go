package allotv1

import "fmt"

// Reader reads the varint-coded byte formats written beside the protobuf
// messages: packed grants (packed.go) and the allocator's compact log
// entries. Its strings are substrings of S, so reading allocates nothing.
// A read past the end or a malformed varint sets Err (wrapping Base, with
// the offset) and moves P to the end, so every later read fails too: a
// caller may read a whole record and check Err once.
type Reader struct {
	S    string
	P    int
	Err  error
	Base error
}

// Fail records a malformed input at the current offset.
func (d *Reader) Fail() {
	if d.Err == nil {
		d.Err = fmt.Errorf("%w at byte %d", d.Base, d.P)
	}
	d.P = len(d.S)
}

// Left returns the bytes not read yet.
func (d *Reader) Left() int { return len(d.S) - d.P }

// Uvarint reads an unsigned varint (encoding/binary's format).
func (d *Reader) Uvarint() uint64 {
	var x uint64
	for shift := uint(0); ; shift += 7 {
		if d.P >= len(d.S) || shift > 63 {
			d.Fail()
			return 0
		}
		b := d.S[d.P]
		d.P++
		x |= uint64(b&0x7f) << shift
		if b < 0x80 {
			return x
		}
	}
}

// Varint reads a zigzag-coded signed varint.
func (d *Reader) Varint() int64 {
	u := d.Uvarint()
	return int64(u>>1) ^ -int64(u&1)
}

// Str reads a string: its length as a uvarint, then its bytes.
func (d *Reader) Str() string {
	n := d.Uvarint()
	if n > uint64(d.Left()) {
		d.Fail()
		return ""
	}
	s := d.S[d.P : d.P+int(n)]
	d.P += int(n)
	return s
}

// Byte reads one byte.
func (d *Reader) Byte() byte {
	if d.P >= len(d.S) {
		d.Fail()
		return 0
	}
	b := d.S[d.P]
	d.P++
	return b
}

// Fixed64 reads 8 bytes, little endian.
func (d *Reader) Fixed64() uint64 {
	if d.Left() < 8 {
		d.Fail()
		return 0
	}
	var v uint64
	for i := 7; i >= 0; i-- {
		v = v<<8 | uint64(d.S[d.P+i])
	}
	d.P += 8
	return v
}
