// Package sfvtest is a strict parser for HTTP Structured Field Lists
// (RFC 9651 §4.2.1), for tests that check what package sfv and the HTTP
// middleware write. It parses Lists whose members are Items (not Inner
// Lists) with bare items of type Integer, Decimal, String, Token or Boolean,
// and their Parameters; anything else is an error.
package sfvtest

import (
	"errors"
	"fmt"
	"strconv"
)

// Param is one parameter of an Item.
type Param struct {
	Key   string
	Value any // int64, float64, string, Token or bool
}

// Token is a bare sf-token.
type Token string

// Item is one List member.
type Item struct {
	Value  any // int64, float64, string, Token or bool
	Params []Param
}

// Param returns the value of parameter key and whether it is present.
func (it Item) Param(key string) (any, bool) {
	// Per RFC 9651 a later duplicate key overrides an earlier one.
	var v any
	ok := false
	for _, p := range it.Params {
		if p.Key == key {
			v, ok = p.Value, true
		}
	}
	return v, ok
}

// ParseList parses a field value as an sf-list. Leading and trailing spaces
// are discarded, as the algorithm requires; an empty value is an empty List.
func ParseList(s string) ([]Item, error) {
	p := &parser{s: s}
	p.skipSP()
	var out []Item
	for !p.eof() {
		it, err := p.item()
		if err != nil {
			return nil, err
		}
		out = append(out, it)
		p.skipOWS()
		if p.eof() {
			break
		}
		if p.s[p.i] != ',' {
			return nil, p.errf("expected ',' after list member")
		}
		p.i++
		p.skipOWS()
		if p.eof() {
			return nil, p.errf("trailing ','")
		}
	}
	return out, nil
}

type parser struct {
	s string
	i int
}

func (p *parser) eof() bool { return p.i >= len(p.s) }

func (p *parser) errf(format string, a ...any) error {
	return fmt.Errorf("sfvtest: at %d: %s", p.i, fmt.Sprintf(format, a...))
}

func (p *parser) skipSP() {
	for !p.eof() && p.s[p.i] == ' ' {
		p.i++
	}
}

func (p *parser) skipOWS() {
	for !p.eof() && (p.s[p.i] == ' ' || p.s[p.i] == '\t') {
		p.i++
	}
}

func (p *parser) item() (Item, error) {
	if !p.eof() && p.s[p.i] == '(' {
		return Item{}, p.errf("inner lists are not supported")
	}
	v, err := p.bare()
	if err != nil {
		return Item{}, err
	}
	params, err := p.params()
	if err != nil {
		return Item{}, err
	}
	return Item{Value: v, Params: params}, nil
}

func (p *parser) params() ([]Param, error) {
	var out []Param
	for !p.eof() && p.s[p.i] == ';' {
		p.i++
		p.skipSP()
		k, err := p.key()
		if err != nil {
			return nil, err
		}
		var v any = true
		if !p.eof() && p.s[p.i] == '=' {
			p.i++
			if v, err = p.bare(); err != nil {
				return nil, err
			}
		}
		out = append(out, Param{Key: k, Value: v})
	}
	return out, nil
}

func (p *parser) key() (string, error) {
	start := p.i
	if p.eof() || !(isLCAlpha(p.s[p.i]) || p.s[p.i] == '*') {
		return "", p.errf("key must start with lcalpha or '*'")
	}
	p.i++
	for !p.eof() {
		c := p.s[p.i]
		if isLCAlpha(c) || isDigit(c) || c == '_' || c == '-' || c == '.' || c == '*' {
			p.i++
			continue
		}
		break
	}
	return p.s[start:p.i], nil
}

func (p *parser) bare() (any, error) {
	if p.eof() {
		return nil, p.errf("expected a bare item")
	}
	c := p.s[p.i]
	switch {
	case c == '-' || isDigit(c):
		return p.number()
	case c == '"':
		return p.str()
	case c == '?':
		p.i++
		if p.eof() {
			return nil, p.errf("truncated boolean")
		}
		switch p.s[p.i] {
		case '1':
			p.i++
			return true, nil
		case '0':
			p.i++
			return false, nil
		}
		return nil, p.errf("bad boolean")
	case isAlpha(c) || c == '*':
		start := p.i
		p.i++
		for !p.eof() && isTChar(p.s[p.i]) {
			p.i++
		}
		return Token(p.s[start:p.i]), nil
	}
	return nil, p.errf("unsupported bare item starting %q", c)
}

func (p *parser) number() (any, error) {
	start := p.i
	if p.s[p.i] == '-' {
		p.i++
	}
	digits, dot := 0, -1
	for !p.eof() {
		c := p.s[p.i]
		if isDigit(c) {
			digits++
			p.i++
			continue
		}
		if c == '.' && dot < 0 {
			if digits > 12 {
				return nil, p.errf("decimal integer part too long")
			}
			dot = digits
			p.i++
			continue
		}
		break
	}
	if digits == 0 {
		return nil, p.errf("number without digits")
	}
	lit := p.s[start:p.i]
	if dot < 0 {
		if digits > 15 {
			return nil, p.errf("integer longer than 15 digits")
		}
		v, err := strconv.ParseInt(lit, 10, 64)
		if err != nil {
			return nil, p.errf("bad integer: %v", err)
		}
		return v, nil
	}
	if frac := digits - dot; frac == 0 || frac > 3 {
		return nil, p.errf("decimal needs 1-3 fraction digits")
	}
	v, err := strconv.ParseFloat(lit, 64)
	if err != nil {
		return nil, p.errf("bad decimal: %v", err)
	}
	return v, nil
}

func (p *parser) str() (any, error) {
	p.i++ // opening DQUOTE
	var b []byte
	for !p.eof() {
		c := p.s[p.i]
		p.i++
		switch {
		case c == '\\':
			if p.eof() {
				return nil, p.errf("truncated escape")
			}
			n := p.s[p.i]
			if n != '"' && n != '\\' {
				return nil, p.errf("bad escape %q", n)
			}
			b = append(b, n)
			p.i++
		case c == '"':
			return string(b), nil
		case c < 0x20 || c > 0x7e:
			return nil, p.errf("byte %#x not allowed in a string", c)
		default:
			b = append(b, c)
		}
	}
	return nil, errors.New("sfvtest: unterminated string")
}

func isLCAlpha(c byte) bool { return c >= 'a' && c <= 'z' }
func isAlpha(c byte) bool   { return isLCAlpha(c) || (c >= 'A' && c <= 'Z') }
func isDigit(c byte) bool   { return c >= '0' && c <= '9' }

// isTChar reports tchar (RFC 9110) plus ':' and '/', as sf-token allows.
func isTChar(c byte) bool {
	if isAlpha(c) || isDigit(c) {
		return true
	}
	switch c {
	case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~', ':', '/':
		return true
	}
	return false
}
