package cliflags

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLogFlags(t *testing.T) {
	var l Log
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	l.Register(fs)
	if err := fs.Parse([]string{"-log-level", "warn", "-log-format", "json"}); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	lg, err := l.Logger(&buf)
	if err != nil {
		t.Fatal(err)
	}
	lg.Info("hidden")
	lg.Warn("shown")
	if s := buf.String(); strings.Contains(s, "hidden") || !strings.Contains(s, `"msg":"shown"`) {
		t.Errorf("log output %q", s)
	}
	for _, bad := range []Log{{Level: "loud"}, {Format: "xml"}} {
		if _, err := bad.Logger(&buf); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}

func TestTLSFlags(t *testing.T) {
	var tl TLS
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	tl.Register(fs, TLSUsage{Cert: "c", CA: "a", Client: true})
	if err := fs.Parse([]string{"--tls-cert", "c.pem", "-tls-server-name", "n"}); err != nil {
		t.Fatal(err)
	}
	if _, err := tl.Options(); err == nil || !strings.Contains(err.Error(), "go together") {
		t.Errorf("cert without key: %v", err)
	}
	tl.Key, tl.MinVersion = "k.pem", "1.1"
	if _, err := tl.Options(); err == nil {
		t.Error("TLS 1.1 accepted")
	}
	tl.MinVersion = "1.3"
	o, err := tl.Options()
	if err != nil || o.CertFile != "c.pem" || o.KeyFile != "k.pem" || !tl.Enabled() {
		t.Errorf("Options = %+v, %v", o, err)
	}
}

func TestReadToken(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "tokens")
	if err := os.WriteFile(p, []byte("# admins\nfirst-token-0123456789\nsecond-token-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if tok, err := ReadToken(p); err != nil || tok != "first-token-0123456789" {
		t.Errorf("ReadToken = %q, %v", tok, err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("# none\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadToken(empty); err == nil {
		t.Error("empty token file accepted")
	}
}
