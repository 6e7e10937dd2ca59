package rules

import (
	"errors"
	"strings"
	"testing"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Every validation error names file, line and key. Line numbers below count
// from the first line of src.
func TestValidationErrors(t *testing.T) {
	const okLimit = "    rate_limit: {unit: second, requests_per_unit: 1}\n"
	cases := []errCase{
		{"unknown top-level key", "domain: d\ndomian: x\n", 2, "domian", "config error, unknown key 'domian'"},
		{"unknown descriptor key", "domain: d\ndescriptors:\n  - key: a\n    ratelimit: {unit: second}\n", 4, "ratelimit", "config error, unknown key 'ratelimit'"},
		{"unknown rate_limit key", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requestsperunit: 5\n", 6, "requestsperunit", "config error, unknown key 'requestsperunit'"},
		{"extension beside rate_limit", "domain: d\ndescriptors:\n  - key: a\n    burst: 5\n" + okLimit, 4, "burst", "extensions go inside rate_limit"},
		{"unknown replaces key", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces: [{nmae: x}]\n", 7, "nmae", "unknown key 'nmae'"},
		{"empty domain", "domain: \"\"\ndescriptors: []\n", 1, "domain", "config file cannot have empty domain"},
		{"missing domain", "descriptors:\n  - key: a\n" + okLimit, 1, "domain", "config file cannot have empty domain"},
		{"empty file", "", 1, "domain", "config file cannot have empty domain"},
		{"comment-only file", "# nothing\n", 1, "domain", "config file cannot have empty domain"},
		{"duplicate exact descriptor", "domain: d\ndescriptors:\n  - key: a\n    value: x\n" + okLimit + "  - key: a\n    value: x\n" + okLimit, 7, "value", "duplicate descriptor composite key 'd.a_x'"},
		{"duplicate key-only descriptor", "domain: d\ndescriptors:\n  - key: a\n" + okLimit + "  - key: a\n" + okLimit, 5, "key", "duplicate descriptor composite key 'd.a'"},
		{"duplicate wildcard descriptor", "domain: d\ndescriptors:\n  - key: a\n    value: x*\n  - key: a\n    value: x*\n", 6, "value", "duplicate descriptor composite key 'd.a_x*'"},
		{"duplicate nested descriptor", "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n      - key: b\n", 6, "key", "duplicate descriptor composite key 'd.a.b'"},
		{"invalid unit", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n", 5, "unit", "invalid rate limit unit 'fortnight'"},
		{"missing unit", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      requests_per_unit: 1\n", 4, "unit", "invalid rate limit unit ''"},
		{"unit with unlimited", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      unit: second\n", 6, "unit", "should not specify rate limit unit when unlimited"},
		{"burst with unlimited", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      burst: 4\n", 6, "burst", "should not specify burst when unlimited"},
		{"burst zero", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      burst: 0\n", 7, "burst", "burst must be between 1 and"},
		{"burst negative", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      burst: -3\n", 7, "burst", "got -3"},
		{"burst too large", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      burst: 1000000000001\n", 7, "burst", "burst must be between 1 and"},
		{"burst on a window algorithm", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n      algorithm: fixed_window\n      burst: 3\n", 8, "burst", "burst applies to token_bucket and gcra only"},
		{"burst refill too slow", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: year\n      unit_multiplier: 30\n      requests_per_unit: 1\n      burst: 1000\n", 8, "burst", "refilling the burst"},
		{"burst with requests_per_unit 0", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 0\n      burst: 5\n", 7, "burst", "should not specify burst when requests_per_unit is 0"},
		{"requests_per_unit negative", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: -5\n", 6, "requests_per_unit", "got -5"},
		{"requests_per_unit too large", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 4294967296\n", 6, "requests_per_unit", "between 0 and 4294967295"},
		{"requests_per_unit missing", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n", 4, "requests_per_unit", "requests_per_unit is required"},
		{"requests_per_unit not a number", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: lots\n", 6, "requests_per_unit", "must be an integer, not lots"},
		{"requests_per_unit fractional", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1.5\n", 6, "requests_per_unit", "must be an integer"},
		{"unknown algorithm", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      algorithm: leaky\n", 7, "algorithm", "unknown algorithm 'leaky'"},
		{"unknown backend", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      backend: etcd\n", 7, "backend", "unknown backend 'etcd'"},
		{"unknown failure_mode", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      failure_mode: maybe\n", 7, "failure_mode", "unknown failure_mode 'maybe'"},
		{"unknown routing", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      routing: random\n", 7, "routing", "unknown routing 'random'"},
		{"shards zero", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      shards: 0\n", 7, "shards", "shards must be between 1 and 1024"},
		{"shards too many", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      shards: 5000\n", 7, "shards", "shards must be between 1 and 1024"},
		{"unit_multiplier zero", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      unit_multiplier: 0\n      requests_per_unit: 1\n", 6, "unit_multiplier", "unit_multiplier must be ≥ 1"},
		{"window too long", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: year\n      unit_multiplier: 40\n      requests_per_unit: 1\n", 5, "unit_multiplier", "longest supported window"},
		{"top level is a list", "- domain: d\n", 1, "", "the top level must be a mapping"},
		{"descriptors is a scalar", "domain: d\ndescriptors: five\n", 2, "descriptors", "descriptors must be a list of mappings"},
		{"descriptors is a mapping", "domain: d\ndescriptors:\n  key: a\n", 3, "descriptors", "descriptors must be a list of mappings"},
		{"descriptor list of scalars", "domain: d\ndescriptors:\n  - a\n", 3, "descriptors", "yaml file contains list of type other than map: a"},
		{"rate_limit is a list", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      - unit: second\n", 5, "rate_limit", "must be a mapping"},
		{"replaces is a mapping", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces: {name: x}\n", 7, "replaces", "replaces must be a list"},
		{"replaces list of scalars", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces: [x]\n", 7, "replaces", "list of type other than map: x"},
		{"domain is a list", "domain: [a, b]\n", 1, "domain", "must be a string, not a list"},
		{"key is a mapping", "domain: d\ndescriptors:\n  - key: {a: b}\n", 3, "key", "must be a string, not a mapping"},
		{"shadow_mode not a bool", "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: maybe\n" + okLimit, 4, "shadow_mode", "must be true or false, not maybe"},
		{"quoted bool", "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: \"yes\"\n" + okLimit, 4, "shadow_mode", "must be true or false"},
		{"unlimited with a bad requests_per_unit", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unlimited: true\n      requests_per_unit: lots\n", 6, "requests_per_unit", "must be an integer"},
		{"unlimited not a bool", "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: 1}\n", 4, "unlimited", "must be true or false, not 1"},
		{"metadata not a mapping", "domain: d\ndescriptors:\n  - key: a\n    metadata: [1]\n", 4, "metadata", "must be a mapping"},
		{"empty replaces name", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: \"\"\n", 8, "replaces", "should not have an empty replaces entry"},
		{"replaces itself", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      name: me\n      unit: second\n      requests_per_unit: 1\n      replaces:\n        - name: me\n", 9, "replaces", "replaces should not contain name of same descriptor"},
		{"empty key", "domain: d\ndescriptors:\n  - value: x\n" + okLimit, 3, "key", "descriptor has empty key"},
		{"empty key string", "domain: d\ndescriptors:\n  - key: \"\"\n", 3, "key", "descriptor has empty key"},
		{"yaml syntax error", "domain: d\ndescriptors:\n  - key: a\n   value: [\n", 2, "", "error loading config file: did not find expected '-' indicator"},
		{"duplicate mapping key", "domain: d\ndescriptors:\n  - key: a\n    key: b\n", 4, "key", "defined twice"},
		{"non-string key", "domain: d\n0.25: x\n", 2, "", "config error, key is not of type string: 0.25"},
		{"two documents", "domain: d\n---\ndomain: e\n", 2, "", "more than one YAML document"},
		{"nested too deep", deepYAML(33), 0, "descriptors", "nested deeper than 32 levels"},
		{"quoted number", "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: \"10\"\n", 6, "requests_per_unit", `must be an integer, not "10"`},
		// Text a request can never carry: the agent refuses such
		// descriptors, so the rule could never match.
		{"domain with a tab", "domain: \"a\\tb\"\ndescriptors: []\n", 1, "domain", "the domain is not valid text"},
		{"domain with a C1 control", "# c\ndomain: \"\\u0085\"\n", 2, "domain", "the domain is not valid text"},
		{"key with NUL", "domain: d\ndescriptors:\n  - key: \"x\\u0000\"\n" + okLimit, 3, "key", "the key is not valid text"},
		{"value with NEL", "domain: d\ndescriptors:\n  - key: k\n    value: \"\\u0085\"\n" + okLimit, 4, "value", "the value is not valid text"},
		{"nested value with DEL", "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: j\n        value: \"a\\x7f\"\n", 6, "value", "the value is not valid text"},
		{"value too long", "domain: d\ndescriptors:\n  - key: k\n    value: " + strings.Repeat("v", MaxKeyBytes) + "\n", 3, "key", "takes 4100 bytes"},
		{"nested path too long", "domain: d\ndescriptors:\n  - key: k\n    value: " + strings.Repeat("v", 3000) + "\n    descriptors:\n      - key: j\n        value: " + strings.Repeat("w", 1100) + "\n", 6, "key", "at most 4096"},
	}
	checkErrors(t, cases)
}

// TestYAMLErrorLines: a YAML error that carries a line is reported at it;
// one that does not (the reader's: control characters, invalid UTF-8) is
// reported without a line rather than at line 0.
func TestYAMLErrorLines(t *testing.T) {
	for _, tc := range []struct{ src, want string }{
		{"domain: \x01\n", "f.yaml: error loading config file: control characters are not allowed"},
		{"domain: d\ndescriptors:\n  - key: \x7f\n", "f.yaml: error loading config file: control characters are not allowed"},
		{"domain: \xff\n", "f.yaml: error loading config file: invalid leading UTF-8 octet"},
		{"domain: d\n---\n[\n", "f.yaml:3: error loading config file: did not find expected node content"},
		{"a: b\n c: d\n", "f.yaml:2: error loading config file: mapping values are not allowed in this context"},
	} {
		_, err := Compile(1, []File{{Name: "f.yaml", Source: []byte(tc.src)}})
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.src, err, tc.want)
		}
	}
}

// errCase is a file that must fail to compile with an *Error at line (0:
// any line) and key whose Msg contains msg.
type errCase struct {
	name string
	src  string
	line int
	key  string
	msg  string // substring of Msg
}

func checkErrors(t *testing.T, cases []errCase) {
	t.Helper()
	for _, c := range cases {
		_, err := Compile(1, []File{{Name: "f.yaml", Source: []byte(c.src)}})
		var e *Error
		if !errors.As(err, &e) {
			t.Errorf("%s: Compile() error = %v (%T), want *Error", c.name, err, err)
			continue
		}
		if e.File != "f.yaml" || (c.line != 0 && e.Line != c.line) || e.Key != c.key || !strings.Contains(e.Msg, c.msg) {
			t.Errorf("%s:\n got  %s (line %d key %q)\n want f.yaml:%d: %s: …%s…", c.name, e, e.Line, e.Key, c.line, c.key, c.msg)
		}
	}
}

// deepYAML nests depth descriptors.
func deepYAML(depth int) string {
	var b strings.Builder
	b.WriteString("domain: d\ndescriptors:\n")
	for i := 0; i < depth; i++ {
		ind := strings.Repeat("    ", i)
		b.WriteString(ind + "  - key: a\n")
		if i < depth-1 {
			b.WriteString(ind + "    descriptors:\n")
		} else {
			b.WriteString(ind + "    rate_limit: {unit: second, requests_per_unit: 1}\n")
		}
	}
	return b.String()
}

// A descriptor of exactly MaxKeyBytes, the protocol's bound, compiles.
func TestMaxKeyBytesAccepted(t *testing.T) {
	if MaxKeyBytes != allotv1.MaxKeyBytes {
		t.Fatalf("MaxKeyBytes = %d, the protocol's is %d", MaxKeyBytes, allotv1.MaxKeyBytes)
	}
	v := strings.Repeat("v", MaxKeyBytes-len("d")-len("k")-2)
	s := compileOne(t, "f.yaml", "domain: d\ndescriptors:\n  - key: k\n    value: "+v+"\n    rate_limit: {unit: second, requests_per_unit: 1}\n")
	if r := s.Match("d", []Entry{{"k", v}}); r == nil {
		t.Fatal("the rule at the bound does not match")
	}
}

func TestMaxDepthAccepted(t *testing.T) {
	s := compileOne(t, "deep.yaml", deepYAML(MaxDepth))
	d := make([]Entry, MaxDepth)
	for i := range d {
		d[i] = Entry{"a", "x"}
	}
	if r := s.Match("d", d); r == nil || r.Depth != MaxDepth {
		t.Fatalf("Match at depth %d = %v", MaxDepth, r)
	}
}

func TestErrorString(t *testing.T) {
	e := &Error{File: "rules/a.yaml", Line: 12, Key: "unit", Msg: "invalid rate limit unit 'foo'"}
	if got, want := e.Error(), "rules/a.yaml:12: unit: invalid rate limit unit 'foo'"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	e.Key = ""
	if got, want := e.Error(), "rules/a.yaml:12: invalid rate limit unit 'foo'"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
}

func TestDuplicateDomainAcrossFiles(t *testing.T) {
	a := File{Name: "a.yaml", Source: []byte("domain: d\ndescriptors: []\n")}
	b := File{Name: "b.yaml", Source: []byte("# second\ndomain: d\n")}
	_, err := Compile(1, []File{a, b})
	var e *Error
	if !errors.As(err, &e) || e.File != "b.yaml" || e.Line != 2 || e.Key != "domain" ||
		!strings.Contains(e.Msg, "duplicate domain 'd' in config file (already in a.yaml)") {
		t.Fatalf("err = %v", err)
	}
}

func TestDeclaredDomainMismatch(t *testing.T) {
	_, err := Compile(1, []File{{Name: "a.yaml", Domain: "other", Source: []byte("domain: d\n")}})
	var e *Error
	if !errors.As(err, &e) || e.Key != "domain" || !strings.Contains(e.Msg, "does not match") {
		t.Fatalf("err = %v", err)
	}
}

// One bad file rejects the whole set.
func TestOneBadFileRejectsAll(t *testing.T) {
	good := ExampleFiles()[0]
	bad := File{Name: "bad.yaml", Source: []byte("domain: b\ndescriptors:\n  - key: a\n    rate_limit: {unit: sec, requests_per_unit: 1}\n")}
	s, err := Compile(2, []File{good, bad})
	if s != nil || err == nil {
		t.Fatalf("Compile = %v, %v; want nil, error", s, err)
	}
	if !strings.HasPrefix(err.Error(), "bad.yaml:4: unit: invalid rate limit unit 'sec'") {
		t.Errorf("err = %v", err)
	}
}

// An alias bomb (each level doubles the descriptors: 2^30 when expanded)
// is cut off by the node budget instead of expanding.
func TestAliasBomb(t *testing.T) {
	var d strings.Builder
	d.WriteString("domain: d\ndescriptors:\n  - key: k0\n    descriptors: &a0\n      - key: leaf\n")
	for i := 1; i <= 30; i++ {
		d.WriteString("  - key: k" + itoa(i) + "\n    descriptors: &a" + itoa(i) + "\n")
		d.WriteString("      - {key: x, descriptors: *a" + itoa(i-1) + "}\n")
		d.WriteString("      - {key: y, descriptors: *a" + itoa(i-1) + "}\n")
	}
	_, err := Compile(1, []File{{Name: "bomb.yaml", Source: []byte(d.String())}})
	if err == nil || !strings.Contains(err.Error(), "document too large") {
		t.Fatalf("err = %v, want the node budget to stop the expansion", err)
	}
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + string(rune('0'+i%10))
}

// With several merged mappings on one line, the first one listed wins, every
// time.
func TestMergeOrderDeterministic(t *testing.T) {
	src := "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      <<: [{unit: second, requests_per_unit: 1}, {unit: minute, requests_per_unit: 2}]\n"
	for i := 0; i < 20; i++ {
		s := compileOne(t, "m.yaml", src)
		if r := s.Match("d", E("a=x")); r.Unit != UnitSecond || r.RequestsPerUnit != 1 {
			t.Fatalf("run %d: merged rule = %v/%d, want second/1", i, r.Unit, r.RequestsPerUnit)
		}
	}
}

// A mapping that merges itself (directly, through another mapping, or as a
// descriptor) is a cycle: it is refused at the merge key's line after
// visiting a handful of nodes, not expanded until the node budget runs out
// (a million nested calls and hundreds of megabytes of stack).
func TestSelfMergeRefusedAsCycle(t *testing.T) {
	for _, c := range []struct {
		src  string
		line int
	}{
		{"<<: &a {<<: *a}\n", 1},
		{"domain: d\ndescriptors:\n  - &a {key: k, <<: *a}\n", 3},
		{"domain: d\n<<: &x {<<: {<<: *x}}\n", 2},
		{"domain: d\ndescriptors:\n  - key: k\n    rate_limit: &l\n      unit: second\n      <<: [{requests_per_unit: 1}, *l]\n", 6},
	} {
		cp := newCompiler(&Set{domains: map[string]*domainTree{}, nameIDs: map[string]int32{}}, "f.yaml")
		_, _, _, err := cp.compileFile([]byte(c.src))
		var e *Error
		if !errors.As(err, &e) || e.Line != c.line || e.Key != "<<" || !strings.Contains(e.Msg, "cycle") {
			t.Errorf("%q: err = %v, want f.yaml:%d: <<: …cycle…", c.src, err, c.line)
		}
		if used := maxNodes - cp.budget; used > 100 {
			t.Errorf("%q: visited %d nodes before refusing", c.src, used)
		}
	}
}

// A long chain of merges (each mapping merging the next) is refused past
// maxMergeDepth, naming the merge key.
func TestMergeChainDepthBounded(t *testing.T) {
	src := "domain: d\n<<: " + strings.Repeat("{<<: ", 2*maxMergeDepth) + "{}" + strings.Repeat("}", 2*maxMergeDepth) + "\n"
	_, err := Compile(1, []File{{Name: "f.yaml", Source: []byte(src)}})
	var e *Error
	if !errors.As(err, &e) || e.Line != 2 || e.Key != "<<" || !strings.Contains(e.Msg, "nested deeper than") {
		t.Fatalf("err = %v, want a merge depth error", err)
	}
}
