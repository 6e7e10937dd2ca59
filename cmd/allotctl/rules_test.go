package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/allot/allot/internal/testproc"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

const (
	rulesDir     = "testdata/rules"
	publicAPI    = "testdata/rules/public-api.yaml"
	internalYAML = "testdata/rules/internal.yaml"
	badUnit      = "testdata/rules/bad/bad-unit.yaml"
)

func TestRulesValidate(t *testing.T) {
	// validate is local: --addr points nowhere and must not matter.
	dead := testproc.FreeAddr(t)
	for _, format := range []string{"table", "json"} {
		r := runCLI(t, "--addr", dead, "-o", format, "rules", "validate", "-f", publicAPI, "-f", internalYAML)
		if r.code != exitOK {
			t.Fatalf("%s: exit %d, stderr %q", format, r.code, r.stderr)
		}
		name := "rules_validate"
		if format == "json" {
			name += ".json"
		}
		checkGolden(t, name, r.stdout)
	}

	t.Run("directory", func(t *testing.T) {
		r := runCLI(t, "rules", "validate", "-f", rulesDir)
		if r.code != exitOK || strings.Count(r.stdout, "OK  ") != 2 {
			t.Errorf("exit %d, stdout %q, stderr %q; want 2 files OK", r.code, r.stdout, r.stderr)
		}
	})

	t.Run("invalid file names file:line", func(t *testing.T) {
		r := runCLI(t, "rules", "validate", "-f", badUnit)
		want := "allotctl: " + badUnit + ":5: unit: "
		if r.code != exitError || !strings.HasPrefix(r.stderr, want) || strings.Count(r.stderr, "\n") != 1 {
			t.Errorf("exit %d, stderr %q; want exit 1 and one line starting %q", r.code, r.stderr, want)
		}
		if r.stdout != "" {
			t.Errorf("stdout %q, want nothing", r.stdout)
		}
	})

	t.Run("same domain twice", func(t *testing.T) {
		r := runCLI(t, "rules", "validate", "-f", publicAPI, "-f", rulesDir)
		if r.code != exitError || !strings.Contains(r.stderr, "public-api") {
			t.Errorf("exit %d, stderr %q; want exit 1 naming the domain", r.code, r.stderr)
		}
	})

	t.Run("missing file", func(t *testing.T) {
		r := runCLI(t, "rules", "validate", "-f", "testdata/rules/nope.yaml")
		if r.code != exitError || !strings.Contains(r.stderr, "nope.yaml") {
			t.Errorf("exit %d, stderr %q", r.code, r.stderr)
		}
	})

	t.Run("no -f", func(t *testing.T) {
		r := runCLI(t, "rules", "validate")
		if r.code != exitUsage || !strings.Contains(r.stderr, `required flag(s) "file" not set`) {
			t.Errorf("exit %d, stderr %q; want a usage error", r.code, r.stderr)
		}
	})
}

func TestRulesDiff(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	for _, format := range []string{"table", "json"} {
		r := runCLI(t, "--addr", addr, "-o", format, "rules", "diff", "-f", publicAPI, "-f", internalYAML)
		if r.code != exitDiffer { // diff(1): 1 when the files differ
			t.Fatalf("%s: exit %d, stderr %q", format, r.code, r.stderr)
		}
		name := "rules_diff"
		if format == "json" {
			name += ".json"
		}
		checkGolden(t, name, r.stdout)
	}

	t.Run("no changes", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "same.yaml")
		if err := os.WriteFile(path, []byte(fakeRulesYAML), 0o644); err != nil {
			t.Fatal(err)
		}
		r := runCLI(t, "--addr", addr, "rules", "diff", "-f", path)
		if want := "public-api: no changes (rules version 4)\n"; r.code != exitOK || r.stdout != want {
			t.Errorf("exit %d, stdout %q; want %q", r.code, r.stdout, want)
		}
	})

	t.Run("formatting only", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "reformatted.yaml")
		src := "# reformatted\n" + strings.ReplaceAll(fakeRulesYAML, "requests_per_unit: 30", "requests_per_unit: 30  # per key")
		if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		r := runCLI(t, "--addr", addr, "rules", "diff", "-f", path)
		if r.code != exitDiffer || !strings.Contains(r.stdout, "+# reformatted") ||
			!strings.Contains(r.stdout, "public-api: 0 rule(s) added, 0 removed, 0 changed") {
			t.Errorf("exit %d, stdout:\n%s", r.code, r.stdout)
		}
	})

	t.Run("invalid local file", func(t *testing.T) {
		before := f.numCalls("GetRules")
		r := runCLI(t, "--addr", addr, "rules", "diff", "-f", badUnit)
		if r.code != exitDiffError || !strings.Contains(r.stderr, "bad-unit.yaml:5") {
			t.Errorf("exit %d, stderr %q", r.code, r.stderr)
		}
		if f.numCalls("GetRules") != before {
			t.Error("diff asked the allocator although the file is invalid")
		}
	})

	t.Run("exit codes", func(t *testing.T) {
		same := filepath.Join(t.TempDir(), "same.yaml")
		if err := os.WriteFile(same, []byte(fakeRulesYAML), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			name string
			args []string
			code int
		}{
			{"no difference", []string{"--addr", addr, "rules", "diff", "-f", same}, 0},
			{"no difference, json", []string{"--addr", addr, "-o", "json", "rules", "diff", "-f", same}, 0},
			{"a difference", []string{"--addr", addr, "rules", "diff", "-f", publicAPI}, 1},
			{"a difference, json", []string{"--addr", addr, "-o", "json", "rules", "diff", "-f", publicAPI}, 1},
			{"a new domain", []string{"--addr", addr, "rules", "diff", "-f", internalYAML}, 1},
			{"invalid file", []string{"--addr", addr, "rules", "diff", "-f", badUnit}, 2},
			{"missing file", []string{"--addr", addr, "rules", "diff", "-f", "testdata/rules/nope.yaml"}, 2},
			{"unreachable", []string{"--addr", testproc.FreeAddr(t), "--timeout", "300ms", "rules", "diff", "-f", same}, 2},
			{"no -f", []string{"--addr", addr, "rules", "diff"}, 2},
		} {
			if r := runCLI(t, tc.args...); r.code != tc.code {
				t.Errorf("%s: exit %d, want %d (stderr %q)", tc.name, r.code, tc.code, r.stderr)
			}
		}
	})
}

// TestRulesReadsLinearizable: get and diff ask for linearizable reads
// unless --stale; apply reads the version it is conditional on
// linearizably.
func TestRulesReadsLinearizable(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	for _, tc := range []struct {
		args []string
		lin  bool
	}{
		{[]string{"rules", "get"}, true},
		{[]string{"rules", "get", "--stale"}, false},
		{[]string{"rules", "--stale", "get"}, false},
		{[]string{"rules", "diff", "-f", publicAPI}, true},
		{[]string{"rules", "diff", "--stale", "-f", publicAPI}, false},
		{[]string{"rules", "apply", "-f", publicAPI, "--dry-run"}, true},
	} {
		runCLI(t, append([]string{"--addr", addr}, tc.args...)...)
		req, ok := f.last("GetRules").(*allotv1.GetRulesRequest)
		if !ok || req.GetLinearizable() != tc.lin {
			t.Errorf("%v: GetRules %v, want linearizable=%v", tc.args, req, tc.lin)
		}
	}
}

func TestRulesApply(t *testing.T) {
	f := newFakeAdmin()
	addr := startFake(t, f, nil)
	src, err := os.ReadFile(publicAPI)
	if err != nil {
		t.Fatal(err)
	}

	r := runCLI(t, "--addr", addr, "rules", "apply", "-f", publicAPI)
	if r.code != exitOK {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	checkGolden(t, "rules_apply", r.stdout)
	want := &allotv1.PutRulesRequest{
		Files:           []*allotv1.RuleFile{{Name: "public-api.yaml", Domain: "public-api", Yaml: src}},
		ReplaceAll:      false,
		ExpectedVersion: 4,
	}
	if got := f.last("PutRules"); !proto.Equal(got, want) {
		t.Errorf("PutRules request = %v, want %v", got, want)
	}

	t.Run("json", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "-o", "json", "rules", "apply", "-f", publicAPI, "-f", internalYAML)
		if r.code != exitOK {
			t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
		}
		checkGolden(t, "rules_apply.json", r.stdout)
		got := f.last("PutRules").(*allotv1.PutRulesRequest)
		if len(got.Files) != 2 || got.Files[1].Domain != "internal" || got.ExpectedVersion != 5 {
			t.Errorf("PutRules request = %v, want 2 files, expected version 5", got)
		}
	})

	t.Run("dry run", func(t *testing.T) {
		r := runCLI(t, "--addr", addr, "rules", "apply", "--dry-run", "-f", publicAPI)
		if r.code != exitOK || !strings.HasPrefix(r.stdout, "Dry run: the allocator accepts domain(s) public-api; rules stay at version 6.") {
			t.Errorf("exit %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
		}
		if !f.last("PutRules").(*allotv1.PutRulesRequest).DryRun {
			t.Error("PutRules request is not a dry run")
		}
	})

	t.Run("invalid file is not sent", func(t *testing.T) {
		before := f.numCalls("PutRules")
		r := runCLI(t, "--addr", addr, "rules", "apply", "-f", badUnit)
		if r.code != exitError || !strings.Contains(r.stderr, "bad-unit.yaml:5: unit:") {
			t.Errorf("exit %d, stderr %q", r.code, r.stderr)
		}
		if f.numCalls("PutRules") != before {
			t.Error("an invalid file reached PutRules")
		}
	})

	t.Run("concurrent change", func(t *testing.T) {
		f.setErr("PutRules", status.Error(codes.FailedPrecondition, "allocator: rules version is 7, not 6"))
		defer f.setErr("PutRules", nil)
		r := runCLI(t, "--addr", addr, "rules", "apply", "-f", publicAPI)
		want := "allotctl: PutRules refused: allocator: rules version is 7, not 6; " +
			"the rules changed since version 6 was read: review with 'allotctl rules diff' and apply again\n"
		if r.code != exitError || r.stderr != want {
			t.Errorf("exit %d, stderr %q; want %q", r.code, r.stderr, want)
		}
	})

	t.Run("server rejects", func(t *testing.T) {
		f.setErr("PutRules", status.Error(codes.InvalidArgument, "public-api.yaml:9: replaces: no rule named \"gold\""))
		defer f.setErr("PutRules", nil)
		r := runCLI(t, "--addr", addr, "rules", "apply", "-f", publicAPI)
		want := "allotctl: PutRules rejected: public-api.yaml:9: replaces: no rule named \"gold\"\n"
		if r.code != exitError || r.stderr != want {
			t.Errorf("exit %d, stderr %q; want %q", r.code, r.stderr, want)
		}
	})
}
