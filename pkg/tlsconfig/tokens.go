package tlsconfig

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"os"
	"strings"
)

// Tokens is a set of bearer tokens checked in constant time. The zero
// Tokens (or nil) accepts nothing. It is immutable, so safe for concurrent
// use; swap a *Tokens atomically to rotate.
type Tokens struct {
	digests [][sha256.Size]byte
}

// NewTokens returns the set of tokens (empty strings are skipped).
func NewTokens(tokens []string) *Tokens {
	t := &Tokens{}
	for _, tok := range tokens {
		if tok != "" {
			t.digests = append(t.digests, sha256.Sum256([]byte(tok)))
		}
	}
	return t
}

// Len returns the number of tokens.
func (t *Tokens) Len() int {
	if t == nil {
		return 0
	}
	return len(t.digests)
}

// Valid reports whether tok is one of the tokens. It compares SHA-256
// digests in constant time against every token, so neither the position of
// a mismatch nor which token matched leaks through timing.
func (t *Tokens) Valid(tok string) bool {
	if t == nil || tok == "" {
		return false
	}
	d := sha256.Sum256([]byte(tok))
	ok := 0
	for i := range t.digests {
		ok |= subtle.ConstantTimeCompare(d[:], t.digests[i][:])
	}
	return ok == 1
}

// BearerToken returns the token of an "authorization" header value
// "Bearer <token>" (the scheme is case-insensitive), and whether the value
// has that form.
func BearerToken(header string) (string, bool) {
	scheme, tok, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "bearer") {
		return "", false
	}
	tok = strings.TrimSpace(tok)
	return tok, tok != ""
}

// ReadTokens reads bearer tokens from a file: one a line, blank lines and
// lines starting with '#' ignored, surrounding white space trimmed. It
// fails on an unreadable file, on a file with no token, and on a token
// shorter than 16 bytes (too easy to guess) or with white space inside.
func ReadTokens(path string) ([]string, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tlsconfig: token file: %w", err)
	}
	var out []string
	for i, line := range bytes.Split(src, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		if len(line) < 16 {
			return nil, fmt.Errorf("tlsconfig: token file %s:%d: token shorter than 16 bytes", path, i+1)
		}
		if bytes.ContainsAny(line, " \t") {
			return nil, fmt.Errorf("tlsconfig: token file %s:%d: white space inside a token", path, i+1)
		}
		out = append(out, string(line))
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("tlsconfig: token file %s holds no token", path)
	}
	return out, nil
}
