package main

import "io"

// indent prefixes every line written through it.
type indent struct {
	w      io.Writer
	prefix string
	mid    bool // inside a line: no prefix before the next byte
}

func (p *indent) Write(b []byte) (int, error) {
	n := 0
	for len(b) > 0 {
		if !p.mid {
			if _, err := io.WriteString(p.w, p.prefix); err != nil {
				return n, err
			}
			p.mid = true
		}
		i := 0
		for i < len(b) && b[i] != '\n' {
			i++
		}
		if i < len(b) {
			i++ // include the newline
			p.mid = false
		}
		m, err := p.w.Write(b[:i])
		n += m
		if err != nil {
			return n, err
		}
		b = b[i:]
	}
	return n, nil
}
