package rules

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoadFilesEnvoyFile(t *testing.T) {
	s, err := LoadFiles(3, "testdata/envoy-basic.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Warnings()) != 0 {
		t.Errorf("warnings: %q", s.Warnings())
	}
	runMatches(t, s, "envoy-basic", []matchCase{
		{E("key1=value1", "subkey1=something"), "key1=value1/subkey1"},
		{E("key1=value1", "subkey1=subvalue1"), "key1=value1/subkey1=subvalue1"},
		{E("key1=value1"), ""},
		{E("key1=something"), ""},
		{E("key2=something"), "key2"},
		{E("key2=value2"), "key2=value2"},
		{E("key2=value2", "subkey=subvalue"), ""},
		{E("key3=foo"), "key3"},
		{E("key4=foo"), "key4"},
		{E("ldap=x"), "ldap"},
		{E("service=auth", "user=user-a"), "user_a"},
		{E("files=files/a.pdf"), "files=files/*"},
		{E("quota=q"), "quota"},
	})
	if r := s.Match("envoy-basic", E("key1=value1", "subkey1=subvalue1")); r.Unit != UnitSecond || r.RequestsPerUnit != 10 {
		t.Errorf("upper-case unit: %+v", r)
	}
	if r := s.Match("envoy-basic", E("quota=q")); r.Window.Minutes() != 5 || !r.ShadowMode {
		t.Errorf("quota rule: %+v", r)
	}
	got := names(s.MatchAll("envoy-basic", [][]Entry{E("service=a", "user=user-a"), E("service=a", "user=user-b")}, nil))
	if got[0] != "" || got[1] != "service/user=user-b" {
		t.Errorf("replaces: %q", got)
	}
}

func TestLoadFilesDirectory(t *testing.T) {
	dir := t.TempDir()
	write := func(name, src string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("b.yaml", "domain: b\n")
	write("a.yml", "domain: a\n")
	write(".hidden.yaml", "not: valid\n")
	write("notes.txt", "ignored")
	if err := os.Mkdir(filepath.Join(dir, "sub.yaml"), 0o755); err != nil {
		t.Fatal(err)
	}
	s, err := LoadFiles(9, dir, "testdata/public-api.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, f := range s.Files() {
		files = append(files, filepath.Base(f.Name)+"="+f.Domain)
	}
	if got := strings.Join(files, " "); got != "a.yml=a b.yaml=b public-api.yaml=public-api" {
		t.Errorf("files = %s", got)
	}
	if s.Version() != 9 {
		t.Errorf("Version = %d", s.Version())
	}

	// A bad file rejects the set, naming the file.
	write("c.yaml", "domain: c\ndescriptors:\n  - key: a\n    rate_limit: {unit: second}\n")
	_, err = LoadFiles(10, dir)
	var e *Error
	if !errors.As(err, &e) || filepath.Base(e.File) != "c.yaml" || e.Line != 4 {
		t.Errorf("err = %v", err)
	}

	if _, err := LoadFiles(1, filepath.Join(dir, "missing.yaml")); err == nil || !strings.HasPrefix(err.Error(), "rules: ") {
		t.Errorf("missing file: err = %v", err)
	}
}
