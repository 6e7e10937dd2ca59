package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// TestWatchRulesHotReload: a new rule set streamed by the allocator is
// compiled and swapped in; a set that does not compile keeps the old rules;
// with the allocator gone the last rules keep serving.
func TestWatchRulesHotReload(t *testing.T) {
	fake := newFake(t, func() int64 { return time.Now().UnixNano() }, testRules)
	srv := serveFake(t, fake)
	a := newAgent(t, fastConfig(srv.addr)) // no initial rules
	waitFor(t, 10*time.Second, "the first rule set", func() bool { return a.Ready() })
	if v := a.Rules().Version(); v != 1 {
		t.Fatalf("version %d, want 1", v)
	}

	stricter := strings.Replace(testRules, "requests_per_unit: 3\n", "requests_per_unit: 1\n", 1)
	stricter = strings.Replace(stricter, "burst: 3\n", "burst: 1\n", 1)
	fake.setRules(t, stricter)
	waitFor(t, 10*time.Second, "version 2", func() bool { return a.Rules().Version() == 2 })
	if got := check(t, a, desc("small", "k")); got.Quota != 1 {
		t.Fatalf("quota %d under the new rules, want 1", got.Quota)
	}

	fake.pushRuleSet(&allotv1.RuleSet{Version: 3, Files: []*allotv1.RuleFile{{Name: "bad.yaml", Yaml: []byte("domain: test\ndescriptors:\n  - key: x\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n")}}})
	waitFor(t, 10*time.Second, "the bad set to be rejected", func() bool {
		var m dtoCounter
		return m.read(a.met.reloadsFailed) >= 1
	})
	if v := a.Rules().Version(); v != 2 {
		t.Fatalf("version %d after a bad set, want 2 (kept)", v)
	}

	srv.stop()
	if got := check(t, a, desc("small", "k2")); got.Quota != 1 || got.Policy != "small" {
		t.Fatalf("with the allocator gone: %+v, want the last rules", got)
	}
}

// TestStandaloneFileWatch: rules files are watched; a bad edit keeps the old
// rules, fixing it reloads.
func TestStandaloneFileWatch(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rules.yaml")
	write := func(s string) {
		t.Helper()
		// A new mtime and size on every write, even within one tick.
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		future := time.Now().Add(time.Duration(len(s)) * time.Second)
		if err := os.Chtimes(path, future, future); err != nil {
			t.Fatal(err)
		}
	}
	write(testRules)
	cfg := DefaultConfig()
	cfg.RulesFiles = []string{path}
	cfg.RulesPollInterval = 5 * time.Millisecond
	a := newAgent(t, cfg)
	if !a.Ready() || a.Rules().Version() != 1 {
		t.Fatalf("not ready with version 1")
	}
	if got := check(t, a, desc("small", "f")); got.Quota != 3 {
		t.Fatalf("quota %d, want 3", got.Quota)
	}

	write(strings.Replace(testRules, "requests_per_unit: 3\n      burst: 3\n", "requests_per_unit: 2\n      burst: 2\n", 1))
	waitFor(t, 10*time.Second, "version 2", func() bool { return a.Rules().Version() == 2 })
	if got := check(t, a, desc("small", "f2")); got.Quota != 2 {
		t.Fatalf("quota %d after reload, want 2", got.Quota)
	}

	write("domain: test\ndescriptors:\n  - key: small\n    rate_limit: {unit: fortnight}\n")
	var m dtoCounter
	waitFor(t, 10*time.Second, "the bad file to be rejected", func() bool { return m.read(a.met.reloadsFailed) >= 1 })
	if v := a.Rules().Version(); v != 2 {
		t.Fatalf("version %d after a bad file, want 2 (kept)", v)
	}
	if got := check(t, a, desc("small", "f3")); got.Quota != 2 {
		t.Fatalf("quota %d with a bad file, want 2 (old rules)", got.Quota)
	}

	write(testRules + "\n")
	waitFor(t, 10*time.Second, "version 3", func() bool { return a.Rules().Version() == 3 })
}

func TestNewRejectsBadRulesFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(path, []byte("domain: [\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.RulesFiles = []string{path}
	if _, err := New(cfg); err == nil || !strings.HasPrefix(err.Error(), "agent: ") {
		t.Fatalf("New: %v, want an agent: error", err)
	}
	cfg.RulesFiles = []string{filepath.Join(t.TempDir(), "missing.yaml")}
	if _, err := New(cfg); err == nil {
		t.Fatalf("New with a missing file: no error")
	}
}

func TestConfigValidate(t *testing.T) {
	for name, c := range map[string]Config{
		"long id":          {ID: strings.Repeat("x", 257)},
		"empty allocator":  {Allocators: []string{""}},
		"files+allocators": {Allocators: []string{"a:1"}, RulesFiles: []string{"f"}},
		"negative":         {RefillInterval: -1},
		"negative count":   {FailureThreshold: -1},
	} {
		if err := c.Validate(); err == nil || !strings.HasPrefix(err.Error(), "agent: ") {
			t.Errorf("%s: %v, want an agent: error", name, err)
		}
	}
	if err := DefaultConfig().Validate(); err != nil {
		t.Errorf("default: %v", err)
	}
}

// TestStaleRulesRewatch pins a gateway whose rule stream was attached to a
// node that no longer received the log and kept version 1 against 2 until
// the process died: Acquire answers carry the committed rules version, and
// a newer one that the stream does not deliver within staleRulesGrace
// re-establishes the watch (counted, logged).
func TestStaleRulesRewatch(t *testing.T) {
	fake := newFake(t, func() int64 { return time.Now().UnixNano() }, testRules)
	srv := serveFake(t, fake)
	a := newAgent(t, fastConfig(srv.addr))
	waitFor(t, 10*time.Second, "the first rule set", func() bool { return a.Ready() })

	// Version 2 is committed, but the open stream never hears of it.
	stricter := strings.Replace(testRules, "requests_per_unit: 3\n", "requests_per_unit: 1\n", 1)
	set, err := rules.Compile(2, []rules.File{{Name: "f0.yaml", Source: []byte(stricter)}})
	if err != nil {
		t.Fatal(err)
	}
	fake.with(func(f *fakeAllocator) {
		f.set = set
		f.ruleSet = &allotv1.RuleSet{Version: 2, Files: []*allotv1.RuleFile{{Name: "f0.yaml", Yaml: []byte(stricter)}}}
	})
	deadline := time.Now().Add(15 * time.Second)
	for a.Rules().Version() != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("rules still version %d; stale watch not re-established", a.Rules().Version())
		}
		check(t, a, desc("small", "k"+time.Now().Format("150405.000"))) // Acquire traffic
		time.Sleep(20 * time.Millisecond)
	}
	var m dtoCounter
	if n := m.read(a.met.rulesStale); n < 1 {
		t.Errorf("allot_agent_rules_stale_total = %v, want ≥ 1", n)
	}
}
