// Package cliflags holds the flags every allot binary spells the same way:
// logging (-log-level, -log-format), TLS towards the cluster (-tls-cert,
// -tls-key, -tls-ca, -tls-server-name, -tls-min-version) and the admin
// token, which is always read from a file (-admin-token-file), never taken
// from the command line, where other users of the host can read it.
//
// Each set registers on a standard flag.FlagSet; allotctl adds that set
// to its cobra flags, so the names are the same with one dash or two.
package cliflags

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"

	"github.com/allot/allot/pkg/tlsconfig"
)

// Log is the logging flags. The zero value logs text at info.
type Log struct {
	Level  string // debug, info, warn or error
	Format string // text or json
}

// Register adds -log-level and -log-format to fs.
func (l *Log) Register(fs *flag.FlagSet) {
	fs.StringVar(&l.Level, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&l.Format, "log-format", "text", "log format: text or json (slog, to stderr)")
}

// Logger returns the slog logger the flags ask for, writing to w.
func (l Log) Logger(w io.Writer) (*slog.Logger, error) {
	var lv slog.Level
	level := l.Level
	if level == "" {
		level = "info"
	}
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("-log-level %q: want debug, info, warn or error", l.Level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch l.Format {
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	case "text", "":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("-log-format %q: want text or json", l.Format)
}

// TLS is the TLS flags: this process's certificate in the cluster's PKI
// and the CA bundle that verifies the other side.
type TLS struct {
	Cert, Key, CA string
	// ServerName is the name to verify in a server's certificate (clients
	// only; default: the host dialled).
	ServerName string
	// MinVersion is "1.2" (default) or "1.3".
	MinVersion string
}

// TLSUsage describes, per binary, what the TLS flags mean there.
type TLSUsage struct {
	Cert, CA string
	// Client: the binary dials (adds -tls-server-name).
	Client bool
}

// Register adds -tls-cert, -tls-key, -tls-ca, -tls-min-version and, for
// a client, -tls-server-name to fs.
func (t *TLS) Register(fs *flag.FlagSet, u TLSUsage) {
	fs.StringVar(&t.Cert, "tls-cert", "", u.Cert)
	fs.StringVar(&t.Key, "tls-key", "", "PEM private key of -tls-cert")
	fs.StringVar(&t.CA, "tls-ca", "", u.CA)
	fs.StringVar(&t.MinVersion, "tls-min-version", "1.2", "minimum TLS version: 1.2 or 1.3")
	if u.Client {
		fs.StringVar(&t.ServerName, "tls-server-name", "", "name to verify in the server's certificate (default: the host dialled)")
	}
}

// Enabled reports whether any TLS file was given.
func (t TLS) Enabled() bool { return t.Cert != "" || t.Key != "" || t.CA != "" }

// Options checks the flags and returns them as tlsconfig.Options.
func (t TLS) Options() (tlsconfig.Options, error) {
	o := tlsconfig.Options{CAFile: t.CA, CertFile: t.Cert, KeyFile: t.Key}
	if (t.Cert == "") != (t.Key == "") {
		return o, errors.New("-tls-cert and -tls-key go together")
	}
	v := t.MinVersion
	if v == "" {
		v = "1.2"
	}
	var err error
	if o.MinVersion, err = tlsconfig.ParseVersion(v); err != nil {
		return o, fmt.Errorf("-tls-min-version: %w", err)
	}
	return o, nil
}

// TokenFileUsage is the usage of -admin-token-file in a client.
const TokenFileUsage = "file of admin bearer tokens, one a line; the first is sent as 'authorization: Bearer <token>'"

// ReadToken returns the first token in the token file at path.
func ReadToken(path string) (string, error) {
	toks, err := tlsconfig.ReadTokens(path)
	if err != nil {
		return "", fmt.Errorf("-admin-token-file: %w", err)
	}
	if len(toks) == 0 {
		return "", fmt.Errorf("-admin-token-file %s: no token", path)
	}
	return toks[0], nil
}
